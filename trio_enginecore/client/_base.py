"""What every Trio engine client shares: streams, batches, utilities.

:class:`TrioClientBase` implements :class:`AsyncEngineCoreClient` for any transport:
request bookkeeping, per-request streams, the merging batch buffer behind
``get_output()``, utility calls by ``call_id`` and failure propagation. A concrete
client only moves messages: it implements the ``_transport_*`` hooks and feeds every
engine message to :meth:`TrioClientBase._handle_outputs` from a single task, with no
checkpoint between receiving and handing over.
"""

from __future__ import annotations

import abc
import collections
import logging
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar, final

import attrs
import msgspec
import trio

from ..config import EngineConfig
from ..errors import EngineCoreError, EngineDeadError, ProtocolError, UtilityCallError
from ..protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    UtilityOutput,
    UtilityRequest,
)
from ._collector import BatchCollector
from ._interface import AsyncEngineCoreClient, ClientStatistics, convert_result
from ._launch import EngineHandle
from ._lb import consensus
from ._stream import RequestStream
from ._validate import check_request, check_requests

__all__ = ["TrioClientBase", "run_client"]

logger = logging.getLogger("trio_enginecore.client")

T = TypeVar("T")

_NOTIFICATION_CALL_IDS: Final = (-1, -2)

MAX_TOMBSTONES: Final = 10_000
"""How many aborted request ids a client remembers (see ``abort_requests``). By the
time an id falls out, its engine read the ABORT long ago."""


@attrs.define(eq=False)
class _UtilityCall:
    method: str
    done: trio.Event = attrs.field(factory=trio.Event)
    reply: UtilityOutput | None = None
    failure: str | None = None


@final
class _IdsInFlight:
    """The caller's ids of the requests in flight (a view, for ``in`` tests)."""

    __slots__ = ("_inflight", "_wire_ids")

    def __init__(self, inflight: dict[str, EngineHandle], wire_ids: dict[str, str]) -> None:
        self._inflight = inflight
        self._wire_ids = wire_ids

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._inflight or request_id in self._wire_ids


class TrioClientBase(AsyncEngineCoreClient):
    """The transport-independent part of the Trio clients (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        client_index: int = 0,
        max_pending_outputs: int = 64,
        abort_timeout_s: float = 1.0,
    ) -> None:
        self.config = config
        self.client_index = client_index
        self.abort_timeout_s = abort_timeout_s
        self._engines: list[EngineHandle] = []
        self._inflight: dict[str, EngineHandle] = {}
        self._streams: dict[str, RequestStream] = {}
        self._open_streams = 0
        self._calls: dict[int, _UtilityCall] = {}
        self._batches = BatchCollector(max_pending_outputs)
        self._batch_event = trio.Event()
        self._failure: str | None = None
        self._closing = False
        self._closed = False
        self._messages = 0
        self._outputs_received = 0
        self._tokens = 0
        self._batched_outputs = 0
        self._protocol_errors = 0
        self._outputs_dropped = 0
        # Ids whose request was aborted while the engine may still be producing for
        # it, most recent last. Reusing one sends the new request under a fresh wire
        # id, so the old request's late outputs cannot be mistaken for the new one's.
        self._tombstones: dict[str, None] = {}
        # The requests in flight under such a wire id: user id -> wire id, and back.
        self._wire_ids: dict[str, str] = {}
        self._user_ids: dict[str, str] = {}
        self._ids_in_flight = _IdsInFlight(self._inflight, self._wire_ids)

    # ------------------------------------------------------- transport hooks

    @abc.abstractmethod
    async def _transport_add(self, engine: EngineHandle, request: EngineCoreRequest) -> None:
        """Deliver an ADD; atomic with respect to cancellation."""

    def _transport_add_nowait(self, engine: EngineHandle, request: EngineCoreRequest) -> None:
        """Deliver an ADD without checkpointing; raise trio.WouldBlock if it cannot."""
        raise trio.WouldBlock

    @abc.abstractmethod
    def _transport_abort(self, engine: EngineHandle, request_ids: list[str]) -> None:
        """Deliver an ABORT without blocking or checkpointing."""

    @abc.abstractmethod
    async def _transport_utility(self, engine: EngineHandle, call: UtilityRequest) -> None:
        """Deliver a UTILITY call; atomic with respect to cancellation."""

    def _on_engine_death(self, engine: EngineHandle) -> None:
        """Called after an engine's death was recorded and every waiter failed."""

    # ------------------------------------------------------------ public state

    @property
    def engines(self) -> tuple[EngineCoreReadyResponse | None, ...]:
        """Each engine's ready response, by rank."""
        return tuple(engine.ready for engine in self._engines)

    @property
    def engine_pids(self) -> tuple[int | None, ...]:
        """The process id of each launched engine (None for attached engines)."""
        return tuple(e.process.pid if e.process else None for e in self._engines)

    @property
    def is_dead(self) -> bool:
        """True once an engine died; every later call raises EngineDeadError."""
        return self._failure is not None

    def statistics(self) -> ClientStatistics:
        """A frozen snapshot of the client's counters."""
        return ClientStatistics(
            requests_in_flight=len(self._inflight),
            open_streams=self._open_streams,
            pending_utility_calls=len(self._calls),
            pending_batches=len(self._batches),
            messages_received=self._messages,
            outputs_received=self._outputs_received,
            tokens_received=self._tokens,
            protocol_errors=self._protocol_errors,
            engines_alive=sum(1 for e in self._engines if e.alive),
            outputs_dropped=self._outputs_dropped,
        )

    # ------------------------------------------------------------ batch API

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the engine; its outputs arrive through :meth:`get_output`.

        Sets ``request.client_index`` to this client's index.

        The request is checked first: nothing is sent or registered if it raises.

        Raises:
            TypeError: a field of the request has the wrong type (the message names
                it), e.g. a request id that is not a ``str``.
            ValueError: a request with this id is already in flight on this client, or
                a field has an impossible value (an empty id, a negative token id).
            EngineDeadError: the engine has died.
            trio.ClosedResourceError: the client is shutting down.
        """
        await self._send_add(request, streamed=False)

    async def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """Send several requests with a single checkpoint.

        Cheaper than one :meth:`add_request` per request when many are ready at once
        (say, every request that finished in the last step being replaced): the sends
        go out back to back instead of one per scheduler tick. All-or-nothing with
        respect to cancellation: if it raises ``Cancelled``, none was sent.

        Raises:
            TypeError: a field of one request has the wrong type; then none was sent.
            ValueError: two requests share an id, one is already in flight, or a field
                has an impossible value; then none was sent.
            EngineDeadError: the engine has died.
            trio.ClosedResourceError: the client is shutting down.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._raise_if_unusable()
        batch = list(requests)
        check_requests(batch, self._ids_in_flight)
        for index, request in enumerate(batch):
            engine = self._engine_for(request)
            request.client_index = self.client_index
            wire = self._register(request, engine, stream=None)
            try:
                self._transport_add_nowait(engine, wire)
            except trio.WouldBlock:
                # Not with the unbounded queues the clients use; go the slow way.
                self._forget(wire.request_id)
                for rest in batch[index:]:
                    await self._send_add(rest, streamed=False)
                return
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def get_output(self) -> EngineCoreOutputs:
        """The next engine message with outputs of requests added by :meth:`add_request`.

        Outputs of streamed requests are not delivered here. A caller that keeps up
        gets each engine message as it was sent; one that fell behind gets an engine's
        whole backlog folded into one message, outputs in arrival order (no output is
        ever dropped).

        Raises:
            EngineDeadError: the engine died and no output is pending.
            trio.ClosedResourceError: the client was closed.
        """
        # Every schedule point comes before the take, and nothing can intervene
        # between taking the message and returning it: an abort_requests() that
        # returned before this returns has removed its requests' outputs from what is
        # taken. (Waiting is the schedule point when nothing is pending yet.)
        await trio.lowlevel.checkpoint_if_cancelled()
        if len(self._batches):
            await trio.lowlevel.cancel_shielded_checkpoint()
        while True:
            outputs = self._batches.take()
            if outputs is not None:
                return outputs
            self._raise_if_unusable()
            await self._batch_event.wait()

    async def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests on the engines that have them. Unknown ids are ignored.

        The engine sends no output for a request it aborts on our behalf, and outputs
        already received for it are dropped (those of a request that finished but
        whose outputs ``get_output()`` has not returned yet too): after this returns,
        ``get_output()`` never returns an output of these requests. A stream of an
        aborted request ends with a local ``FinishReason.ABORT`` output.

        An aborted request's id may be used again at once: the new request then goes
        to the engine under a fresh internal id (its ``external_req_id`` is yours), so
        the old request's late outputs are told apart and dropped; outputs reach you
        with your id.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._abort_now(request_ids)
        await trio.lowlevel.cancel_shielded_checkpoint()

    # --------------------------------------------------------------- streams

    @asynccontextmanager
    async def stream(self, request: EngineCoreRequest) -> AsyncGenerator[RequestStream, None]:
        """Send ``request`` and stream its outputs.

        ::

            async with client.stream(request) as outputs:
                async for output in outputs:
                    ...

        Leaving the block before the request finished (``break``, an exception,
        cancellation) aborts it on the engine, exactly once, from a shielded scope
        bounded by ``abort_timeout_s``. Entering is atomic with respect to
        cancellation (a cancelled entry sent nothing).

        If the engine rejects or fails the request (it finishes it with
        ``FinishReason.ERROR``), iterating the stream raises
        :class:`~trio_enginecore.errors.RequestFailedError` with the engine's message,
        after every output that came before the error.

        Raises:
            TypeError, ValueError: on entry, as :meth:`add_request`; nothing was sent.
            EngineDeadError: the engine has died (on entry, or from the stream).
        """
        stream = await self._send_add(request, streamed=True)
        assert stream is not None
        self._open_streams += 1
        try:
            yield stream
        finally:
            self._open_streams -= 1
            stream._close()  # pyright: ignore[reportPrivateUsage]
            if self._streams.get(stream.wire_id) is stream and not stream.finished:
                # Synchronous: an exit by cancellation cannot skip it.
                self._abort_wire([stream.wire_id])

    def _stream_closed(self, stream: RequestStream) -> None:
        # While the request is in flight the stream stays registered, so that its
        # late outputs reach the (closed) stream and are dropped there instead of
        # leaking into get_output(); finishing or aborting unregisters it.
        wire = stream.wire_id
        if self._streams.get(wire) is stream and wire not in self._inflight:
            del self._streams[wire]

    # ------------------------------------------------------------- utilities

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` on the engine and return its (untyped) result.

        With several engines it goes to one of them (rank 0); see
        ``call_utility_all``. The typed wrappers (``is_sleeping``, ``sleep``, ...)
        go to every engine.

        Cancellation: the call's bookkeeping is undone and a late reply is dropped, but
        the engine may still have run the method; only the typed wrappers that are
        idempotent can simply be retried.

        Raises:
            UtilityCallError: the method raised on the engine; carries its message.
            EngineDeadError: the engine died before replying.
        """
        (result,) = await self._call_engines([self._utility_engine()], method, args)
        return result

    async def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine; one result per engine, by rank.

        Cancellation and errors as :meth:`call_utility` (the first engine failure is
        raised, naming the engine).
        """
        return await self._call_engines(self._engines, method, args)

    async def _call_engines(
        self, engines: list[EngineHandle], method: str, args: tuple[Any, ...]
    ) -> list[Any]:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._raise_if_unusable()
        calls: list[tuple[int, _UtilityCall]] = []
        try:
            for engine in engines:
                call_id = self._new_call_id()
                call = _UtilityCall(method)
                self._calls[call_id] = call
                calls.append((call_id, call))
                payload = UtilityRequest(self.client_index, call_id, method, tuple(args))
                await self._transport_utility(engine, payload)
            for _, call in calls:
                await call.done.wait()
        finally:
            for call_id, call in calls:
                if self._calls.pop(call_id, None) is not None and not call.done.is_set():
                    logger.debug(
                        "utility call %s (%d) abandoned; a late reply is dropped", method, call_id
                    )
        results: list[Any] = []
        for engine, (_, call) in zip(engines, calls, strict=True):
            if call.failure is not None:
                raise EngineDeadError(call.failure)
            reply = call.reply
            assert reply is not None
            if reply.failure_message is not None:
                where = f"engine {engine.rank}: " if len(engines) > 1 else ""
                raise UtilityCallError(method, where + reply.failure_message)
            results.append(reply.result.result if reply.result is not None else None)
        return results

    async def _typed_call(self, result_type: type[T], method: str, *args: Any) -> T:
        # Every engine gets the wrapped utilities, and must agree on the answer.
        results = await self._call_engines(self._engines, method, args)
        typed = [convert_result(method, result, result_type) for result in results]
        return consensus(method, typed)  # type: ignore[no-any-return]

    async def get_request_counts(self) -> tuple[int, int]:
        """``(waiting, running)`` summed over the engines (see
        :meth:`get_request_counts_per_engine`).

        A reference-engine utility that vLLM 0.33's engines do not have: see
        :meth:`AsyncEngineCoreClient.get_request_counts` for where a vLLM engine's
        figures are.
        """
        per_engine = await self.get_request_counts_per_engine()
        return sum(w for w, _ in per_engine), sum(r for _, r in per_engine)

    async def get_request_counts_per_engine(self) -> list[tuple[int, int]]:
        """``(waiting, running)`` of each engine, by rank."""
        results = await self._call_engines(self._engines, "get_request_counts", ())
        return [convert_result("get_request_counts", r, tuple[int, int]) for r in results]

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        if self._closing:
            raise trio.ClosedResourceError("the engine client is closed")

    def _engine_for(self, request: EngineCoreRequest) -> EngineHandle:
        # The data-parallel clients override the choice; a single engine takes all.
        return self._engines[0]

    def _utility_engine(self) -> EngineHandle:
        return self._engines[0]

    def _new_call_id(self) -> int:
        while True:
            call_id = secrets.randbits(64)
            if call_id not in self._calls:
                return call_id

    async def _send_add(
        self, request: EngineCoreRequest, *, streamed: bool
    ) -> RequestStream | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        check_request(request)
        self._raise_if_unusable()
        request_id = request.request_id
        if request_id in self._ids_in_flight:
            raise ValueError(f"request {request_id!r} is already in flight on this client")
        engine = self._engine_for(request)
        request.client_index = self.client_index
        stream = RequestStream(request_id, on_close=self._stream_closed) if streamed else None
        # Register before sending: the reply may be received before send returns.
        wire = self._register(request, engine, stream=stream)
        try:
            await self._transport_add(engine, wire)
        except BaseException:
            self._forget(wire.request_id)
            raise
        return stream

    def _register(
        self, request: EngineCoreRequest, engine: EngineHandle, *, stream: RequestStream | None
    ) -> EngineCoreRequest:
        """Record ``request`` as in flight on ``engine``; the request to send.

        That is ``request`` itself, or, for an id whose aborted request the engine may
        still be producing for, a copy under a fresh wire id (the caller's object is
        not changed, so its ``request_id`` stays what the caller gave).
        """
        user_id = request.request_id
        wire = request
        if user_id in self._tombstones:
            wire_id = f"{user_id}~{secrets.token_hex(4)}"
            while wire_id in self._inflight:
                wire_id = f"{user_id}~{secrets.token_hex(4)}"
            wire = msgspec.structs.replace(
                request, request_id=wire_id, external_req_id=request.external_req_id or user_id
            )
            self._wire_ids[user_id] = wire_id
            self._user_ids[wire_id] = user_id
        self._inflight[wire.request_id] = engine
        engine.load.in_flight += 1
        if stream is not None:
            stream.wire_id = wire.request_id
            self._streams[wire.request_id] = stream
        return wire

    def _forget(self, wire_id: str) -> None:
        engine = self._inflight.pop(wire_id, None)
        if engine is not None:
            engine.load.in_flight -= 1
        self._streams.pop(wire_id, None)
        user_id = self._user_ids.pop(wire_id, None)
        if user_id is not None:
            del self._wire_ids[user_id]

    def _abort_now(self, request_ids: Iterable[str]) -> None:
        """Abort requests by the caller's ids (see :meth:`abort_requests`)."""
        ids = list(request_ids)
        wire_ids = self._wire_ids
        self._abort_wire([wire_ids.get(request_id, request_id) for request_id in ids])
        if len(self._batches):
            # Outputs received before the abort must not surface after it, those of a
            # request that finished meanwhile included (they carry the caller's ids).
            self._batches.discard(set(ids))

    def _abort_wire(self, wire_ids: list[str]) -> None:
        by_engine: dict[int, tuple[EngineHandle, list[str]]] = {}
        for wire_id in wire_ids:
            engine = self._inflight.get(wire_id)
            if engine is not None:
                by_engine.setdefault(engine.rank, (engine, []))[1].append(wire_id)
        for engine, ids in by_engine.values():
            live = engine.alive and not self._closed
            if live:
                self._transport_abort(engine, ids)
            for wire_id in ids:
                if live:
                    self._bury(self._user_ids.get(wire_id, wire_id))
                stream = self._streams.get(wire_id)
                self._forget(wire_id)
                if stream is not None:
                    stream._abort_locally()  # pyright: ignore[reportPrivateUsage]

    def _bury(self, user_id: str) -> None:
        tombstones = self._tombstones
        tombstones.pop(user_id, None)
        tombstones[user_id] = None
        if len(tombstones) > MAX_TOMBSTONES:
            # The oldest: its engine read the ABORT long ago.
            del tombstones[next(iter(tombstones))]

    def _handle_outputs(self, message: EngineCoreOutputs) -> None:
        """Route one decoded engine message. Synchronous: call it with no checkpoint
        between receiving the message and handing it over.

        An engine's message is checked for consistency as it is routed, never
        trusted: a message from an engine this client does not have is dropped whole
        (``protocol_errors``), an output of a request not in flight (late after an
        abort, for an unknown id, a second finish, after the finish) is dropped
        (``outputs_dropped``), and outputs of a stream that cannot be merged fail that
        stream with :class:`~trio_enginecore.errors.ProtocolError` and abort its
        request. Every other request is served on.
        """
        if not self._known_engine(message.engine_index):
            self._protocol_errors += 1
            logger.error(
                "dropping a message from engine index %r: this client has engines %s",
                message.engine_index,
                [engine.rank for engine in self._engines],
            )
            return
        self._messages += 1
        if message.utility_output is not None:
            self._resolve_utility(message.utility_output)
            if not message.outputs:
                return
        outputs = message.outputs
        inflight = self._inflight
        self._outputs_received += len(outputs)
        self._tokens += sum([len(output.new_token_ids) for output in outputs])
        batch = None
        if not self._streams and not self._user_ids:
            # The batch API's hot path: the whole message goes to get_output() as it is,
            # with the per-output work done in C-level set operations and
            # comprehensions rather than one loop. It needs every output to be of a
            # different request in flight; anything else takes the careful path.
            ids = [output.request_id for output in outputs]
            # All in flight and no id twice: then the intersection keeps every one.
            if len(inflight.keys() & ids) == len(ids):
                for request_id in [o.request_id for o in outputs if o.finish_reason is not None]:
                    inflight.pop(request_id).load.in_flight -= 1
                batch = outputs
        if batch is None:
            batch = self._route_outputs(outputs)
        if batch or message.scheduler_stats is not None:
            if batch is not outputs:
                message.outputs = batch
            self._batched_outputs += len(batch)
            self._batches.put(message)
            self._wake_batch_readers()

    def _known_engine(self, engine_index: int) -> bool:
        engines = self._engines
        if len(engines) == 1:
            return engines[0].rank == engine_index
        return any(engine.rank == engine_index for engine in engines)

    def _route_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Hand stream outputs to their streams; return the ones for get_output()."""
        batch: list[EngineCoreOutput] = []
        inflight = self._inflight
        streams = self._streams
        user_ids = self._user_ids
        for output in outputs:
            wire_id = output.request_id
            if wire_id not in inflight:
                # Produced before the engine read our ABORT (normal), or an output the
                # engine should never have sent.
                self._outputs_dropped += 1
                continue
            stream = streams.get(wire_id)
            user_id = user_ids.get(wire_id)
            if user_id is not None:
                output.request_id = user_id
            finished = output.finish_reason is not None
            if finished:
                self._forget(wire_id)
            if stream is None:
                batch.append(output)
                continue
            try:
                stream._push(output)  # pyright: ignore[reportPrivateUsage]
            except ProtocolError as exc:
                self._protocol_errors += 1
                logger.error("request %r: %s", stream.request_id, exc)
                stream._fail(str(exc), ProtocolError)  # pyright: ignore[reportPrivateUsage]
                if not finished:
                    self._abort_wire([wire_id])
        return batch

    def _wake_batch_readers(self) -> None:
        self._batch_event.set()
        self._batch_event = trio.Event()

    def _resolve_utility(self, reply: UtilityOutput) -> None:
        if reply.call_id in _NOTIFICATION_CALL_IDS:
            logger.info("engine notification (call id %d): %r", reply.call_id, reply.result)
            return
        call = self._calls.get(reply.call_id)
        if call is None:
            logger.debug("dropping a late or unknown utility reply (call id %d)", reply.call_id)
            return
        call.reply = reply
        call.done.set()

    def _engine_died(self, engine: EngineHandle, reason: str) -> None:
        if not engine.alive:
            return
        engine.alive = False
        engine.death = reason
        if self._closing:
            return
        logger.error("%s died: %s", engine.describe(), reason)
        message = f"{engine.describe()} died: {reason}"
        if self._failure is None:
            self._failure = message
        for wire_id, owner in list(self._inflight.items()):
            if owner is engine:
                stream = self._streams.get(wire_id)
                self._forget(wire_id)
                if stream is not None:
                    stream._fail(message)  # pyright: ignore[reportPrivateUsage]
        for call in self._calls.values():
            if not call.done.is_set():
                call.failure = message
                call.done.set()
        self._wake_batch_readers()
        self._on_engine_death(engine)

    def _fail_waiters_on_close(self) -> None:
        """Part of closing: abort what is in flight and wake every waiter."""
        self._closing = True
        if self._inflight:
            self._abort_wire(list(self._inflight))
        for stream in list(self._streams.values()):
            stream._fail("the engine client was closed")  # pyright: ignore[reportPrivateUsage]
        for call in self._calls.values():
            call.failure = "the engine client was closed"
            call.done.set()
        self._wake_batch_readers()


C = TypeVar("C", bound=TrioClientBase)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    pending: collections.deque[BaseException] = collections.deque([group])
    while pending:
        error = pending.popleft()
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)  # pyright: ignore[reportUnknownArgumentType, reportUnknownMemberType]
        else:
            leaves.append(error)
    return leaves


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception in a (nested) group, or None if there are several."""
    leaves = _leaves(group)
    return leaves[0] if len(leaves) == 1 else None


def _first_failure(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The first exception in a (nested) group that is not a cancellation."""
    return next((e for e in _leaves(group) if not isinstance(e, trio.Cancelled)), None)


@asynccontextmanager
async def run_client(
    client: C, start: Callable[[trio.Nursery], Awaitable[None]]
) -> AsyncGenerator[C, None]:
    """Run ``client`` inside its own nursery for the duration of an ``async with``.

    ``start(nursery)`` must return only once the client is usable. On the way out the
    client is closed (shielded) and its background tasks cancelled. The block's own
    exception, or ``Cancelled``, propagates as itself (identity, ``__context__`` and
    ``__cause__`` untouched); a startup failure propagates as itself; an engine death
    during a block that did not raise becomes one :class:`EngineDeadError`; a failure
    of a background task (a bug: they handle bad input themselves) raises one
    :class:`~trio_enginecore.errors.EngineCoreError` chained from it, in place of the
    ``Cancelled`` it caused in the block; an ExceptionGroup never escapes.
    """
    user_error: BaseException | None = None
    startup_error: BaseException | None = None
    background: BaseExceptionGroup[BaseException] | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                await start(nursery)
            except BaseException as exc:
                startup_error = exc
            else:
                try:
                    yield client
                except BaseException as exc:
                    user_error = exc
            finally:
                await client.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Background tasks never raise on purpose: this is an outer cancellation that
        # arrived during shutdown, or a bug. Either way the caller gets one exception.
        background = group
    # Raised outside any `except` block so the exception keeps its own __context__ and
    # __cause__: the caller's exception comes back exactly as it was.
    error = user_error or startup_error
    failure = _first_failure(background) if background is not None else None
    if failure is not None and (error is None or isinstance(error, trio.Cancelled)):
        # A background task failed, and the nursery cancelled the block because of it:
        # the failure is the news, not the Cancelled it caused.
        if isinstance(failure, EngineCoreError):
            raise failure
        raise EngineCoreError(
            f"the engine client failed in its background task: {failure!r}"
        ) from failure
    if error is None and background is not None:
        error = _single(background)
        if error is None:
            raise EngineDeadError("the engine client failed in the background") from background
    if error is not None:
        raise error
    if client._failure is not None:  # pyright: ignore[reportPrivateUsage]
        raise EngineDeadError(client._failure)  # pyright: ignore[reportPrivateUsage]

"""What every Trio engine client shares: the interface, streams, batches, utilities.

:class:`AsyncEngineCoreClient` is the interface of every Trio client, documented once.
:class:`TrioClientBase` implements it for any transport: request bookkeeping, per-request
streams, the merging batch buffer behind ``get_output()``, utility calls by ``call_id``
and failure propagation. A concrete client only moves messages: it implements the
``_transport_*`` hooks and feeds every engine message to :meth:`TrioClientBase._handle_outputs`
from a single task, with no checkpoint between receiving and handing over.
"""

from __future__ import annotations

import abc
import collections
import logging
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final, Literal, TypeVar, final

import attrs
import msgspec
import trio

from ..config import EngineConfig
from ..errors import EngineDeadError, ProtocolError, UtilityCallError
from ..protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    LoRARequest,
    UtilityOutput,
    UtilityRequest,
)
from ._collector import BatchCollector
from ._launch import EngineHandle
from ._lb import consensus
from ._stream import RequestStream
from ._validate import check_request, check_requests

__all__ = ["AsyncEngineCoreClient", "ClientStatistics", "TrioClientBase"]

logger = logging.getLogger("trio_enginecore.client")

T = TypeVar("T")

_NOTIFICATION_CALL_IDS: Final = (-1, -2)

PauseMode = Literal["abort", "wait", "keep"]


@final
@attrs.frozen
class ClientStatistics:
    """A snapshot of a client's state, from :meth:`TrioMPClient.statistics`."""

    requests_in_flight: int
    """Requests sent and neither finished nor aborted (streams included)."""
    open_streams: int
    """Streams whose ``async with`` block has not exited."""
    pending_utility_calls: int
    """Utility calls waiting for their reply."""
    pending_batches: int
    """Engine messages waiting for ``get_output()``."""
    messages_received: int
    """Messages decoded from the output socket."""
    outputs_received: int
    """Per-request outputs in those messages."""
    tokens_received: int
    """New token ids in those outputs."""
    protocol_errors: int
    """Output messages dropped because they could not be decoded."""
    engines_alive: int
    """Engines that have neither died nor been shut down."""


class AsyncEngineCoreClient(abc.ABC):
    """The interface of every Trio engine-core client.

    Every async method is a checkpoint. Unless its docstring says otherwise it is
    atomic with respect to cancellation: it either completes, or raises
    :class:`trio.Cancelled` with nothing sent and nothing changed. Utility calls are
    the documented exception: a cancelled call may still have run on the engine.
    """

    @abc.abstractmethod
    async def add_request(self, request: EngineCoreRequest) -> None:
        """Submit a request; its outputs arrive through :meth:`get_output`."""

    async def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """Submit several requests, as :meth:`add_request` does for one."""
        for request in requests:
            await self.add_request(request)

    @abc.abstractmethod
    async def get_output(self) -> EngineCoreOutputs:
        """The next engine message with outputs of requests from :meth:`add_request`."""

    @abc.abstractmethod
    async def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests; unknown ids are ignored."""

    @abc.abstractmethod
    def stream(self, request: EngineCoreRequest) -> AbstractAsyncContextManager[RequestStream]:
        """Submit a request and stream its outputs (``async with ... as outputs``)."""

    @abc.abstractmethod
    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call a utility method on the engine and return its untyped result."""

    @abc.abstractmethod
    def statistics(self) -> ClientStatistics:
        """A frozen snapshot of the client's counters."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Abort in-flight requests and release everything the client holds."""

    async def _typed_call(self, result_type: type[T], method: str, *args: Any) -> T:
        return convert_result(method, await self.call_utility(method, *args), result_type)

    async def is_sleeping(self) -> bool:
        """Whether the engine is asleep. Safe to retry after cancellation."""
        return await self._typed_call(bool, "is_sleeping")

    async def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep: it stops stepping until :meth:`wake_up`."""
        await self._typed_call(type(None), "sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine up after :meth:`sleep`."""
        await self._typed_call(type(None), "wake_up", tags)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Clear the engine's prefix cache; False if it could not (requests running)."""
        return await self._typed_call(
            bool, "reset_prefix_cache", reset_running_requests, reset_connector
        )

    async def profile(self, is_start: bool = True) -> None:
        """Start (or stop) the engine's profiler."""
        await self._typed_call(type(None), "profile", is_start)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter on the engine; False if there is no room."""
        return await self._typed_call(bool, "add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Unregister a LoRA adapter; False if it was not registered."""
        return await self._typed_call(bool, "remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        """Ids of the LoRA adapters registered on the engine."""
        return await self._typed_call(set[int], "list_loras")

    async def pin_lora(self, lora_id: int) -> bool:
        """Keep a LoRA adapter registered; False if it is not registered."""
        return await self._typed_call(bool, "pin_lora", lora_id)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """The tasks the engine serves, e.g. ``("generate",)``."""
        return await self._typed_call(tuple[str, ...], "get_supported_tasks")

    async def execute_dummy_batch(self) -> None:
        """Run the model once on a throwaway batch (a warm-up)."""
        await self._typed_call(type(None), "execute_dummy_batch")

    async def set_weight_version(self, version: str | None) -> None:
        """Record the weight version the engine reports on its outputs."""
        await self._typed_call(type(None), "set_weight_version", version)

    async def get_weight_version(self) -> str | None:
        """The weight version set with :meth:`set_weight_version`."""
        return await self._typed_call(str | None, "get_weight_version")  # type: ignore[arg-type]

    async def pause_scheduler(
        self, mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True
    ) -> None:
        """Pause the engine's scheduler.

        ``abort`` aborts in-flight requests (their streams end with ABORT), ``wait``
        returns once running requests finished, ``keep`` freezes them in place.
        Requests added while paused wait until :meth:`resume_scheduler`.
        """
        await self._typed_call(type(None), "pause_scheduler", mode, clear_cache)

    async def resume_scheduler(self) -> None:
        """Resume the engine's scheduler after :meth:`pause_scheduler`."""
        await self._typed_call(type(None), "resume_scheduler")

    async def is_scheduler_paused(self) -> bool:
        """Whether the engine's scheduler is paused."""
        return await self._typed_call(bool, "is_scheduler_paused")

    async def get_request_counts(self) -> tuple[int, int]:
        """``(waiting, running)`` request counts of the engine (for load balancing)."""
        return await self._typed_call(tuple[int, int], "get_request_counts")

    # -------------------------------------------------------------- internals


def convert_result(method: str, result: Any, result_type: type[T]) -> T:
    """A utility's untyped result as ``result_type``, or ProtocolError."""
    try:
        return msgspec.convert(result, result_type, strict=False)
    except msgspec.ValidationError as exc:
        raise ProtocolError(
            f"utility {method!r} returned {result!r}, expected {result_type}: {exc}"
        ) from exc


@attrs.define(eq=False)
class _UtilityCall:
    method: str
    done: trio.Event = attrs.field(factory=trio.Event)
    reply: UtilityOutput | None = None
    failure: str | None = None


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
        check_requests(batch, self._inflight)
        pending = list(batch)
        while pending:
            request = pending[0]
            engine = self._engine_for(request)
            request.client_index = self.client_index
            self._track(request.request_id, engine)
            try:
                self._transport_add_nowait(engine, request)
            except trio.WouldBlock:
                # Not with the unbounded queues the clients use; go the slow way.
                self._forget(request.request_id)
                for rest in pending:
                    await self._send_add(rest, streamed=False)
                return
            pending.pop(0)
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
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            outputs = self._batches.take()
            if outputs is not None:
                break
            self._raise_if_unusable()
            await self._batch_event.wait()
            waited = True
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return outputs

    async def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests on the engines that have them. Unknown ids are ignored.

        The engine sends no output for a request it aborts on our behalf, and outputs
        already received for it are dropped: after this returns, ``get_output()`` never
        returns an output of these requests. A stream of an aborted request ends with a
        local ``FinishReason.ABORT`` output.
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
            if request.request_id in self._inflight and not stream.finished:
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(self.abort_timeout_s):
                        await self.abort_requests([request.request_id])

    def _stream_closed(self, stream: RequestStream) -> None:
        # While the request is in flight the stream stays registered, so that its
        # late outputs reach the (closed) stream and are dropped there instead of
        # leaking into get_output(); finishing or aborting unregisters it.
        if (
            self._streams.get(stream.request_id) is stream
            and stream.request_id not in self._inflight
        ):
            del self._streams[stream.request_id]

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
        :meth:`get_request_counts_per_engine`)."""
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
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} is already in flight on this client")
        stream = RequestStream(request_id, on_close=self._stream_closed) if streamed else None
        engine = self._engine_for(request)
        request.client_index = self.client_index
        # Register before sending: the reply may be received before send returns.
        self._track(request_id, engine)
        if stream is not None:
            self._streams[request_id] = stream
        try:
            await self._transport_add(engine, request)
        except BaseException:
            self._forget(request_id)
            if stream is not None:
                self._streams.pop(request_id, None)
            raise
        return stream

    def _track(self, request_id: str, engine: EngineHandle) -> None:
        self._inflight[request_id] = engine
        engine.load.in_flight += 1

    def _forget(self, request_id: str) -> None:
        engine = self._inflight.pop(request_id, None)
        if engine is not None:
            engine.load.in_flight -= 1

    def _abort_now(self, request_ids: Iterable[str]) -> None:
        by_engine: dict[int, tuple[EngineHandle, list[str]]] = {}
        for request_id in request_ids:
            engine = self._inflight.get(request_id)
            if engine is not None:
                by_engine.setdefault(engine.rank, (engine, []))[1].append(request_id)
        for engine, ids in by_engine.values():
            if engine.alive and not self._closed:
                self._transport_abort(engine, ids)
            for request_id in ids:
                self._forget(request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream._abort_locally()  # pyright: ignore[reportPrivateUsage]
            if len(self._batches):
                # Outputs received before the abort must not surface after it.
                self._batches.discard(set(ids))

    def _handle_outputs(self, message: EngineCoreOutputs) -> None:
        """Route one decoded engine message. Synchronous: call it with no checkpoint
        between receiving the message and handing it over."""
        self._messages += 1
        if message.utility_output is not None:
            self._resolve_utility(message.utility_output)
            if not message.outputs:
                return
        outputs = message.outputs
        inflight = self._inflight
        self._outputs_received += len(outputs)
        self._tokens += sum([len(output.new_token_ids) for output in outputs])
        if not self._streams and all([o.request_id in inflight for o in outputs]):  # noqa: C419 - a list is faster here
            # The batch API's hot path: the whole message goes to get_output() as it is,
            # with the per-output work done in comprehensions rather than one loop.
            for request_id in [o.request_id for o in outputs if o.finish_reason is not None]:
                inflight.pop(request_id).load.in_flight -= 1
            batch = outputs
        else:
            batch = self._route_outputs(outputs)
        if batch or message.scheduler_stats is not None:
            if batch is not outputs:
                message.outputs = batch
            self._batched_outputs += len(batch)
            self._batches.put(message)
            self._wake_batch_readers()

    def _route_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Hand stream outputs to their streams; return the ones for get_output()."""
        batch: list[EngineCoreOutput] = []
        inflight = self._inflight
        streams = self._streams
        for output in outputs:
            request_id = output.request_id
            if request_id not in inflight:
                # Output of a request we aborted, produced before the abort arrived.
                continue
            if output.finish_reason is not None:
                inflight.pop(request_id).load.in_flight -= 1
            stream = streams.get(request_id)
            if stream is not None:
                stream._push(output)  # pyright: ignore[reportPrivateUsage]
                if output.finish_reason is not None:
                    del streams[request_id]
            else:
                batch.append(output)
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
        for request_id, owner in list(self._inflight.items()):
            if owner is engine:
                self._forget(request_id)
                stream = self._streams.pop(request_id, None)
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
            self._abort_now(list(self._inflight))
        for stream in list(self._streams.values()):
            stream._fail("the engine client was closed")  # pyright: ignore[reportPrivateUsage]
        for call in self._calls.values():
            call.failure = "the engine client was closed"
            call.done.set()
        self._wake_batch_readers()


C = TypeVar("C", bound=TrioClientBase)


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception in a (nested) group, or None if there are several."""
    leaves: list[BaseException] = []
    pending: collections.deque[BaseException] = collections.deque([group])
    while pending:
        error = pending.popleft()
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)  # pyright: ignore[reportUnknownArgumentType, reportUnknownMemberType]
        else:
            leaves.append(error)
    return leaves[0] if len(leaves) == 1 else None


@asynccontextmanager
async def run_client(
    client: C, start: Callable[[trio.Nursery], Awaitable[None]]
) -> AsyncGenerator[C, None]:
    """Run ``client`` inside its own nursery for the duration of an ``async with``.

    ``start(nursery)`` must return only once the client is usable. On the way out the
    client is closed (shielded) and its background tasks cancelled. The block's own
    exception, or ``Cancelled``, propagates as itself (identity, ``__context__`` and
    ``__cause__`` untouched); a startup failure propagates as itself; an engine death
    during a block that did not raise becomes one :class:`EngineDeadError`; an
    ExceptionGroup never escapes.
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
    if error is None and background is not None:
        error = _single(background)
        if error is None:
            raise EngineDeadError("the engine client failed in the background") from background
    if error is not None:
        raise error
    if client._failure is not None:  # pyright: ignore[reportPrivateUsage]
        raise EngineDeadError(client._failure)  # pyright: ignore[reportPrivateUsage]

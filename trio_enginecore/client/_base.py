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
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

from ..config import EngineConfig
from ..errors import EngineCoreError, EngineDeadError, UtilityCallError
from ..protocol import (
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    UtilityRequest,
)
from ._interface import AsyncEngineCoreClient, ClientStatistics
from ._launch import EngineHandle
from ._state import ClientState, UtilityCall
from ._stream import RequestStream, StreamFeed, open_request_stream
from ._validate import check_request, check_requests

__all__ = ["TrioClientBase", "run_client"]

logger = logging.getLogger("trio_enginecore.client")


class TrioClientBase(AsyncEngineCoreClient):
    """The transport-independent part of the Trio clients (see the module docstring).

    The decisions are :class:`~trio_enginecore.client._state.ClientState`'s; this class
    adds the checkpoints, the waits and the hand-over to the transport.
    """

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
        self._state = ClientState(
            [], self._transport_abort, max_pending_outputs=max_pending_outputs
        )

    # ------------------------------------------------------- transport hooks

    @abc.abstractmethod
    def _transport_add(self, engine: EngineHandle, request: EngineCoreRequest) -> None:
        """Deliver an ADD without blocking or checkpointing."""

    @abc.abstractmethod
    def _transport_abort(self, engine: EngineHandle, request_ids: list[str]) -> None:
        """Deliver an ABORT without blocking or checkpointing."""

    @abc.abstractmethod
    def _transport_utility(self, engine: EngineHandle, call: UtilityRequest) -> None:
        """Deliver a UTILITY call without blocking or checkpointing."""

    def _on_engine_death(self, engine: EngineHandle) -> None:
        """Called after an engine's death was recorded and every waiter failed."""

    # ------------------------------------------------------------ public state

    @property
    def engines(self) -> tuple[EngineCoreReadyResponse | None, ...]:
        """Each engine's ready response, by rank."""
        return tuple(engine.ready for engine in self._state.engines)

    @property
    def engine_pids(self) -> tuple[int | None, ...]:
        """The process id of each launched engine (None for attached engines)."""
        return tuple(e.process.pid if e.process else None for e in self._state.engines)

    @property
    def failure(self) -> str | None:
        """Why the client is dead (the first engine death, named), or None."""
        return self._state.failure

    @property
    def is_dead(self) -> bool:
        """True once an engine died; every later call raises EngineDeadError."""
        return self._state.failure is not None

    def statistics(self) -> ClientStatistics:
        """A frozen snapshot of the client's counters."""
        return self._state.statistics()

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
        await self._send_add(request, stream=None)

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
        state = self._state
        state.raise_if_unusable()
        batch = list(requests)
        check_requests(batch, state.ids_in_flight)
        for request in batch:
            self._add_now(request, stream=None)
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
        state = self._state
        await trio.lowlevel.checkpoint_if_cancelled()
        if len(state.batches):
            await trio.lowlevel.cancel_shielded_checkpoint()
        while True:
            outputs = state.take_batch()
            if outputs is not None:
                return outputs
            state.raise_if_unusable()
            await state.batch_ready.wait()

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
        self._state.abort(request_ids)
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
        state = self._state
        feed, stream = open_request_stream(request.request_id, on_close=state.stream_closed)
        await self._send_add(request, stream=feed)
        state.open_streams += 1
        try:
            yield stream
        finally:
            state.stream_left(feed)

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
        return await self._call_engines(self._state.engines, method, args)

    async def _call_engines(
        self, engines: list[EngineHandle], method: str, args: tuple[Any, ...]
    ) -> list[Any]:
        await trio.lowlevel.checkpoint_if_cancelled()
        state = self._state
        state.raise_if_unusable()
        calls: list[tuple[int, UtilityCall]] = []
        try:
            for engine in engines:
                call_id, call = state.new_call(method)
                calls.append((call_id, call))
                payload = UtilityRequest(self.client_index, call_id, method, tuple(args))
                self._transport_utility(engine, payload)
            for _, call in calls:
                await call.done.wait()
        finally:
            for call_id, _ in calls:
                if not state.end_call(call_id):
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

    # -------------------------------------------------------------- internals

    def _engine_for(self, request: EngineCoreRequest) -> EngineHandle:
        # The data-parallel clients override the choice; a single engine takes all.
        return self._state.engines[0]

    def _utility_engine(self) -> EngineHandle:
        return self._state.engines[0]

    async def _send_add(self, request: EngineCoreRequest, *, stream: StreamFeed | None) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        check_request(request)
        state = self._state
        state.raise_if_unusable()
        if request.request_id in state.ids_in_flight:
            raise ValueError(f"request {request.request_id!r} is already in flight on this client")
        self._add_now(request, stream=stream)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def _add_now(self, request: EngineCoreRequest, *, stream: StreamFeed | None) -> None:
        """Register and send a checked request, with no checkpoint."""
        engine = self._engine_for(request)
        request.client_index = self.client_index
        # Register before sending: the reply may be received before send returns.
        wire = self._state.register(request, engine, stream=stream)
        try:
            self._transport_add(engine, wire)
        except BaseException:
            self._state.forget(wire.request_id)
            raise

    def _handle_outputs(self, message: EngineCoreOutputs) -> None:
        """Route one decoded engine message (see ``ClientState.handle_outputs``)."""
        self._state.handle_outputs(message)

    def _engine_died(self, engine: EngineHandle, reason: str) -> None:
        if self._state.engine_died(engine, reason):
            self._on_engine_death(engine)

    def _fail_waiters_on_close(self) -> None:
        """Part of closing: abort what is in flight and wake every waiter."""
        self._state.close()


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
    death = client.failure
    if death is not None:
        raise EngineDeadError(death)

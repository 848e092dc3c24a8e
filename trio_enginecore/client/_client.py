"""The one Trio engine client: streams, batches, utilities, over any transport.

:class:`TrioEngineClient` implements :class:`AsyncEngineCoreClient`. What happens to
each request is decided by its :class:`~trio_enginecore.client._state.ClientState`
(no I/O); which engine gets it, by its :class:`~trio_enginecore.client._router.Router`;
the coordinator's request wave is followed by its
:class:`~trio_enginecore.client._router.WaveFollower`. The client adds the
checkpoints and the waits, and hands messages to its
:class:`~trio_enginecore.client._transport.Transport`, which it is given: ZeroMQ to
engine processes, an engine task in this process, or the scripted engine of
:mod:`trio_enginecore.testing`. The vLLM-shaped classes (``TrioMPClient``,
``DPTrioMPClient``, ``DPLBTrioMPClient``, ``TrioInprocClient``) only choose the
transport and the routing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager, suppress
from typing import Any, Self

import trio

from .._request_checks import check_request, check_requests
from ..config import EngineConfig
from ..errors import EngineDeadError, UtilityCallError
from ..protocol import EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequest
from ._calls import call_engines
from ._engines import EngineHandle
from ._interface import AsyncEngineCoreClient, ClientStatistics
from ._lb import LoadBalancer
from ._options import FailurePolicy
from ._policy import RESTART_NEEDS_LAUNCHED_ENGINES, Policy, Restart, resolve_policy
from ._router import DataParallelRole, Router, WaveFollower
from ._state import ClientState
from ._stream import RequestStream, StreamBlock, StreamFeed
from ._supervision import wait_for_service
from ._transport import ClientLink, Transport

__all__ = ["TrioEngineClient"]

logger = logging.getLogger("trio_enginecore.client")


class TrioEngineClient(AsyncEngineCoreClient, trio.abc.AsyncResource):
    """A Trio engine client over a transport (see the module docstring).

    Open one with :func:`~trio_enginecore.open_engine_client` (or, managing your own
    nursery, :func:`~trio_enginecore.connect_engine_client`); the classes named after
    vLLM's build one with the right transport. See
    :class:`~trio_enginecore.AsyncEngineCoreClient` for the methods and their
    cancellation semantics. As a :class:`trio.abc.AsyncResource`, ``async with
    client:`` closes it on the way out.

    A client built with its constructor does nothing until :meth:`start`: every
    method of a client that was never started (``async with client:`` included)
    raises ``RuntimeError`` saying so, rather than serving with no engine.

    Args:
        transport: how messages reach the engines.
        config: the engine configuration the client was opened with.
        role: which engines it talks to and how requests are routed (one engine by
            default).
        client_index: this client's index among the engines' clients.
        max_pending_outputs: messages kept for ``get_output()`` before they are
            merged (never dropped).
        on_engine_failure: what an engine's death does (see
            :func:`~trio_enginecore.open_engine_client`): fail the client, take that
            engine out of routing and serve on with the others, or also restart it.

    Raises:
        ValueError: the ``restart`` policy over a transport that cannot restart
            engines (it did not launch them all).
    """

    def __init__(
        self,
        transport: Transport,
        config: EngineConfig,
        *,
        role: DataParallelRole | None = None,
        client_index: int = 0,
        max_pending_outputs: int = 64,
        on_engine_failure: FailurePolicy | Policy = "fail",
    ) -> None:
        self.config = config
        self.client_index = client_index
        role = role if role is not None else DataParallelRole.single(config)
        self.role = role
        self._transport = transport
        policy = resolve_policy(on_engine_failure)
        # The one check of the policy against the transport.
        if isinstance(policy, Restart) and not transport.restarts_engines:
            raise ValueError(RESTART_NEEDS_LAUNCHED_ENGINES)
        self._restart = policy if isinstance(policy, Restart) else None
        self._state = ClientState(
            [], transport.send_abort, max_pending_outputs=max_pending_outputs, policy=policy
        )
        # Both share the state's engine list, which the transport fills in place.
        self._router = Router(self._state.engines, role.load_balancer)
        self._waves = WaveFollower(stamps=role.data_parallel)
        self._started = False
        # Bound once: every open stream's block refers to these three instead of
        # holding three bound-method objects of its own (about 190 bytes a stream).
        self._stream_hooks = (self._send_stream, self._state.stream_closed, self._state.stream_left)

    async def start(self, nursery: trio.Nursery) -> None:
        """Reach the engines and start the client's background tasks in ``nursery``;
        return once every engine is ready.

        The openers call it; call it yourself only for a client you constructed, once.
        If it raises (or is cancelled), call :meth:`aclose`, as the openers do.

        Raises:
            EngineStartupError: an engine failed to start or was not ready in time.
            RuntimeError: the client was started before.
        """
        if self._started:
            raise RuntimeError("the engine client was already started")
        if self._state.closed:
            raise trio.ClosedResourceError("the engine client was closed")
        self._started = True
        await self._transport.start(
            nursery,
            ClientLink(
                self._state,
                self._engine_died,
                self._waves,
                self._ping,
                self._engine_back,
                self._engine_given_up,
                self._state.requests_lost,
                self._state.engine_suspect,
                self._state.engine_cleared,
            ),
        )

    async def __aenter__(self) -> Self:
        """``async with client:``, for a client you started: closes it on the way out.

        Raises:
            RuntimeError: the client was never started (``async with
                open_engine_client(config) as client:`` starts one).
        """
        self._require_started()
        return await super().__aenter__()

    def _require_started(self) -> None:
        if not self._started:
            name = type(self).__name__
            raise RuntimeError(
                f"this {name} was never started, so it has no engine: open a client with "
                f"`async with open_engine_client(config) as client:` (or "
                f"connect_engine_client(nursery, config)), or call "
                f"`await client.start(nursery)` before using a {name} you built yourself"
            )

    async def aclose(self) -> None:
        """Abort in-flight requests, close every stream and call, stop the transport.

        A multiprocess client stops the engines it launched (SIGTERM, then SIGKILL
        after ``shutdown_timeout_s``), leaves attached engines running (their requests
        from this client aborted) and closes its sockets. Idempotent. Runs shielded
        from cancellation (bounded by the transport's timeouts), like every Trio
        ``aclose``.
        """
        state = self._state
        if state.closed:
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):
            state.close()
            self._waves.announce()  # wakes wave waiters, who then raise
            await self._transport.aclose()
            state.closed = True
            state.engines_stopped()
            logger.debug("client closed")

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
        self._require_started()
        return self._state.statistics()

    async def wait_failed(self) -> EngineDeadError:
        """Wait until the client fails, and return the error its calls now raise.

        For code in the client's block that waits on something else (an HTTP server, a
        queue of work) and must learn that the engines are gone: run it beside
        ``wait_failed()`` and stop when it returns, or open the client with
        ``cancel_on_failure=True`` to have the block's body cancelled instead. Returns
        at once if the client failed already. Cancellation leaves nothing changed.

        Raises:
            trio.ClosedResourceError: the client was closed (before or while waiting)
                without failing.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._require_started()
        state = self._state
        if state.ended.is_set():
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await state.ended.wait()
        if state.failure is not None:
            return state.dead_error()
        raise trio.ClosedResourceError("the engine client was closed")

    @property
    def load_balancer(self) -> LoadBalancer | None:
        """The policy choosing each request's engine (None: one engine takes all)."""
        return self._router.load_balancer

    @property
    def current_wave(self) -> int:
        """The request wave the coordinator last published (0 before the first, and
        always 0 for a client following no coordinator)."""
        return self._waves.current_wave

    @property
    def engines_running(self) -> bool:
        """Whether the engines are in a wave, as the coordinator last published."""
        return self._waves.engines_running

    async def wait_wave_change(self) -> tuple[int, bool]:
        """Wait until the coordinator publishes a different wave or running state.

        A client following no coordinator (one engine) sees no change: the wait ends
        only by raising, when the client dies or closes.

        Returns the new ``(current_wave, engines_running)``. Cancellation leaves
        nothing changed.

        Raises:
            EngineDeadError: an engine died (before or while waiting).
            trio.ClosedResourceError: the client is closed (before or while waiting).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._require_started()
        self._state.raise_if_unusable()
        await self._waves.wait_changed()
        self._state.raise_if_unusable()
        return self._waves.current_wave, self._waves.engines_running

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
        self._require_started()
        state = self._state
        state.raise_if_unusable()
        batch = list(requests)
        await self._wait_for_an_engine()
        check_requests(batch, state.ids_in_flight)
        router = self._router
        for request in batch:
            router.check(request)
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
        self._require_started()
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
        self._require_started()
        self._state.abort(request_ids)
        await trio.lowlevel.cancel_shielded_checkpoint()

    # --------------------------------------------------------------- streams

    def stream(self, request: EngineCoreRequest) -> AbstractAsyncContextManager[RequestStream]:
        """Send ``request`` and stream its outputs.

        ::

            async with client.stream(request) as outputs:
                async for output in outputs:
                    ...

        Leaving the block before the request finished (``break``, an exception,
        cancellation) aborts it on the engine, exactly once, before the block exits:
        the ABORT is one non-blocking send, with no checkpoint, so cancellation cannot
        skip it and nothing waits for it. Entering is atomic with respect to
        cancellation (a cancelled entry sent nothing).

        If the engine rejects or fails the request (it finishes it with
        ``FinishReason.ERROR``), iterating the stream raises
        :class:`~trio_enginecore.errors.RequestFailedError` with the engine's message,
        after every output that came before the error.

        Raises:
            TypeError, ValueError: on entry, as :meth:`add_request`; nothing was sent.
            EngineDeadError: the engine has died (on entry, or from the stream).
        """
        self._require_started()
        return StreamBlock(request, *self._stream_hooks)

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
        await trio.lowlevel.checkpoint_if_cancelled()
        self._require_started()
        await self._wait_for_an_engine()
        (result,) = await self._call_engines([self._router.utility_engine()], method, args)
        return result

    async def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine in service; one result per engine,
        by rank (engines a ``route_around`` client took out of service are skipped).

        Cancellation and errors as :meth:`call_utility` (the first engine failure is
        raised, naming the engine).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._require_started()
        await self._wait_for_an_engine()
        return await self._call_engines(self._router.live, method, args)

    async def _call_engines(
        self,
        engines: list[EngineHandle],
        method: str,
        args: tuple[Any, ...],
        *,
        internal: bool = False,
    ) -> list[Any]:
        await trio.lowlevel.checkpoint_if_cancelled()
        state = self._state
        if not internal or state.closing:
            # The client's own checks go on after it failed: under "fail" the other
            # engines' streams keep streaming, and one that hangs must be noticed.
            state.raise_if_unusable()
        for engine in engines:
            # A utility the engine's release lacks, or a signature it does not have, is
            # refused here with the reason, instead of failing on the engine.
            problem = engine.dialect.utility_problem(method, len(args))
            if problem is not None:
                raise UtilityCallError(
                    method, f"not sent: {engine.describe()} runs {problem}", rank=engine.rank
                )
        return await call_engines(
            state.calls,
            self._transport.send_utility,
            self.client_index,
            engines,
            method,
            args,
            internal=internal,
        )

    # -------------------------------------------------------------- internals

    async def _send_stream(self, request: EngineCoreRequest, feed: StreamFeed) -> None:
        await self._send_add(request, stream=feed)
        self._state.open_streams += 1

    async def _send_add(self, request: EngineCoreRequest, *, stream: StreamFeed | None) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._require_started()
        check_request(request)
        state = self._state
        state.raise_if_unusable()
        await self._wait_for_an_engine()
        if request.request_id in state.ids_in_flight:
            raise ValueError(f"request {request.request_id!r} is already in flight on this client")
        self._router.check(request)
        self._add_now(request, stream=stream)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def _add_now(self, request: EngineCoreRequest, *, stream: StreamFeed | None) -> None:
        """Register and send a checked request, with no checkpoint."""
        engine = self._router.engine_for(request)
        request.client_index = self.client_index
        # Register before sending: the reply may be received before send returns.
        wire = self._state.register(request, engine, stream=stream)
        self._waves.stamp(wire)
        try:
            self._transport.send_add(engine, wire)
        except BaseException:
            self._state.forget(wire.request_id)
            raise

    def _engine_died(self, engine: EngineHandle, reason: str) -> None:
        state = self._state
        if state.engine_died(engine, reason):
            self._router.take_out(engine)
            if state.failure is not None:
                self._waves.announce()  # wakes wave waiters, who then raise
            self._transport.engine_death_recorded(engine)

    async def _wait_for_an_engine(self) -> None:
        if self._restart is not None and not self._router.live:
            await wait_for_service(self._router, self._state, self._restart.wait_s)

    def _engine_back(self, engine: EngineHandle) -> None:
        self._state.engine_back(engine)
        self._router.put_back(engine)

    def _engine_given_up(self, engine: EngineHandle, reason: str) -> None:
        state = self._state
        state.engine_given_up(engine, reason)
        if state.failure is not None:
            self._waves.announce()

    async def _ping(self, engine: EngineHandle) -> None:
        """One utility round trip to ``engine``: any answer, a failure included."""
        with suppress(UtilityCallError):
            await self._call_engines([engine], "is_sleeping", (), internal=True)

"""The one Trio engine client: streams, batches, utilities, over any transport.

:class:`TrioEngineClient` implements :class:`AsyncEngineCoreClient`. What happens to
each request is decided by its :class:`~trio_enginecore.client._core._state.ClientState`
(no I/O); which engine gets it, by its :class:`~trio_enginecore.client._core._router.Router`;
the coordinator's request wave is followed by its
:class:`~trio_enginecore.client._core._router.WaveFollower`. The client adds the
checkpoints and the waits, and hands messages to its
:class:`~trio_enginecore.client._transport.Transport`, which it is given: ZeroMQ to
engine processes, an engine task in this process, or the scripted engine of
:mod:`trio_enginecore.testing`. The vLLM-shaped classes (``TrioMPClient``,
``DPTrioMPClient``, ``DPLBTrioMPClient``, ``TrioInprocClient``) only choose the
transport and the routing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, suppress
from typing import Any, Self, final

import trio

from .._request_checks import check_request, check_requests
from ..config import EngineConfig
from ..errors import EngineDeadError, UtilityCallError
from ..protocol import EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequest
from ._core._calls import call_engines
from ._core._engines import EngineHandle
from ._core._lb import LoadBalancer
from ._core._policy import (
    RESTART_NEEDS_LAUNCHED_ENGINES,
    FailurePolicy,
    Policy,
    Restart,
    resolve_policy,
)
from ._core._router import DataParallelRole, Router, WaveFollower
from ._core._state import ClientState
from ._core._stream import RequestStream, StreamBlock, StreamFeed
from ._interface import AsyncEngineCoreClient, ClientStatistics
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
        events = _EngineEvents(self._state, self._router, self._waves, self._transport)
        await self._transport.start(nursery, events.link(ping=self._ping))

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
            raise RuntimeError(_never_started(type(self).__name__))

    async def aclose(self) -> None:
        state = self._state
        if state.closed:
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):
            state.close()
            self._waves.announce()  # wakes wave waiters, who then raise
            await self._transport.aclose()
            state.closed = True
            state.lifecycle.engines_stopped()
            logger.debug("client closed")

    # ------------------------------------------------------------ public state

    @property
    def engines(self) -> tuple[EngineCoreReadyResponse | None, ...]:
        """Each engine's ready response, by rank."""
        return tuple(engine.ready for engine in self._state.engines)

    @property
    def engine_pids(self) -> tuple[int | None, ...]:
        """The process id of each launched engine (None for attached engines)."""
        return tuple(engine.pid for engine in self._state.engines)

    @property
    def failure(self) -> str | None:
        """Why the client is dead (the first engine death, named), or None."""
        return self._state.failure

    def failure_error(self) -> EngineDeadError | None:
        """The error every call raises now that the client failed, as a fresh copy
        (the dead engine's rank, pid and location included), or None while it has
        not failed. Not a checkpoint: for code that must not wait (another thread's
        view of a client whose loop is ending)."""
        self._require_started()
        state = self._state
        return state.dead_error() if state.failure is not None else None

    @property
    def is_dead(self) -> bool:
        """True once an engine died; every later call raises EngineDeadError."""
        return self._state.failure is not None

    def observe_outputs(self, observer: Callable[[EngineCoreOutputs], None]) -> Callable[[], None]:
        """Have ``observer`` called with every engine message carrying outputs or
        scheduler statistics, as it arrives and before its outputs reach their requests
        (for metrics: the engine's timestamps, events and ``scheduler_stats`` are there
        and nowhere else). Returns the function that stops it.

        The observer runs in the client's receive task: it must be quick and must not
        change the message. Its request ids are those on the wire: the caller's ids,
        except a reused id of an aborted request (then ``"<id>~<suffix>"``). One that
        raises is logged once and dropped; the outputs are served on.

        Raises:
            RuntimeError: the client was never started.
        """
        self._require_started()
        observers = self._state.output_observers
        observers.append(observer)

        def stop() -> None:
            if observer in observers:
                observers.remove(observer)

        return stop

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
        await self._send_add(request, stream=None)

    async def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
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
        await trio.lowlevel.checkpoint_if_cancelled()
        self._require_started()
        self._state.abort(request_ids)
        await trio.lowlevel.cancel_shielded_checkpoint()

    # --------------------------------------------------------------- streams

    def stream(self, request: EngineCoreRequest) -> AbstractAsyncContextManager[RequestStream]:
        self._require_started()
        return StreamBlock(request, *self._stream_hooks)

    # ------------------------------------------------------------- utilities

    async def call_utility(self, method: str, *args: Any) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._require_started()
        await self._wait_for_an_engine()
        (result,) = await self._call_engines([self._router.utility_engine()], method, args)
        return result

    async def call_utility_all(self, method: str, *args: Any) -> list[Any]:
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

    async def _wait_for_an_engine(self) -> None:
        if self._restart is not None and not self._router.live:
            await wait_for_service(self._router, self._state, self._restart.wait_s)

    async def _ping(self, engine: EngineHandle) -> None:
        """One utility round trip to ``engine``: any answer, a failure included."""
        with suppress(UtilityCallError):
            await self._call_engines([engine], "is_sleeping", (), internal=True)


def _never_started(name: str) -> str:
    return (
        f"this {name} was never started, so it has no engine: open a client with "
        f"`async with open_engine_client(config) as client:` (or "
        f"connect_engine_client(nursery, config)), or call "
        f"`await client.start(nursery)` before using a {name} you built yourself"
    )


@final
class _EngineEvents:
    """What a client does when its transport reports an engine's death, return or
    abandonment: the state's lifecycle decides; this carries out what only the client
    can (routing, the wave waiters, the transport's restart)."""

    __slots__ = ("_router", "_state", "_transport", "_waves")

    def __init__(
        self, state: ClientState, router: Router, waves: WaveFollower, transport: Transport
    ) -> None:
        self._state = state
        self._router = router
        self._waves = waves
        self._transport = transport

    def link(self, *, ping: Callable[[EngineHandle], Awaitable[None]]) -> ClientLink:
        """What the transport is handed: the state, and these reactions."""
        lifecycle = self._state.lifecycle
        return ClientLink(
            state=self._state,
            engine_died=self.died,
            waves=self._waves,
            ping=ping,
            engine_back=self.back,
            engine_given_up=self.given_up,
            requests_lost=lifecycle.requests_lost,
            engine_suspect=lifecycle.engine_suspect,
            engine_cleared=lifecycle.engine_cleared,
        )

    def died(self, engine: EngineHandle, reason: str) -> None:
        state = self._state
        if state.lifecycle.engine_died(engine, reason):
            self._router.take_out(engine)
            if state.failure is not None:
                self._waves.announce()  # wakes wave waiters, who then raise
            self._transport.engine_death_recorded(engine)

    def back(self, engine: EngineHandle) -> None:
        self._state.lifecycle.engine_back(engine)
        self._router.put_back(engine)

    def given_up(self, engine: EngineHandle, reason: str) -> None:
        state = self._state
        state.lifecycle.engine_given_up(engine, reason)
        if state.failure is not None:
            self._waves.announce()


async def wait_for_service(router: Router, state: ClientState, wait_s: float) -> None:
    """With no engine in service while one restarts, wait up to ``wait_s`` for one to be
    back. Cancellation changes nothing.

    Raises:
        EngineDeadError: none was back in time, or the client failed meanwhile.
        trio.ClosedResourceError: the client closed meanwhile.
    """
    with trio.move_on_after(wait_s):
        while not router.live:
            await state.engine_returned.wait()
            state.raise_if_unusable()
        return
    restarting = ", ".join(f"{e.describe()} ({e.death})" for e in state.engines if e.restarting)
    raise EngineDeadError(
        f"no engine in service after waiting {wait_s:g} s; restarting: {restarting}",
        retryable=True,
    )

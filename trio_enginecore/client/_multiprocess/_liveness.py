"""Noticing that an engine died or hung, and telling which one it was.

The settings and the rules are in :mod:`._liveness_rules`; here are the tasks that
apply them, each reporting to the client's state, which decides (see
:mod:`._engines`):

* :func:`watch_process`: a launched engine's process exits;
* :class:`ConnectionWatch`: an engine's connection to the input socket closes, or goes
  silent under ZeroMQ heartbeats (killed, stopped, cut off), whatever kind of engine
  it is; it is suspect at once and dead unless, within
  :data:`~.._core._liveness_rules.RECONNECT_GRACE_S`, it shows life on a new
  connection or makes one from where the lost one came (then it stays suspect until
  it answers, and the progress deadline bounds the wait);
* :class:`ProgressWatch`: an engine with work makes no progress for
  ``progress_timeout_s`` (hung), with a cheap utility call every so often
  (:func:`keep_asking`) so that an idle engine has work too;
* :class:`DeathAttribution`: an engine sends ENGINE_CORE_DEAD, one frame that does not
  say who sent it: with several engines the sender exits right after (or its
  connection closes), and that says which it was; if nothing does within a bounded
  time, every engine is failed.

:class:`EngineWatches` starts them for an engine group (:mod:`._group`) and stops them
first when it closes, so that none reports the deaths the shutdown causes.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final, final

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from ..._zmq import TrioSocket
from ...errors import EngineDeadError
from .._core._engines import EngineHandle
from .._core._liveness_rules import (
    RECONNECT_GRACE_S,
    ConnectionTable,
    Liveness,
    Peer,
    ProgressClock,
)
from .._transport import ClientLink
from ._launch import LaunchedProcesses, exit_description

__all__ = [
    "ConnectionWatch",
    "DeathAttribution",
    "EngineWatches",
    "ProgressWatch",
    "keep_asking",
    "peer_of",
    "watch_process",
]

logger = logging.getLogger("trio_enginecore.client")

_STDERR_WAIT_S: Final = 1.0
_MONITORED: Final = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_GRACE_POLL_S: Final = 0.02
_GRACE_ASK_S: Final = 0.1
_ADRIFT_POLL_S: Final = 0.1
_ADRIFT_ASK_S: Final = 1.0
"""After the grace, an engine that may have reconnected is asked once a second (each
call stays outstanding: it is answered when the engine's step ends)."""
_RECONNECTED: Final = (
    "lost its connection to this client and made it again (a network reset, say): "
    "messages of this client's requests on it may have been lost either way, so they "
    "failed (retryable; the engine is in service)"
)
_PEERCRED: Final = getattr(socket, "SO_PEERCRED", None)
_UCRED: Final = struct.Struct("3i")


def peer_of(fd: int) -> Peer | None:
    """Where the connection on descriptor ``fd`` comes from: the peer's host for TCP,
    its process for a Unix-domain socket (Linux); None if that cannot be told (the
    descriptor closed meanwhile, another transport). The descriptor is only looked
    at: it stays libzmq's."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            return ("host", sock.getpeername()[0])
        if sock.family == socket.AF_UNIX and _PEERCRED is not None:
            pid, _, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, _PEERCRED, _UCRED.size))
            return ("process", pid) if pid > 0 else None
        return None
    except OSError:
        return None
    finally:
        sock.detach()


def _kill_if_ours(engine: EngineHandle, processes: LaunchedProcesses) -> str:
    """Kill the engine's process if the client launched it and it still runs (a hung
    or stopped engine holds memory and devices until it goes): what to add to the
    reason."""
    launched = processes.get(engine)
    if launched is not None and launched.kill_if_running():
        return "; killed it"
    return ""


async def watch_process(
    engine: EngineHandle, processes: LaunchedProcesses, link: ClientLink
) -> None:
    """Report the exit of ``engine``'s launched process as its death, unless the
    client is closing (then the exit is the one it asked for) or the process was
    replaced meanwhile. Its last stderr lines go in the reason. Returns when the
    process has exited; cancelled, it reports nothing."""
    launched = processes.get(engine)
    assert launched is not None
    code = await launched.process.wait()
    launched.kill_stragglers()  # an engine core whose vLLM launcher was killed
    if not link.state.closing:
        await launched.wait_stderr(_STDERR_WAIT_S)
        if processes.get(engine) is launched:
            link.engine_died(engine, exit_description(engine, launched, with_name=False))
        logger.debug("engine exit code %d", code)


@final
class ConnectionWatch:
    """Follows the connections of the client's input ROUTER, and reports an engine
    whose connection was lost (see :class:`~.._core._liveness_rules.ConnectionTable`).

    Create it before the socket is bound, so that no connection is missed; claim each
    engine's connection with the descriptor its ready message came on (:meth:`claim`);
    run :meth:`run` in the client's nursery.

    An engine whose connection was lost is suspect, and has
    :data:`~.._core._liveness_rules.RECONNECT_GRACE_S` to show it can be reached: a
    ready message on a new connection (the reference engine reconnecting), or an
    answer to a call sent after the loss. A vLLM engine whose TCP connection was reset
    mid-step does neither in time: libzmq reconnects it silently, and it answers once
    its step ends, seconds later. So an engine that made a new connection from where
    its lost one came, within the grace, stays suspect after it, asked once a second,
    until it answers (it is then placed on that connection, watched there as on its
    first), or the connection is lost too (a new grace), or it cannot be the engine's
    any more (another engine took it); a dead engine's silence meanwhile is the
    progress deadline's to judge. A killed engine's connection never comes back, nor
    does a stopped one's (libzmq's thread is stopped with it): dead after the grace,
    as before.

    Args:
        sock: the input ROUTER (with heartbeats set).
        link: the client's link.
        liveness: the settings (for the messages).
        processes: the engines the client launched (killed if still running when
            declared dead; an exited one is left to :func:`watch_process`).
    """

    def __init__(
        self,
        sock: TrioSocket,
        link: ClientLink,
        liveness: Liveness,
        processes: LaunchedProcesses,
    ) -> None:
        self.sock = sock
        self.link = link
        self.liveness = liveness
        self.processes = processes
        self.table = ConnectionTable()
        self.monitor = TrioSocket(sock.raw.get_monitor_socket(_MONITORED))
        self._claims: list[tuple[int, EngineHandle]] = []
        self._wake: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._graces: dict[int, trio.CancelScope] = {}
        self._changed = trio.Event()

    def claim(self, fd: int, engine: EngineHandle) -> None:
        """``engine``'s ready message came on descriptor ``fd`` (applied by the watch
        task, after the events queued before it)."""
        self._claims.append((fd, engine))
        if self._wake is not None:
            self._wake.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply the monitor's events and the claims until cancelled; the monitor
        socket is closed on the way out."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                while True:
                    with trio.CancelScope() as self._wake:
                        if not self._claims:
                            for frames in await self.monitor.drain():
                                self._apply(frames)
                    self._wake = None
                    # Every event queued before a claimed message was queued before
                    # it was received: apply them all, then the claims.
                    self._apply_queued()
                    claims, self._claims = self._claims, []
                    for fd, engine in claims:
                        # A connection whose "accepted" event was dropped: looked at now.
                        if not self.table.claim(fd, engine.identity, peer_of(fd)):
                            self._lost(engine)
                    self._touch()
        finally:
            self._nursery = None
            for scope in self._graces.values():
                scope.cancel()
            if not self.sock.closed:
                self.sock.raw.disable_monitor()
            self.monitor.close(linger=0)

    def _apply_queued(self) -> None:
        raw = self.monitor.raw
        while True:
            try:
                frames = raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._apply(frames)

    def _apply(self, frames: list[bytes | memoryview] | list[bytes]) -> None:
        event = parse_monitor_message([bytes(frame) for frame in frames])
        fd = int(event["value"])
        if event["event"] == zmq.EVENT_ACCEPTED:
            # Read now, while the descriptor is this connection's: a later event says
            # if it closed (and the number was reused) meanwhile.
            self.table.accepted(fd, peer_of(fd))
            return
        for identity in self.table.disconnected(fd):
            engine = next((e for e in self.link.state.engines if e.identity == identity), None)
            if engine is not None:
                self._lost(engine)

    def _touch(self) -> None:
        """Wake the graces: what they decide on may have changed."""
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    def _lost(self, engine: EngineHandle) -> None:
        """``engine``'s connection was lost, or one that may have been its own: a grace
        of its own, from now (one already running is replaced: its answers and its
        deadline were for the earlier loss)."""
        if not engine.alive or self.link.state.closing or self._nursery is None:
            self.table.forget(engine.identity)
            return
        heartbeat = (
            f", or it answered no heartbeat for {self.liveness.heartbeat_timeout_s:g} s"
            if self.liveness.heartbeat_interval_s is not None
            else ""
        )
        suspicion = f"its connection was lost (closed by its end{heartbeat})"
        # Suspect already (no progress for a while, say): the connection decides now.
        self.link.engine_suspect(engine, suspicion)
        earlier = self._graces.pop(id(engine), None)
        if earlier is not None:
            earlier.cancel()
        scope = self._graces[id(engine)] = trio.CancelScope()
        self._nursery.start_soon(self._grace, engine, suspicion, scope)

    def _prune(self) -> None:
        """Engines out of service are nobody's candidates (see ``ConnectionTable.gone``)."""
        for engine in self.link.state.engines:
            if not engine.alive:
                self.table.forget(engine.identity)

    async def _grace(self, engine: EngineHandle, suspicion: str, scope: trio.CancelScope) -> None:
        """Give the engine a moment to show it can be reached again: a second ready
        message on a new connection, or an answer to a call sent after the loss (an
        output proves nothing: one sent before a kill can still be on its way). After
        it, an engine that may have made a new connection has until it answers (see
        the class docstring). Else it is dead."""
        identity = engine.identity
        try:
            with scope:
                answered = trio.Event()
                async with trio.open_nursery() as asking:
                    asking.start_soon(self._ask_until_answered, engine, answered)
                    grace_ends = trio.current_time() + RECONNECT_GRACE_S
                    waiting = False
                    while engine.alive and not self.link.state.closing:
                        if self.table.connected(identity):
                            self.link.engine_cleared(engine)
                            break
                        if answered.is_set():
                            self._prune()
                            self.table.confirm(identity)
                            if waiting:
                                logger.warning(
                                    "%s answered on its new connection: it is in service",
                                    engine.describe(),
                                )
                            self.link.engine_cleared(engine)
                            # ZeroMQ made the connection again behind our back: what
                            # was on its way either way when it broke (requests, aborts,
                            # outputs) may be lost, and a stream must be exact or fail.
                            self.link.requests_lost(engine, _RECONNECTED)
                            break
                        if trio.current_time() >= grace_ends:
                            self._prune()
                            if self.table.gone(identity):
                                self._died(engine, suspicion)
                                break
                            if not waiting:
                                waiting = True
                                logger.warning(
                                    "%s made a new connection from where the lost one came: "
                                    "waiting for it to answer (a step in progress delays "
                                    "it; the progress deadline bounds the wait)",
                                    engine.describe(),
                                )
                        # Woken by the table or an answer; a death reported by another
                        # watch, or the grace's end, is seen at the next poll.
                        with trio.move_on_after(_ADRIFT_POLL_S if waiting else _GRACE_POLL_S):
                            await self._changed.wait()
                    asking.cancel_scope.cancel()
        finally:
            if self._graces.get(id(engine)) is scope:
                del self._graces[id(engine)]

    def _died(self, engine: EngineHandle, suspicion: str) -> None:
        # A launched engine that exited: its exit, with its code and last stderr
        # lines, says more than its lost connection; watch_process reports it.
        self.table.forget(engine.identity)
        if self.processes.exited(engine):
            return
        reason = (
            f"{suspicion} and not made again within {RECONNECT_GRACE_S:g} s: it "
            "was killed or stopped, or the network between us failed"
        )
        self.link.engine_died(engine, reason + _kill_if_ours(engine, self.processes))

    async def _ask_until_answered(self, engine: EngineHandle, answered: trio.Event) -> None:
        # A call sent while the engine has no connection is dropped by the ROUTER (it
        # has no route to it): ask again every so often. Earlier calls stay
        # outstanding: an engine in a long step answers them all when it ends.
        started = trio.current_time()
        async with trio.open_nursery() as calls:
            while True:
                calls.start_soon(self._ask, engine, answered)
                in_grace = trio.current_time() - started < RECONNECT_GRACE_S
                await trio.sleep(_GRACE_ASK_S if in_grace else _ADRIFT_ASK_S)

    async def _ask(self, engine: EngineHandle, answered: trio.Event) -> None:
        try:
            await self.link.ping(engine)
        except (EngineDeadError, trio.ClosedResourceError):
            return  # failed, not answered (the grace decides what that means)
        answered.set()
        self._touch()


async def keep_asking(engine: EngineHandle, link: ClientLink, interval_s: float) -> None:
    """Every ``interval_s`` (once the previous call was answered), ask ``engine`` a
    cheap utility: an idle engine then has work, and a hung one leaves it unanswered
    for :class:`ProgressWatch` to see. Ends when the engine is dead or the client
    closes; a client failed by another engine's death keeps asking, since the
    engine's streams go on."""
    while True:
        await trio.sleep(interval_s)
        if not engine.alive:
            return
        try:
            await link.ping(engine)
        except trio.ClosedResourceError:
            return
        except EngineDeadError:
            # It died (the loop ends), or the client failed with another engine, or
            # the call was failed with the requests of an engine that came back on
            # its own (ask again later).
            continue


@final
class ProgressWatch:
    """Declares dead an engine that has made no progress for ``timeout_s`` while it had
    work (see :class:`~.._core._liveness_rules.ProgressClock`); suspect after half of it.

    Args:
        link: the client's link.
        timeout_s: the progress timeout.
        processes: the engines the client launched (a hung one is killed).
    """

    def __init__(self, link: ClientLink, timeout_s: float, processes: LaunchedProcesses) -> None:
        self.link = link
        self.timeout_s = timeout_s
        self.processes = processes
        self._clocks: dict[int, ProgressClock] = {}
        self._suspected: set[int] = set()

    async def run(self) -> None:
        tick = min(1.0, self.timeout_s / 10)
        while True:
            await trio.sleep(tick)
            self.check(trio.current_time())

    def check(self, now: float) -> None:
        """Look at every engine once."""
        state = self.link.state
        if state.closing:
            return
        for engine in state.engines:
            key = id(engine)
            if not engine.alive:
                self._clocks.pop(key, None)
                self._suspected.discard(key)
                continue
            own, callers = state.calls.waiting_on(engine)
            requests = engine.load.in_flight
            stalled = self._clocks.setdefault(key, ProgressClock()).observe(
                now, heard=engine.heard, busy=requests > 0 or own > 0, excused=callers > 0
            )
            if stalled >= self.timeout_s:
                self._suspected.discard(key)
                reason = self._hung(stalled, requests) + _kill_if_ours(engine, self.processes)
                self.link.engine_died(engine, reason)
            elif stalled >= self.timeout_s / 2:
                if key not in self._suspected and self.link.engine_suspect(
                    engine, f"no progress for {stalled:.1f} s with {requests} request(s) pending"
                ):
                    self._suspected.add(key)
            elif key in self._suspected:
                self._suspected.discard(key)
                self.link.engine_cleared(engine)

    def _hung(self, stalled: float, requests: int) -> str:
        return (
            f"no progress for {stalled:.1f} s with {requests} request(s) pending (no output, "
            "and no reply to the client's liveness call): hung; raise "
            f"Liveness.progress_timeout_s ({self.timeout_s:g} s) if your steps are longer"
        )


@final
class DeathAttribution:
    """Tells which engine sent an ENGINE_CORE_DEAD (see the module docstring).

    Args:
        link: the client's link (its engines, and how to report a death).
        window_s: how long the sender may take to be identified; None when nothing
            can identify it (then every live engine is failed at once).
    """

    def __init__(self, link: ClientLink, window_s: float | None) -> None:
        self.link = link
        self.window_s = window_s
        self._next_death = trio.Event()

    def death_recorded(self) -> None:
        """An engine's death was recorded (by whatever noticed it)."""
        death, self._next_death = self._next_death, trio.Event()
        death.set()

    def reported_dead(self, nursery: trio.Nursery) -> None:
        """Someone sent ENGINE_CORE_DEAD: with one live engine, it is that one; with
        several, start a task (in ``nursery``) waiting for one of them to die."""
        suspects = [engine for engine in self.link.state.engines if engine.alive]
        window = self.window_s
        if len(suspects) <= 1 or window is None:
            for engine in suspects:
                self.link.engine_died(
                    engine, "the engine reported a fatal error (ENGINE_CORE_DEAD)"
                )
            return
        logger.warning("an engine reported a fatal error; waiting up to %g s to tell which", window)
        nursery.start_soon(self._attribute, suspects, window)

    async def _attribute(self, suspects: list[EngineHandle], window_s: float) -> None:
        with trio.move_on_after(window_s):
            while all(engine.alive for engine in suspects):
                await self._next_death.wait()
            return
        for engine in suspects:
            self.link.engine_died(
                engine,
                "an engine reported a fatal error (ENGINE_CORE_DEAD) and none could be "
                f"identified as the sender within {window_s:g} s",
            )


@final
class EngineWatches:
    """Every watch of an engine group's engines (see the module docstring).

    Args:
        link: the client's link.
        liveness: the settings (None: a launched engine's exit only).
        processes: the engines the group launched.
        attribution_window_s: see :class:`DeathAttribution`.
    """

    def __init__(
        self,
        link: ClientLink,
        liveness: Liveness | None,
        processes: LaunchedProcesses,
        attribution_window_s: float | None,
    ) -> None:
        self.link = link
        self.liveness = liveness
        self.processes = processes
        self.deaths = DeathAttribution(link, attribution_window_s)
        self.connections: ConnectionWatch | None = None
        self._nursery: trio.Nursery | None = None
        self._scopes: set[trio.CancelScope] = set()

    async def watch_connections(
        self,
        sock: TrioSocket | None,
        nursery: trio.Nursery,
        run_socket_task: Callable[..., Awaitable[None]],
    ) -> None:
        """Heartbeats on ``sock`` (the message pipe's connection socket, not bound
        yet, so that no engine's connection is missed), and the watch of its
        connections, started in ``nursery`` through ``run_socket_task`` (it owns a
        monitor socket). Not a checkpoint if there is nothing to watch."""
        liveness = self.liveness
        if liveness is None or liveness.heartbeat_interval_s is None or sock is None:
            return
        for name, value in liveness.heartbeat_options.items():
            sock.raw.set(getattr(zmq, name), value)
        self.connections = ConnectionWatch(sock, self.link, liveness, self.processes)
        await nursery.start(run_socket_task, self.connections.run)

    def came_on(self, fd: int, engine: EngineHandle) -> None:
        """``engine``'s ready message came on connection ``fd``."""
        if self.connections is not None:
            self.connections.claim(fd, engine)

    def watch_process(self, nursery: trio.Nursery, engine: EngineHandle) -> None:
        """Watch the process just launched for ``engine`` (:func:`watch_process`)."""
        nursery.start_soon(watch_process, engine, self.processes, self.link)

    def start(self, nursery: trio.Nursery) -> None:
        """Every engine is ready: start the liveness calls and the progress watch."""
        self._nursery = nursery
        for engine in self.link.state.engines:
            self.keep_asking(engine)
        liveness = self.liveness
        if liveness is not None and liveness.progress_timeout_s is not None:
            watch = ProgressWatch(self.link, liveness.progress_timeout_s, self.processes)
            nursery.start_soon(self._run, watch.run)

    def keep_asking(self, engine: EngineHandle) -> None:
        """Ask ``engine`` a cheap utility every so often (see :func:`keep_asking`), if
        the settings say so: at the start, and when a restarted engine is back."""
        liveness = self.liveness
        interval = liveness.ping_interval_s if liveness is not None else None
        if interval is not None and self._nursery is not None:
            self._nursery.start_soon(self._run, partial(keep_asking, engine, self.link, interval))

    def reported_dead(self, nursery: trio.Nursery) -> Callable[[], None]:
        """What the receive task calls for each ENGINE_CORE_DEAD."""
        return partial(self.deaths.reported_dead, nursery)

    def stop(self) -> None:
        """Stop the liveness calls and the progress watch (the group is closing)."""
        for scope in self._scopes:
            scope.cancel()

    async def _run(self, watch: Callable[[], Awaitable[Any]]) -> None:
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                await watch()
            finally:
                self._scopes.discard(scope)

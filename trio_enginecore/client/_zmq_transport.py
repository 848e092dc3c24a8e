"""The ZeroMQ transport: engines in other processes, as vLLM's clients reach them.

One ROUTER socket carries requests to every engine (addressed by its identity) and one
PULL socket brings their messages back. Startup follows the :class:`Topology` decided
when the transport is made: bind, launch (or wait for engines started elsewhere), the
handshake, the ready messages. Then, in the client's nursery:

* the **receive task** (:mod:`._receive`) feeds the client's state what the PULL
  socket brings, losing nothing to cancellation;
* a **coordinator task** (data-parallel clients) follows the coordinator's
  publications: the engines' loads and the request wave (:mod:`._following`);
* whatever notices an engine's death or hang (:mod:`._liveness`): its process exit
  (launched engines), its connection to the input socket (kept under ZeroMQ
  heartbeats), its progress.

Sends are non-blocking multipart sends from the caller's task (atomic; a ROUTER with
no high-water mark never refuses one).
"""

from __future__ import annotations

import logging
import secrets
import shutil
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final, final

import attrs
import trio
import zmq

from .._addresses import bind_address
from .._curve import (
    CurveRefusal,
    CurveRefusals,
    local_engine_keys,
    run_zap_handler,
)
from .._ipc_dirs import private_ipc_dir
from .._listeners import ListenerFd, bind_all
from .._zmq import TrioSocket, make_socket
from ..config import EngineConfig
from ..coordinator import CoordinatorAddresses, serve_coordinator
from ..errors import EngineCoreError
from ..protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
)
from ..serial import Buffer, MsgpackDecoder, MsgpackEncoder, request_for
from ._engines import EngineHandle
from ._following import CoordinatorFollower
from ._launch import launch_engine, stop_engines
from ._liveness import (
    ConnectionWatch,
    DeathAttribution,
    ProgressWatch,
    keep_asking,
    watch_process,
)
from ._liveness_rules import Liveness
from ._policy import Restart
from ._receive import receive_outputs
from ._remote import RemoteEngines, connectable
from ._router import DataParallelRole
from ._startup import StartupProgress, group_hint, handshake_metadata
from ._supervision import EngineSupervisor, ProcessRelaunch, RelaunchByRank, RemoteRelaunch
from ._topology import CoordinatorSource, Topology, plan_topology
from ._transport import ClientLink

__all__ = ["ZmqTransport"]

logger = logging.getLogger("trio_enginecore.client")

_ADD: Final = EngineCoreRequestType.ADD.value
_ABORT: Final = EngineCoreRequestType.ABORT.value
_UTILITY: Final = EngineCoreRequestType.UTILITY.value


@final
class ZmqTransport:
    """Engines in other processes, over ZeroMQ (see the module docstring).

    Args:
        config: what to launch (and how many engines to expect).
        role: which ranks, and whether to follow a coordinator.
        input_address, output_address: attach to engines started elsewhere.
        remote: engines that join over TCP from other hosts.
        liveness: how deaths and hangs are noticed (None: a launched engine's exit
            only).
        restart: restart engines that die (the ``restart`` policy): launched ones,
            and remote ones with a ``restarter``.
        ready_timeout_s: how long the engines may take to be ready.
        shutdown_timeout_s: how long launched engines may take to exit.

    Raises:
        ValueError: inconsistent addresses, or external load balancing with no
            coordinator (see ``plan_topology``).
    """

    def __init__(
        self,
        config: EngineConfig,
        role: DataParallelRole,
        *,
        input_address: str | ListenerFd | None = None,
        output_address: str | ListenerFd | None = None,
        remote: RemoteEngines | None = None,
        liveness: Liveness | None = None,
        restart: Restart | None = None,
        ready_timeout_s: float = 60.0,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        self.config = config
        self.restart = restart
        self.remote = remote
        self.ready_timeout_s = ready_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.topology: Topology = plan_topology(
            role,
            input_address=input_address,
            output_address=output_address,
            remote=remote,
            liveness=liveness,
        )
        self.coordinator: CoordinatorAddresses | None = role.coordinator
        self.refusals = CurveRefusals()
        # Made by start(): a client that is built and never started holds nothing.
        self._ctx: zmq.Context[Any] | None = None
        self._input: TrioSocket | None = None
        self._output: TrioSocket | None = None
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._ipc_dir: str | None = None
        self._link: ClientLink | None = None
        self._nursery: trio.Nursery | None = None
        self._deaths: DeathAttribution | None = None
        self._follower: CoordinatorFollower | None = None
        self._startup_scope: trio.CancelScope | None = None
        self._socket_tasks: list[tuple[trio.CancelScope, trio.Event]] = []
        self._supervisor: EngineSupervisor | None = None
        self._handshake: TrioSocket | None = None
        self._admitted: set[bytes] = set()  # the engine keys CURVE admits
        self._connections: ConnectionWatch | None = None
        self._watches: set[trio.CancelScope] = set()

    @property
    def restarts_engines(self) -> bool:
        """Whether every engine can be started again: launched here, or remote with
        a restarter."""
        topology = self.topology
        if self.remote is not None and self.remote.restarter is not None:
            return True
        return bool(topology.launched) and topology.launched == topology.ranks

    # ------------------------------------------------------------------ sending

    def send_add(self, engine: EngineHandle, request: EngineCoreRequest) -> None:
        # Each engine gets its own vLLM release's form (a 0.34 engine cannot read a
        # 0.33 prompt, nor the reverse).
        self._send(
            [engine.identity, _ADD, *self._encoder.encode(request_for(engine.dialect, request))]
        )

    def send_abort(self, engine: EngineHandle, request_ids: list[str]) -> None:
        logger.debug("engine rank %d: ABORT %d request(s)", engine.rank, len(request_ids))
        self._send([engine.identity, _ABORT, *self._encoder.encode(request_ids)])

    def send_utility(self, engine: EngineHandle, call: UtilityRequest) -> None:
        self._send([engine.identity, _UTILITY, *self._encoder.encode(call)])

    def _send(self, frames: list[Any]) -> None:
        sock = self._input
        assert sock is not None, "the transport is not started"
        try:
            sock.send_multipart_nowait(frames)
        except trio.WouldBlock:  # pragma: no cover - a ROUTER with HWM 0 never blocks
            raise EngineCoreError("the input socket refused a message") from None

    @property
    def _context(self) -> zmq.Context[Any]:
        assert self._ctx is not None, "the transport was not started"
        return self._ctx

    # ------------------------------------------------------------------ startup

    async def start(self, nursery: trio.Nursery, link: ClientLink) -> None:
        topology = self.topology
        self._link = link
        self._nursery = nursery
        self._ctx = zmq.Context()
        self._follower = CoordinatorFollower(self._ctx, link, self.topology.curve)
        self._deaths = DeathAttribution(link, topology.attribution_window_s)
        engines = link.state.engines
        engines[:] = [EngineHandle.for_rank(rank) for rank in topology.ranks]
        if self.remote is not None:
            for engine in engines:
                engine.location = self.remote.locations.get(engine.rank)
        if topology.private_dir:
            self._ipc_dir = private_ipc_dir()
        local_arguments = await self._admit_engines(nursery)
        input_address, output_address, handshake_address = topology.addresses(self._ipc_dir)
        self._input = self._server_socket(zmq.ROUTER)
        self._output = self._server_socket(zmq.PULL)
        await self._watch_connections(nursery, link)
        # Checks any listener descriptors before binding either socket (_listeners.py).
        bound_input, bound_output = bind_all(
            [
                (self._input, input_address, "client input, ROUTER"),
                (self._output, output_address, "client output, PULL"),
            ]
        )
        logger.debug(
            "bound the input ROUTER at %s and the output PULL at %s", bound_input, bound_output
        )
        handshake: TrioSocket | None = None
        metadata: list[Buffer] = []
        progress = StartupProgress(engines, bound_input, None)
        timeout = trio.CancelScope()
        ready = False
        try:
            with trio.CancelScope() as scope:
                self._startup_scope = scope
                with trio.move_on_after(self.ready_timeout_s) as timeout:
                    if topology.coordinator is not CoordinatorSource.ANNOUNCED:
                        await self._join_coordinator(nursery)
                    if handshake_address is not None:
                        handshake = self._server_socket(zmq.ROUTER)
                        progress.handshake_address = bind_address(
                            handshake, handshake_address, role="client handshake, ROUTER"
                        )
                        logger.debug("bound the handshake ROUTER at %s", progress.handshake_address)
                        await self._launch(nursery, progress.handshake_address, local_arguments)
                        metadata = self._encoder.encode(
                            handshake_metadata(
                                self.config,
                                self.remote,
                                self.coordinator,
                                bound_input,
                                bound_output,
                            )
                        )
                        await progress.handshake(handshake, metadata)
                    await progress.wait_ready(self._input, self._came_on)
                    if topology.coordinator is CoordinatorSource.ANNOUNCED:
                        assert self._follower is not None
                        await self._follower.follow_announced(nursery)
                    if handshake is not None:
                        await progress.wait_handshake_ready(handshake)
                    ready = True
        finally:
            # Whatever ended the startup (success, timeout, an error, or the caller's
            # cancellation), the handshake socket is not needed any more, except to
            # restart engines.
            self._startup_scope = None
            if handshake is not None:
                progress.note_queued_readies(handshake)
                if self.restart is not None and ready:
                    self._handshake = handshake
                else:
                    handshake.close()
        if not ready:
            raise await progress.error(
                self.ready_timeout_s,
                timed_out=bool(timeout.cancelled_caught),
                waits_for_coordinator=self.coordinator is not None,
                group_hint=group_hint(self.config, self.remote),
                refusals=self.refusals.describe() if self.refusals else None,
            )
        assert self._deaths is not None
        reported_dead = partial(self._deaths.reported_dead, nursery)
        nursery.start_soon(receive_outputs, self._output, link.state, self._decoder, reported_dead)
        for engine in engines:
            self._keep_asking(engine)
        liveness = topology.liveness
        if liveness is not None and liveness.progress_timeout_s is not None:
            nursery.start_soon(self._watch, ProgressWatch(link, liveness.progress_timeout_s).run)
        self._supervise(nursery, bound_input, progress.handshake_address, metadata, local_arguments)
        if topology.launched:
            logger.info("client ready: %d engine(s) serving %r", len(engines), self.config.model)
        else:  # what engines started elsewhere serve is theirs to say, not our config's
            logger.info("client ready: %d engine(s) started elsewhere", len(engines))

    def engine_death_recorded(self, engine: EngineHandle) -> None:
        if self._deaths is not None:
            self._deaths.death_recorded()
        if self._startup_scope is not None:
            self._startup_scope.cancel()
        elif engine.restarting and self._supervisor is not None:
            self._supervisor.restart_later(engine)

    async def _watch_connections(self, nursery: trio.Nursery, link: ClientLink) -> None:
        """Heartbeats on the input socket, and the watch of its connections: set up
        before it is bound, so that no engine's connection is missed."""
        liveness = self.topology.liveness
        sock = self._input
        assert sock is not None
        if liveness is None or liveness.heartbeat_interval_s is None:
            return
        for name, value in liveness.heartbeat_options.items():
            sock.raw.set(getattr(zmq, name), value)
        self._connections = ConnectionWatch(sock, link, liveness)
        await nursery.start(self._run_socket_task, self._connections.run)

    def _came_on(self, fd: int, engine: EngineHandle) -> None:
        if self._connections is not None:
            self._connections.claim(fd, engine)

    def _keep_asking(self, engine: EngineHandle) -> None:
        """Ask ``engine`` a cheap utility every so often (see ``keep_asking``)."""
        liveness = self.topology.liveness
        interval = liveness.ping_interval_s if liveness is not None else None
        if interval is not None and self._nursery is not None and self._link is not None:
            self._nursery.start_soon(
                self._watch, partial(keep_asking, engine, self._link, interval)
            )

    async def _watch(self, watch: Callable[[], Awaitable[None]]) -> None:
        """Run a task that watches the engines until :meth:`aclose` stops it."""
        with trio.CancelScope() as scope:
            self._watches.add(scope)
            try:
                await watch()
            finally:
                self._watches.discard(scope)

    def _supervise(
        self,
        nursery: trio.Nursery,
        input_address: str,
        handshake_address: str | None,
        metadata: list[Buffer],
        local_arguments: list[str],
    ) -> None:
        """Start the input watch, and the restarter (see :mod:`._supervision`)."""
        link = self._link
        assert link is not None
        assert self._input is not None

        async def launch(engine: EngineHandle) -> None:
            assert handshake_address is not None
            await self._launch_one(engine, nursery, handshake_address, local_arguments)

        restarter = self.remote.restarter if self.remote is not None else None
        relaunch = RelaunchByRank(
            self.topology.launched,
            ProcessRelaunch(launch),
            RemoteRelaunch(restarter, self._admitted.add) if restarter is not None else None,
        )
        self._supervisor = EngineSupervisor(
            link,
            self._input,
            input_address,
            restart=self.restart if self._handshake is not None else None,
            handshake=self._handshake,
            handshake_address=handshake_address,
            metadata=metadata,
            relaunch=relaunch,
            back_in_service=self._keep_asking,
            ready_timeout_s=self.ready_timeout_s,
            came_on=self._came_on,
        )
        nursery.start_soon(self._supervisor.run)

    async def _admit_engines(self, nursery: trio.Nursery) -> list[str]:
        """With CURVE, start the handler admitting the engines' keys (before any CURVE
        socket is bound: without one libzmq admits anyone). The arguments of the
        engines launched here, which get a key pair of their own."""
        topology = self.topology
        curve = topology.curve
        if curve is None:
            return []
        # Mutable: an engine restarted with a new key pair is admitted from then on.
        allowed = self._admitted
        allowed |= curve.allowed
        arguments: list[str] = []
        if topology.local_engine_keys:
            assert self._ipc_dir is not None
            public, arguments = local_engine_keys(self._ipc_dir, curve)
            allowed.add(public)
        await nursery.start(
            self._run_socket_task, partial(run_zap_handler, self._context, allowed, self._refused)
        )
        return arguments

    async def _launch(
        self, nursery: trio.Nursery, handshake_address: str, extra_arguments: list[str]
    ) -> None:
        link = self._link
        assert link is not None
        for engine in link.state.engines:
            if engine.rank in self.topology.launched:
                await self._launch_one(engine, nursery, handshake_address, extra_arguments)

    async def _launch_one(
        self,
        engine: EngineHandle,
        nursery: trio.Nursery,
        handshake_address: str,
        extra_arguments: list[str],
    ) -> None:
        """Launch ``engine``'s process (at startup, or again to restart it) and watch it."""
        assert self._link is not None
        await launch_engine(
            engine,
            self.config,
            connectable(handshake_address),
            nursery,
            extra_arguments=extra_arguments,
        )
        nursery.start_soon(watch_process, engine, self._link)

    def _server_socket(self, socket_type: int) -> TrioSocket:
        """A socket engines connect to: a CURVE server when remote engines use CURVE."""
        sock = make_socket(self._context, socket_type)
        if self.topology.curve is not None:
            self.topology.curve.apply(sock)
        return sock

    def _refused(self, refusal: CurveRefusal) -> None:
        logger.warning("refused a connection from %s", refusal)
        self.refusals.add(refusal)

    async def _run_socket_task(
        self,
        serve: Callable[..., Awaitable[None]],
        *,
        task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run ``serve(task_status=...)``, a task owning sockets, so that
        :meth:`aclose` can stop it before destroying the context."""
        done = trio.Event()
        with trio.CancelScope() as scope:
            self._socket_tasks.append((scope, done))
            try:
                await serve(task_status=task_status)
            finally:
                done.set()

    # -------------------------------------------------------------- coordinator

    async def _join_coordinator(self, nursery: trio.Nursery) -> None:
        """Follow the coordinator given, else launch one (beside launched engines)."""
        assert self._follower is not None
        source = self.topology.coordinator
        if source is CoordinatorSource.NONE:
            await trio.lowlevel.checkpoint()
            return
        addresses = self.coordinator
        if source is CoordinatorSource.LAUNCHED:
            link = self._link
            assert link is not None
            if self.remote is not None:
                # Engines reach it over TCP; this client, in the same context, in-process.
                addresses = attrs.evolve(
                    CoordinatorAddresses.on_host(self.remote.host),
                    publish=f"inproc://coordinator-{secrets.token_hex(8)}",
                )
            else:
                assert self._ipc_dir is not None
                addresses = CoordinatorAddresses.in_directory(self._ipc_dir)
            addresses = await nursery.start(
                self._run_socket_task,
                partial(
                    serve_coordinator,
                    self._context,
                    engines=len(link.state.engines),
                    addresses=addresses,
                    curve=self.topology.curve,
                ),
            )
            self.coordinator = addresses
        assert addresses is not None
        await self._follower.follow(nursery, addresses.publish)

    # ----------------------------------------------------------------- shutdown

    async def aclose(self) -> None:
        for scope in self._watches:
            scope.cancel()
        # First, so that no engine is restarted while (or after) they are stopped.
        if self._supervisor is not None:
            await self._supervisor.stop()
        link = self._link
        if link is not None:
            await stop_engines(link.state.engines, self.shutdown_timeout_s)
        # Sockets owned by tasks must be closed by their task before the context goes
        # (closing a socket under a waiting task breaks the wait).
        for scope, _ in self._socket_tasks:
            scope.cancel()
        for _, done in self._socket_tasks:
            await done.wait()
        for sock in (self._input, self._output, self._handshake):
            if sock is not None:
                sock.close(linger=0)
        if self._follower is not None:
            self._follower.close()
        # destroy() also closes any socket a failed startup left behind, with linger 0,
        # so terminating the context cannot block.
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        logger.debug("transport closed: sockets, context and private directory released")

"""The engine group: engines in other processes, from startup to shutdown.

:class:`EngineGroup` is the multiprocess client's :class:`~.._transport.Transport`. It
decides the engines' lifecycle and leaves the data path to a
:class:`~._pipe.MessagePipe` it makes when it starts (:class:`~._zmq_pipe.ZmqPipe`,
vLLM's ZeroMQ sockets, unless told otherwise). Startup follows the :class:`Topology`
decided when the group is made: admit the engines' CURVE keys, bind the pipe, join or
launch the coordinator, launch the engines (or wait for engines started elsewhere),
the handshake, the ready messages. Then, in the client's nursery:

* the pipe's **receive task** feeds the client's state what the engines send;
* a **coordinator task** (data-parallel clients) follows the coordinator's
  publications: the engines' loads and the request wave (:mod:`._following`);
* whatever notices an engine's death or hang (:mod:`._liveness`): its process exit
  (launched engines), its connection to the pipe (kept under ZeroMQ heartbeats), its
  progress;
* the input watch and the restarter (:mod:`._supervision`).

The control plane (the handshake, the coordinator, CURVE admission) is ZeroMQ, in the
group's context (:class:`~._control.ControlPlane`); the processes it launched are its
:class:`~._launch.LaunchedProcesses`; its watches, :class:`~._liveness.EngineWatches`.
"""

from __future__ import annotations

import logging
from typing import Final, final

import msgspec
import trio
import zmq

from ..._addresses import bind_address, connectable
from ..._listeners import ListenerFd
from ..._zmq import TrioSocket
from ...config import EngineConfig
from ...coordinator import CoordinatorAddresses
from ...protocol import EngineCoreRequest, EngineCoreRequestType, UtilityRequest
from ...serial import Buffer, MsgpackEncoder, request_for
from .._core._engines import EngineHandle
from .._core._liveness_rules import Liveness
from .._core._policy import Restart
from .._core._router import DataParallelRole
from .._transport import ClientLink
from ._control import ControlPlane
from ._following import CoordinatorFollower
from ._launch import EngineLauncher, LaunchedProcesses, ReferenceLauncher, VllmLauncher
from ._liveness import EngineWatches
from ._pipe import MessagePipe, PipeFactory
from ._remote import RemoteEngines
from ._startup import StartupProgress, group_hint, handshake_metadata
from ._supervision import EngineSupervisor, ProcessRelaunch, RelaunchByRank, RemoteRelaunch
from ._topology import CoordinatorSource, Topology, plan_topology
from ._vllm import VllmEngines

__all__ = ["EngineGroup"]

logger = logging.getLogger("trio_enginecore.client")

_ADD: Final = EngineCoreRequestType.ADD.value
_ABORT: Final = EngineCoreRequestType.ABORT.value
_UTILITY: Final = EngineCoreRequestType.UTILITY.value


@final
class EngineGroup:
    """Engines in other processes, around a message pipe (see the module docstring).

    Args:
        config: what to launch (and how many engines to expect).
        role: which ranks, and whether to follow a coordinator.
        pipe: makes the data path when the group starts (``ZmqPipe``).
        input_address, output_address: attach to engines started elsewhere.
        remote: engines that join over TCP from other hosts.
        vllm: launch vLLM's engine cores instead of the reference engine.
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
        pipe: PipeFactory,
        input_address: str | ListenerFd | None = None,
        output_address: str | ListenerFd | None = None,
        remote: RemoteEngines | None = None,
        vllm: VllmEngines | None = None,
        liveness: Liveness | None = None,
        restart: Restart | None = None,
        ready_timeout_s: float = 60.0,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        self.config = config
        self.restart = restart
        self.remote = remote
        self.vllm = vllm
        self.ready_timeout_s = ready_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.topology: Topology = plan_topology(
            role,
            input_address=input_address,
            output_address=output_address,
            remote=remote,
            vllm=vllm,
            liveness=liveness,
        )
        self.coordinator: CoordinatorAddresses | None = role.coordinator
        self.control = ControlPlane(self.topology, remote)
        self.refusals = self.control.refusals
        launcher: EngineLauncher = ReferenceLauncher(config) if vllm is None else VllmLauncher(vllm)
        self.processes = LaunchedProcesses(launcher)
        self._make_pipe = pipe
        self._encoder = MsgpackEncoder()
        # Made by start(): a client that is built and never started holds nothing.
        self._pipe: MessagePipe | None = None
        self._handshake: TrioSocket | None = None
        self._link: ClientLink | None = None
        self._follower: CoordinatorFollower | None = None
        self._watches: EngineWatches | None = None
        self._supervisor: EngineSupervisor | None = None
        self._startup_scope: trio.CancelScope | None = None

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
        self._started_pipe.send(engine, _ADD, request_for(engine.dialect, request))

    def send_abort(self, engine: EngineHandle, request_ids: list[str]) -> None:
        logger.debug("engine rank %d: ABORT %d request(s)", engine.rank, len(request_ids))
        self._started_pipe.send(engine, _ABORT, request_ids)

    def send_utility(self, engine: EngineHandle, call: UtilityRequest) -> None:
        self._started_pipe.send(engine, _UTILITY, call)

    @property
    def _started_pipe(self) -> MessagePipe:
        assert self._pipe is not None, "the transport is not started"
        return self._pipe

    # ------------------------------------------------------------------ startup

    async def start(self, nursery: trio.Nursery, link: ClientLink) -> None:
        """See :meth:`Transport.start <.._transport.Transport.start>`. Cancelled (or
        failed) part-way, it leaves what it started for :meth:`aclose` to release."""
        topology = self.topology
        self._link = link
        context = self.control.open()
        self._follower = CoordinatorFollower(context, link, topology.curve)
        watches = self._watches = EngineWatches(
            link, topology.liveness, self.processes, topology.attribution_window_s
        )
        engines = link.state.engines
        engines[:] = [EngineHandle.for_rank(rank) for rank in topology.ranks]
        if self.remote is not None:
            for engine in engines:
                engine.location = self.remote.locations.get(engine.rank)
        local_arguments = await self.control.admit_engines(nursery)
        input_address, output_address, handshake_address = topology.addresses(self.control.ipc_dir)
        pipe = self._pipe = self._make_pipe(self.control.server_socket)
        await watches.watch_connections(
            pipe.connection_socket, nursery, self.control.run_socket_task
        )
        bound_input, bound_output = pipe.bind(input_address, output_address)
        progress = StartupProgress(engines, bound_input, None)
        metadata = await self._start_up(
            nursery, progress, handshake_address, bound_output, local_arguments
        )
        self._serve(nursery, link, progress, metadata, local_arguments)
        if topology.launched:
            serves = self.processes.launcher.serves
            logger.info("client ready: %d engine(s) serving %s", len(engines), serves)
        else:  # what engines started elsewhere serve is theirs to say, not our config's
            logger.info("client ready: %d engine(s) started elsewhere", len(engines))

    async def _start_up(
        self,
        nursery: trio.Nursery,
        progress: StartupProgress,
        handshake_address: str | None,
        output_address: str,
        local_arguments: list[str],
    ) -> list[Buffer]:
        """Run the startup within the ready timeout (an engine's death stops it);
        the encoded handshake answer, kept for restarts. If it fails, the error says
        how far each engine got; if it is cancelled, the cancellation goes on
        unchanged (the handshake socket is closed either way, unless kept for
        restarts)."""
        timeout = trio.CancelScope()
        metadata: list[Buffer] = []
        ready = False
        try:
            with trio.CancelScope() as self._startup_scope:
                with trio.move_on_after(self.ready_timeout_s) as timeout:
                    metadata = await self._until_ready(
                        nursery, progress, handshake_address, output_address, local_arguments
                    )
                    ready = True
        finally:
            # Whatever ended the startup (success, timeout, an error, or the caller's
            # cancellation), the handshake socket is not needed any more, except to
            # restart engines.
            self._startup_scope = None
            handshake = self._handshake
            if handshake is not None:
                progress.note_queued_readies(handshake)
                if self.restart is None or not ready:
                    handshake.close()
                    self._handshake = None
        if not ready:
            raise await progress.error(
                self.ready_timeout_s,
                self.processes,
                timed_out=bool(timeout.cancelled_caught),
                waits_for_coordinator=self.coordinator is not None,
                group_hint=group_hint(self.config, self.remote),
                refusals=self.refusals.describe() if self.refusals else None,
            )
        return metadata

    async def _until_ready(
        self,
        nursery: trio.Nursery,
        progress: StartupProgress,
        handshake_address: str | None,
        output_address: str,
        local_arguments: list[str],
    ) -> list[Buffer]:
        """The coordinator, the launch, the handshake, the ready messages, in order;
        the encoded handshake answer (empty with no handshake)."""
        topology = self.topology
        assert self._follower is not None
        if topology.coordinator is not CoordinatorSource.ANNOUNCED:
            await self._join_coordinator(nursery)
        metadata: list[Buffer] = []
        handshake: TrioSocket | None = None
        if handshake_address is not None:
            handshake = self._handshake = self.control.server_socket(zmq.ROUTER)
            progress.handshake_address = bind_address(
                handshake, handshake_address, role="client handshake, ROUTER"
            )
            logger.debug("bound the handshake ROUTER at %s", progress.handshake_address)
            for engine in progress.engines:
                if engine.rank in topology.launched:
                    await self._launch_one(
                        engine, nursery, progress.handshake_address, local_arguments
                    )
            answer = handshake_metadata(
                self.config, self.remote, self.coordinator, progress.input_address, output_address
            )
            if self.vllm is not None:
                group = self.vllm.group_parallel_config(self.config.data_parallel_size)
                answer = msgspec.structs.replace(answer, parallel_config=group)
            metadata = self._encoder.encode(answer)
            await progress.handshake(handshake, metadata)
        assert self._watches is not None
        await progress.wait_ready(self._started_pipe.next_ready, self._watches.came_on)
        if topology.coordinator is CoordinatorSource.ANNOUNCED:
            await self._follower.follow_announced(nursery)
        if handshake is not None:
            await progress.wait_handshake_ready(handshake)
        return metadata

    def _serve(
        self,
        nursery: trio.Nursery,
        link: ClientLink,
        progress: StartupProgress,
        metadata: list[Buffer],
        local_arguments: list[str],
    ) -> None:
        """Every engine is ready: start the receive task, the liveness watches, the
        input watch and the restarter (see :mod:`._supervision`)."""
        watches = self._watches
        assert watches is not None
        pipe = self._started_pipe
        nursery.start_soon(pipe.receive, link.state, watches.reported_dead(nursery))
        watches.start(nursery)
        handshake_address = progress.handshake_address

        async def launch(engine: EngineHandle) -> None:
            assert handshake_address is not None
            await self._launch_one(engine, nursery, handshake_address, local_arguments)

        restarter = self.remote.restarter if self.remote is not None else None
        relaunch = RelaunchByRank(
            self.topology.launched,
            ProcessRelaunch(self.processes, launch),
            RemoteRelaunch(restarter, self.control.admitted.add) if restarter is not None else None,
        )
        self._supervisor = EngineSupervisor(
            link,
            pipe,
            progress.input_address,
            restart=self.restart if self._handshake is not None else None,
            handshake=self._handshake,
            handshake_address=handshake_address,
            metadata=metadata,
            relaunch=relaunch,
            back_in_service=watches.keep_asking,
            ready_timeout_s=self.ready_timeout_s,
            came_on=watches.came_on,
            dialects=progress.dialects,
        )
        nursery.start_soon(self._supervisor.run)

    def engine_death_recorded(self, engine: EngineHandle) -> None:
        if self._watches is not None:
            self._watches.deaths.death_recorded()
        if self._startup_scope is not None:
            self._startup_scope.cancel()
        elif engine.restarting and self._supervisor is not None:
            self._supervisor.restart_later(engine)

    # ------------------------------------------------------------ the engines

    async def _launch_one(
        self,
        engine: EngineHandle,
        nursery: trio.Nursery,
        handshake_address: str,
        extra_arguments: list[str],
    ) -> None:
        """Launch ``engine``'s process (at startup, or again to restart it) and watch it."""
        assert self._watches is not None
        await self.processes.launch(
            engine,
            connectable(handshake_address),
            nursery,
            extra_arguments=extra_arguments,
        )
        self._watches.watch_process(nursery, engine)

    async def _join_coordinator(self, nursery: trio.Nursery) -> None:
        """Follow the coordinator given, else launch one (beside launched engines)."""
        assert self._follower is not None
        source = self.topology.coordinator
        if source is CoordinatorSource.NONE:
            await trio.lowlevel.checkpoint()
            return
        if source is CoordinatorSource.LAUNCHED:
            engines = len(self.topology.ranks)
            self.coordinator = await self.control.launch_coordinator(nursery, engines)
        assert self.coordinator is not None
        await self._follower.follow(nursery, self.coordinator.publish)

    # ----------------------------------------------------------------- shutdown

    async def aclose(self) -> None:
        """See :meth:`Transport.aclose <.._transport.Transport.aclose>`: watches first,
        then the restarter, the engines, the tasks owning sockets, the sockets, the
        context and the private directory. Bounded by ``shutdown_timeout_s`` and short
        waits; meant to run shielded."""
        if self._watches is not None:
            self._watches.stop()
        # First, so that no engine is restarted while (or after) they are stopped.
        if self._supervisor is not None:
            await self._supervisor.stop()
        if self._link is not None:
            await self.processes.stop(self._link.state.engines, self.shutdown_timeout_s)
        await self.control.stop_tasks()
        if self._pipe is not None:
            self._pipe.close()
        if self._handshake is not None:
            self._handshake.close(linger=0)
        if self._follower is not None:
            self._follower.close()
        self.control.close()
        logger.debug("transport closed: sockets, context and private directory released")

"""TrioMPClient: the engine-core client for engines in other processes.

One nursery per client holds every background task:

* the **receive task** drains the output (PULL) socket in batches, decodes each
  message once, resolves utility replies, merges stream outputs into their streams'
  collectors and hands the rest to :meth:`TrioMPClient.get_output` through a bounded,
  merging buffer. It never waits for a reader, and there is no checkpoint between
  taking a message off the socket and handing it over, so no message is ever lost to
  cancellation;
* per launched engine, a **watcher** that turns an exit nobody asked for into
  :class:`~trio_enginecore.errors.EngineDeadError` for every waiter, and a task keeping
  the tail of the engine's stderr for error messages.

Requests are sent from the caller's task (non-blocking multipart sends are atomic).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import Any, Final, final

import attrs
import trio
import zmq

from .._addresses import bind_address, connect_address
from .._curve import (
    CurveRefusal,
    CurveRefusals,
    CurveServer,
    load_public_key,
    run_zap_handler,
    write_key_pair,
)
from .._listeners import ListenerFd, bind_all
from .._zmq import Frames, TrioSocket, make_socket
from ..config import EngineConfig
from ..coordinator import CoordinatorAddresses, serve_coordinator
from ..errors import (
    EngineCoreError,
    EngineDeadError,
    EngineStartupError,
    ProtocolError,
    UtilityCallError,
)
from ..protocol import (
    COORDINATOR_SUBSCRIBE,
    ENGINE_CORE_DEAD,
    CoordinatorPublication,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeHello,
    HandshakeMessage,
    HandshakeReady,
    UtilityRequest,
)
from ..serial import MsgpackDecoder, MsgpackEncoder
from ._base import TrioClientBase, run_client
from ._ipc_dirs import private_ipc_dir
from ._launch import (
    EngineHandle,
    engine_command,
    open_lifeline,
    start_engine_process,
)
from ._lb import LeastLoaded, LoadBalancer
from ._remote import DEFAULT_LIVENESS, Liveness, RemoteEngines, connectable
from ._router import Router, WaveFollower

__all__ = [
    "DPLBTrioMPClient",
    "DPTrioMPClient",
    "TrioMPClient",
    "connect_engine_client",
    "open_trio_mp_client",
]

logger = logging.getLogger("trio_enginecore.client")

_ADD: Final = EngineCoreRequestType.ADD.value
_ABORT: Final = EngineCoreRequestType.ABORT.value
_UTILITY: Final = EngineCoreRequestType.UTILITY.value
_MAX_DRAIN_MESSAGES: Final = 256
_DRAIN_OUTPUTS: Final = 2048
_ATTRIBUTION_WINDOW_S: Final = 2.0
_STDERR_DRAIN_S: Final = 1.0
_DEAD_ENGINE_EXIT_S: Final = 2.0
EXTERNAL_LB_NEEDS_COORDINATOR: Final = (
    "external load balancing (data_parallel_external_lb) shares one coordinator between "
    "the clients of a data-parallel group: open one with trio_enginecore.open_coordinator() "
    "and pass its addresses as coordinator="
)


@final
@attrs.frozen
class DataParallelRole:
    """Which engines a client talks to and how it routes: decided by the constructor
    (the vLLM-shaped class names), used by the one client class."""

    ranks: range
    load_balancer: LoadBalancer | None = None
    coordinator: CoordinatorAddresses | None = None
    data_parallel: bool = False
    """Follows a coordinator and stamps requests with its wave."""
    launches_coordinator: bool = False
    """Launches a coordinator of its own when it launches engines and is given none."""

    @classmethod
    def single(cls, config: EngineConfig) -> DataParallelRole:
        return cls(ranks=range(config.data_parallel_size))

    @classmethod
    def one_rank(
        cls, config: EngineConfig, coordinator: CoordinatorAddresses | None
    ) -> DataParallelRole:
        rank = config.data_parallel_rank
        return cls(ranks=range(rank, rank + 1), coordinator=coordinator, data_parallel=True)

    @classmethod
    def balanced(
        cls,
        config: EngineConfig,
        load_balancer: LoadBalancer,
        coordinator: CoordinatorAddresses | None,
    ) -> DataParallelRole:
        return cls(
            ranks=range(config.data_parallel_size),
            load_balancer=load_balancer,
            coordinator=coordinator,
            data_parallel=True,
            launches_coordinator=True,
        )


class TrioMPClient(TrioClientBase):
    """A Trio client for engines running in other processes.

    Create it with :func:`trio_enginecore.open_engine_client`, which launches (or
    attaches to) the engines and returns only once they are ready; leaving the
    ``async with`` block shuts everything down. See
    :class:`~trio_enginecore.AsyncEngineCoreClient` for the methods and their
    cancellation semantics.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        client_index: int = 0,
        max_pending_outputs: int = 64,
        abort_timeout_s: float = 1.0,
        shutdown_timeout_s: float = 5.0,
        _role: DataParallelRole | None = None,
    ) -> None:
        self.shutdown_timeout_s = shutdown_timeout_s
        super().__init__(
            config,
            client_index=client_index,
            max_pending_outputs=max_pending_outputs,
            abort_timeout_s=abort_timeout_s,
        )
        role = _role if _role is not None else DataParallelRole.single(config)
        self._role = role
        self._router = Router(self._state.engines, role.load_balancer)
        self._waves = WaveFollower(stamps=role.data_parallel)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._input: TrioSocket | None = None
        self._output: TrioSocket | None = None
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._ipc_dir: str | None = None
        self._handshake_ready: set[bytes] = set()
        self._subscription: TrioSocket | None = None
        self._coordinator_addresses: CoordinatorAddresses | None = role.coordinator
        self._startup_scope: trio.CancelScope | None = None
        self._remote: RemoteEngines | None = None
        self._refusals = CurveRefusals()
        self._hellos: set[bytes] = set()
        self._ready_messages: set[bytes] = set()
        self._handshake_address: str | None = None
        self._input_address: str | None = None
        self._checks: tuple[float, float, str] | None = None
        self._socket_tasks: list[tuple[trio.CancelScope, trio.Event]] = []
        self._nursery: trio.Nursery | None = None
        self._a_death = trio.Event()

    # ------------------------------------------------------------ public state

    def _sock_in(self) -> TrioSocket:
        assert self._input is not None, "the client is not started"
        return self._input

    def _transport_add(self, engine: EngineHandle, request: EngineCoreRequest) -> None:
        self._waves.stamp(request)
        self._send([engine.identity, _ADD, *self._encoder.encode(request)])

    def _send(self, frames: list[Any]) -> None:
        try:
            self._sock_in().send_multipart_nowait(frames)
        except trio.WouldBlock:  # pragma: no cover - a ROUTER with HWM 0 never blocks
            raise EngineCoreError("the input socket refused a message") from None

    def _transport_abort(self, engine: EngineHandle, request_ids: list[str]) -> None:
        logger.debug("engine rank %d: ABORT %d request(s)", engine.rank, len(request_ids))
        self._send([engine.identity, _ABORT, *self._encoder.encode(request_ids)])

    def _transport_utility(self, engine: EngineHandle, call: UtilityRequest) -> None:
        self._send([engine.identity, _UTILITY, *self._encoder.encode(call)])

    @property
    def load_balancer(self) -> LoadBalancer | None:
        """The policy choosing each request's engine (None: one engine takes all)."""
        return self._router.load_balancer

    @property
    def current_wave(self) -> int:
        """The request wave the coordinator last published (0 before the first)."""
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
        self._state.raise_if_unusable()
        await self._waves.wait_changed()
        self._state.raise_if_unusable()
        return self._waves.current_wave, self._waves.engines_running

    def _ranks(self) -> range:
        """The data-parallel ranks this client talks to."""
        return self._role.ranks

    def _engine_for(self, request: EngineCoreRequest) -> EngineHandle:
        return self._router.engine_for(request)

    def _utility_engine(self) -> EngineHandle:
        return self._router.utility_engine()

    async def _join_coordinator(self, nursery: trio.Nursery, *, launch: bool) -> None:
        """Data-parallel clients follow a coordinator: the one given, else (launching
        engines) one of their own, launched here; the external-LB kind must be given one."""
        addresses = self._coordinator_addresses
        if not self._role.data_parallel or (addresses is None and not launch):
            await trio.lowlevel.checkpoint()
            return
        if addresses is None:
            if not self._role.launches_coordinator:
                raise ValueError(EXTERNAL_LB_NEEDS_COORDINATOR)
            if self._remote is not None:
                # Engines reach it over TCP; this client, in the same context, in-process.
                addresses = attrs.evolve(
                    CoordinatorAddresses.on_host(self._remote.host),
                    publish=f"inproc://coordinator-{secrets.token_hex(8)}",
                )
            else:
                assert self._ipc_dir is not None
                addresses = CoordinatorAddresses.in_directory(self._ipc_dir)
            addresses = await nursery.start(
                self._run_socket_task,
                partial(
                    serve_coordinator,
                    self._ctx,
                    engines=len(self._state.engines),
                    addresses=addresses,
                    curve=self._remote.curve if self._remote is not None else None,
                ),
            )
            self._coordinator_addresses = addresses
        await self._subscribe(nursery, addresses.publish)

    async def _join_announced_coordinator(self, nursery: trio.Nursery) -> None:
        if not self._role.data_parallel:
            await trio.lowlevel.checkpoint()
            return
        announced = {e.ready.dp_stats_address for e in self._state.engines if e.ready is not None}
        announced.discard(None)
        if self._subscription is not None or not announced:
            await trio.lowlevel.checkpoint()
            return
        if len(announced) > 1:
            raise EngineStartupError(
                f"the engines name different coordinators: {sorted(map(str, announced))}"
            )
        (address,) = announced
        assert address is not None
        logger.debug("following the coordinator the engines named, at %s", address)
        await self._subscribe(nursery, address)

    async def _subscribe(self, nursery: trio.Nursery, publish_address: str) -> None:
        sock = make_socket(self._ctx, zmq.XSUB)
        try:
            curve = self._remote.curve if self._remote is not None else None
            if curve is not None and publish_address.startswith("tcp://"):
                # A shared coordinator holds the frontends' key pair: we prove we are a
                # frontend with the same key, and check it is theirs.
                curve.as_client_of_itself().apply(sock)
            connect_address(sock, publish_address, role="coordinator publish address")
            await sock.send_multipart([COORDINATOR_SUBSCRIBE])
        except BaseException:
            sock.close()
            raise
        self._subscription = sock
        nursery.start_soon(self._coordinator_loop, sock)

    async def _coordinator_loop(self, sock: TrioSocket) -> None:
        """Follow the coordinator's publications: loads, wave, running state."""
        decoder = MsgpackDecoder(CoordinatorPublication)
        try:
            while True:
                for frames in await sock.drain():
                    try:
                        self._waves.fold(decoder.decode(frames), self._state.engines)
                    except (ProtocolError, IndexError) as exc:
                        logger.error("dropping an invalid coordinator message: %s", exc)
        except trio.ClosedResourceError:
            if not self._state.closing:
                raise
        finally:
            sock.close()

    def _coordinator_fields(self) -> dict[str, str]:
        """The coordinator's addresses, for the handshake metadata."""
        addresses = self._coordinator_addresses
        if addresses is None:
            return {}
        return {
            "coordinator_input": addresses.engine_publish,
            "coordinator_output": addresses.stats,
            "frontend_stats_publish_address": addresses.publish,
        }

    def _on_engine_death(self, engine: EngineHandle) -> None:
        self._waves.announce()  # wakes wave waiters, who then raise
        death, self._a_death = self._a_death, trio.Event()
        death.set()
        if self._startup_scope is not None:
            self._startup_scope.cancel()

    # ------------------------------------------------------- the receive task

    async def _receive_loop(self) -> None:
        sock = self._output
        assert sock is not None
        budget = _MAX_DRAIN_MESSAGES
        while True:
            try:
                batch = await sock.drain(budget)
            except trio.ClosedResourceError:
                if self._state.closing:
                    return  # aclose() closed the socket under us: the normal way out
                raise
            before = self._state.batched_outputs
            for frames in batch:
                self._handle_message(frames)
            # Outputs for get_output() wait in the batch buffer as decoded objects, so
            # decoding far ahead of its reader keeps many young objects alive and costs
            # more in garbage collection than batching saves (measured: 3.4k -> 8k
            # messages/s of 256 outputs): drain about _DRAIN_OUTPUTS of them per batch.
            # Stream outputs are merged into their streams as they arrive, so for them
            # the bigger the batch the fewer reader wake-ups: drain all that is there.
            per_message = max(1, (self._state.batched_outputs - before) // len(batch))
            budget = max(1, min(_MAX_DRAIN_MESSAGES, _DRAIN_OUTPUTS // per_message))

    def _handle_message(self, frames: Frames) -> None:
        if len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD:
            self._engine_reported_dead()
            return
        try:
            message = self._decoder.decode(frames)
        except ProtocolError as exc:
            self._state.undecodable(exc)
            return
        self._state.handle_outputs(message)

    def _engine_reported_dead(self) -> None:
        """Someone sent ENGINE_CORE_DEAD: one frame, which does not say who.

        With one engine, it is that one. With several, the engine that sent it exits
        right after, and its process's exit (or, for a remote engine, its silence to
        the liveness checks) says which one it was: only that engine's requests fail.
        If that cannot tell within a bounded time, every engine is failed.
        """
        suspects = [engine for engine in self._state.engines if engine.alive]
        window = self._attribution_window_s()
        if len(suspects) <= 1 or window is None or self._nursery is None:
            for engine in suspects:
                self._engine_died(engine, "the engine reported a fatal error (ENGINE_CORE_DEAD)")
            return
        logger.warning("an engine reported a fatal error; waiting up to %g s to tell which", window)
        self._nursery.start_soon(self._attribute_death, suspects, window)

    def _attribution_window_s(self) -> float | None:
        if all(engine.process is not None for engine in self._state.engines):
            return _ATTRIBUTION_WINDOW_S
        if self._checks is not None:
            interval_s, timeout_s, _ = self._checks
            return interval_s + timeout_s + _ATTRIBUTION_WINDOW_S
        return None

    async def _attribute_death(self, suspects: list[EngineHandle], window_s: float) -> None:
        with trio.move_on_after(window_s):
            while all(engine.alive for engine in suspects):
                await self._a_death.wait()
            return
        for engine in suspects:
            self._engine_died(
                engine,
                "an engine reported a fatal error (ENGINE_CORE_DEAD) and none could be "
                f"identified as the sender within {window_s:g} s",
            )

    async def _watch_process(self, engine: EngineHandle) -> None:
        process = engine.process
        assert process is not None
        code = await process.wait()
        if not self._state.closing:
            with trio.move_on_after(1):
                await engine.stderr_done.wait()
            self._engine_died(engine, engine.exit_description(with_name=False))
            logger.debug("engine exit code %d", code)

    # ----------------------------------------------------------------- startup

    async def _start(
        self,
        nursery: trio.Nursery,
        *,
        input_address: str | ListenerFd | None,
        output_address: str | ListenerFd | None,
        ready_timeout_s: float,
        remote: RemoteEngines | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        attach = input_address is not None or output_address is not None
        if attach and (input_address is None or output_address is None):
            raise ValueError("attaching needs both input_address and output_address")
        if attach and remote is not None:
            raise ValueError(
                "remote engines join through the handshake: give remote= or the attach "
                "addresses, not both"
            )
        # In place: the router shares the list.
        self._state.engines[:] = [EngineHandle.for_rank(rank) for rank in self._ranks()]
        self._remote = remote
        self._nursery = nursery
        local = self._state.engines
        local_arguments: list[str] = []
        if remote is not None:
            local = [e for e in self._state.engines if e.rank not in remote.joining(self._ranks())]
            if local:
                # Engines we launch use TCP like the remote ones; their key files (and
                # nothing else) go in a private directory.
                self._ipc_dir = private_ipc_dir()
            if remote.curve is not None:
                allowed = remote.curve.allowed
                if local:
                    public, local_arguments = self._local_engine_keys(remote.curve)
                    allowed |= {public}
                # Before any CURVE socket is bound: without a handler libzmq admits anyone.
                await nursery.start(
                    self._run_socket_task,
                    partial(run_zap_handler, self._ctx, allowed, self._refused),
                )
            input_address = output_address = remote.any_port
        elif not attach:
            self._ipc_dir = private_ipc_dir()
            input_address = f"ipc://{self._ipc_dir}/input"
            output_address = f"ipc://{self._ipc_dir}/output"
        assert input_address is not None
        assert output_address is not None
        self._input = self._server_socket(zmq.ROUTER)
        self._output = self._server_socket(zmq.PULL)
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
        self._input_address = bound_input
        handshake: TrioSocket | None = None
        timeout = trio.CancelScope()
        try:
            with trio.CancelScope() as scope:
                self._startup_scope = scope
                with trio.move_on_after(ready_timeout_s) as timeout:
                    await self._join_coordinator(nursery, launch=not attach)
                    if not attach:
                        handshake = self._server_socket(zmq.ROUTER)
                        handshake_address = bind_address(
                            handshake,
                            remote.handshake_address
                            if remote is not None
                            else f"ipc://{self._ipc_dir}/handshake",
                            role="client handshake, ROUTER",
                        )
                        logger.debug("bound the handshake ROUTER at %s", handshake_address)
                        self._handshake_address = handshake_address
                        await self._launch_engines(
                            nursery, local, handshake_address, local_arguments
                        )
                        await self._handshake(handshake, bound_input, bound_output)
                    await self._wait_ready()
                    if attach:
                        await self._join_announced_coordinator(nursery)
                    if handshake is not None:
                        await self._wait_handshake_ready(handshake)
        finally:
            # Whatever ended the startup (success, timeout, an error, or the caller's
            # cancellation), the handshake socket is not needed any more.
            self._startup_scope = None
            if handshake is not None:
                self._note_queued_handshake_readies(handshake)
                handshake.close()
        if timeout.cancelled_caught or scope.cancelled_caught:
            raise await self._startup_error(ready_timeout_s, bool(timeout.cancelled_caught))
        nursery.start_soon(self._receive_loop)
        self._checks = checks = self._liveness_checks(attach, liveness)
        if checks is not None:
            for engine in self._state.engines:
                nursery.start_soon(self._check_liveness, engine, *checks)
        logger.info(
            "client ready: %d engine(s) serving %r", len(self._state.engines), self.config.model
        )

    def _liveness_checks(
        self, attach: bool, liveness: Liveness | None
    ) -> tuple[float, float, str] | None:
        """The (interval, timeout, kind of engine) of the liveness checks the engines
        need: remote and attached ones, which are no child processes of ours."""
        remote = self._remote
        if remote is not None and remote.liveness_interval_s is not None:
            return remote.liveness_interval_s, remote.liveness_timeout_s, "remote"
        if attach and liveness is not None:
            return liveness.interval_s, liveness.timeout_s, "attached"
        return None

    async def _check_liveness(
        self, engine: EngineHandle, interval_s: float, timeout_s: float, kind: str
    ) -> None:
        """Declare a remote or attached engine dead when it stops answering.

        There is no process to watch, and ZeroMQ reconnects silently: such an engine
        killed, hung, or cut off by the network, would otherwise leave its requests
        waiting forever. Any answer counts, a failure reply included.
        """
        while True:
            await trio.sleep(interval_s)
            with trio.move_on_after(timeout_s) as unanswered:
                try:
                    await self._call_engines([engine], "is_sleeping", ())
                except UtilityCallError:
                    pass
                except (EngineDeadError, trio.ClosedResourceError):
                    return
            if unanswered.cancelled_caught:
                self._engine_died(
                    engine,
                    f"no answer to a liveness check within {timeout_s:g} s (the {kind} "
                    "engine stopped, or the network between us failed)",
                )
                return

    async def _launch_engines(
        self,
        nursery: trio.Nursery,
        engines: list[EngineHandle],
        handshake_address: str,
        extra_arguments: list[str],
    ) -> None:
        for engine in engines:
            config = self.config.evolve(data_parallel_rank=engine.rank)
            # The engine stops by itself once this process is gone, however it dies:
            # its lifeline pipe's write end, kept open until aclose(), closes then.
            read_end, engine.lifeline = open_lifeline()
            try:
                command = engine_command(
                    config, connectable(handshake_address), lifeline_fd=read_end
                )
                await start_engine_process(
                    engine, command + extra_arguments, nursery, lifeline=read_end
                )
            finally:
                os.close(read_end)
            nursery.start_soon(self._watch_process, engine)

    def _local_engine_keys(self, curve: CurveServer) -> tuple[bytes, list[str]]:
        """A key pair for the engines this client launches beside remote ones, its
        secret in the private directory: the public key and the engines' arguments."""
        assert self._ipc_dir is not None
        public, secret = write_key_pair(self._ipc_dir, "local-engines")
        server_key = curve.keys.public.decode("ascii")
        # "=": a Z85 key may start with "-", which argparse would take for an option.
        arguments = ["--curve-secret-key", str(secret), f"--curve-server-key={server_key}"]
        return load_public_key(public), arguments

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

    def _server_socket(self, socket_type: int) -> TrioSocket:
        """A socket engines connect to: a CURVE server when remote engines use CURVE."""
        sock = make_socket(self._ctx, socket_type)
        if self._remote is not None and self._remote.curve is not None:
            self._remote.curve.apply(sock)
        return sock

    def _refused(self, refusal: CurveRefusal) -> None:
        logger.warning("refused a connection from %s", refusal)
        self._refusals.add(refusal)

    async def _startup_error(self, timeout_s: float, timed_out: bool) -> EngineStartupError:
        details: list[str] = []
        for engine in self._state.engines:
            if engine.identity in self._ready_messages and engine.alive:
                continue
            if engine.process is not None and engine.process.returncode is not None:
                with trio.move_on_after(1):
                    await engine.stderr_done.wait()
            if not engine.alive or (
                engine.process is not None and engine.process.returncode is not None
            ):
                details.append(engine.exit_description())
            else:
                details.append(self._startup_stage(engine))
        if self._refusals:
            details.append(self._refusals.describe())
        what = f"not ready within {timeout_s:g} s" if timed_out else "failed to start"
        return EngineStartupError(f"engine {what}: " + " | ".join(details))

    def _startup_stage(self, engine: EngineHandle) -> str:
        """How far a live engine got in the startup, and what it is waiting for."""
        name = f"engine rank {engine.rank}"
        if self._handshake_address is None:  # attached: no handshake
            return (
                f"{name} never sent its ready message: no engine with its identity "
                f"connected to the input address {self._input_address} (is it running, "
                "and given this address?)"
            )
        if engine.identity not in self._hellos:
            where = "(remote) " if engine.process is None else ""
            return (
                f"{name} {where}never said HELLO at {self._handshake_address} (still "
                "starting, or it cannot reach that address)"
            )
        if engine.identity not in self._handshake_ready:
            waiting = ["loading its model and sizing its KV cache"]
            if self._coordinator_addresses is not None:
                waiting.append("for every rank of its group to subscribe to the coordinator")
            if self.config.data_parallel_size > 1:
                hint = ""
                if self._remote is not None and self._remote.data_parallel_master_ip is None:
                    hint = (
                        " (vLLM MoE ranks started by separate launchers meet only "
                        "where the client tells them: RemoteEngines("
                        "data_parallel_master_ip=...))"
                    )
                waiting.append(f"for its data-parallel group to form{hint}")
            return f"{name} said HELLO but never READY: still " + ", or ".join(waiting)
        return (
            f"{name} said READY in the handshake but its ready message never arrived at "
            f"the input address {self._input_address} (it could not connect there)"
        )

    async def _handshake(self, sock: TrioSocket, input_address: str, output_address: str) -> None:
        decoder: MsgpackDecoder[HandshakeHello | HandshakeReady] = MsgpackDecoder(HandshakeMessage)
        group = (
            self._remote.group_parallel_config(self.config.data_parallel_size)
            if self._remote is not None
            else {}
        )
        metadata = self._encoder.encode(
            EngineHandshakeMetadata(
                addresses=EngineZmqAddresses(
                    inputs=[input_address],
                    outputs=[output_address],
                    **self._coordinator_fields(),
                ),
                parallel_config=group,
            )
        )
        waiting = {engine.identity: engine for engine in self._state.engines}
        while waiting:
            identity, *payload = await sock.recv_multipart()
            try:
                message = decoder.decode(payload)
            except ProtocolError as exc:
                raise EngineStartupError(
                    f"invalid handshake message from {identity!r}: {exc}"
                ) from exc
            if isinstance(message, HandshakeReady):
                # A fast engine can be READY before a slower one has said HELLO.
                self._handshake_ready.add(bytes(identity))
                logger.debug(
                    "handshake: engine rank %d reported READY", int.from_bytes(identity, "little")
                )
                continue
            engine = waiting.pop(bytes(identity), None)
            if engine is None:
                logger.warning("ignoring a HELLO from unexpected identity %r", identity)
                continue
            self._hellos.add(engine.identity)
            logger.debug(
                "handshake: engine rank %d said HELLO; sending it the addresses", engine.rank
            )
            await sock.send_multipart([engine.identity, *metadata])

    def _note_queued_handshake_readies(self, sock: TrioSocket) -> None:
        """Record the READYs already queued on the handshake socket (unread when the
        startup stops early), so that a startup error says how far each engine got."""
        decoder: MsgpackDecoder[HandshakeHello | HandshakeReady] = MsgpackDecoder(HandshakeMessage)
        while not sock.closed:
            try:
                identity, *payload = sock.raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            with suppress(ProtocolError):
                if isinstance(decoder.decode(payload), HandshakeReady):
                    self._handshake_ready.add(bytes(identity))

    async def _wait_handshake_ready(self, sock: TrioSocket) -> None:
        decoder: MsgpackDecoder[HandshakeHello | HandshakeReady] = MsgpackDecoder(HandshakeMessage)
        waiting = {engine.identity for engine in self._state.engines} - self._handshake_ready
        while waiting:
            identity, *payload = await sock.recv_multipart()
            message = decoder.decode(payload)
            if isinstance(message, HandshakeReady):
                waiting.discard(bytes(identity))
                logger.debug(
                    "handshake: engine rank %d reported READY", int.from_bytes(identity, "little")
                )

    async def _wait_ready(self) -> None:
        sock = self._sock_in()
        decoder = MsgpackDecoder(EngineCoreReadyResponse)
        waiting = {engine.identity: engine for engine in self._state.engines}
        while waiting:
            frames = await sock.recv_multipart()
            if len(frames) != 2:
                logger.warning("ignoring a %d-frame message on the input socket", len(frames))
                continue
            identity, payload = bytes(frames[0]), frames[1]
            engine = waiting.pop(identity, None)
            if engine is None:
                logger.warning("ignoring a ready message from unexpected identity %r", identity)
                continue
            self._ready_messages.add(identity)
            if len(payload):
                try:
                    engine.ready = decoder.decode(payload)
                except ProtocolError as exc:
                    raise EngineStartupError(
                        f"{engine.describe()} sent an invalid ready message: {exc}"
                    ) from exc
            logger.debug("%s is ready", engine.describe())

    # ---------------------------------------------------------------- shutdown

    async def aclose(self) -> None:
        """Abort in-flight requests, stop launched engines, close sockets.

        Launched engines get SIGTERM and are killed if they have not exited within
        ``shutdown_timeout_s`` (a constructor argument). Attached engines are left
        running (their in-flight requests from this client are aborted). Idempotent.
        Runs shielded from cancellation (bounded by the timeout), like every Trio
        ``aclose``.
        """
        if self._state.closed:
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):
            if self._input is not None:
                self._fail_waiters_on_close()
            self._state.closing = True
            self._waves.announce()  # wakes wave waiters, who then raise
            await self._stop_processes(self.shutdown_timeout_s)
            # The engines have exited (after SIGTERM, or SIGKILL): their lifelines go.
            for engine in self._state.engines:
                engine.close_lifeline()
            self._state.closed = True
            # Sockets owned by tasks must be closed by their task before the context
            # goes (closing a socket under a waiting task breaks the wait).
            for scope, _ in self._socket_tasks:
                scope.cancel()
            for _, done in self._socket_tasks:
                await done.wait()
            for sock in (self._input, self._output, self._subscription):
                if sock is not None:
                    sock.close(linger=0)
            # destroy() also closes any socket a failed startup left behind, with linger
            # 0, so terminating the context cannot block.
            self._ctx.destroy(linger=0)
            if self._ipc_dir is not None:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
            logger.debug("client closed: sockets, context and private directory released")

    async def _stop_processes(self, timeout_s: float) -> None:
        processes = [e.process for e in self._state.engines if e.process is not None]
        # An engine that reported a fatal error is on its way out: a SIGTERM now would
        # cut off its last log lines, which say why it failed.
        with trio.move_on_after(min(_DEAD_ENGINE_EXIT_S, timeout_s)):
            for engine in self._state.engines:
                if engine.process is not None and engine.death is not None:
                    await engine.process.wait()
        for engine in self._state.engines:
            if engine.process is not None and engine.process.returncode is None:
                logger.debug("shutdown: sending SIGTERM to %s", engine.describe())
                engine.process.terminate()
        with trio.move_on_after(timeout_s):
            for process in processes:
                await process.wait()
        for process in processes:
            if process.returncode is None:
                logger.warning(
                    "engine pid %d did not exit in %g s; killing it", process.pid, timeout_s
                )
                process.kill()
                await process.wait()
        # An exited engine's last lines (often why it died) are still in the pipe:
        # let the reader relay them before the pipe is closed under it.
        with trio.move_on_after(_STDERR_DRAIN_S):
            for engine in self._state.engines:
                if engine.process is not None:
                    await engine.stderr_done.wait()
        for engine in self._state.engines:
            engine.alive = False
            if engine.process is not None:
                logger.debug("shutdown: %s", engine.exit_description(with_stderr=False))
                if engine.process.stderr is not None:
                    await engine.process.stderr.aclose()


@asynccontextmanager
async def open_trio_mp_client(
    config: EngineConfig,
    *,
    input_address: str | ListenerFd | None = None,
    output_address: str | ListenerFd | None = None,
    ready_timeout_s: float = 60.0,
    shutdown_timeout_s: float = 5.0,
    max_pending_outputs: int = 64,
    client_index: int = 0,
    load_balancer: LoadBalancer | None = None,
    coordinator: CoordinatorAddresses | None = None,
    remote: RemoteEngines | None = None,
    liveness: Liveness | None = DEFAULT_LIVENESS,
) -> AsyncGenerator[TrioMPClient, None]:
    """Open a :class:`TrioMPClient`, or with several engines a :class:`DPLBTrioMPClient`
    (see :func:`trio_enginecore.open_engine_client`)."""
    if not (math.isfinite(ready_timeout_s) and ready_timeout_s > 0):
        raise ValueError(f"ready_timeout_s must be a positive number, got {ready_timeout_s!r}")
    client = _new_client(
        config,
        load_balancer=load_balancer,
        coordinator=coordinator,
        client_index=client_index,
        max_pending_outputs=max_pending_outputs,
        shutdown_timeout_s=shutdown_timeout_s,
    )

    async def start(nursery: trio.Nursery) -> None:
        await client._start(  # pyright: ignore[reportPrivateUsage]
            nursery,
            input_address=input_address,
            output_address=output_address,
            ready_timeout_s=ready_timeout_s,
            remote=remote,
            liveness=liveness,
        )

    async with run_client(client, start) as running:
        yield running


class DPTrioMPClient(TrioMPClient):
    """A Trio client owning one rank of a data-parallel group (external load balancing).

    Selected by :func:`~trio_enginecore.open_engine_client` when
    ``config.data_parallel_size > 1`` and ``config.data_parallel_external_lb``: several
    clients (say, one per API server, with a load balancer in front) each launch and
    use their own rank, ``config.data_parallel_rank``, and share one coordinator
    (:func:`~trio_enginecore.open_coordinator`), whose addresses every client is given.

    The engines of a MoE group move through request *waves* together. The client
    follows the coordinator's :attr:`current_wave` and :attr:`engines_running` and
    stamps every request with the wave; it sends the coordinator nothing, as vLLM's
    front-end does not: an engine that gets a request while paused has the coordinator
    start the wave on the others. Engines that run no waves (vLLM's dense data
    parallelism) leave both at ``(0, False)``.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        coordinator: CoordinatorAddresses | None = None,
        client_index: int = 0,
        max_pending_outputs: int = 64,
        abort_timeout_s: float = 1.0,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(
            config,
            client_index=client_index,
            max_pending_outputs=max_pending_outputs,
            abort_timeout_s=abort_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s,
            _role=DataParallelRole.one_rank(config, coordinator),
        )


@final
class DPLBTrioMPClient(DPTrioMPClient):
    """A Trio client balancing requests over several data-parallel engines.

    Selected by :func:`~trio_enginecore.open_engine_client` when
    ``config.data_parallel_size > 1``: it launches that many engines (ranks) and sends
    each request to the engine its ``load_balancer`` chooses (by default
    :class:`~trio_enginecore.client.LeastLoaded`, vLLM's score over the client's exact
    in-flight counts and the waiting/running counts the engines report through a
    coordinator process launched with them, unless ``coordinator`` names a shared
    one), or to ``request.data_parallel_rank`` when set. Aborts (and the aborts of
    cancelled streams) go only to the engine that has the request.
    ``call_utility`` goes to rank 0, ``call_utility_all`` to every engine, and the
    typed wrappers to every engine, raising
    :class:`~trio_enginecore.client.EngineConsensusError` if the answers differ.
    Request waves are followed as :class:`DPTrioMPClient` does.

    Failure policy: the client fails as a whole. When one engine dies, its in-flight
    requests fail with ``EngineDeadError`` at once and every later call raises it;
    requests on the surviving engines keep streaming until the block ends, and the
    ``async with`` block then raises one ``EngineDeadError``. A death is seen when a
    launched engine's process exits, when a remote or attached engine stops answering
    the liveness checks (:class:`~trio_enginecore.RemoteEngines`,
    :class:`~trio_enginecore.Liveness`), or when an engine sends ``ENGINE_CORE_DEAD``:
    that frame does not say who sent it, so the client waits up to 2 s (remote and
    attached engines: a liveness period) for the sender's exit to identify it, and
    fails every engine only if none is identified.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        load_balancer: LoadBalancer | None = None,
        coordinator: CoordinatorAddresses | None = None,
        client_index: int = 0,
        max_pending_outputs: int = 64,
        abort_timeout_s: float = 1.0,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        TrioMPClient.__init__(
            self,
            config,
            client_index=client_index,
            max_pending_outputs=max_pending_outputs,
            abort_timeout_s=abort_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s,
            _role=DataParallelRole.balanced(config, load_balancer or LeastLoaded(), coordinator),
        )


def _new_client(
    config: EngineConfig,
    *,
    load_balancer: LoadBalancer | None,
    coordinator: CoordinatorAddresses | None,
    client_index: int,
    max_pending_outputs: int,
    shutdown_timeout_s: float,
) -> TrioMPClient:
    """One engine: a TrioMPClient; several: a DPTrioMPClient owning one of them
    (external load balancing) or a DPLBTrioMPClient balancing over them all."""
    if config.data_parallel_size == 1:
        if coordinator is not None:
            raise ValueError("a coordinator is only used with data_parallel_size > 1")
        return TrioMPClient(
            config,
            client_index=client_index,
            max_pending_outputs=max_pending_outputs,
            shutdown_timeout_s=shutdown_timeout_s,
        )
    if config.data_parallel_external_lb:
        return DPTrioMPClient(
            config,
            coordinator=coordinator,
            client_index=client_index,
            max_pending_outputs=max_pending_outputs,
            shutdown_timeout_s=shutdown_timeout_s,
        )
    return DPLBTrioMPClient(
        config,
        load_balancer=load_balancer,
        coordinator=coordinator,
        client_index=client_index,
        max_pending_outputs=max_pending_outputs,
        shutdown_timeout_s=shutdown_timeout_s,
    )


async def connect_engine_client(
    nursery: trio.Nursery,
    config: EngineConfig | None = None,
    *,
    input_address: str | ListenerFd | None = None,
    output_address: str | ListenerFd | None = None,
    ready_timeout_s: float = 60.0,
    shutdown_timeout_s: float = 5.0,
    max_pending_outputs: int = 64,
    client_index: int = 0,
    coordinator: CoordinatorAddresses | None = None,
    remote: RemoteEngines | None = None,
    liveness: Liveness | None = DEFAULT_LIVENESS,
) -> TrioMPClient:
    """Start a :class:`TrioMPClient` whose background tasks run in ``nursery``.

    The lower-level form of :func:`~trio_enginecore.open_engine_client` (as
    trio-websocket's ``connect_websocket``), for code that manages its own nursery.
    Returns once the engines are ready. The caller owns the client: ``await
    client.aclose()`` when done, after which its tasks in ``nursery`` all end. If the
    startup fails or is cancelled, everything started so far is cleaned up first.

    Raises:
        EngineStartupError: as :func:`~trio_enginecore.open_engine_client`.
    """
    client = _new_client(
        config if config is not None else EngineConfig(),
        load_balancer=None,
        coordinator=coordinator,
        client_index=client_index,
        max_pending_outputs=max_pending_outputs,
        shutdown_timeout_s=shutdown_timeout_s,
    )
    try:
        await client._start(  # pyright: ignore[reportPrivateUsage]
            nursery,
            input_address=input_address,
            output_address=output_address,
            ready_timeout_s=ready_timeout_s,
            remote=remote,
            liveness=liveness,
        )
    except BaseException:
        await client.aclose()
        raise
    return client

"""EngineCoreProc: the reference engine as a process speaking vLLM's wire protocol.

Three kinds of Trio task share one :class:`EngineCore`:

* one **input task** per input socket (a DEALER connected to a client's ROUTER) drains
  requests in batches and applies them to the core synchronously;
* the **busy loop** steps the core whenever there is work and PUSHes the outputs (and
  utility replies) to the client each one belongs to;
* while a step "computes" (``step_time_s``), the input tasks keep running, as a real
  engine overlaps I/O with the accelerator.

Nothing a client sends can kill the engine: malformed frames are logged and, where the
protocol has a place for an error (an ADD's output, a UTILITY's reply), answered with
one. A fatal error (the model failing) sends ``ENGINE_CORE_DEAD`` to every client
before the process exits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Final

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from .._addresses import connect_address
from .._curve import CurveClient
from .._zmq import Frames, TrioSocket, make_socket
from ..config import EngineConfig
from ..errors import EngineStartupError, ProtocolError
from ..protocol import (
    COORDINATOR_READY,
    COORDINATOR_SUBSCRIBE,
    ENGINE_CORE_DEAD,
    REPORTS_OWN_WAVES,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeHello,
    HandshakeReady,
    SchedulerStats,
    StartDPWave,
    UtilityRequest,
    identity_for_rank,
)
from ..serial import MsgpackDecoder, MsgpackEncoder
from ._core import EngineCore, FatalEngineError
from ._waves import EngineWaveState

__all__ = ["EngineCoreProc", "engine_handshake"]

logger = logging.getLogger("trio_enginecore.engine")

OUTPUT_LINGER_MS: Final = 4000
"""How long queued outputs (and the ENGINE_CORE_DEAD frame) may outlive a closed PUSH
socket; the process terminates its context after Trio exits, which waits this long."""

HANDSHAKE_LINGER_MS: Final = 5000
REPORT_INTERVAL_S: Final = 0.02
"""How often an engine of a data-parallel group checks its counts for the coordinator."""
DEFAULT_HANDSHAKE_TIMEOUT_S: Final = 300.0


def connect_socket(
    ctx: zmq.Context[Any],
    socket_type: int,
    address: str,
    *,
    curve: CurveClient | None = None,
    identity: bytes | None = None,
    linger_ms: int = 0,
    role: str = "",
) -> TrioSocket:
    """A socket connected to ``address``; a CURVE client when ``curve`` is given and
    the address is TCP (ipc:// stays in a private directory instead).

    Raises:
        AddressError: ZeroMQ refused the address (``role`` names the socket).
    """
    sock = make_socket(ctx, socket_type, identity=identity, linger_ms=linger_ms)
    try:
        if curve is not None and address.startswith("tcp://"):
            curve.apply(sock)
        connect_address(sock, address, role=role)
    except BaseException:
        sock.close()
        raise
    return sock


async def engine_handshake(
    ctx: zmq.Context[Any],
    config: EngineConfig,
    handshake_address: str,
    *,
    headless: bool = False,
    timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    curve: CurveClient | None = None,
) -> tuple[TrioSocket, EngineZmqAddresses]:
    """Say HELLO to a frontend and receive the addresses to serve.

    Returns the still-open handshake socket (READY is sent on it once the engine is up)
    and the addresses.

    Raises:
        EngineStartupError: no reply within ``timeout_s``, or an invalid reply.
    """
    sock = connect_socket(
        ctx,
        zmq.DEALER,
        handshake_address,
        curve=curve,
        identity=identity_for_rank(config.data_parallel_rank),
        linger_ms=HANDSHAKE_LINGER_MS,
        role="handshake",
    )
    secured = curve is not None and handshake_address.startswith("tcp://")
    try:
        hello = HandshakeHello(local=not headless, headless=headless)
        await sock.send_multipart(MsgpackEncoder().encode(hello))
        logger.debug("handshake: sent HELLO to %s", handshake_address)
        frames = None
        with trio.move_on_after(timeout_s):
            if secured:
                frames = await _reply_unless_refused(sock, handshake_address)
            else:
                frames = await sock.recv_multipart()
        if frames is None:
            hint = (
                " (with CURVE, also check that the client admits this engine's public key "
                "and that --curve-server-key is the client's)"
                if secured
                else ""
            )
            raise EngineStartupError(
                f"no handshake reply from {handshake_address} within {timeout_s:g} s{hint}"
            )
        try:
            metadata = MsgpackDecoder(EngineHandshakeMetadata).decode(frames)
        except ProtocolError as exc:
            raise EngineStartupError(f"invalid handshake reply: {exc}") from exc
        logger.debug(
            "handshake: the client gave inputs %s, outputs %s",
            metadata.addresses.inputs,
            metadata.addresses.outputs,
        )
    except BaseException:
        # A HELLO nobody answered is not worth waiting for: drop it (linger 0).
        sock.close(linger=0)
        raise
    return sock, metadata.addresses


async def _reply_unless_refused(sock: TrioSocket, address: str) -> Frames:
    """The handshake reply, or EngineStartupError as soon as the client refuses our
    CURVE key (libzmq would otherwise retry, and be refused, silently forever)."""
    monitor = TrioSocket(sock.raw.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH))
    reply: Frames | None = None
    refusal: str | None = None
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal refusal
                event = parse_monitor_message([bytes(f) for f in await monitor.recv_multipart()])
                refusal = (
                    f"the client at {address} refused this engine's CURVE key (ZAP status "
                    f"{event['value']}): is this engine's public key in the client's "
                    "allow-list?"
                )
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            reply = await sock.recv_multipart()
            nursery.cancel_scope.cancel()
    finally:
        sock.raw.disable_monitor()
        monitor.close()
    if refusal is not None:
        raise EngineStartupError(refusal)
    assert reply is not None
    return reply


class EngineCoreProc:
    """The engine's I/O around an :class:`EngineCore`.

    Args:
        config: the engine configuration.
        ctx: the ZeroMQ context to create sockets in. The caller terminates it after
            :meth:`run` returns (outside Trio: terminating waits for queued outputs).
        core: the core to serve; by default one built from ``config``.
        curve: authenticate to the client with CURVE on every TCP connection.
    """

    def __init__(
        self,
        config: EngineConfig,
        ctx: zmq.Context[Any],
        core: EngineCore | None = None,
        *,
        curve: CurveClient | None = None,
    ) -> None:
        self.config = config
        self._curve = curve
        self.core = core if core is not None else EngineCore(config)
        self._ctx = ctx
        self._encoder = MsgpackEncoder()
        self._request_decoder = MsgpackDecoder(EngineCoreRequest)
        self._abort_decoder = MsgpackDecoder(list[str])
        self._utility_decoder = MsgpackDecoder(UtilityRequest)
        self._wave_decoder = MsgpackDecoder(StartDPWave)
        self._generic_decoder = MsgpackDecoder()
        self._outputs: list[TrioSocket] = []
        self._work = trio.Event()
        self._draining = False
        self._serving = False
        self._drain_deadline = math.inf
        self.waves = EngineWaveState(config.data_parallel_rank)
        self._coordinator: TrioSocket | None = None
        self._start_wave: int | None = None
        self._abandoned = False

    # -------------------------------------------------------------------- running

    async def run(
        self,
        addresses: EngineZmqAddresses,
        *,
        handshake_socket: TrioSocket | None = None,
        headless: bool = False,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Connect to the clients, announce readiness and serve until drained.

        Returns after :meth:`begin_drain` once no request is left. Cancelling it stops
        the engine at once (queued outputs are still flushed by the context's linger,
        unless :meth:`abandon` was called). It closes ``handshake_socket`` in any case.

        Raises:
            FatalEngineError: the core failed; ``ENGINE_CORE_DEAD`` was sent first.
        """
        rank = self.config.data_parallel_rank
        inputs: list[TrioSocket] = []
        try:
            if addresses.coordinator_output is not None:
                self._coordinator = self._connect(
                    zmq.PUSH, addresses.coordinator_output, role="coordinator stats"
                )
                # No collective lets rank 0 speak for us, as vLLM's rank 0 does for its
                # group: we report our own waves, and say so first.
                announce = EngineCoreOutputs(engine_index=rank, wave_complete=REPORTS_OWN_WAVES)
                await self._coordinator.send_multipart(self._encoder.encode(announce))
            if addresses.coordinator_input is not None:
                # START_DP_WAVE broadcasts arrive like requests: an input socket.
                inputs.append(await self._join_coordinator(addresses.coordinator_input))
            for address in addresses.outputs:
                self._outputs.append(
                    self._connect(zmq.PUSH, address, linger_ms=OUTPUT_LINGER_MS, role="output")
                )
            ready = self._encoder.encode(self.core.ready_response())
            for address in addresses.inputs:
                sock = self._connect(
                    zmq.DEALER, address, identity=identity_for_rank(rank), role="input"
                )
                inputs.append(sock)
                # The ready message is what lets the client's ROUTER route to us.
                await sock.send_multipart(ready)
                logger.debug("connected to the input %s and sent the ready message", address)
            if handshake_socket is not None:
                ready_msg = HandshakeReady(local=not headless, headless=headless)
                await handshake_socket.send_multipart(self._encoder.encode(ready_msg))
                handshake_socket.close()
                logger.debug("handshake: sent READY")
            logger.info(
                "engine rank %d serving model %r (%d input(s), %d output(s))",
                rank,
                self.config.model,
                len(inputs),
                len(self._outputs),
            )
            self._serving = True
            task_status.started()
            async with trio.open_nursery() as nursery:
                for sock in inputs:
                    nursery.start_soon(self._input_loop, sock)
                if self._coordinator is not None:
                    nursery.start_soon(self._report_loop, self._coordinator)
                await self._busy_loop()
                nursery.cancel_scope.cancel()
        except* FatalEngineError:
            self._send_engine_dead()
            raise
        finally:
            # After abandon(), nothing queued is worth a wait: linger 0.
            linger = 0 if self._abandoned else None
            for sock in (*inputs, *self._outputs):
                sock.close(linger=linger)
            if self._coordinator is not None:
                self._coordinator.close(linger=linger)
            if handshake_socket is not None:
                handshake_socket.close(linger=linger)

    @property
    def serving(self) -> bool:
        """Whether the engine is connected and ready (its startup is over)."""
        return self._serving

    @property
    def draining(self) -> bool:
        """Whether :meth:`begin_drain` was called."""
        return self._draining

    def abandon(self) -> None:
        """The clients are gone: drop whatever is queued for them.

        Call it before cancelling :meth:`run`: the sockets are then closed with linger
        0, so terminating the context does not wait for peers that will never read.
        """
        self._abandoned = True

    def begin_drain(self) -> None:
        """Stop accepting requests; finish in-flight ones within ``drain_timeout_s``.

        Requests still running at the deadline are aborted (clients get ABORT outputs).
        :meth:`run` returns once nothing is left.
        """
        if not self._draining:
            self._draining = True
            self._drain_deadline = trio.current_time() + self.config.drain_timeout_s
            logger.info(
                "draining %d request(s) (timeout %g s)",
                self.core.num_requests,
                self.config.drain_timeout_s,
            )
        self._work.set()

    def _connect(
        self,
        socket_type: int,
        address: str,
        *,
        identity: bytes | None = None,
        linger_ms: int = 0,
        role: str = "",
    ) -> TrioSocket:
        return connect_socket(
            self._ctx,
            socket_type,
            address,
            curve=self._curve,
            identity=identity,
            linger_ms=linger_ms,
            role=role,
        )

    # ---------------------------------------------------------------- input side

    async def _join_coordinator(self, address: str) -> TrioSocket:
        """Subscribe to the coordinator's START_DP_WAVE broadcasts.

        Returns once the coordinator said READY (it does when every engine of the group
        has subscribed), so that no broadcast can be missed.
        """
        sock = self._connect(zmq.XSUB, address, role="coordinator waves")
        try:
            await sock.send_multipart([COORDINATOR_SUBSCRIBE])
            while True:
                frames = await sock.recv_multipart()
                if len(frames) == 1 and frames[0] == COORDINATOR_READY:
                    return sock
                logger.warning(
                    "ignoring a %d-frame message before the coordinator's READY", len(frames)
                )
        except BaseException:
            sock.close()
            raise

    async def _input_loop(self, sock: TrioSocket) -> None:
        while True:
            batch = await sock.drain(copy_leading=2)
            for frames in batch:
                if len(frames) == 1 and frames[0] == COORDINATOR_READY:
                    continue  # repeated for an engine that joined late
                self._handle_input(frames)
            self._work.set()

    def _handle_input(self, frames: Frames) -> None:
        if len(frames) < 2:
            logger.error("dropping a %d-frame input message: expected type + payload", len(frames))
            return
        type_frame = bytes(frames[0])
        payload = frames[1:]
        try:
            request_type = EngineCoreRequestType(type_frame)
        except ValueError:
            logger.error("dropping a message with unknown request type %r", type_frame)
            return
        if request_type is EngineCoreRequestType.ADD:
            self._handle_add(payload)
        elif request_type is EngineCoreRequestType.ABORT:
            try:
                request_ids = self._abort_decoder.decode(payload)
            except ProtocolError as exc:
                logger.error("dropping an invalid ABORT: %s", exc)
            else:
                logger.debug("ABORT of %d request(s)", len(request_ids))
                self.core.abort_requests(request_ids)
        elif request_type is EngineCoreRequestType.UTILITY:
            self._handle_utility(payload)
        elif request_type is EngineCoreRequestType.START_DP_WAVE:
            try:
                start = self._wave_decoder.decode(payload)
            except ProtocolError as exc:
                logger.error("dropping an invalid START_DP_WAVE: %s", exc)
            else:
                self.waves.on_start_wave(start.wave, start.exclude_engine_index)
        else:
            logger.error("dropping an engine-internal request type %s from the wire", request_type)

    def _handle_add(self, payload: Frames) -> None:
        try:
            request = self._request_decoder.decode(payload)
        except ProtocolError as exc:
            logger.error("invalid ADD: %s", exc)
            request_id, client_index = self._salvage_ids(payload, id_pos=0, client_pos=11)
            if isinstance(request_id, str) and request_id:
                self.core.reject(request_id, client_index, f"invalid request: {exc}")
            return
        if self._draining:
            self.core.reject(
                request.request_id, request.client_index, "the engine is shutting down"
            )
            return
        start = self.waves.on_request(request.current_wave)
        if start is not None:
            self._start_wave = start
        self.core.add_request(request)

    def _handle_utility(self, payload: Frames) -> None:
        try:
            call = self._utility_decoder.decode(payload)
        except ProtocolError as exc:
            logger.error("invalid UTILITY: %s", exc)
            call_id, client_index = self._salvage_ids(payload, id_pos=1, client_pos=0)
            if isinstance(call_id, int):
                self.core.reply_failure(client_index, call_id, "?", f"invalid call: {exc}")
            return
        self.core.call_utility(call.client_index, call.call_id, call.method, call.args)

    def _salvage_ids(self, payload: Frames, *, id_pos: int, client_pos: int) -> tuple[Any, int]:
        """Best-effort read of an invalid message's id, so its sender gets an error."""
        try:
            generic = self._generic_decoder.decode(payload)
        except ProtocolError:
            return None, 0
        if not isinstance(generic, list) or len(generic) <= id_pos:  # pyright: ignore[reportUnknownArgumentType]
            return None, 0
        items: list[Any] = generic  # pyright: ignore[reportUnknownVariableType]
        client = items[client_pos] if len(items) > client_pos else 0
        return items[id_pos], client if type(client) is int else 0

    # --------------------------------------------------------------- output side

    async def _busy_loop(self) -> None:
        core = self.core
        step_time = self.config.step_time_s
        while True:
            if self._draining and trio.current_time() >= self._drain_deadline:
                if core.num_requests:
                    logger.warning("drain timeout: aborting %d request(s)", core.num_requests)
                core.abort_all()
            # Replies first: they are cheap, latency-sensitive, and must not be lost if
            # the step that follows fails fatally.
            await self._send_utility_replies()
            if self._coordinator is not None:
                await self._report_waves(self._coordinator)
            if core.can_step:
                messages = core.step()
                for client_index, outputs in messages.items():
                    await self._send(client_index, outputs)
                await self._send_utility_replies()
                if step_time:
                    await trio.sleep(step_time)
                else:
                    await trio.lowlevel.checkpoint()
                continue
            if self._draining and core.num_requests == 0:
                return
            if self._draining:
                with trio.move_on_at(self._drain_deadline):
                    await self._work.wait()
            else:
                await self._work.wait()
            self._work = trio.Event()

    async def _report_waves(self, sock: TrioSocket) -> None:
        """Tell the coordinator to start a wave, or that ours is complete."""
        report = None
        if self._start_wave is not None:
            report = EngineCoreOutputs(start_wave=self._start_wave)
            self._start_wave = None
        elif self.core.num_requests == 0 and (done := self.waves.on_idle()) is not None:
            report = EngineCoreOutputs(wave_complete=done)
        if report is not None:
            report.engine_index = self.config.data_parallel_rank
            await sock.send_multipart(self._encoder.encode(report))

    async def _report_loop(self, sock: TrioSocket) -> None:
        """Tell the DP coordinator our request counts whenever they change."""
        last: tuple[int, int] | None = None
        while True:
            counts = (self.core.num_waiting, self.core.num_running)
            if counts != last:
                stats = SchedulerStats(
                    num_waiting_reqs=counts[0],
                    num_running_reqs=counts[1],
                    current_wave=self.waves.current_wave,
                )
                report = EngineCoreOutputs(
                    engine_index=self.config.data_parallel_rank, scheduler_stats=stats
                )
                await sock.send_multipart(self._encoder.encode(report))
                last = counts
            await trio.sleep(REPORT_INTERVAL_S)

    async def _send_utility_replies(self) -> None:
        for client_index, reply in self.core.take_utility_outputs():
            await self._send(
                client_index,
                EngineCoreOutputs(
                    engine_index=self.config.data_parallel_rank, utility_output=reply
                ),
            )

    async def _send(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        if not 0 <= client_index < len(self._outputs):
            logger.error("dropping outputs for unknown client index %d", client_index)
            return
        await self._outputs[client_index].send_multipart(self._encoder.encode(outputs))

    def _send_engine_dead(self) -> None:
        for sock in self._outputs:
            if sock.closed:
                continue
            try:
                sock.raw.send(ENGINE_CORE_DEAD, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # pragma: no cover - best effort while dying
                logger.error("could not send ENGINE_CORE_DEAD: %s", exc)


def addresses_for(inputs: Sequence[str], outputs: Sequence[str]) -> EngineZmqAddresses:
    """The addresses of an engine attached to clients directly (no handshake)."""
    return EngineZmqAddresses(inputs=list(inputs), outputs=list(outputs))

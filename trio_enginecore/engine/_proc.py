"""EngineCoreProc: the reference engine as a process speaking vLLM's wire protocol.

It decides what the engine does with what arrives and when it stops; the sockets
towards the clients, who is connected and what a client's departure drops are
:mod:`._links`' decisions. Three kinds of Trio task share one :class:`EngineCore`:

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

Three ways to serve (see :meth:`EngineCoreProc.run`):

* **attach mode** (no handshake): the engine serves successive clients at the same
  addresses; each arriving client gets the ready message, and a departed client's
  requests are aborted (:class:`~._links.FrontendLinks`);
* **handshake mode**: the ready message is sent once, as vLLM's engines do;
* **headless** (``until_frontend_leaves``): as handshake mode, but the engine stops
  serving when its frontend's connection closes, so that it can go back to the
  handshake and join the next frontend (see ``serve``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Final

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from .._curve import CurveClient
from .._zmq import Frames, SendablePart, TrioSocket
from ..config import EngineConfig
from ..errors import EngineStartupError, ProtocolError
from ..protocol import (
    COORDINATOR_READY,
    COORDINATOR_SUBSCRIBE,
    REPORTS_OWN_WAVES,
    EngineCoreOutputs,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeHello,
    HandshakeReady,
    SchedulerStats,
    identity_for_rank,
)
from ..serial import MsgpackDecoder, MsgpackEncoder, outputs_for, ready_for
from ._core import EngineCore, FatalEngineError
from ._intake import RequestIntake
from ._links import FrontendConnection, FrontendLinks, connect_socket
from ._waves import EngineWaveState

__all__ = ["EngineCoreProc", "engine_handshake"]

logger = logging.getLogger("trio_enginecore.engine")

HANDSHAKE_LINGER_MS: Final = 5000
REPORT_INTERVAL_S: Final = 0.02
"""How often an engine of a data-parallel group checks its counts for the coordinator."""
DEFAULT_HANDSHAKE_TIMEOUT_S: Final = 300.0


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


async def _report_own_waves(links: FrontendLinks, address: str, rank: int) -> TrioSocket:
    """Connect to the coordinator's stats address, saying we report our own waves.

    Cancelled, the socket is closed and the announcement may not have been sent.
    """
    sock = links.connect(zmq.PUSH, address, role="coordinator stats")
    try:
        # No collective lets rank 0 speak for us, as vLLM's rank 0 does for its group:
        # we report our own waves, and say so first.
        announce = EngineCoreOutputs(engine_index=rank, wave_complete=REPORTS_OWN_WAVES)
        await sock.send_multipart(MsgpackEncoder().encode(announce))
    except BaseException:
        sock.close()
        raise
    return sock


async def _join_coordinator(links: FrontendLinks, address: str) -> TrioSocket:
    """Subscribe to the coordinator's START_DP_WAVE broadcasts.

    Returns once the coordinator said READY (it does when every engine of the group
    has subscribed), so that no broadcast can be missed. Cancelled, the socket is
    closed.
    """
    sock = links.connect(zmq.XSUB, address, role="coordinator waves")
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
        self.core = core if core is not None else EngineCore(config)
        self._encoder = MsgpackEncoder()
        # The release the engine speaks (the one it presents itself as, or for a
        # version that names none, wire_release's) decides the form of what it
        # writes; it reads requests of every release.
        self._dialect = config.dialect
        self._intake = RequestIntake(self.core, EngineWaveState(config.data_parallel_rank))
        self.waves = self._intake.waves
        self._links = FrontendLinks(
            ctx,
            self.core,
            identity=identity_for_rank(config.data_parallel_rank),
            curve=curve,
            ready_message=self._ready_message,
            apply_input=self._apply_input,
            wake=self._wake,
        )
        self._work = trio.Event()
        self._serving = False
        self._drain_deadline = math.inf
        self._coordinator: TrioSocket | None = None
        self._abandoned = False
        self.frontend_left = False
        """The frontend's connection closed while serving (``until_frontend_leaves``)."""

    # -------------------------------------------------------------------- running

    async def run(
        self,
        addresses: EngineZmqAddresses,
        *,
        handshake_socket: TrioSocket | None = None,
        headless: bool = False,
        until_frontend_leaves: bool = False,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Connect to the clients, announce readiness and serve until drained.

        Without ``handshake_socket`` (attach mode) every client that connects gets the
        ready message, and the next one too once it left. Returns after
        :meth:`begin_drain` once no request is left, or (handshake mode,
        ``until_frontend_leaves``) as soon as the frontend's connection to the input
        socket closes: :attr:`frontend_left` then says so, and its requests are
        dropped (the engine abandons them). Cancelling it stops the engine at once
        (queued outputs are still flushed by the context's linger, unless
        :meth:`abandon` was called). It closes ``handshake_socket`` in any case.

        Raises:
            FatalEngineError: the core failed; ``ENGINE_CORE_DEAD`` was sent first.
        """
        links = self._links
        # Sockets read by a plain input task: the coordinator's broadcasts, and the
        # clients' inputs outside attach mode (attach mode's are the links' own).
        inputs: list[TrioSocket] = []
        try:
            if addresses.coordinator_output is not None:
                self._coordinator = await _report_own_waves(
                    links, addresses.coordinator_output, self.config.data_parallel_rank
                )
            if addresses.coordinator_input is not None:
                # START_DP_WAVE broadcasts arrive like requests: an input socket.
                inputs.append(await _join_coordinator(links, addresses.coordinator_input))
            links.open_outputs(addresses.outputs)
            for index, address in enumerate(addresses.inputs):
                if handshake_socket is None:
                    output = addresses.outputs[index] if index < len(addresses.outputs) else None
                    links.open_reattaching(index, address, output)
                    logger.debug(
                        "connecting to the input %s: each client there gets the ready message",
                        address,
                    )
                    continue
                if until_frontend_leaves:
                    sock = links.open_frontend(index, address).input
                else:
                    sock = links.open_input(address)
                inputs.append(sock)
                # The ready message is what lets the client's ROUTER route to us.
                await sock.send_multipart(self._ready_message())
                logger.debug("connected to the input %s and sent the ready message", address)
            if handshake_socket is not None:
                ready_msg = HandshakeReady(local=not headless, headless=headless)
                await handshake_socket.send_multipart(self._encoder.encode(ready_msg))
                handshake_socket.close()
                logger.debug("handshake: sent READY")
            logger.info(
                "engine rank %d serving model %r (%d input(s), %d output(s))",
                self.config.data_parallel_rank,
                self.config.model,
                len(addresses.inputs),
                len(links.outputs),
            )
            self._serving = True
            task_status.started()
            async with trio.open_nursery() as nursery:
                for sock in inputs:
                    nursery.start_soon(self._input_loop, sock)
                for link in links.reattaching:
                    nursery.start_soon(links.serve_client, link)
                for link in links.watched:
                    nursery.start_soon(self._serve_until_departure, link, nursery.cancel_scope)
                if self._coordinator is not None:
                    nursery.start_soon(self._report_loop, self._coordinator)
                await self._busy_loop()
                nursery.cancel_scope.cancel()
        except* FatalEngineError:
            links.send_engine_dead()
            raise
        finally:
            self._serving = False
            # After abandon(), nothing queued is worth a wait: linger 0.
            linger = 0 if self._abandoned else None
            links.close(linger)
            for sock in inputs:
                sock.close(linger=linger)  # closing twice (a link's input) is harmless
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
        return self._intake.draining

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
        if not self._intake.draining:
            self._intake.draining = True
            self._drain_deadline = trio.current_time() + self.config.drain_timeout_s
            logger.info(
                "draining %d request(s) (timeout %g s)",
                self.core.num_requests,
                self.config.drain_timeout_s,
            )
        self._work.set()

    def _ready_message(self) -> Sequence[SendablePart]:
        return self._encoder.encode(ready_for(self._dialect, self.core.ready_response()))

    def _wake(self) -> None:
        # Not a bound method of the event handed out once: the busy loop replaces it.
        self._work.set()

    async def _serve_until_departure(
        self, link: FrontendConnection, serving: trio.CancelScope
    ) -> None:
        """Stop serving once the frontend's connection closes (``until_frontend_leaves``)."""
        await self._links.frontend_departure(link)
        self.frontend_left = True
        logger.warning(
            "the frontend left (its connection to %s closed): dropping its %d request(s)",
            link.input_address,
            self.core.num_requests,
        )
        self.abandon()
        serving.cancel()

    # ---------------------------------------------------------------- input side

    async def _input_loop(self, sock: TrioSocket) -> None:
        """Apply everything that arrives on ``sock``, forever. Cancelling it loses
        nothing: a cancelled drain() took nothing off the socket."""
        while True:
            batch = await sock.drain(copy_leading=2)
            self._apply_input(
                # Repeated for an engine that joined late: not an input.
                [frames for frames in batch if frames != [COORDINATOR_READY]]
            )

    def _apply_input(self, batch: list[Frames]) -> None:
        for frames in batch:
            self._intake.apply(frames)
        self._work.set()

    # --------------------------------------------------------------- output side

    async def _busy_loop(self) -> None:
        """Step the core while there is work and send what it produces. Returns once
        drained; cancelled, outputs of the step in progress may be lost."""
        core = self.core
        step_time = self.config.step_time_s
        while True:
            if self._intake.draining and trio.current_time() >= self._drain_deadline:
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
                epochs = self._links.epochs()
                for client_index, outputs in messages.items():
                    await self._send(client_index, outputs, epochs)
                await self._send_utility_replies()
                if step_time:
                    await trio.sleep(step_time)
                else:
                    await trio.lowlevel.checkpoint()
                continue
            if self._intake.draining and core.num_requests == 0:
                return
            with trio.move_on_at(self._drain_deadline):  # +inf unless draining
                await self._work.wait()
            self._work = trio.Event()

    async def _report_waves(self, sock: TrioSocket) -> None:
        """Tell the coordinator to start a wave, or that ours is complete."""
        report = None
        if (start := self._intake.take_start_wave()) is not None:
            report = EngineCoreOutputs(start_wave=start)
        elif self.core.num_requests == 0 and (done := self.waves.on_idle()) is not None:
            report = EngineCoreOutputs(wave_complete=done)
        if report is not None:
            report.engine_index = self.config.data_parallel_rank
            await sock.send_multipart(self._encoder.encode(report))

    async def _report_loop(self, sock: TrioSocket) -> None:
        """Tell the DP coordinator our request counts whenever they change, forever."""
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
        replies = self.core.take_utility_outputs()
        epochs = self._links.epochs()
        rank = self.config.data_parallel_rank
        for client_index, reply in replies:
            outputs = EngineCoreOutputs(engine_index=rank, utility_output=reply)
            await self._send(client_index, outputs, epochs)

    async def _send(
        self, client_index: int, outputs: EngineCoreOutputs, epochs: Sequence[int]
    ) -> None:
        message = self._encoder.encode(outputs_for(self._dialect, outputs))
        await self._links.send(client_index, message, epochs)


def addresses_for(inputs: Sequence[str], outputs: Sequence[str]) -> EngineZmqAddresses:
    """The addresses of an engine attached to clients directly (no handshake)."""
    return EngineZmqAddresses(inputs=list(inputs), outputs=list(outputs))

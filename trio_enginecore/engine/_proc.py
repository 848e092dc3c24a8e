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

**Re-attach** (attach mode only, i.e. no handshake): the engine serves successive
clients at the same addresses. A ZeroMQ socket monitor on each input DEALER, read by a
*watch task*, reports each ZMTP handshake with a client's ROUTER and each loss of that
connection; libzmq itself keeps reconnecting to the address in the background.

* A connection lost (the client closed its sockets, or its process died: the kernel
  closes them) is the client's departure: at once, in one synchronous step, its
  requests are aborted on the core, what was queued for it (outputs, utility replies)
  is dropped, its PUSH socket is replaced by a fresh one (discarding the outputs still
  queued on the old one) and its input stops being applied.
* A handshake is a client arriving: the input task first takes and drops whatever the
  departed client had sent that was not read yet (libzmq keeps a connecting socket's
  queue across connections, and all of it was queued before the departure was
  reported), then sends the ready message and applies input again. A client sends
  nothing before the ready message, so the ready message is the first thing the new
  client receives on its ROUTER, and nothing of its predecessor reaches the core.

In handshake mode the ready message is sent once, as vLLM's engines do. A headless
engine (``until_frontend_leaves``) watches its input socket the same way, and stops
serving when its frontend's connection closes, so that it can go back to the handshake
and join the next frontend (see ``serve``).
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
from ..dialects import choose_dialect
from ..errors import AddressError, EngineStartupError, ProtocolError
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
from ..serial import MsgpackDecoder, MsgpackEncoder, outputs_for, ready_for
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

CLIENT_EVENTS: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
"""What the monitor of an attach-mode input socket reports: a client's arrival (the
ZMTP handshake completed) and its departure (the connection closed)."""
STALE_INPUT_WAIT_S: Final = 0.002
"""How long the input task waits, once it found the input socket empty, before it
sends a new client the ready message (see :func:`_drop_queued_input`)."""


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
        # The release the engine presents itself as decides the form of what it
        # writes; it reads requests of every release.
        self._dialect = choose_dialect(config.vllm_version).dialect
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
        self._links: list[_ClientLink] = []
        # Per client index, how many times its client left: outputs computed before a
        # departure are not sent after it (to whoever took the index since).
        self._epochs: list[int] = []
        self._frontends: list[_ClientLink] = []
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

        Returns after :meth:`begin_drain` once no request is left, or (handshake mode,
        ``until_frontend_leaves``) as soon as the frontend's connection to the input
        socket closes: :attr:`frontend_left` then says so, and its requests are
        dropped (the engine abandons them). Cancelling it stops
        the engine at once (queued outputs are still flushed by the context's linger,
        unless :meth:`abandon` was called). It closes ``handshake_socket`` in any case.

        Raises:
            FatalEngineError: the core failed; ``ENGINE_CORE_DEAD`` was sent first.
        """
        rank = self.config.data_parallel_rank
        inputs: list[TrioSocket] = []
        # Attach mode: every client gets the ready message when it connects, and the
        # next one too once it left (see the module docstring).
        reattach = handshake_socket is None
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
            self._epochs = [0] * len(self._outputs)
            ready = self._encoder.encode(ready_for(self._dialect, self.core.ready_response()))
            for index, address in enumerate(addresses.inputs):
                if reattach:
                    output = addresses.outputs[index] if index < len(addresses.outputs) else None
                    link = self._open_link(index, address, output)
                    self._links.append(link)
                    inputs.append(link.input)
                    logger.debug(
                        "connecting to the input %s: each client there gets the ready message",
                        address,
                    )
                    continue
                if until_frontend_leaves:
                    link = self._open_link(index, address, None)
                    self._frontends.append(link)
                    sock = link.input
                else:
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
                linked = {id(link.input) for link in self._links}
                for sock in inputs:
                    if id(sock) not in linked:
                        nursery.start_soon(self._input_loop, sock)
                for link in self._links:
                    nursery.start_soon(self._watch_client, link)
                    nursery.start_soon(self._client_input_loop, link)
                for link in self._frontends:
                    nursery.start_soon(self._watch_frontend, link, nursery.cancel_scope)
                if self._coordinator is not None:
                    nursery.start_soon(self._report_loop, self._coordinator)
                await self._busy_loop()
                nursery.cancel_scope.cancel()
        except* FatalEngineError:
            self._send_engine_dead()
            raise
        finally:
            self._serving = False
            # After abandon(), nothing queued is worth a wait: linger 0.
            linger = 0 if self._abandoned else None
            for link in (*self._links, *self._frontends):
                link.close_monitor()
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

    def _open_link(self, index: int, address: str, output_address: str | None) -> _ClientLink:
        """Connect an input DEALER to ``address``, watched from before the connection."""
        sock = make_socket(
            self._ctx, zmq.DEALER, identity=identity_for_rank(self.config.data_parallel_rank)
        )
        try:
            # The monitor first, so that not even the first client's handshake is missed.
            monitor = TrioSocket(sock.raw.get_monitor_socket(CLIENT_EVENTS))
            link = _ClientLink(index, address, output_address, sock, monitor)
            try:
                if self._curve is not None and address.startswith("tcp://"):
                    self._curve.apply(sock)
                connect_address(sock, address, role="input")
            except BaseException:
                link.close_monitor()
                raise
        except BaseException:
            sock.close()
            raise
        return link

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

    async def _watch_client(self, link: _ClientLink) -> None:
        """Follow a client's arrivals and departures on its input socket's monitor."""
        while True:
            frames = await link.monitor.recv_multipart(copy_leading=2)
            event = parse_monitor_message([bytes(f) for f in frames])["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if link.connected:  # a departure libzmq did not report: cannot happen
                    self._client_departed(link)
                link.connected = True
                link.connection += 1
                link.attach_pending = True
                logger.debug("a client connected to %s", link.input_address)
                # The input task sends the ready message: it owns the input socket.
                if link.wake is not None:
                    link.wake.cancel()
            elif event == zmq.EVENT_DISCONNECTED and link.connected:
                self._client_departed(link)

    async def _watch_frontend(self, link: _ClientLink, serving: trio.CancelScope) -> None:
        """Stop serving once the frontend's connection closes (``until_frontend_leaves``)."""
        while True:
            frames = await link.monitor.recv_multipart(copy_leading=2)
            event = parse_monitor_message([bytes(f) for f in frames])["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connected = True
            elif event == zmq.EVENT_DISCONNECTED and link.connected:
                self.frontend_left = True
                logger.warning(
                    "the frontend left (its connection to %s closed): dropping its %d request(s)",
                    link.input_address,
                    self.core.num_requests,
                )
                self.abandon()
                serving.cancel()
                return

    def _client_departed(self, link: _ClientLink) -> None:
        """Forget a client that is gone (synchronous: nothing runs in between)."""
        link.connected = False
        link.attached = False
        link.attach_pending = False
        index = link.index
        aborted = self.core.forget_client(index)
        if index < len(self._epochs):
            self._epochs[index] += 1
        self._replace_output(link)
        self._work.set()
        logger.info(
            "client %d left (its connection to %s closed): aborted its %d request(s), "
            "waiting for the next client",
            index,
            link.input_address,
            aborted,
        )

    def _replace_output(self, link: _ClientLink) -> None:
        """Give the client's index a fresh PUSH socket: the outputs still queued on the
        old one were the departed client's, and must not reach the next one."""
        index = link.index
        if link.output_address is None or index >= len(self._outputs):
            return
        try:
            fresh = self._connect(
                zmq.PUSH, link.output_address, linger_ms=OUTPUT_LINGER_MS, role="output"
            )
        except (AddressError, zmq.ZMQError) as exc:  # pragma: no cover - it worked before
            logger.error(
                "could not reopen the output socket of client %d (%s): outputs queued for "
                "the departed client may reach the next one",
                index,
                exc,
            )
            return
        stale, self._outputs[index] = self._outputs[index], fresh
        stale.close(linger=0)

    async def _client_input_loop(self, link: _ClientLink) -> None:
        """The input task of an attach-mode client: apply its input while a client is
        attached, drop it otherwise, and greet each new client with the ready message."""
        sock = link.input
        while True:
            if link.attach_pending:
                await self._attach(link)
                continue
            batch: list[Frames] = []
            with trio.CancelScope() as wake:
                # The watch task cancels this wait when a client arrives. drain() is
                # atomic: cancelled, it took nothing off the socket.
                link.wake = wake
                try:
                    batch = await sock.drain(copy_leading=2)
                finally:
                    link.wake = None
            if not batch:
                continue
            if not link.attached:
                # Sent by a client that has left (or by one that did not wait for the
                # ready message): not applied.
                logger.debug("dropping %d message(s): no client attached", len(batch))
                continue
            for frames in batch:
                self._handle_input(frames)
            self._work.set()

    async def _attach(self, link: _ClientLink) -> None:
        """Greet the client that just connected with the ready message."""
        link.attach_pending = False
        connection = link.connection
        if connection > 1:
            # A client was here before. Whatever it sent that was not read yet is still
            # queued (libzmq keeps a connecting socket's queue across connections), and
            # all of it was queued before its departure was reported, so before this
            # arrival: take it off now, before the new client can send anything.
            dropped = await _drop_queued_input(link.input)
            if dropped:
                logger.info(
                    "dropped %d message(s) that the departed client %d sent before it left",
                    dropped,
                    link.index,
                )
            if link.connection != connection or not link.connected:
                return  # that client left meanwhile (or another one came): start over
        ready = self._encoder.encode(ready_for(self._dialect, self.core.ready_response()))
        # From here on input is the new client's; it sends nothing before this message.
        link.attached = True
        try:
            link.input.send_multipart_nowait(ready)
        except trio.WouldBlock:  # pragma: no cover - the DEALER's queue is unbounded
            await link.input.send_multipart(ready)
        logger.info(
            "a client attached at %s (connection %d): sent the ready message",
            link.input_address,
            connection,
        )

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
                epochs = tuple(self._epochs)
                for client_index, outputs in messages.items():
                    await self._send(client_index, outputs, epochs)
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
        replies = self.core.take_utility_outputs()
        epochs = tuple(self._epochs)
        for client_index, reply in replies:
            await self._send(
                client_index,
                EngineCoreOutputs(
                    engine_index=self.config.data_parallel_rank, utility_output=reply
                ),
                epochs,
            )

    async def _send(
        self, client_index: int, outputs: EngineCoreOutputs, epochs: Sequence[int]
    ) -> None:
        """Send to a client, unless it left since ``epochs`` was taken (when ``outputs``
        was computed): then they were the departed client's, and are dropped."""
        if not 0 <= client_index < len(self._outputs):
            logger.error("dropping outputs for unknown client index %d", client_index)
            return
        if epochs[client_index] != self._epochs[client_index]:
            return
        sock = self._outputs[client_index]
        try:
            await sock.send_multipart(self._encoder.encode(outputs_for(self._dialect, outputs)))
        except trio.ClosedResourceError:
            if sock is self._outputs[client_index]:
                raise
            # Replaced under us: its client left, and these outputs were its.

    def _send_engine_dead(self) -> None:
        for sock in self._outputs:
            if sock.closed:
                continue
            try:
                sock.raw.send(ENGINE_CORE_DEAD, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # pragma: no cover - best effort while dying
                logger.error("could not send ENGINE_CORE_DEAD: %s", exc)


class _ClientLink:
    """An attach-mode client's input socket, its monitor, and where the client is.

    Written by the watch task (arrivals, departures) and the input task (attaching);
    both run in one Trio thread, so a synchronous step of either is atomic.
    """

    __slots__ = (
        "attach_pending",
        "attached",
        "connected",
        "connection",
        "index",
        "input",
        "input_address",
        "monitor",
        "output_address",
        "wake",
    )

    def __init__(
        self,
        index: int,
        input_address: str,
        output_address: str | None,
        sock: TrioSocket,
        monitor: TrioSocket,
    ) -> None:
        self.index = index
        """The client index: its requests' ``client_index``, its output socket."""
        self.input_address = input_address
        self.output_address = output_address
        self.input = sock
        self.monitor = monitor
        self.connected = False
        """A client's connection is up (its handshake succeeded, it has not closed)."""
        self.attached = False
        """The ready message went out on the current connection: apply the input."""
        self.attach_pending = False
        """A client connected and the input task has not sent it the ready message."""
        self.connection = 0
        """How many clients connected so far."""
        self.wake: trio.CancelScope | None = None
        """The input task's wait for input, which the watch task cancels on an arrival."""

    def close_monitor(self) -> None:
        """Stop monitoring and close the monitor socket; idempotent."""
        if not self.input.closed and not self.monitor.closed:
            self.input.raw.disable_monitor()
        self.monitor.close(linger=0)


async def _drop_queued_input(sock: TrioSocket) -> int:
    """Take every message queued on ``sock`` right now off it; return how many.

    ``drain()`` always tries a non-blocking receive before it waits, so a drain that
    waits (until the deadline cancels it, having taken nothing) has found the socket
    empty, which is the end.
    """
    dropped = 0
    while True:
        with trio.CancelScope() as scope:
            # Set once inside: a deadline already past on entering would cancel the
            # scope before drain() looked at the socket. Set now, it can only take
            # effect at a checkpoint, i.e. once drain() is waiting.
            scope.deadline = trio.current_time() + STALE_INPUT_WAIT_S
            dropped += len(await sock.drain())
        if scope.cancelled_caught:
            return dropped


def addresses_for(inputs: Sequence[str], outputs: Sequence[str]) -> EngineZmqAddresses:
    """The addresses of an engine attached to clients directly (no handshake)."""
    return EngineZmqAddresses(inputs=list(inputs), outputs=list(outputs))

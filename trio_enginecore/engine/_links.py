"""The engine's connections to its frontends (the clients), one per client index.

:class:`FrontendLinks` owns every socket the engine has towards its clients: per client
index, an input DEALER (connected to the client's ROUTER) and an output PUSH
(connected to its PULL). It decides:

* **who is there** (attach mode): a ZeroMQ socket monitor on each input DEALER, read
  by a *watch task*, reports each ZMTP handshake with a client's ROUTER (an arrival)
  and each loss of that connection (a departure); libzmq itself keeps reconnecting to
  the address in the background, so the engine serves successive clients at the same
  addresses;
* **what a departure drops**, in one synchronous step: the client's requests are
  aborted on the core, what was queued for it (outputs, utility replies) is dropped,
  its PUSH socket is replaced by a fresh one (discarding the outputs still queued on
  the old one), and its input stops being applied. Outputs computed before the
  departure are not sent after it: each client index has an *epoch*, bumped at each
  departure, that a send compares with the one taken when the outputs were computed;
* **when the ready message goes out** to an arriving client: after the input task has
  taken and dropped whatever the departed client had sent that was not read yet
  (libzmq keeps a connecting socket's queue across connections, and all of it was
  queued before the departure was reported). A client sends nothing before the ready
  message, so it is the first thing the new client receives on its ROUTER, and nothing
  of its predecessor reaches the core;
* **when a headless engine's frontend has left** (``until_frontend_leaves``): its input
  socket is watched the same way, and :meth:`FrontendLinks.frontend_departure` returns
  once the connection closes; what to do then is the engine's business.

What the input *means* (decoding, the core) is not decided here: the engine passes
the batches it reads to a callback of :class:`~trio_enginecore.engine.EngineCoreProc`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from .._addresses import connect_address
from .._curve import CurveClient
from .._zmq import Frames, SendablePart, TrioSocket, make_socket
from ..errors import AddressError
from ..protocol import ENGINE_CORE_DEAD
from ._core import EngineCore

__all__ = ["FrontendConnection", "FrontendLinks", "connect_socket", "drop_queued_input"]

logger = logging.getLogger("trio_enginecore.engine")

OUTPUT_LINGER_MS: Final = 4000
"""How long queued outputs (and the ENGINE_CORE_DEAD frame) may outlive a closed PUSH
socket; the process terminates its context after Trio exits, which waits this long."""

CLIENT_EVENTS: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
"""What the monitor of a watched input socket reports: a client's arrival (the ZMTP
handshake completed) and its departure (the connection closed)."""

STALE_INPUT_WAIT_S: Final = 0.002
"""How long the input task waits, once it found the input socket empty, before it
sends a new client the ready message (see :func:`drop_queued_input`)."""


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


class FrontendConnection:
    """A watched client's input socket, its monitor, and where the client is.

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


class FrontendLinks:
    """The engine's sockets towards its clients (see the module docstring).

    Args:
        ctx: the ZeroMQ context to create sockets in.
        core: the core whose requests a departed client leaves behind.
        identity: the DEALER identity of every input socket (the engine's rank).
        curve: authenticate to the clients with CURVE on every TCP connection.
        ready_message: the ready message, encoded; asked for at each arrival.
        apply_input: applies a batch of a client's input messages to the engine.
        wake: wakes the engine's busy loop (a departure changed the core's requests).
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        core: EngineCore,
        *,
        identity: bytes,
        curve: CurveClient | None,
        ready_message: Callable[[], Sequence[SendablePart]],
        apply_input: Callable[[list[Frames]], None],
        wake: Callable[[], None],
    ) -> None:
        self._ctx = ctx
        self._core = core
        self._identity = identity
        self._curve = curve
        self._ready_message = ready_message
        self._apply_input = apply_input
        self._wake = wake
        self.outputs: list[TrioSocket] = []
        """Per client index, the PUSH socket its outputs go to."""
        self._epochs: list[int] = []
        # Per client index, how many times its client left: outputs computed before a
        # departure are not sent after it (to whoever took the index since).
        self.reattaching: list[FrontendConnection] = []
        """Attach mode: the input sockets whose successive clients each get served."""
        self.watched: list[FrontendConnection] = []
        """``until_frontend_leaves``: the input sockets whose frontend's departure ends
        the serving."""
        self._inputs: list[TrioSocket] = []

    # ----------------------------------------------------------------- opening

    def connect(
        self, socket_type: int, address: str, *, linger_ms: int = 0, role: str = ""
    ) -> TrioSocket:
        """A socket of the engine connected to ``address`` (CURVE as configured)."""
        return connect_socket(
            self._ctx, socket_type, address, curve=self._curve, linger_ms=linger_ms, role=role
        )

    def open_outputs(self, addresses: Sequence[str]) -> None:
        """Connect one PUSH socket per client index."""
        for address in addresses:
            self.outputs.append(
                self.connect(zmq.PUSH, address, linger_ms=OUTPUT_LINGER_MS, role="output")
            )
        self._epochs = [0] * len(self.outputs)

    def open_input(self, address: str) -> TrioSocket:
        """An input DEALER connected to ``address``, not watched (handshake mode)."""
        sock = connect_socket(
            self._ctx, zmq.DEALER, address, curve=self._curve, identity=self._identity, role="input"
        )
        self._inputs.append(sock)
        return sock

    def open_reattaching(
        self, index: int, address: str, output_address: str | None
    ) -> FrontendConnection:
        """A watched input DEALER whose every arriving client gets the ready message;
        serve it with :meth:`serve_client`."""
        link = self._open_watched(index, address, output_address)
        self.reattaching.append(link)
        return link

    def open_frontend(self, index: int, address: str) -> FrontendConnection:
        """A watched input DEALER whose departure :meth:`frontend_departure` reports."""
        link = self._open_watched(index, address, None)
        self.watched.append(link)
        return link

    def _open_watched(
        self, index: int, address: str, output_address: str | None
    ) -> FrontendConnection:
        sock = make_socket(self._ctx, zmq.DEALER, identity=self._identity)
        try:
            # The monitor first, so that not even the first client's handshake is missed.
            monitor = TrioSocket(sock.raw.get_monitor_socket(CLIENT_EVENTS))
            link = FrontendConnection(index, address, output_address, sock, monitor)
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
        self._inputs.append(sock)
        return link

    def close(self, linger: int | None) -> None:
        """Close every socket opened here (``linger`` None: each socket's own)."""
        for link in (*self.reattaching, *self.watched):
            link.close_monitor()  # before its input socket: disabling needs it open
        for sock in (*self._inputs, *self.outputs):
            sock.close(linger=linger)

    # ----------------------------------------------------------------- outputs

    def epochs(self) -> tuple[int, ...]:
        """The epochs now: take them when computing outputs, give them to :meth:`send`."""
        return tuple(self._epochs)

    async def send(
        self, client_index: int, message: Sequence[SendablePart], epochs: Sequence[int]
    ) -> None:
        """Send to a client, unless it left since ``epochs`` was taken (when ``message``
        was computed): then it was the departed client's, and is dropped.

        Cancelled, the message may or may not have been queued (``send_multipart``).
        """
        if not 0 <= client_index < len(self.outputs):
            logger.error("dropping outputs for unknown client index %d", client_index)
            return
        if epochs[client_index] != self._epochs[client_index]:
            return
        sock = self.outputs[client_index]
        try:
            await sock.send_multipart(message)
        except trio.ClosedResourceError:
            if sock is self.outputs[client_index]:
                raise
            # Replaced under us: its client left, and these outputs were its.

    def send_engine_dead(self) -> None:
        """Tell every client the engine is dead (best effort, never blocks)."""
        for sock in self.outputs:
            if sock.closed:
                continue
            try:
                sock.send_multipart_nowait([ENGINE_CORE_DEAD])
            except (trio.WouldBlock, zmq.ZMQError) as exc:  # pragma: no cover - while dying
                logger.error("could not send ENGINE_CORE_DEAD: %r", exc)

    # ------------------------------------------------------ attach mode clients

    async def serve_client(self, link: FrontendConnection) -> None:
        """Serve the successive clients of a re-attaching input socket, forever.

        Cancel it to stop; nothing is left half-done: arrivals and departures are
        synchronous steps, and a cancelled read takes nothing off the socket.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_client, link)
            await self._client_input_loop(link)

    async def _watch_client(self, link: FrontendConnection) -> None:
        """Follow a client's arrivals and departures on its input socket's monitor."""
        while True:
            event = await _next_event(link)
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

    def _client_departed(self, link: FrontendConnection) -> None:
        """Forget a client that is gone (synchronous: nothing runs in between)."""
        link.connected = False
        link.attached = False
        link.attach_pending = False
        index = link.index
        aborted = self._core.forget_client(index)
        if index < len(self._epochs):
            self._epochs[index] += 1
        self._replace_output(link)
        self._wake()
        logger.info(
            "client %d left (its connection to %s closed): aborted its %d request(s), "
            "waiting for the next client",
            index,
            link.input_address,
            aborted,
        )

    def _replace_output(self, link: FrontendConnection) -> None:
        """Give the client's index a fresh PUSH socket: the outputs still queued on the
        old one were the departed client's, and must not reach the next one."""
        index = link.index
        if link.output_address is None or index >= len(self.outputs):
            return
        try:
            fresh = self.connect(
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
        stale, self.outputs[index] = self.outputs[index], fresh
        stale.close(linger=0)

    async def _client_input_loop(self, link: FrontendConnection) -> None:
        """Apply a client's input while a client is attached, drop it otherwise, and
        greet each new client with the ready message."""
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
            self._apply_input(batch)

    async def _attach(self, link: FrontendConnection) -> None:
        """Greet the client that just connected with the ready message."""
        link.attach_pending = False
        connection = link.connection
        if connection > 1:
            # A client was here before. Whatever it sent that was not read yet is still
            # queued (libzmq keeps a connecting socket's queue across connections), and
            # all of it was queued before its departure was reported, so before this
            # arrival: take it off now, before the new client can send anything.
            dropped = await drop_queued_input(link.input)
            if dropped:
                logger.info(
                    "dropped %d message(s) that the departed client %d sent before it left",
                    dropped,
                    link.index,
                )
            if link.connection != connection or not link.connected:
                return  # that client left meanwhile (or another one came): start over
        ready = self._ready_message()
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

    # --------------------------------------------------------- headless frontend

    async def frontend_departure(self, link: FrontendConnection) -> None:
        """Return once the frontend's connection to ``link``'s input closes (after it
        was up). Cancelling it has no effect but to stop watching."""
        while True:
            event = await _next_event(link)
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connected = True
            elif event == zmq.EVENT_DISCONNECTED and link.connected:
                link.connected = False
                return


async def _next_event(link: FrontendConnection) -> int:
    """The next event of ``link``'s monitor (one of :data:`CLIENT_EVENTS`)."""
    frames = await link.monitor.recv_multipart(copy_leading=2)
    event: int = parse_monitor_message([bytes(f) for f in frames])["event"]
    return event


async def drop_queued_input(sock: TrioSocket) -> int:
    """Take every message queued on ``sock`` right now off it; return how many.

    ``drain()`` always tries a non-blocking receive before it waits, so a drain that
    waits (until the deadline cancels it, having taken nothing) has found the socket
    empty, which is the end. Cancelled, it took some of them off (none is half-taken).
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

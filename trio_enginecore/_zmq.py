"""A Trio-native wrapper around a pyzmq socket.

pyzmq gives us non-blocking ``send``/``recv`` and one file descriptor per socket
(``ZMQ_FD``). That descriptor is awkward to wait on:

* it is the socket's internal command mailbox, not a data channel: it becomes *readable*
  when the socket's state *may* have changed, in either direction (it is always writable,
  so waiting for writability would spin);
* it is edge-triggered, and *any* call into the socket (send, recv, reading
  ``ZMQ_EVENTS``, bind/connect) may process the pending commands and so consume the edge
  another task is sleeping on;
* a readable fd does not mean a message is there (spurious wake-ups are normal).

:class:`TrioSocket` turns that into Trio semantics: every async method is a checkpoint and
is atomic with respect to cancellation, one task at a time may receive, any number may
send, and closing wakes every waiter with :class:`trio.ClosedResourceError`.

Waiting works like this. A task whose non-blocking operation raised ``zmq.Again`` reads
``ZMQ_EVENTS``; if its flag (``POLLIN`` to receive, ``POLLOUT`` to send) is set it retries
at once, otherwise it goes to sleep. Trio allows only one task in ``wait_readable`` per fd,
so the first sleeper *watches* the fd and later ones park on a :class:`ParkingLot`; when the
watcher wakes up for any reason it unparks everybody so that they all re-read ``ZMQ_EVENTS``
(the edge belongs to all of them) and one becomes the new watcher. Whoever touches the
socket while others sleep re-reads ``ZMQ_EVENTS`` afterwards and wakes the sleepers whose
flag is now set, because its call may have consumed the edge they were sleeping on. While
nobody sleeps this costs nothing: the fast path never reads ``ZMQ_EVENTS``.

This module is private; the engine client builds on it.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar, cast, final

import trio
import zmq

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType

    import numpy as np

    if sys.version_info >= (3, 12):
        from collections.abc import Buffer
    else:
        from typing_extensions import Buffer

__all__ = ["Frames", "SendablePart", "TrioSocket", "TrioSocketStatistics", "make_socket"]

Frames: TypeAlias = list[bytes | memoryview]
"""One multipart message as received: leading frames as ``bytes``, the rest zero-copy."""

# numpy's stubs only declare ``__buffer__`` for Python >= 3.12, so arrays are named here
# for type checkers on 3.11; at run time pyzmq takes anything with the buffer protocol.
SendablePart: TypeAlias = "Buffer | np.ndarray[Any, Any]"
"""One frame to send: ``bytes``, ``memoryview``, a numpy array, any other buffer."""

_T = TypeVar("_T")

_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)
_NOBLOCK: Final = int(zmq.NOBLOCK)
_EVENTS: Final = int(zmq.EVENTS)
_RCVMORE: Final = int(zmq.RCVMORE)
_SRCFD: Final = int(zmq.SRCFD)
_SNDMORE_NOBLOCK: Final = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
# pyzmq's own frame send, under the Python layer whose send_multipart re-checks each
# frame's type and combines enum flags per frame: measured 0.5 us against 3.2 us for a
# three-frame message (every request and utility call is one).
_send_frame: Callable[..., object] = zmq.backend.Socket.send


def _send_frames(sock: zmq.Socket[bytes], parts: Sequence[Buffer], copy: bool) -> None:
    """Send one multipart message without blocking (``zmq.Again`` if it cannot be
    queued; libzmq queues a multipart message atomically: EAGAIN can only come before
    the first frame is accepted)."""
    last = len(parts) - 1
    for index, part in enumerate(parts):
        _send_frame(sock, part, _SNDMORE_NOBLOCK if index < last else _NOBLOCK, copy)


# When an operation fails right after ZMQ_EVENTS said it would succeed (a ROUTER with
# ROUTER_MANDATORY reports POLLOUT if *any* peer can take a message, yet a send to a full
# peer raises EAGAIN), ZMQ_EVENTS cannot tell us when to retry. We then sleep until the fd
# fires or this much time has passed, whichever comes first, instead of spinning.
_DISTRUSTED_RETRY_INTERVAL: Final = 0.005


@final
@dataclasses.dataclass(frozen=True, slots=True)
class TrioSocketStatistics:
    """A snapshot of a :class:`TrioSocket`'s state, for debugging and tests.

    Attributes:
        closed: whether :meth:`TrioSocket.close` was called.
        receiving: whether a task is inside ``recv_multipart`` or ``drain``.
        tasks_waiting_receive: tasks (0 or 1) waiting for a message to arrive.
        tasks_waiting_send: tasks waiting for the socket to accept a message.
    """

    closed: bool
    receiving: bool
    tasks_waiting_receive: int
    tasks_waiting_send: int


@final
class TrioSocket:
    """A pyzmq socket driven from Trio without threads.

    The wrapper takes ownership of the socket: from now on only the wrapper sends,
    receives and closes it. Synchronous configuration (``setsockopt``, ``subscribe``,
    ``bind``, ``connect``...) may still be done through :attr:`raw`; prefer
    :meth:`bind` and :meth:`connect` while other tasks use the socket, because they
    re-check readiness afterwards (bind and connect process the socket's pending
    commands and can swallow a wake-up).

    Concurrency: one task at a time may receive (:meth:`recv_multipart` or
    :meth:`drain`; a second one gets :class:`trio.BusyResourceError`), any number of
    tasks may send at the same time, including while another task receives.

    Every async method is a Trio checkpoint (a cancel point and a schedule point) even
    when it does not need to wait, and is atomic with respect to cancellation: it either
    completes or raises :class:`trio.Cancelled` having done nothing (no message taken
    off the socket, none sent, not even partly).

    Args:
        sock: the socket to wrap. It must be open and must not be used directly
            afterwards (except for synchronous configuration through :attr:`raw`).
    """

    __slots__ = (
        "_closed",
        "_fd",
        "_lot",
        "_parked_recv",
        "_parked_send",
        "_receiving",
        "_sock",
        "_waiting_recv",
        "_waiting_send",
        "_watch_flag",
        "_watch_scope",
    )

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock: Final = sock
        # Cached because reading FD on a closed socket raises, and close() still needs it.
        self._fd: Final = sock.fileno()
        self._closed = False
        self._receiving = False
        # The single task allowed in wait_readable(fd), and the flag it waits for (0 when
        # it does not trust ZMQ_EVENTS, so that nobody wakes it on the flag's account).
        self._watch_scope: trio.CancelScope | None = None
        self._watch_flag = 0
        # Everybody else sleeps here; counters only include tasks that trust ZMQ_EVENTS.
        self._lot: Final = trio.lowlevel.ParkingLot()
        self._parked_recv = 0
        self._parked_send = 0
        # Tasks in the slow path, for statistics() only.
        self._waiting_recv = 0
        self._waiting_send = 0

    # ----------------------------------------------------------------- properties

    @property
    def raw(self) -> zmq.Socket[bytes]:
        """The wrapped pyzmq socket.

        Only synchronous configuration calls may be made on it (socket options,
        ``bind``, ``connect``, ``subscribe``...). Never send, receive, poll, read
        ``EVENTS`` or close through it: that would bypass the wake-up bookkeeping and
        could strand a waiting task or lose a message.
        """
        return self._sock

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def statistics(self) -> TrioSocketStatistics:
        """Return a snapshot of who is using the socket right now."""
        return TrioSocketStatistics(
            closed=self._closed,
            receiving=self._receiving,
            tasks_waiting_receive=self._waiting_recv,
            tasks_waiting_send=self._waiting_send,
        )

    # ------------------------------------------------------------ configuration

    def bind(self, addr: str) -> str:
        """Bind the socket to ``addr`` and return the endpoint actually bound.

        The returned string is ``ZMQ_LAST_ENDPOINT``, so ``tcp://127.0.0.1:*`` comes back
        with the chosen port.

        Raises:
            trio.ClosedResourceError: the socket was closed.
            zmq.ZMQError: libzmq refused the address.
        """
        self._check_open()
        self._sock.bind(addr)
        self._after_op()
        endpoint = self._sock.get(zmq.LAST_ENDPOINT)
        return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)

    def connect(self, addr: str) -> None:
        """Connect the socket to ``addr`` (the peer need not exist yet).

        Raises:
            trio.ClosedResourceError: the socket was closed.
            zmq.ZMQError: libzmq refused the address.
        """
        self._check_open()
        self._sock.connect(addr)
        self._after_op()

    # ------------------------------------------------------------------- sending

    async def send_multipart(self, parts: Sequence[SendablePart], *, copy: bool = False) -> None:
        """Send one multipart message, waiting while the socket cannot accept it.

        With the options set by :func:`make_socket` (unbounded queues) this only waits
        when the socket has no peer to send to (e.g. a PUSH or DEALER nobody connected
        to yet).

        Args:
            parts: the frames; anything supporting the buffer protocol.
            copy: passed to pyzmq. With ``False`` (the default) frames of at least
                ``zmq.COPY_THRESHOLD`` bytes are sent without copying, so the caller must
                not modify such a buffer afterwards; smaller frames are copied anyway.

        Cancellation:
            Atomic. If :class:`trio.Cancelled` is raised, no part of the message was
            queued; if the call returns, the whole message was queued. It is always a
            checkpoint.

        Raises:
            ValueError: ``parts`` is empty.
            trio.ClosedResourceError: the socket was closed before or during the call.
            zmq.ZMQError: any other libzmq error (e.g. ``EHOSTUNREACH`` from a ROUTER
                with ``ROUTER_MANDATORY``); then nothing was sent.
        """
        self._check_open()
        if not parts:
            raise ValueError("a message needs at least one frame")
        await trio.lowlevel.checkpoint_if_cancelled()
        sock = self._sock
        buffers = cast("Sequence[Buffer]", parts)
        try:
            # libzmq queues a multipart message atomically: EAGAIN can only come before
            # the first frame is accepted (a later failure rolls the earlier frames back).
            _send_frames(sock, buffers, copy)
        except zmq.Again:
            pass
        else:
            self._after_op()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return

        def attempt() -> None:
            _send_frames(sock, buffers, copy)

        self._waiting_send += 1
        try:
            await self._retry_until_done(_POLLOUT, attempt)
        finally:
            self._waiting_send -= 1

    def send_multipart_nowait(self, parts: Sequence[SendablePart], *, copy: bool = False) -> None:
        """Send one multipart message if the socket can take it right now.

        The synchronous twin of :meth:`send_multipart`, for callers that must do several
        sends with no checkpoint in between (to stay atomic with respect to
        cancellation). With unbounded queues (:func:`make_socket`) a ROUTER never
        refuses: it queues, or drops a message for an unknown peer.

        Raises:
            trio.WouldBlock: the socket cannot take the message now; nothing was sent.
            ValueError: ``parts`` is empty.
            trio.ClosedResourceError: the socket was closed.
            zmq.ZMQError: any other libzmq error; then nothing was sent.
        """
        self._check_open()
        if not parts:
            raise ValueError("a message needs at least one frame")
        try:
            _send_frames(self._sock, cast("Sequence[Buffer]", parts), copy)
        except zmq.Again:
            raise trio.WouldBlock from None
        self._after_op()

    # ----------------------------------------------------------------- receiving

    async def recv_multipart(self, *, copy_leading: int = 1) -> Frames:
        """Receive one whole multipart message, waiting until one arrives.

        Args:
            copy_leading: how many leading frames to copy into ``bytes`` (copying is
                faster for small frames such as routing ids and msgpack headers). The
                remaining frames are returned without copying as the ``memoryview``
                of the received ``zmq.Frame``, which keeps the frame's memory alive.

        Returns:
            The frames, in order.

        Cancellation:
            Atomic. If :class:`trio.Cancelled` is raised, no message was taken off the
            socket (the next receive gets it); if the call returns, exactly one message
            was taken. It is always a checkpoint.

        Raises:
            ValueError: ``copy_leading`` is negative.
            trio.BusyResourceError: another task is already receiving on this socket.
            trio.ClosedResourceError: the socket was closed before or during the call.
            zmq.ZMQError: any other libzmq error.
        """
        return await self._receive(self._recv_one_op(copy_leading))

    async def recv_multipart_with_source(self) -> tuple[Frames, int]:
        """Receive one whole multipart message, as :meth:`recv_multipart` with its
        first frame copied, and the file descriptor of the connection it came on
        (libzmq's ``ZMQ_SRCFD``): what a socket monitor's connection events name.

        Cancellation, and the errors raised: as :meth:`recv_multipart`.
        """
        sock = self._sock

        def recv_one() -> tuple[Frames, int]:
            first = sock.recv(_NOBLOCK, copy=False)
            fd = int(first.get(_SRCFD))
            parts: Frames = [first.bytes]
            more: object = first.more
            try:
                while more:
                    frame = sock.recv(_NOBLOCK, copy=False)
                    parts.append(frame.buffer)
                    more = frame.more
            except zmq.Again:
                raise RuntimeError("libzmq delivered an incomplete multipart message") from None
            return parts, fd

        return await self._receive(recv_one)

    async def drain(self, max_messages: int = 256, *, copy_leading: int = 1) -> list[Frames]:
        """Receive every message available right now, waiting until there is one.

        This is the batched receive: one checkpoint per batch instead of one per message,
        and no wait at all while messages keep coming.

        Args:
            max_messages: the largest batch to return; at least 1. A full batch does not
                mean the socket is empty.
            copy_leading: as for :meth:`recv_multipart`, per message.

        Returns:
            Between 1 and ``max_messages`` messages, in arrival order.

        Cancellation:
            Atomic. If :class:`trio.Cancelled` is raised, no message was taken off the
            socket; if the call returns, the returned messages (and only those) were
            taken. It is always a checkpoint.

        Raises:
            ValueError: ``max_messages`` is less than 1 or ``copy_leading`` is negative.
            trio.BusyResourceError: another task is already receiving on this socket.
            trio.ClosedResourceError: the socket was closed before or during the call.
            zmq.ZMQError: any other libzmq error before the first message was taken (an
                error after that ends the batch early and will normally recur on the next
                call).
        """
        if max_messages < 1:
            raise ValueError(f"max_messages must be at least 1, got {max_messages}")
        recv_one = self._recv_one_op(copy_leading)

        def recv_batch() -> list[Frames]:
            batch: list[Frames] = []
            try:
                while len(batch) < max_messages:
                    batch.append(recv_one())
            except zmq.ZMQError:
                # Messages already taken off the socket must reach the caller: returning
                # them is the only way not to lose them.
                if not batch:
                    raise
            return batch

        return await self._receive(recv_batch)

    def _recv_one_op(self, copy_leading: int) -> Callable[[], Frames]:
        """Build the non-blocking "take one message" operation; raises ``zmq.Again``."""
        if copy_leading < 0:
            raise ValueError(f"copy_leading must not be negative, got {copy_leading}")
        sock = self._sock

        def recv_one() -> Frames:
            parts: Frames = []
            more: object = True
            try:
                while more:
                    if len(parts) < copy_leading:
                        parts.append(sock.recv(_NOBLOCK))
                        more = sock.get(_RCVMORE)
                    else:
                        frame = sock.recv(_NOBLOCK, copy=False)
                        parts.append(frame.buffer)
                        more = frame.more
            except zmq.Again:
                if not parts:
                    raise
                # libzmq delivers multipart messages atomically; if that ever breaks we
                # must not report "nothing received" after taking frames off the socket.
                raise RuntimeError("libzmq delivered an incomplete multipart message") from None
            return parts

        return recv_one

    async def _receive(self, op: Callable[[], _T]) -> _T:
        self._check_open()
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this socket")
        self._receiving = True
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                result = op()
            except zmq.Again:
                pass
            else:
                self._after_op()
                await trio.lowlevel.cancel_shielded_checkpoint()
                return result
            self._waiting_recv += 1
            try:
                return await self._retry_until_done(_POLLIN, op)
            finally:
                self._waiting_recv -= 1
        finally:
            self._receiving = False

    # ------------------------------------------------------------------- closing

    def close(self, linger: int | None = None) -> None:
        """Close the socket; idempotent.

        Every task waiting in a method of this object wakes up with
        :class:`trio.ClosedResourceError`, and later calls raise it at once. A message
        already returned to a caller stays valid (zero-copy frames keep their memory).

        Args:
            linger: milliseconds libzmq may keep trying to deliver queued outgoing
                messages in the background; ``None`` keeps the socket's ``LINGER``
                option (:func:`make_socket` sets 0, i.e. drop them). Closing never
                blocks, whatever the value.
        """
        if self._closed:
            return
        self._closed = True
        # Waiters must be woken before the socket (and with it the fd) goes away: once
        # libzmq closes the fd, the kernel silently forgets the registration and a task
        # in wait_readable would sleep forever. No checkpoint may come in between.
        if trio.lowlevel.in_trio_run():
            trio.lowlevel.notify_closing(self._fd)
            # The watcher would pass the news on to the parked tasks anyway; waking them
            # here does not depend on that.
            self._lot.unpark_all()
        self._sock.close(linger=linger)

    def __enter__(self) -> TrioSocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ waiting

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this socket was closed")

    def _after_op(self) -> None:
        """Wake sleepers whose event our socket call may have swallowed (free if none)."""
        if self._watch_flag or self._parked_recv or self._parked_send:
            self._read_events()

    def _read_events(self) -> int:
        """Read ZMQ_EVENTS and wake every sleeper whose condition it shows as true.

        Reading ZMQ_EVENTS processes the socket's pending commands and so resets the fd:
        anybody sleeping on it for a condition that now holds would not be woken again.
        """
        events = cast("int", self._sock.get(_EVENTS))
        if events & self._watch_flag:
            assert self._watch_scope is not None
            self._watch_scope.cancel()
        if (events & _POLLIN and self._parked_recv) or (events & _POLLOUT and self._parked_send):
            self._lot.unpark_all()
        return events

    async def _retry_until_done(self, flag: int, op: Callable[[], _T]) -> _T:
        """Slow path, entered after ``op`` raised ``zmq.Again``: wait and retry until done.

        Cancellation can only be raised while sleeping, i.e. while ``op`` has not
        succeeded; ``op`` succeeding is followed by no checkpoint except a shielded one.
        """
        slept = False
        # True when the last failed attempt was made only because ZMQ_EVENTS showed
        # ``flag``: then ZMQ_EVENTS cannot be trusted and we must really sleep.
        tried_on_events = False
        while True:
            self._check_open()
            events = self._read_events()
            if events & flag and not tried_on_events:
                tried_on_events = True
            else:
                await self._sleep(flag, trust_events=not tried_on_events)
                slept = True
                tried_on_events = False
                self._check_open()
            try:
                result = op()
            except zmq.Again:
                continue
            self._after_op()
            if not slept:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return result

    async def _sleep(self, flag: int, *, trust_events: bool) -> None:
        """Sleep until the fd fires, another task wakes us, or the socket is closed.

        The caller has just read ZMQ_EVENTS (which resets the fd), so any later change of
        state makes the fd readable again and wakes the watcher, who then wakes everyone.
        A task that does not trust ZMQ_EVENTS for ``flag`` is not counted as waiting for
        it (so that tasks seeing ``flag`` set do not keep waking it) and also wakes up
        after a short interval.
        """
        if self._watch_scope is None:
            with trio.CancelScope() as scope:
                if not trust_events:
                    scope.deadline = trio.current_time() + _DISTRUSTED_RETRY_INTERVAL
                self._watch_scope = scope
                self._watch_flag = flag if trust_events else 0
                try:
                    await trio.lowlevel.wait_readable(self._fd)
                finally:
                    self._watch_scope = None
                    self._watch_flag = 0
                    # The edge (or the wake-up) was meant for every sleeper: let them all
                    # re-read ZMQ_EVENTS, and one of them take over the fd.
                    self._lot.unpark_all()
            return
        if not trust_events:
            with trio.move_on_after(_DISTRUSTED_RETRY_INTERVAL):
                await self._lot.park()
            return
        if flag == _POLLIN:
            self._parked_recv += 1
            try:
                await self._lot.park()
            finally:
                self._parked_recv -= 1
        else:
            self._parked_send += 1
            try:
                await self._lot.park()
            finally:
                self._parked_send -= 1


def make_socket(
    ctx: zmq.Context[Any],
    socket_type: int,
    *,
    identity: bytes | None = None,
    linger_ms: int = 0,
    max_message_size: int | None = None,
) -> TrioSocket:
    """Create a socket with vLLM's options and wrap it in a :class:`TrioSocket`.

    Like vLLM's ``make_zmq_socket``, the high-water marks are 0 (unbounded queues):
    sends to a connected peer never wait and nothing is dropped for being over a limit;
    memory is the only bound. Bind or connect the result with :meth:`TrioSocket.bind` /
    :meth:`TrioSocket.connect`.

    Args:
        ctx: the context to create the socket in.
        socket_type: ``zmq.ROUTER``, ``zmq.DEALER``, ``zmq.PUSH``, ``zmq.PULL``...
        identity: the routing id (``ZMQ_IDENTITY``) to present to a ROUTER peer.
        linger_ms: ``ZMQ_LINGER``: how long queued outgoing messages may outlive
            :meth:`TrioSocket.close`; 0 drops them, so that terminating the context
            never blocks.
        max_message_size: ``ZMQ_MAXMSGSIZE``: a peer sending a larger message is
            disconnected. ``None`` leaves libzmq's default (no limit).

    Raises:
        zmq.ZMQError: libzmq rejected the socket type or an option (e.g. an empty
            identity); the socket is then closed.
    """
    sock: zmq.Socket[bytes] = ctx.socket(socket_type)
    try:
        sock.set(zmq.SNDHWM, 0)
        sock.set(zmq.RCVHWM, 0)
        sock.set(zmq.LINGER, linger_ms)
        if identity is not None:
            sock.set(zmq.IDENTITY, identity)
        if max_message_size is not None:
            sock.set(zmq.MAXMSGSIZE, max_message_size)
    except BaseException:
        sock.close(linger=0)
        raise
    return TrioSocket(sock)

"""Listening sockets bound by another process and handed to the client as descriptors.

A supervisor (a process manager, a launcher holding privileged ports, a test harness)
may bind and ``listen()`` the client's two server sockets itself and pass the client
only their file descriptors. ZeroMQ can take such a socket over: with the socket option
``ZMQ_USE_FD`` set, the next ``bind`` accepts connections on that descriptor instead of
creating a socket of its own. The address given to that ``bind`` must be the one the
descriptor is bound to, so it is read from the descriptor (``getsockname``) rather than
trusted from anyone.

Ownership is all or nothing and moves only once every socket of the client is bound:
:func:`bind_all` first checks every descriptor, then binds (ZeroMQ gets a duplicate of
each descriptor, never the caller's), and only when all the binds succeeded closes the
caller's descriptors. Any failure before that point leaves them open and untouched.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Sequence
from typing import Final, cast, final

import attrs
import zmq

from ._addresses import bind_address
from ._zmq import TrioSocket
from .errors import AddressError

__all__ = ["ListenerFd", "bind_all"]

# SO_ACCEPTCONN is missing on a few platforms; there the listen() check is skipped and
# a socket that does not listen is found out when no engine can connect.
_SO_ACCEPTCONN: Final[int | None] = getattr(socket, "SO_ACCEPTCONN", None)

_FAMILY_NAMES: Final[dict[int, str]] = {
    socket.AF_INET: "IPv4",
    socket.AF_INET6: "IPv6",
    socket.AF_UNIX: "Unix-domain",
}


@final
@attrs.frozen
class ListenerFd:
    """A listening socket, bound by another process, that the client adopts by descriptor.

    Pass it as ``input_address`` or ``output_address`` (of
    :func:`~trio_enginecore.open_engine_client`,
    :func:`~trio_enginecore.connect_engine_client` or
    :class:`~trio_enginecore.SyncMPClient`) instead of an address string: the client then
    accepts the engines' connections on that socket instead of binding one itself
    (ZeroMQ's ``ZMQ_USE_FD``). The socket must be a stream socket, TCP (IPv4 or IPv6) or
    Unix-domain, already bound and listening; the client reads the address it is bound
    to from the socket, and the engine connects to that address as usual. Creating a
    ``ListenerFd`` checks nothing but the number: the descriptor is inspected when a
    client starts (or when :meth:`address` is called).

    **Who closes the descriptor.** The client takes it over once its sockets are bound:
    the descriptor is then closed, and the listening socket lives on inside the client
    (on a duplicate) until the client closes; a failure later in the startup (no engine
    ready in time, say) closes it with the client. If the startup fails before the
    sockets are bound (a descriptor that is not a listening socket, the other address
    refused, a wrong argument), the descriptor is left open and untouched: it is still
    yours, to close or to pass again. Once handed over, do not use, close or pass on the
    number: it may be reused for another file.

    The client's copy is made non-blocking (a flag the copies in other processes share)
    and is not inherited by the processes it starts. A Unix-domain socket's file is left
    in place when the client closes: removing it is the job of whoever bound it.

    Attributes:
        fd: the descriptor's number in this process, e.g. one inherited from the
            supervisor (``subprocess.Popen(..., pass_fds=[fd])``) or
            ``sock.detach()`` of a ``socket.socket`` you bound.
    """

    fd: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])

    def address(self) -> str:
        """The ZeroMQ address the socket is bound to, read from it now:
        ``tcp://HOST:PORT`` for TCP, ``ipc://PATH`` (``ipc://@NAME`` in Linux's abstract
        namespace) for a Unix-domain socket.

        Raises:
            AddressError: the descriptor is not open, not a socket, not a stream socket
                of a supported family, or not listening; the message names it.
        """
        return _inspect(self, role="").address


@attrs.frozen
class _Listening:
    """What :func:`_inspect` learnt about a descriptor."""

    address: str
    family: int
    identity: tuple[int, int]  # (st_dev, st_ino): the same socket under two numbers


def _refusal(listener: ListenerFd, role: str, reason: str) -> AddressError:
    return AddressError(repr(listener), f"file descriptor {listener.fd} {reason}", role=role)


def _zmq_address(listener: ListenerFd, role: str, family: int, name: object) -> str:
    if family in (socket.AF_INET, socket.AF_INET6):
        host, port = cast("tuple[str, int]", name)[:2]
        return f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"
    if isinstance(name, bytes):
        if name.startswith(b"\0"):
            return f"ipc://@{os.fsdecode(name[1:])}"
        name = os.fsdecode(name)
    if not isinstance(name, str) or not name:
        raise _refusal(listener, role, "is a Unix-domain socket bound to no path")
    return f"ipc://{name}"


def _name(enum: type[socket.AddressFamily | socket.SocketKind], value: int) -> str:
    try:
        return enum(value).name
    except ValueError:
        return str(value)


def _inspect(listener: ListenerFd, role: str) -> _Listening:
    """Check that ``listener`` is a listening stream socket and read its address.

    The descriptor is only looked at: it stays open, and its flags are unchanged.
    """
    try:
        info = os.fstat(listener.fd)
    except OSError as exc:
        if exc.errno == errno.EBADF:
            raise _refusal(listener, role, "is not open") from None
        raise _refusal(listener, role, f"cannot be inspected: {exc.strerror}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise _refusal(listener, role, "is not a socket")
    try:
        sock = socket.socket(fileno=listener.fd)
    except OSError as exc:
        raise _refusal(listener, role, f"cannot be inspected: {exc.strerror}") from None
    try:
        family, kind = int(sock.family), int(sock.type)
        if family not in _FAMILY_NAMES:
            raise _refusal(
                listener,
                role,
                f"is a socket of an unsupported family ({_name(socket.AddressFamily, family)}): "
                "the client adopts TCP (IPv4, IPv6) and Unix-domain listeners",
            )
        if kind != socket.SOCK_STREAM:
            raise _refusal(
                listener,
                role,
                f"is a {_name(socket.SocketKind, kind)} socket ({_FAMILY_NAMES[family]}), "
                "not a stream socket (SOCK_STREAM)",
            )
        if _SO_ACCEPTCONN is not None and not sock.getsockopt(socket.SOL_SOCKET, _SO_ACCEPTCONN):
            raise _refusal(
                listener, role, "is not listening: bind it and call listen() before handing it over"
            )
        name: object = sock.getsockname()
        address = _zmq_address(listener, role, family, name)
    finally:
        # The socket object only borrowed the descriptor: never close the caller's.
        sock.detach()
    return _Listening(address=address, family=family, identity=(info.st_dev, info.st_ino))


def _adopt(
    sock: TrioSocket, listener: ListenerFd, listening: _Listening, role: str
) -> tuple[str, int]:
    """Make ``sock`` accept on a duplicate of ``listener``'s descriptor; return the bound
    endpoint and the duplicate. ``listener.fd`` itself stays open: :func:`bind_all`
    closes it."""
    copy = os.dup(listener.fd)  # not inheritable, as every descriptor Python creates
    try:
        if listening.family == socket.AF_INET6:
            # Newer libzmq resolves the bind address even when adopting a socket, and
            # resolves IPv6 literals only with ZMQ_IPV6 set.
            sock.raw.set(zmq.IPV6, 1)
        sock.raw.set(zmq.USE_FD, copy)
        where = f"{role}, {listener!r}" if role else repr(listener)
        return bind_address(sock, listening.address, role=where), copy
    except BaseException:
        # ZeroMQ takes the descriptor over only when the bind succeeds.
        os.close(copy)
        raise


def bind_all(bindings: Sequence[tuple[TrioSocket, str | ListenerFd, str]]) -> list[str]:
    """Bind each ``(socket, address or listener, role)``; return the endpoints bound.

    Every :class:`ListenerFd` is checked before anything is bound. The callers'
    descriptors are closed only once every socket is bound; if any check or bind fails,
    they are all left open (the sockets bound so far are the caller's to close).

    Raises:
        AddressError: an address ZeroMQ refused, or a descriptor that is not a listening
            stream socket (or is given twice); ``role`` says which socket it was for.
        trio.ClosedResourceError: a socket was closed.
    """
    checked: dict[int, _Listening] = {}
    seen: dict[tuple[int, int], ListenerFd] = {}
    for index, (_, where, role) in enumerate(bindings):
        if isinstance(where, ListenerFd):
            listening = _inspect(where, role)
            if listening.identity in seen:
                raise _refusal(
                    where,
                    role,
                    f"is the listening socket already given as {seen[listening.identity]!r}: "
                    "each socket needs a listener of its own",
                )
            seen[listening.identity] = where
            checked[index] = listening
    bound: list[str] = []
    copies: list[int] = []
    for index, (sock, where, role) in enumerate(bindings):
        if isinstance(where, ListenerFd):
            endpoint, copy = _adopt(sock, where, checked[index], role)
            bound.append(endpoint)
            copies.append(copy)
        else:
            bound.append(bind_address(sock, where, role=role))
    # Everything is bound: the listeners are the client's now. Non-blocking, so that
    # ZeroMQ's accept never stalls its I/O thread. The flag belongs to the open file,
    # which every copy shares: set only now, so that a failed startup leaves the
    # caller's descriptors exactly as they were.
    for copy in copies:
        os.set_blocking(copy, False)
    for listener in seen.values():
        os.close(listener.fd)
    return bound

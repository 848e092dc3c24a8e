"""Binding and connecting to user-given addresses, with ZeroMQ's refusals typed.

libzmq refuses an address it cannot use with a bare ``zmq.ZMQError`` ("Address
already in use", "Protocol not supported", "Cannot assign requested address", ...).
These helpers turn that refusal into :class:`~trio_enginecore.errors.AddressError`,
which names the address and says what was wrong, and leave every other failure (a
closed socket, a terminated context) as it was.
"""

from __future__ import annotations

import errno
import socket
from typing import Final

import zmq

from ._zmq import TrioSocket
from .errors import AddressError

__all__ = ["bind_address", "connect_address", "connectable", "free_tcp_ports"]

# Failures that say nothing about the address: the socket or its context is gone.
_NOT_ABOUT_THE_ADDRESS: Final = frozenset({zmq.ETERM, zmq.ENOTSOCK, zmq.EMTHREAD, errno.EINTR})


def _reason(exc: zmq.ZMQError, address: str) -> str:
    """ZeroMQ's message without the ``(addr='...')`` that pyzmq appends to it."""
    message = str(exc.strerror or exc)
    suffix = f" (addr={address!r})"
    if message.endswith(suffix):
        message = message[: -len(suffix)]
    return message.rstrip(". ") or zmq.strerror(exc.errno or 0)


def bind_address(sock: TrioSocket, address: str, *, role: str = "") -> str:
    """Bind ``sock`` to ``address``; return the endpoint bound (``TrioSocket.bind``).

    Raises:
        AddressError: ZeroMQ refused the address (``role`` says which socket it was).
        trio.ClosedResourceError: the socket was closed.
    """
    try:
        return sock.bind(address)
    except zmq.ZMQError as exc:
        if exc.errno in _NOT_ABOUT_THE_ADDRESS:
            raise
        raise AddressError(address, _reason(exc, address), role=role) from exc


def connect_address(sock: TrioSocket, address: str, *, role: str = "") -> None:
    """Connect ``sock`` to ``address`` (``TrioSocket.connect``).

    Only a malformed address or an unknown transport fails here: ZeroMQ connects in
    the background, so a peer that is not there yet is not an error.

    Raises:
        AddressError: ZeroMQ refused the address (``role`` says which socket it was).
        trio.ClosedResourceError: the socket was closed.
    """
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        if exc.errno in _NOT_ABOUT_THE_ADDRESS:
            raise
        raise AddressError(address, _reason(exc, address), role=role) from exc


def connectable(address: str) -> str:
    """The address a process on this host connects to, for one bound at ``address``
    (a wildcard host is reached through the loopback interface)."""
    if not address.startswith("tcp://"):
        return address
    host, _, port = address[len("tcp://") :].rpartition(":")
    if host in ("*", "0.0.0.0"):
        return f"tcp://127.0.0.1:{port}"
    if host in ("::", "[::]"):
        return f"tcp://[::1]:{port}"
    return address


def free_tcp_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on this host now (held open together while
    chosen, so that none is picked twice)."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()

"""Engines on other hosts: where the client listens for them, and how it checks them."""

from __future__ import annotations

import ipaddress
from typing import Final

import attrs

from .._curve import CurveServer

__all__ = ["RemoteEngines"]

_ALL_INTERFACES: Final = frozenset({"*", "0.0.0.0", "::", "[::]"})


def _split_tcp(address: str) -> tuple[str, str]:
    if not address.startswith("tcp://"):
        raise ValueError(f"remote engines join over TCP: expected tcp://HOST:PORT, got {address!r}")
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not host or not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"expected tcp://HOST:PORT with a port number, got {address!r}")
    return host, port


@attrs.frozen
class RemoteEngines:
    """Engines that start elsewhere (``trio-enginecore serve --headless``) and join the
    client through the startup handshake over TCP.

    The client launches no engine: it binds ``handshake_address``, and its input and
    output sockets (and, for internal load balancing, its coordinator's) on the same
    host with ports chosen at bind time, which the handshake tells the engines. It
    waits for every rank of ``config.data_parallel_size`` (or the one rank of an
    external-LB client) to join, up to ``ready_timeout_s``, and then fails naming the
    ranks that did not.

    Attributes:
        handshake_address: ``tcp://HOST:PORT`` to bind for the handshake. ``HOST`` must
            be an explicit address: binding every interface (``*``, ``0.0.0.0``,
            ``::``) needs ``all_interfaces=True``.
        curve: authenticate and encrypt every TCP connection with CURVE: the client's
            key pair and the engine public keys it admits. Strongly recommended beyond
            loopback (see the security guide).
        all_interfaces: allow a wildcard ``HOST``.
    """

    handshake_address: str
    curve: CurveServer | None = None
    all_interfaces: bool = False

    def __attrs_post_init__(self) -> None:
        host, _ = _split_tcp(self.handshake_address)
        if host in _ALL_INTERFACES and not self.all_interfaces:
            raise ValueError(
                f"{self.handshake_address} binds every network interface; give the address "
                "of the interface the engines reach, or pass all_interfaces=True"
            )
        if host.startswith("["):
            ipaddress.IPv6Address(host.strip("[]"))  # raises ValueError naming the host

    @property
    def host(self) -> str:
        """The host part of ``handshake_address``."""
        return _split_tcp(self.handshake_address)[0]

    @property
    def any_port(self) -> str:
        """``tcp://HOST:*``: an address on the same host, port chosen when bound."""
        return f"tcp://{self.host}:*"

"""Engines on other hosts: where the client listens for them, and how it checks them."""

from __future__ import annotations

import ipaddress
import math
import socket
from collections.abc import Iterable
from typing import Any, Final

import attrs

from .._curve import CurveServer

__all__ = ["Liveness", "RemoteEngines", "connectable"]

_ALL_INTERFACES: Final = frozenset({"*", "0.0.0.0", "::", "[::]"})


def _split_tcp(address: str) -> tuple[str, str]:
    if not address.startswith("tcp://"):
        raise ValueError(f"remote engines join over TCP: expected tcp://HOST:PORT, got {address!r}")
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not host or not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"expected tcp://HOST:PORT with a port number, got {address!r}")
    return host, port


def connectable(address: str) -> str:
    """The address a process on this host connects to, for one bound at ``address``
    (a wildcard host is reached through the loopback interface)."""
    if not address.startswith("tcp://"):
        return address
    host, port = _split_tcp(address)
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


def _optional_ranks(ranks: Iterable[int] | None) -> frozenset[int] | None:
    return None if ranks is None else frozenset(ranks)


def _positive_or_none(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (
        isinstance(value, int | float) and math.isfinite(value) and value > 0
    ):
        raise ValueError(f"RemoteEngines.{attribute.name} must be a positive number, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        raise ValueError(f"RemoteEngines.{attribute.name} must be a positive number, got None")
    _positive_or_none(instance, attribute, value)


@attrs.frozen
class Liveness:
    """How often a client checks that each engine still answers, and how long an
    answer may take.

    A process that is alive is not an engine that works: one stuck in a deadlock, a
    collective that never completes, or stopped (``SIGSTOP``) keeps its requests
    waiting for ever, and an engine the client attached to is no child process of the
    client at all (nothing says when it is killed; ZeroMQ reconnects silently). So the
    client calls a cheap utility every engine answers, vLLM's included
    (``is_sleeping``), every ``interval_s``, and declares the engine dead when no answer
    (a failure reply counts as one) comes within ``timeout_s``: its requests fail with
    ``EngineDeadError``, as on any engine death, whose message says how long it stopped
    responding; an engine the client launched is killed. The defaults notice a hang
    within 2 s. Keep ``timeout_s`` well above the engine's longest step: an engine
    answers between steps. Engines that join through the handshake from other hosts
    have the same checks, set on :class:`RemoteEngines`.
    """

    interval_s: float = attrs.field(default=0.4, validator=_positive)
    timeout_s: float = attrs.field(default=1.2, validator=_positive)


DEFAULT_LIVENESS: Final = Liveness()
"""The checks of attached engines unless the caller chooses others (or ``None``)."""


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
        ranks: the ranks that join from elsewhere; the client launches the others
            itself, on this host (over TCP as well, with a key pair of their own when
            ``curve`` is set). ``None`` (the default): every rank is remote.
        all_interfaces: allow a wildcard ``HOST``.
        liveness_interval_s: how often to check that each engine still answers (a cheap
            utility call); ``None`` disables the checks. There is no process to watch
            for a remote engine, so this is how its death is noticed.
        liveness_timeout_s: an engine that has not answered a check within this time
            is declared dead: its requests fail with ``EngineDeadError`` and the
            client fails as with a launched engine's death. Keep it well above your
            engines' longest step: an engine answers between steps.
        data_parallel_master_ip: for ranks that form one torch data-parallel group
            (vLLM's MoE data parallelism, ``DPEngineCoreProc``) and were started by
            separate launchers (one ``vllm serve --headless`` per host): the address,
            on rank 0's host, where the group meets (vLLM's ``--data-parallel-address``).
            The client then sends every rank, in the handshake, the group's master
            address and ports, as vLLM's front-end does; without them each launcher
            picks its own ports and the group never forms. Leave it ``None`` for the
            reference engines, for dense (non-MoE) vLLM ranks (which are independent,
            and must not be sent a group), and for ranks of one launcher (which share
            its choice).
        data_parallel_master_port: the group's master port; ``None``: a free port of
            this host, with four more for the group's later collectives, chosen
            when the client starts (rank 0 must then run on this host, or those ports
            be free on its host too).
    """

    handshake_address: str
    ranks: frozenset[int] | None = attrs.field(default=None, converter=_optional_ranks)
    curve: CurveServer | None = None
    all_interfaces: bool = False
    liveness_interval_s: float | None = attrs.field(default=0.4, validator=_positive_or_none)
    liveness_timeout_s: float = attrs.field(default=1.2, validator=_positive)
    data_parallel_master_ip: str | None = None
    data_parallel_master_port: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )

    def __attrs_post_init__(self) -> None:
        host, _ = _split_tcp(self.handshake_address)
        if host in _ALL_INTERFACES and not self.all_interfaces:
            raise ValueError(
                f"{self.handshake_address} binds every network interface; give the address "
                "of the interface the engines reach, or pass all_interfaces=True"
            )
        if host.startswith("["):
            ipaddress.IPv6Address(host.strip("[]"))  # raises ValueError naming the host

    def group_parallel_config(self, data_parallel_size: int) -> dict[str, int | str | list[int]]:
        """The ``parallel_config`` of the handshake's init message for these engines:
        empty unless they form a torch group (``data_parallel_master_ip``), else what
        vLLM's front-end sends coordinated ranks. Each call picks new free ports."""
        if self.data_parallel_master_ip is None:
            return {}
        ports = free_tcp_ports(5 if self.data_parallel_master_port is None else 4)
        master = self.data_parallel_master_port or ports.pop()
        return {
            "data_parallel_master_ip": self.data_parallel_master_ip,
            "data_parallel_master_port": master,
            "_data_parallel_master_port_list": ports,
            # Only elastic EP needs vLLM's coordination store; 0 says there is none.
            "_coord_store_port": 0,
            "data_parallel_size": data_parallel_size,
        }

    def joining(self, ranks: range) -> frozenset[int]:
        """Which of a client's ``ranks`` join from elsewhere.

        Raises:
            ValueError: ``self.ranks`` names a rank the client does not have.
        """
        if self.ranks is None:
            return frozenset(ranks)
        unknown = sorted(self.ranks - set(ranks))
        if unknown:
            raise ValueError(
                f"RemoteEngines.ranks names rank(s) {unknown}, but the client's ranks are "
                f"{list(ranks)}"
            )
        return self.ranks

    @property
    def host(self) -> str:
        """The host part of ``handshake_address``."""
        return _split_tcp(self.handshake_address)[0]

    @property
    def any_port(self) -> str:
        """``tcp://HOST:*``: an address on the same host, port chosen when bound."""
        return f"tcp://{self.host}:*"

"""Engines on other hosts: where the client listens for them, and how it checks them."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Final, Protocol, final

import attrs

from ..._addresses import free_tcp_ports
from ..._curve import CurveServer
from ..._keywords import suggest_keywords
from .._core._settings_checks import positive_number

__all__ = ["EngineRestarter", "RemoteEngines", "RestartedEngine", "torch_group_config"]

_ALL_INTERFACES: Final = frozenset({"*", "0.0.0.0", "::", "[::]"})


def _split_tcp(address: str) -> tuple[str, str]:
    if not address.startswith("tcp://"):
        raise ValueError(f"remote engines join over TCP: expected tcp://HOST:PORT, got {address!r}")
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not host or not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"expected tcp://HOST:PORT with a port number, got {address!r}")
    return host, port


def _optional_ranks(ranks: Iterable[int] | None) -> frozenset[int] | None:
    return None if ranks is None else frozenset(ranks)


def _locations(locations: Mapping[int, str]) -> Mapping[int, str]:
    return MappingProxyType(dict(locations))


_positive: Final = positive_number("RemoteEngines")
_positive_or_none: Final = positive_number("RemoteEngines", optional=True)


def torch_group_config(
    master_ip: str, master_port: int | None, data_parallel_size: int
) -> dict[str, int | str | list[int]]:
    """The ``parallel_config`` vLLM's front-end sends the ranks of one torch
    data-parallel group (MoE ranks) in the handshake: where the group meets
    (``master_port``, or a free port of this host), and four more free ports for its
    later collectives. Each call picks new free ports."""
    ports = free_tcp_ports(5 if master_port is None else 4)
    master = master_port or ports.pop()
    return {
        "data_parallel_master_ip": master_ip,
        "data_parallel_master_port": master,
        "_data_parallel_master_port_list": ports,
        # Only elastic EP needs vLLM's coordination store; 0 says there is none.
        "_coord_store_port": 0,
        "data_parallel_size": data_parallel_size,
    }


@final
@attrs.frozen(kw_only=True)
class RestartedEngine:
    """What an :class:`EngineRestarter` tells the client about the engine it started.

    Attributes:
        location: where the new engine runs (as ``RemoteEngines.locations``), for the
            messages naming it; ``None`` keeps the old one.
        public_key: the new engine's CURVE public key (40 bytes of Z85), for an engine
            with a key pair of its own made for this start; the client admits it
            besides ``curve.allowed``. ``None``: its key is admitted already.
    """

    location: str | None = None
    public_key: bytes | None = None


class EngineRestarter(Protocol):
    """Starts remote engines again, for the ``restart`` failure policy
    (``RemoteEngines(restarter=...)``): how a client restarts engines it did not
    launch, through whatever started them (a cluster manager, a supervisor). The
    client calls it from its own tasks, for one engine at a time.
    :class:`~trio_enginecore.client.RayEngines` is one.
    """

    async def restart_engine(self, rank: int) -> RestartedEngine:
        """Stop what is left of rank ``rank``'s engine, which the client declared
        dead (it may still run: hung, say), and start a new one that joins the
        client's handshake address as the first did; return once it is started.
        The client then handshakes it and waits, up to its ``ready_timeout_s``,
        for it to be ready.

        Cancellation: the client is closing; leave nothing the client's own
        clean-up (or yours) will not remove.

        Raises:
            Exception: the engine could not be started; the message is logged and
                the restart is tried again, as the policy allows.
        """
        ...

    async def stop_engine(self, rank: int) -> None:
        """Stop the engine :meth:`restart_engine` started for ``rank``: it was not
        ready in time. Same cancellation rule."""
        ...


@suggest_keywords
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
        locations: where each rank's engine runs (``{rank: "host-b"}``), for the
            messages naming an engine: an ``EngineDeadError`` then says which host
            to look at. :class:`~trio_enginecore.client.RayEngines` fills it with
            each engine's Ray actor and node.
        restarter: starts a dead engine again, which lets
            ``on_engine_failure="restart"`` apply to these engines (see
            :class:`~trio_enginecore.client.EngineRestarter`); ``None``: the client
            cannot restart them.
            :class:`~trio_enginecore.client.RayEngines` passes its own.
    """

    handshake_address: str
    ranks: frozenset[int] | None = attrs.field(default=None, converter=_optional_ranks)
    curve: CurveServer | None = None
    all_interfaces: bool = False
    data_parallel_master_ip: str | None = None
    data_parallel_master_port: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    # Compared, not hashed (a mapping is not hashable): equal objects still hash equal.
    locations: Mapping[int, str] = attrs.field(
        factory=dict[int, str], converter=_locations, hash=False
    )
    restarter: EngineRestarter | None = attrs.field(default=None, hash=False)

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
        return torch_group_config(
            self.data_parallel_master_ip, self.data_parallel_master_port, data_parallel_size
        )

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

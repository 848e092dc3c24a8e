"""Where a multiprocess client's sockets go and which engines it waits for.

:func:`plan_topology` decides it once, from the client's role and options, before
anything is bound or launched: a plain function, unit-tested without sockets. The
engine group (:mod:`._group`) then follows the plan: bind, launch, handshake, watch.
"""

from __future__ import annotations

import enum
from typing import Final, final

import attrs

from ..._curve import CurveServer
from ..._listeners import ListenerFd
from .._core._liveness_rules import Liveness
from .._core._router import DataParallelRole
from ._remote import RemoteEngines
from ._vllm import VllmEngines

__all__ = [
    "ATTRIBUTION_WINDOW_S",
    "EXTERNAL_LB_NEEDS_COORDINATOR",
    "VLLM_HANDSHAKE_ADDRESS",
    "CoordinatorSource",
    "Topology",
    "plan_topology",
]

ATTRIBUTION_WINDOW_S: Final = 2.0
"""How long a launched engine that sent ENGINE_CORE_DEAD may take to exit (its exit
says which engine sent the frame, which does not say so itself)."""

EXTERNAL_LB_NEEDS_COORDINATOR: Final = (
    "external load balancing (data_parallel_external_lb) shares one coordinator between "
    "the clients of a data-parallel group: open one with trio_enginecore.open_coordinator() "
    "and pass its addresses as coordinator="
)


VLLM_HANDSHAKE_ADDRESS: Final = "tcp://127.0.0.1:*"
"""Where launched vLLM engine cores say HELLO: ``vllm serve --headless`` only takes a
TCP host and port (``--data-parallel-address``, ``--data-parallel-rpc-port``), so the
client binds the loopback interface, on a port chosen when bound."""


class CoordinatorSource(enum.Enum):
    """Which coordinator a client follows, if any."""

    NONE = "none"
    """No coordinator: one engine, or engines that run no waves."""
    GIVEN = "given"
    """The one whose addresses the client was given (shared with other clients)."""
    LAUNCHED = "launched"
    """One the client launches beside the engines it launches."""
    ANNOUNCED = "announced"
    """The one attached engines name in their ready messages, if they name one."""


@final
@attrs.frozen
class Topology:
    """Everything a multiprocess client decides before it binds or launches anything.

    An address of ``None`` means a socket in the client's private directory
    (``ipc://<dir>/<name>``), created when the client starts (:meth:`addresses`).
    """

    input_address: str | ListenerFd | None
    output_address: str | ListenerFd | None
    handshake_address: str | None
    """Where engines say HELLO; None when attaching (engines started elsewhere connect
    straight to the input and output addresses)."""
    handshakes: bool
    ranks: tuple[int, ...]
    """Every engine the client waits for."""
    launched: tuple[int, ...]
    """The ranks the client launches itself."""
    private_dir: bool
    """Whether the client needs a private directory (ipc sockets, or the key files of
    engines launched beside CURVE-authenticated remote ones)."""
    curve: CurveServer | None
    """The client's CURVE role: every socket engines connect to is a CURVE server."""
    local_engine_keys: bool
    """Engines launched beside CURVE-authenticated remote ones get a key pair of their
    own, which the client admits besides ``curve.allowed``."""
    coordinator: CoordinatorSource
    liveness: Liveness | None
    """How deaths and hangs are noticed (every kind of engine alike)."""
    attribution_window_s: float | None
    """How long to wait for the exit (or silence) of the sender of an
    ENGINE_CORE_DEAD before failing every engine; None: there is no way to tell."""

    @property
    def attached(self) -> bool:
        """The engines were started elsewhere and connect to the client's addresses."""
        return not self.handshakes

    def addresses(
        self, private_dir: str | None
    ) -> tuple[str | ListenerFd, str | ListenerFd, str | None]:
        """The input, output and handshake addresses, those in the private directory
        spelled out."""

        def resolve(address: str | ListenerFd | None, name: str) -> str | ListenerFd:
            if address is not None:
                return address
            assert private_dir is not None, "the topology needs a private directory"
            return f"ipc://{private_dir}/{name}"

        handshake: str | None = None
        if self.handshakes:
            resolved = resolve(self.handshake_address, "handshake")
            assert isinstance(resolved, str)
            handshake = resolved
        return (
            resolve(self.input_address, "input"),
            resolve(self.output_address, "output"),
            handshake,
        )


def plan_topology(
    role: DataParallelRole,
    *,
    input_address: str | ListenerFd | None = None,
    output_address: str | ListenerFd | None = None,
    remote: RemoteEngines | None = None,
    vllm: VllmEngines | None = None,
    liveness: Liveness | None = None,
) -> Topology:
    """Decide a multiprocess client's topology (see :class:`Topology`).

    Three shapes: *launch* (no addresses, no ``remote``: engines launched here, ipc
    sockets in a private directory; vLLM's engine cores, ``vllm``, say HELLO over TCP
    on the loopback interface); *attach* (``input_address`` and ``output_address``:
    engines started elsewhere connect there, no handshake); *remote* (``remote``:
    engines, some or all started on other hosts, join through the handshake over
    TCP, on ports chosen when bound).

    Raises:
        ValueError: only one attach address; attach addresses together with
            ``remote``; ``vllm`` with either; ``remote.ranks`` naming a rank the
            client does not have; a
            client with external load balancing given no coordinator whose engine
            joins through the handshake (launched or remote: the handshake is how it
            learns the coordinator's addresses).
    """
    attach = input_address is not None or output_address is not None
    if attach and (input_address is None or output_address is None):
        raise ValueError("attaching needs both input_address and output_address")
    if attach and remote is not None:
        raise ValueError(
            "remote engines join through the handshake: give remote= or the attach "
            "addresses, not both"
        )
    if vllm is not None and (attach or remote is not None):
        raise ValueError(
            "vllm= launches vLLM's engine cores here: give it, or the attach addresses, "
            "or remote=, one of them"
        )
    ranks = tuple(role.ranks)
    if attach:
        launched: tuple[int, ...] = ()
    elif remote is not None:
        joining = remote.joining(role.ranks)
        launched = tuple(rank for rank in ranks if rank not in joining)
    else:
        launched = ranks
    curve = remote.curve if remote is not None else None
    handshake_address: str | None = None
    if remote is not None:
        input_address = output_address = remote.any_port
        handshake_address = remote.handshake_address
    elif vllm is not None:
        handshake_address = VLLM_HANDSHAKE_ADDRESS
    return Topology(
        input_address=input_address,
        output_address=output_address,
        handshake_address=handshake_address,
        handshakes=not attach,
        ranks=ranks,
        launched=launched,
        # Launched engines beside remote ones use TCP too: only their CURVE keys
        # need the directory.
        private_dir=(not attach and remote is None) or (curve is not None and bool(launched)),
        curve=curve,
        local_engine_keys=curve is not None and bool(launched),
        coordinator=_coordinator_source(role, attach=attach),
        liveness=liveness,
        attribution_window_s=_attribution_window(
            every_engine_launched=launched == ranks, liveness=liveness
        ),
    )


def _coordinator_source(role: DataParallelRole, *, attach: bool) -> CoordinatorSource:
    if not role.data_parallel:
        return CoordinatorSource.NONE
    if role.coordinator is not None:
        return CoordinatorSource.GIVEN
    if attach:
        return CoordinatorSource.ANNOUNCED
    if not role.launches_coordinator:
        raise ValueError(EXTERNAL_LB_NEEDS_COORDINATOR)
    return CoordinatorSource.LAUNCHED


def _attribution_window(*, every_engine_launched: bool, liveness: Liveness | None) -> float | None:
    # The sender of ENGINE_CORE_DEAD exits: a launched one's exit is seen at once; any
    # engine's closed connection, once its grace to reconnect is over.
    if every_engine_launched:
        return ATTRIBUTION_WINDOW_S
    if liveness is not None and liveness.connection_loss_s is not None:
        return liveness.connection_loss_s + ATTRIBUTION_WINDOW_S
    return None

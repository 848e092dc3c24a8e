"""How a client talks to its engines, in one frozen object.

:class:`~trio_enginecore.EngineConfig` describes the reference engine a client
launches; :class:`ClientOptions` describes the client's side: where to bind, how long
to wait, how deaths are noticed. Attaching to engines started elsewhere (vLLM's among
them) needs only the options.
"""

from __future__ import annotations

import math
from typing import Any, final

import attrs

from .._listeners import ListenerFd
from ..coordinator import CoordinatorAddresses
from ._lb import LoadBalancer
from ._remote import DEFAULT_LIVENESS, Liveness, RemoteEngines

__all__ = ["ClientOptions"]


def _positive_seconds(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive number, got {value!r}")


@final
@attrs.frozen(kw_only=True)
class ClientOptions:
    """The options of a multiprocess client (see
    :func:`~trio_enginecore.open_engine_client` for each one's meaning).

    Raises:
        ValueError: a timeout that is not a positive number.
    """

    input_address: str | ListenerFd | None = None
    output_address: str | ListenerFd | None = None
    remote: RemoteEngines | None = None
    liveness: Liveness | None = DEFAULT_LIVENESS
    coordinator: CoordinatorAddresses | None = None
    load_balancer: LoadBalancer | None = None
    ready_timeout_s: float = attrs.field(default=60.0, validator=_positive_seconds)
    shutdown_timeout_s: float = attrs.field(default=5.0, validator=_positive_seconds)
    max_pending_outputs: int = 64
    client_index: int = 0

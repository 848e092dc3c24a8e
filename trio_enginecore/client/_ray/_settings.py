"""What :class:`RayEngines` says: where the engines go and how they start (pure).

The settings of engines placed by Ray, checked when made, and the few pure functions
built on them; :mod:`._ray` does the placing. Importing this needs no Ray.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Final, Literal, final

import attrs

from ..._curve import CurveServer
from ..._keywords import suggest_keywords
from ...config import EngineConfig
from .._core._settings_checks import positive_number
from .._multiprocess._launch import serve_arguments

__all__ = ["PlacementStrategy", "RayEngines", "describe_location"]

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
"""Ray's placement-group strategies: ``"PACK"`` (as few nodes as possible),
``"SPREAD"`` (as many as possible), and their strict forms (all on one node; each
on its own node), which fail to place rather than bend."""

_STRATEGIES: Final = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


def _resources(value: Mapping[str, Any]) -> Mapping[str, float]:
    resources = dict(value)
    for name, amount in resources.items():
        if not (isinstance(amount, int | float) and math.isfinite(amount) and amount >= 0):
            raise ValueError(
                f"RayEngines.resources_per_engine[{name!r}] must be a number >= 0, got {amount!r}"
            )
    if not any(resources.values()):
        raise ValueError(
            "RayEngines.resources_per_engine must reserve something (Ray refuses an "
            f"empty bundle), got {resources!r}"
        )
    return MappingProxyType(resources)


def _paths(paths: Iterable[str | os.PathLike[str]]) -> tuple[str, ...]:
    return tuple(os.fspath(path) for path in paths)


_positive: Final = positive_number("RayEngines")
_positive_or_none: Final = positive_number("RayEngines", optional=True)


@final
@suggest_keywords
@attrs.frozen(kw_only=True)
class RayEngines:
    """Engines placed on a Ray cluster, one actor per data-parallel rank (see
    :func:`open_ray_engine_client`). Needs the ``ray`` extra
    (``pip install "/path/to/trio-enginecore[ray]"`` from a checkout, or
    ``pip install -e ".[ray]"`` in it).

    Attributes:
        address: the cluster to use (``ray.init(address=...)``: ``"auto"``,
            ``"HOST:PORT"``, ``"ray://HOST:PORT"``). ``None``: a local cluster started
            for the purpose and shut down when the client closes. Either way, if this
            process is already connected to Ray (``ray.is_initialized()``), that
            connection is used and left open.
        init_options: more keyword arguments of ``ray.init`` (``num_cpus``,
            ``include_dashboard``, ``runtime_env``, ...).
        resources_per_engine: the placement-group bundle of each engine, in Ray's
            resource names (``{"CPU": 1}``, ``{"CPU": 4, "GPU": 1}``); the actor
            reserves exactly its bundle.
        strategy: how the bundles are spread over nodes, one of Ray's
            placement-group strategies: ``"PACK"`` (as few nodes as possible),
            ``"SPREAD"`` (as many as possible), and their strict forms
            ``"STRICT_PACK"`` (all on one node) and ``"STRICT_SPREAD"`` (each on its
            own node), which fail to place rather than bend.
        placement_timeout_s: how long the placement group and the actors may take to
            exist; then the startup fails, naming what the cluster has free.
        handshake_host: the address of this host the engines connect to (the client
            binds its handshake, input and output sockets there). ``None``:
            ``127.0.0.1`` with a local cluster this client starts, else this host's
            address as Ray knows it (``ray.util.get_node_ip_address()``).
        handshake_port: the handshake's TCP port; ``None``: a free one.
        curve: authenticate and encrypt the engines' TCP connections with CURVE.
            ``"ephemeral"``: a key pair per engine made by its actor on its own node
            (the secret never leaves that node: only public keys go through Ray), and
            one for the client made in this process, all new for each client.
            A :class:`~trio_enginecore.curve.CurveServer`: the client's key pair and
            the engine public keys it admits, with ``engine_secret_keys``.
        engine_secret_keys: with a ``CurveServer``: the path, *on the engine's
            node*, of each rank's secret key file (``NAME.key_secret`` of
            ``trio-enginecore keygen``), in the client's rank order: provisioned by
            the operator (or on a shared file system); only the path goes through Ray.
        stop_timeout_s: how long an engine may take to exit when the client closes,
            before it is killed.
        engine_log_level: the engines' ``--log-level`` (their logs go to the actors'
            log files, and to this process's stderr when Ray forwards worker logs).
    """

    address: str | None = None
    init_options: Mapping[str, Any] = attrs.field(
        factory=dict[str, Any], converter=_frozen_mapping, hash=False
    )
    resources_per_engine: Mapping[str, float] = attrs.field(
        factory=lambda: {"CPU": 1.0}, converter=_resources, hash=False
    )
    strategy: PlacementStrategy = attrs.field(
        default="SPREAD", validator=attrs.validators.in_(_STRATEGIES)
    )
    placement_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    handshake_host: str | None = None
    handshake_port: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional([attrs.validators.ge(1), attrs.validators.le(65535)]),
    )
    curve: CurveServer | Literal["ephemeral"] | None = None
    engine_secret_keys: tuple[str, ...] = attrs.field(default=(), converter=_paths)
    stop_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    engine_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"

    def __attrs_post_init__(self) -> None:
        if self.curve is not None and self.curve != "ephemeral":
            if not self.engine_secret_keys:
                raise ValueError(
                    "RayEngines.curve=CurveServer(...) needs engine_secret_keys: the "
                    "path of each engine's secret key file on its node (or "
                    "curve='ephemeral' to make new keys on the nodes)"
                )
        elif self.engine_secret_keys:
            raise ValueError(
                "RayEngines.engine_secret_keys go with curve=CurveServer(...) (the "
                "client's keys and the engines' public keys)"
            )

    def engine_arguments(
        self, config: EngineConfig, rank: int, handshake_address: str
    ) -> list[str]:
        """The ``trio-enginecore serve`` arguments of rank ``rank``'s engine (without
        its CURVE ones)."""
        return [
            "--headless",
            "--handshake-address",
            handshake_address,
            # The engine ends with its actor, however the actor ends, and with the
            # client (it does not wait for another frontend).
            "--exit-with-parent",
            "--rejoin-timeout-s",
            "0",
            "--log-level",
            self.engine_log_level,
            *serve_arguments(config.evolve(data_parallel_rank=rank)),
        ]


def describe_location(where: Mapping[str, Any]) -> str:
    """How messages name an engine's actor and node."""
    return (
        f"Ray actor {where['actor_id']} on node {where['node_ip']} "
        f"(node id {where['node_id']}), worker pid {where['pid']}"
    )

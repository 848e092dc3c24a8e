"""Engines placed by Ray: :class:`RayEngines` and :func:`open_ray_engine_client`.

The cut: Ray only *places and starts* the engines; everything after that is the
remote-engine machinery the client already has. :func:`open_ray_engine_client`

1. connects to the Ray cluster (or starts a local one, which it then owns);
2. reserves one placement-group bundle per data-parallel rank of the client
   (``resources_per_engine``, ``strategy``) and waits until the group is placed;
3. creates one :class:`~._actor.EngineActor` per rank, pinned to its bundle, and
   asks each where it runs (node id and address, worker pid, actor id);
4. with CURVE, gets each engine's public key (``"ephemeral"``: the actor makes the
   pair on its own node) or uses the key files the operator put on the nodes;
5. has each actor start ``trio-enginecore serve --headless`` joining a handshake
   address of this host over TCP;
6. opens an ordinary client with ``remote=RemoteEngines(...)`` for those ranks, its
   ``locations`` naming each rank's actor and node, so every message about an engine
   (an ``EngineDeadError`` above all) says where it ran.

Leaving the block (normally, by an exception or by cancellation, or a startup that
failed half-way) stops the engines, kills the actors, removes the placement group and,
if this client started the cluster, shuts it down: every Ray object the client made is
recorded the moment it exists, and the clean-up, shielded from cancellation, removes
whatever there is.

Ray's API is blocking. Every Ray call runs in **one dedicated thread** of the
session, awaited through ``trio.to_thread.run_sync``: the processes of a local cluster
are started with ``PR_SET_PDEATHSIG``, which Linux ties to the *thread* that started
them, so a cluster started from one of Trio's cached worker threads is killed when
that idle thread exits (seen: GCS and raylet gone a few seconds after ``ray.init``).
Long waits (placement, actor creation) poll in short steps, so a cancellation is
acted on within about half a second.

``import ray`` happens only here, at run time: the default install neither needs nor
imports Ray. The Ray objects are typed ``Any`` at this boundary (Ray is not installed
where the package is type-checked).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar, Unpack, final

import attrs
import trio

from ..._addresses import free_tcp_ports
from ..._curve import CurveKeyPair, CurveServer, load_public_key
from ...config import EngineConfig
from ...errors import EngineStartupError
from .._core._router import DataParallelRole
from .._mp import TrioMPClient, open_trio_mp_client
from .._multiprocess._remote import RemoteEngines, RestartedEngine
from .._options import ClientOptionKeywords, ClientOptions, options_from
from ._settings import RayEngines, describe_location

__all__ = ["RaySession", "open_ray_engine_client"]

logger = logging.getLogger("trio_enginecore.client")

_POLL_S: Final = 0.5
_RAY_MISSING: Final = (
    "RayEngines needs Ray: install the ray extra (pip install "
    '"/path/to/trio-enginecore[ray]" from a checkout, or pip install -e ".[ray]" in it; '
    "the default install does not pull it)"
)

_T = TypeVar("_T")


@final
class RaySession:
    """The Ray objects of one client, and the one thread every Ray call runs in (see
    the module docstring). Internal: :func:`open_ray_engine_client` drives it."""

    def __init__(self, spec: RayEngines) -> None:
        self.spec = spec
        self.ray: Any = None  # the ray module, once imported
        self.owns_cluster = False
        self.placement_group: Any = None
        self.actors: dict[int, Any] = {}
        self.where: dict[int, dict[str, Any]] = {}
        self.engine_pids: dict[int, int] = {}
        self.bundles: dict[int, int] = {}  # rank -> its placement-group bundle
        self._config: EngineConfig | None = None
        self._handshake_address = ""
        self._curve: CurveServer | None = None
        self._secret_keys: dict[int, str] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="trio-enginecore-ray"
        )

    async def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in the session's thread. Not abandoned on cancellation: every
        call is short, and what it creates is recorded for the clean-up."""
        future = self._executor.submit(fn, *args)
        return await trio.to_thread.run_sync(future.result)

    # ------------------------------------------------------------- startup

    async def start(self, config: EngineConfig, ranks: Sequence[int]) -> RemoteEngines:
        """Place and start one engine per rank; the ``RemoteEngines`` to open the
        client with."""
        spec = self.spec
        self._config = config
        self.bundles = {rank: bundle for bundle, rank in enumerate(ranks)}
        await self.call(self._connect)
        await self._place(len(ranks))
        await self._create_actors(ranks)
        self._curve, self._secret_keys = await self._keys(ranks)
        host = spec.handshake_host or await self.call(self._default_host)
        port = spec.handshake_port or free_tcp_ports(1)[0]
        self._handshake_address = f"tcp://{host}:{port}"
        await self.call(self._start_engines, ranks)
        remote = RemoteEngines(
            self._handshake_address,
            curve=self._curve,
            locations={rank: describe_location(self.where[rank]) for rank in ranks},
            restarter=self,
        )
        logger.info(
            "Ray placed %d engine(s) on node(s) %s; they join %s",
            len(ranks),
            ", ".join(sorted({w["node_ip"] for w in self.where.values()})),
            self._handshake_address,
        )
        return remote

    # ----------------------------------------------- restarts (EngineRestarter)

    async def restart_engine(self, rank: int) -> RestartedEngine:
        """Replace rank ``rank``'s actor: the old one is stopped (its engine too, a
        hung one included) and killed, a new one is created in the same bundle, and
        its engine joins the same handshake address. Cancellation: what exists is
        recorded, and the session's clean-up removes it."""
        await self.call(self._remove_actor, rank)
        await self._create_actors([rank])
        public_key: bytes | None = None
        if self.spec.curve == "ephemeral":
            ref = {rank: self.actors[rank].generate_keys.remote()}
            made: dict[int, tuple[str, bytes]] = await self.call(self._get_all, ref)
            self._secret_keys[rank], public_key = made[rank]
        await self.call(self._start_engines, [rank])
        logger.info("Ray restarted engine rank %d: %s", rank, describe_location(self.where[rank]))
        return RestartedEngine(location=describe_location(self.where[rank]), public_key=public_key)

    async def stop_engine(self, rank: int) -> None:
        """Stop and kill rank ``rank``'s actor (its engine was not ready in time)."""
        await self.call(self._remove_actor, rank)

    def _remove_actor(self, rank: int) -> None:
        actor = self.actors.pop(rank, None)
        if actor is None:
            return
        try:
            # A live actor stops its engine first (SIGTERM, then SIGKILL: a hung or
            # stopped engine goes too) and removes its keys; a dead one's engine
            # exits on its own (--exit-with-parent).
            stop = actor.stop.remote(1.0)
            self.ray.wait([stop], timeout=3.0)
        except Exception:
            logger.debug("stopping the actor of rank %d", rank, exc_info=True)
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:
            logger.warning("could not kill the Ray actor of rank %d", rank, exc_info=True)

    def _connect(self) -> None:
        try:
            ray: Any = importlib.import_module("ray")
        except ImportError as exc:
            raise ImportError(_RAY_MISSING) from exc
        self.ray = ray
        if ray.is_initialized():
            logger.debug("using this process's Ray connection")
            return
        ray.init(address=self.spec.address, **self.spec.init_options)
        self.owns_cluster = True
        logger.debug("connected to Ray (%s)", self.spec.address or "a new local cluster")

    def _default_host(self) -> str:
        if self.owns_cluster and self.spec.address is None:
            return "127.0.0.1"
        host: str = self.ray.util.get_node_ip_address()
        return host

    async def _place(self, engines: int) -> None:
        spec = self.spec
        ready = await self.call(self._create_placement_group, engines)
        with trio.move_on_after(spec.placement_timeout_s):
            while not await self.call(self._ready, [ready]):
                pass
            return
        available = await self.call(self.ray.available_resources)
        raise EngineStartupError(
            f"Ray could not place {engines} engine(s) of {dict(spec.resources_per_engine)} "
            f"each (strategy {spec.strategy}) within {spec.placement_timeout_s:g} s; "
            f"the cluster has {available} free"
        )

    def _create_placement_group(self, engines: int) -> Any:
        from_ray: Any = importlib.import_module("ray.util.placement_group")
        bundles = [dict(self.spec.resources_per_engine) for _ in range(engines)]
        self.placement_group = from_ray.placement_group(bundles, strategy=self.spec.strategy)
        return self.placement_group.ready()

    def _ready(self, refs: list[Any]) -> bool:
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=_POLL_S)
        return len(done) == len(refs)

    async def _create_actors(self, ranks: Sequence[int]) -> None:
        refs = await self.call(self._create_actor_objects, ranks)
        with trio.move_on_after(self.spec.placement_timeout_s):
            while not await self.call(self._ready, list(refs.values())):
                pass
            try:
                self.where.update(await self.call(self._get_all, refs))
            except Exception as exc:  # a RayActorError, most likely
                raise EngineStartupError(f"an engine actor failed to start: {exc}") from exc
            return
        raise EngineStartupError(
            f"the engine actors were not running within {self.spec.placement_timeout_s:g} s"
        )

    def _create_actor_objects(self, ranks: Sequence[int]) -> dict[int, Any]:
        ray = self.ray
        strategies: Any = importlib.import_module("ray.util.scheduling_strategies")
        from ._actor import EngineActor

        actor_class: Any = ray.remote(EngineActor)
        resources = dict(self.spec.resources_per_engine)
        cpus, gpus = resources.pop("CPU", 0), resources.pop("GPU", 0)
        refs: dict[int, Any] = {}
        for rank in ranks:
            actor = actor_class.options(
                name=None,
                num_cpus=cpus,
                num_gpus=gpus,
                resources=resources,
                max_restarts=0,
                scheduling_strategy=strategies.PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group,
                    placement_group_bundle_index=self.bundles[rank],
                ),
            ).remote()
            self.actors[rank] = actor
            refs[rank] = actor.where.remote()
        return refs

    def _get_all(self, refs: Mapping[int, Any]) -> dict[int, Any]:
        values = self.ray.get(list(refs.values()), timeout=self.spec.placement_timeout_s)
        return dict(zip(refs, values, strict=True))

    async def _keys(self, ranks: Sequence[int]) -> tuple[CurveServer | None, dict[int, str]]:
        curve = self.spec.curve
        if curve is None:
            return None, {}
        if isinstance(curve, CurveServer):
            paths = self.spec.engine_secret_keys
            if len(paths) != len(ranks):
                raise ValueError(
                    f"RayEngines.engine_secret_keys has {len(paths)} path(s) for "
                    f"{len(ranks)} engine(s)"
                )
            return curve, dict(zip(ranks, paths, strict=True))
        refs = {rank: self.actors[rank].generate_keys.remote() for rank in ranks}
        made: dict[int, tuple[str, bytes]] = await self.call(self._get_all, refs)
        server = CurveServer(
            CurveKeyPair.generate(), [load_public_key(public) for _, public in made.values()]
        )
        return server, {rank: secret for rank, (secret, _) in made.items()}

    def _start_engines(self, ranks: Sequence[int]) -> None:
        config, curve = self._config, self._curve
        assert config is not None
        refs: dict[int, Any] = {}
        for rank in ranks:
            arguments = self.spec.engine_arguments(config, rank, self._handshake_address)
            if curve is not None:
                server_key = curve.keys.public.decode("ascii")
                # "=": a Z85 key may start with "-", which argparse would take for an option.
                arguments += [
                    "--curve-secret-key",
                    self._secret_keys[rank],
                    f"--curve-server-key={server_key}",
                ]
            refs[rank] = self.actors[rank].start.remote(arguments)
        self.engine_pids.update(self._get_all(refs))

    # ------------------------------------------------------------- clean-up

    async def close(self) -> None:
        """Remove every Ray object of the session (whatever exists of them), then the
        session's thread. Never raises: what fails is logged."""
        try:
            await self.call(self._close)
        finally:
            await trio.to_thread.run_sync(self._executor.shutdown)

    def _close(self) -> None:
        ray = self.ray
        if ray is None:
            return
        if self.actors:
            stops = [actor.stop.remote(self.spec.stop_timeout_s) for actor in self.actors.values()]
            try:
                ray.wait(stops, num_returns=len(stops), timeout=self.spec.stop_timeout_s + 5)
            except Exception:  # an actor that died already: it is killed below anyway
                logger.debug("stopping the engine actors", exc_info=True)
        for rank, actor in self.actors.items():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                logger.warning("could not kill the Ray actor of rank %d", rank, exc_info=True)
        self.actors.clear()
        if self.placement_group is not None:
            try:
                module: Any = importlib.import_module("ray.util.placement_group")
                module.remove_placement_group(self.placement_group)
            except Exception:
                logger.warning("could not remove the placement group", exc_info=True)
            self.placement_group = None
        if self.owns_cluster:
            ray.shutdown()
            self.owns_cluster = False
            logger.debug("shut down the local Ray cluster")


def _check_options(options: ClientOptions) -> None:
    if options.remote is not None:
        raise ValueError("open_ray_engine_client makes the remote engines itself: give no remote=")
    if options.input_address is not None or options.output_address is not None:
        raise ValueError("engines placed by Ray join through the handshake: no attach addresses")


@asynccontextmanager
async def open_ray_engine_client(
    config: EngineConfig | None = None,
    engines: RayEngines | None = None,
    options: ClientOptions | None = None,
    *,
    cancel_on_failure: bool = False,
    **keywords: Unpack[ClientOptionKeywords],
) -> AsyncGenerator[TrioMPClient, None]:
    """Open a client whose engines Ray places:
    ``async with open_ray_engine_client(config, RayEngines(...)) as client:``.

    One engine per data-parallel rank of the client (every rank of
    ``config.data_parallel_size``, or its own with external load balancing), each in a
    Ray actor pinned to a bundle of one placement group, running the reference engine
    as a headless engine that joins this client over TCP (see the module docstring
    for the steps, and the guide *Several hosts*). The client is then the one
    :func:`~trio_enginecore.open_engine_client` returns for ``config`` with
    ``remote=RemoteEngines(...)``; the options are the same, but for ``remote`` and
    the attach addresses (made here).

    An actor that dies (its process killed, its node lost) is an engine death: its
    engine's connection closes with it (or its heartbeats stop), and the
    ``EngineDeadError`` names the rank, the actor and its node. The failure policies
    apply as to launched engines; with ``on_engine_failure="restart"`` the dead rank's
    actor is replaced by a new one in the same placement-group bundle (so on the same
    node, while it lives), whose engine joins the client again. Leaving the block,
    however it is left, stops the engines and removes the actors and the placement
    group, and shuts down a local cluster the client started.

    Raises:
        ImportError: Ray is not installed.
        EngineStartupError: the cluster could not place the engines or start them in
            time, or they did not join (as ``open_engine_client``).
        ValueError: options that do not apply (above).
    """
    config = config if config is not None else EngineConfig()
    spec = engines if engines is not None else RayEngines()
    options = options_from(options, keywords, opener=open_ray_engine_client)
    _check_options(options)
    session = RaySession(spec)
    try:
        remote = await session.start(config, DataParallelRole.for_config(config).ranks)
        # The multiprocess opener open_engine_client would call: the same judgement of
        # the configuration (new_mp_client) as every other opener.
        async with open_trio_mp_client(
            config, attrs.evolve(options, remote=remote), cancel_on_failure=cancel_on_failure
        ) as client:
            yield client
    finally:
        with trio.CancelScope(shield=True):
            await session.close()

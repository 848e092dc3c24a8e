"""The multiprocess Trio clients, named as vLLM names them, and their openers.

Each class is a constructor of the one :class:`~trio_enginecore.client.TrioEngineClient`
over the multiprocess transport (``client/_multiprocess/``); they differ only in the
routing :meth:`DataParallelRole.for_config
<trio_enginecore.client._core._router.DataParallelRole.for_config>` chooses:

* :class:`TrioMPClient`: one engine (or, with ``data_parallel_size > 1``, the ranks of
  its configuration, routed to the first);
* :class:`DPTrioMPClient`: the one rank of a data-parallel group this client owns
  (external load balancing), following a shared coordinator;
* :class:`DPLBTrioMPClient`: every rank, each request to the engine its load balancer
  chooses.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Final, Unpack, final

import trio

from ..config import EngineConfig
from ._client import TrioEngineClient
from ._core._lb import LeastLoaded
from ._core._policy import Restart, resolve_policy
from ._core._router import DataParallelRole
from ._multiprocess._group import EngineGroup
from ._multiprocess._pipe import PipeFactory
from ._multiprocess._vllm import VllmEngines
from ._multiprocess._zmq_pipe import ZmqPipe
from ._options import ClientOptionKeywords, ClientOptions, options_from
from ._running import run_client

__all__ = [
    "DPLBTrioMPClient",
    "DPTrioMPClient",
    "TrioMPClient",
    "connect_engine_client",
    "new_mp_client",
    "open_trio_mp_client",
]


class TrioMPClient(TrioEngineClient):
    """A Trio client for engines running in other processes.

    Open it with :func:`trio_enginecore.open_engine_client`, which launches (or
    attaches to) the engines and returns only once they are ready; leaving the
    ``async with`` block shuts everything down. ``options`` are
    ``open_engine_client``'s (:class:`~trio_enginecore.client.ClientOptions`). See
    :class:`~trio_enginecore.AsyncEngineCoreClient` for the methods and their
    cancellation semantics.

    ``pipe`` makes the data path between the client and its engines (ZeroMQ sockets,
    as vLLM's); the engines' lifecycle around it is the same whatever the pipe.

    Raises:
        ValueError: inconsistent addresses (see ``open_engine_client``).
    """

    def __init__(
        self,
        config: EngineConfig,
        options: ClientOptions | None = None,
        *,
        pipe: PipeFactory = ZmqPipe,
        _role: DataParallelRole | None = None,
    ) -> None:
        options = options if options is not None else ClientOptions()
        role = _role if _role is not None else DataParallelRole.single(config)
        self.options = options
        policy = resolve_policy(options.on_engine_failure)
        self.transport = EngineGroup(
            config,
            role,
            pipe=pipe,
            input_address=options.input_address,
            output_address=options.output_address,
            remote=options.remote,
            vllm=options.vllm,
            liveness=options.liveness,
            restart=policy if isinstance(policy, Restart) else None,
            ready_timeout_s=options.ready_timeout_s,
            shutdown_timeout_s=options.shutdown_timeout_s,
        )
        super().__init__(
            self.transport,
            config,
            role=role,
            client_index=options.client_index,
            max_pending_outputs=options.max_pending_outputs,
            on_engine_failure=policy,
        )

    @property
    def shutdown_timeout_s(self) -> float:
        """How long launched engines may take to exit when the client closes."""
        return self.transport.shutdown_timeout_s


@final
class DPTrioMPClient(TrioMPClient):
    """A Trio client owning one rank of a data-parallel group (external load balancing).

    Selected by :func:`~trio_enginecore.open_engine_client` when
    ``config.data_parallel_size > 1`` and ``config.data_parallel_external_lb``: several
    clients (say, one per API server, with a load balancer in front) each launch and
    use their own rank, ``config.data_parallel_rank``, and share one coordinator
    (:func:`~trio_enginecore.open_coordinator`), whose addresses every client is given.

    The engines of a MoE group move through request *waves* together. The client
    follows the coordinator's :attr:`current_wave` and :attr:`engines_running` and
    stamps every request with the wave; it sends the coordinator nothing, as vLLM's
    front-end does not: an engine that gets a request while paused has the coordinator
    start the wave on the others. Engines that run no waves (vLLM's dense data
    parallelism) leave both at ``(0, False)``.
    """

    def __init__(self, config: EngineConfig, options: ClientOptions | None = None) -> None:
        options = options if options is not None else ClientOptions()
        super().__init__(
            config, options, _role=DataParallelRole.one_rank(config, options.coordinator)
        )


@final
class DPLBTrioMPClient(TrioMPClient):
    """A Trio client balancing requests over several data-parallel engines.

    Selected by :func:`~trio_enginecore.open_engine_client` when
    ``config.data_parallel_size > 1``: it launches that many engines (ranks) and sends
    each request to the engine its ``load_balancer`` chooses (by default
    :class:`~trio_enginecore.client.LeastLoaded`, vLLM's score over the client's exact
    in-flight counts and the waiting/running counts the engines report through a
    coordinator, which the client runs as one of its own tasks unless ``coordinator``
    names a shared one), or to ``request.data_parallel_rank`` when set. Aborts (and
    the aborts of cancelled streams) go only to the engine that has the request.
    ``call_utility`` goes to rank 0, ``call_utility_all`` to every engine, and the
    typed wrappers to every engine, raising
    :class:`~trio_enginecore.errors.EngineConsensusError` if the answers differ.
    Request waves are followed as :class:`DPTrioMPClient` does (it is not one of them:
    both are constructors of :class:`~trio_enginecore.TrioMPClient` with a different
    routing).

    Failure policy (``on_engine_failure``): by default the client fails as a whole.
    When one engine dies, its in-flight requests fail with ``EngineDeadError`` at
    once and every later call raises it; requests on the surviving engines keep
    streaming until the block ends, and the ``async with`` block then raises one
    ``EngineDeadError``. With ``on_engine_failure="route_around"`` only what depended
    on the dead engine fails, and the others serve on (see
    :func:`~trio_enginecore.open_engine_client`). A death is seen when a launched
    engine's process exits, when an engine's connection is lost or it makes no
    progress (:class:`~trio_enginecore.Liveness`), or when an engine sends
    ``ENGINE_CORE_DEAD``: that frame does not say who sent it, so the client waits up
    to 2 s (remote and attached engines: that, and the time a lost connection takes to
    be noticed) for the sender's exit to identify it, and fails every engine only if
    none is identified.
    """

    def __init__(self, config: EngineConfig, options: ClientOptions | None = None) -> None:
        options = options if options is not None else ClientOptions()
        balancer = options.load_balancer or LeastLoaded()
        super().__init__(
            config,
            options,
            _role=DataParallelRole.balanced(config, balancer, options.coordinator),
        )


_CLASS_FOR: Final[dict[str, type[TrioMPClient]]] = {
    "single": TrioMPClient,
    "one_rank": DPTrioMPClient,
    "balanced": DPLBTrioMPClient,
}
"""The vLLM-shaped class of each routing: each constructs the same client with that
routing (the DP classes build the very role :meth:`DataParallelRole.for_config`
chose, from the same configuration and options)."""


def new_mp_client(config: EngineConfig, options: ClientOptions) -> TrioMPClient:
    """One engine: a TrioMPClient; several: a DPTrioMPClient owning one of them
    (external load balancing) or a DPLBTrioMPClient balancing over them all.

    With ``options.vllm`` (vLLM's engine cores launched here), the group's shape is
    ``VllmEngines.data_parallel_size`` and ``config`` must be left as it comes
    (``EngineConfig()``): the engines' settings are vLLM's arguments.

    Raises:
        ValueError: a coordinator for one engine; external load balancing launching
            engines with no coordinator; a non-zero ``client_index`` for engines that
            join through the handshake; inconsistent addresses; an ``EngineConfig``
            given beside ``VllmEngines``.
    """
    if options.vllm is not None:
        config = _config_for_vllm(config, options.vllm)
    if options.client_index != 0 and options.input_address is None:
        # The handshake names one output address, the engines' output 0: outputs for
        # any other index would be dropped by the engine, and the client would hang.
        raise ValueError(
            f"client_index={options.client_index} needs engines started elsewhere with "
            "several output addresses, attached to with input_address/output_address; "
            "engines this client launches, or that join through its handshake, have one "
            "output (client_index=0)"
        )
    role = DataParallelRole.for_config(
        config, load_balancer=options.load_balancer, coordinator=options.coordinator
    )
    return _CLASS_FOR[role.kind](config, options)


def _config_for_vllm(config: EngineConfig, vllm: VllmEngines) -> EngineConfig:
    """The configuration of a group of vLLM engine cores: only its size counts."""
    if config != EngineConfig():
        raise ValueError(
            "vllm= launches vLLM's engine cores, whose settings are vLLM's own "
            "(VllmEngines.arguments) and whose number is VllmEngines.data_parallel_size: "
            "give no EngineConfig (it describes the reference engine)"
        )
    return config.evolve(data_parallel_size=vllm.data_parallel_size)


@asynccontextmanager
async def open_trio_mp_client(
    config: EngineConfig,
    options: ClientOptions | None = None,
    *,
    cancel_on_failure: bool = False,
    **keywords: Unpack[ClientOptionKeywords],
) -> AsyncGenerator[TrioMPClient, None]:
    """Open a :class:`TrioMPClient`, or with several engines a :class:`DPTrioMPClient`
    or :class:`DPLBTrioMPClient` (see :func:`trio_enginecore.open_engine_client`):
    ``options``, or the :class:`ClientOptions` these keywords make."""
    client = new_mp_client(config, options_from(options, keywords, opener=open_trio_mp_client))
    async with run_client(client, cancel_on_failure=cancel_on_failure) as running:
        yield running


async def connect_engine_client(
    nursery: trio.Nursery,
    config: EngineConfig | None = None,
    options: ClientOptions | None = None,
    **keywords: Unpack[ClientOptionKeywords],
) -> TrioMPClient:
    """Start a multiprocess client whose background tasks run in ``nursery``.

    The lower-level form of :func:`~trio_enginecore.open_engine_client` (as
    trio-websocket's ``connect_websocket``), for code that manages its own nursery;
    it takes the same options (as a :class:`~trio_enginecore.client.ClientOptions`, or as
    keywords). Returns
    once the engines are ready. The caller owns the client: ``await client.aclose()``
    (or ``async with client:``) when done, after which its tasks in ``nursery`` all
    end. If the startup fails or is cancelled, everything started so far is cleaned
    up first.

    Raises:
        EngineStartupError: as :func:`~trio_enginecore.open_engine_client`.
        ValueError, TypeError: bad options; nothing was started.
    """
    client = new_mp_client(
        config if config is not None else EngineConfig(),
        options_from(options, keywords, opener=connect_engine_client),
    )
    try:
        await client.start(nursery)
    except BaseException:
        await client.aclose()
        raise
    return client

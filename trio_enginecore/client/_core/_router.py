"""Which engine gets a request, and the request wave the coordinator publishes.

Plain objects, no I/O: the client asks the :class:`Router` where each request goes
and feeds the coordinator's publications to the :class:`WaveFollower`, which keeps
the engines' published loads and the current wave (stamped on every request of a
data-parallel client). The three shapes of client vLLM has are three routers over
the same client:

* one engine: everything goes to it;
* one rank of a data-parallel group (external load balancing): the same, to the one
  engine this client owns;
* balanced: the :class:`~trio_enginecore.client.LoadBalancer` chooses among the
  engines, unless the request names its ``data_parallel_rank``.

An engine taken out of service (it died, and the client routes around it) is never
chosen again; a request naming its rank is refused.
"""

from __future__ import annotations

from typing import Literal, final

import attrs
import trio

from ...config import EngineConfig
from ...coordinator._addresses import CoordinatorAddresses
from ...errors import ProtocolError
from ...protocol import CoordinatorPublication, EngineCoreRequest
from ._engines import EngineHandle
from ._lb import LeastLoaded, LoadBalancer

__all__ = ["DataParallelRole", "Router", "WaveFollower"]


@final
@attrs.frozen
class DataParallelRole:
    """Which engines a client talks to and how it routes: decided by the constructor
    (the vLLM-shaped class names), used by the one client class."""

    ranks: range
    load_balancer: LoadBalancer | None = None
    coordinator: CoordinatorAddresses | None = None
    data_parallel: bool = False
    """Follows a coordinator and stamps requests with its wave."""
    launches_coordinator: bool = False
    """Launches a coordinator of its own when it launches engines and is given none."""

    @classmethod
    def for_config(
        cls,
        config: EngineConfig,
        *,
        load_balancer: LoadBalancer | None = None,
        coordinator: CoordinatorAddresses | None = None,
    ) -> DataParallelRole:
        """The one answer to "which engines, which routing" for ``config``, used by
        every opener (Trio, blocking, Ray): one engine, :meth:`single`; several with
        external load balancing, the client's own rank (:meth:`one_rank`); else every
        rank, balanced (:meth:`balanced`, by default with :class:`~._lb.LeastLoaded`).

        Raises:
            ValueError: a coordinator for one engine.
        """
        if config.data_parallel_size == 1:
            if coordinator is not None:
                raise ValueError("a coordinator is only used with data_parallel_size > 1")
            return cls.single(config)
        if config.data_parallel_external_lb:
            return cls.one_rank(config, coordinator)
        return cls.balanced(config, load_balancer or LeastLoaded(), coordinator)

    @property
    def kind(self) -> Literal["single", "one_rank", "balanced"]:
        """Which of the three routings this is (what picks the vLLM-shaped class)."""
        if self.load_balancer is not None:
            return "balanced"
        return "one_rank" if self.data_parallel else "single"

    @classmethod
    def single(cls, config: EngineConfig) -> DataParallelRole:
        return cls(ranks=range(config.data_parallel_size))

    @classmethod
    def one_rank(
        cls, config: EngineConfig, coordinator: CoordinatorAddresses | None
    ) -> DataParallelRole:
        rank = config.data_parallel_rank
        return cls(ranks=range(rank, rank + 1), coordinator=coordinator, data_parallel=True)

    @classmethod
    def balanced(
        cls,
        config: EngineConfig,
        load_balancer: LoadBalancer,
        coordinator: CoordinatorAddresses | None,
    ) -> DataParallelRole:
        return cls(
            ranks=range(config.data_parallel_size),
            load_balancer=load_balancer,
            coordinator=coordinator,
            data_parallel=True,
            launches_coordinator=True,
        )


@final
class Router:
    """Chooses the engine of each request (see the module docstring).

    Args:
        engines: the client's engines, by rank (shared with the client's state).
        load_balancer: the policy choosing among several engines; None sends every
            request to the first engine (one engine, or the one rank a client owns).
    """

    __slots__ = ("engines", "live", "load_balancer")

    def __init__(self, engines: list[EngineHandle], load_balancer: LoadBalancer | None) -> None:
        self.engines = engines
        self.load_balancer = load_balancer
        self.live = engines
        """The engines in service: ``engines`` itself until one is taken out."""

    def take_out(self, engine: EngineHandle) -> None:
        """``engine`` died: route nothing to it any more."""
        self.live = [e for e in self.engines if e.alive and e is not engine]

    def put_back(self, engine: EngineHandle) -> None:
        """``engine`` (restarted) is in service again."""
        live = [e for e in self.engines if e.alive or e is engine]
        self.live = self.engines if len(live) == len(self.engines) else live

    def check(self, request: EngineCoreRequest) -> None:
        """Raise what :meth:`engine_for` would raise for ``request``, choosing nothing
        (so that a batch is checked whole before any of it is sent).

        Raises:
            ValueError: the request names a ``data_parallel_rank`` out of range.
            EngineDeadError: it names the rank of an engine out of service.
        """
        rank = request.data_parallel_rank
        if rank is None or self.load_balancer is None:
            return
        engines = self.engines
        if not 0 <= rank < len(engines):
            raise ValueError(
                f"data_parallel_rank {rank} is out of range: there are {len(engines)} engines"
            )
        engine = engines[rank]
        if not engine.alive:
            restarting = " (it is restarting)" if engine.restarting else ""
            raise engine.death_notice(
                f"data_parallel_rank {rank} is out of service{restarting}: "
                f"{engine.describe()} died: {engine.death}",
                retryable=engine.restarting,
            ).error()

    def engine_for(self, request: EngineCoreRequest) -> EngineHandle:
        """The engine ``request`` goes to (call :meth:`check` first).

        Raises:
            ValueError: the request names a ``data_parallel_rank`` out of range.
        """
        engines = self.engines
        balancer = self.load_balancer
        if balancer is None:
            return engines[0]
        live = self.live
        if live is engines or request.data_parallel_rank is not None:
            index = balancer.choose([engine.load for engine in engines], request.data_parallel_rank)
            return engines[index]
        return live[balancer.choose([engine.load for engine in live], None)]

    def utility_engine(self) -> EngineHandle:
        """The engine ``call_utility`` asks: the first in service (rank 0 while it
        lives), as vLLM's clients ask rank 0."""
        live = self.live
        return live[0] if live else self.engines[0]


@final
class WaveFollower:
    """What the coordinator last published: the engines' loads and the request wave.

    The engines of a MoE group move through request *waves* together; a data-parallel
    client stamps each request with :attr:`current_wave`. Engines that run no waves
    (vLLM's dense data parallelism) leave ``(current_wave, engines_running)`` at
    ``(0, False)``.

    Args:
        stamps: whether requests are stamped with the wave (data-parallel clients).
    """

    __slots__ = ("_changed", "current_wave", "engines_running", "stamps")

    def __init__(self, *, stamps: bool) -> None:
        self.stamps = stamps
        self.current_wave: int = 0
        """The request wave the coordinator last published (0 before the first)."""
        self.engines_running: bool = False
        """Whether the engines are in a wave, as the coordinator last published."""
        self._changed = trio.Event()

    def stamp(self, request: EngineCoreRequest) -> None:
        """Set the request's ``current_wave`` (for data-parallel clients only)."""
        if self.stamps:
            request.current_wave = self.current_wave

    def fold(self, publication: CoordinatorPublication, engines: list[EngineHandle]) -> None:
        """Take in one publication: per-engine counts, then the wave state.

        Raises:
            ProtocolError: the counts do not cover every engine's rank (the
                publication is then ignored as a whole: nothing changed).
        """
        counts = publication.counts
        if counts is not None:
            if any(engine.rank >= len(counts) for engine in engines):
                raise ProtocolError(
                    f"a coordinator publication has counts for {len(counts)} engine(s), "
                    f"not for rank {max(engine.rank for engine in engines)}"
                )
            loads = [counts[engine.rank] for engine in engines]
            for engine, (waiting, running, kv_usage) in zip(engines, loads, strict=True):
                load = engine.load
                load.waiting = waiting
                load.running = running
                load.kv_usage = kv_usage
        wave, running = publication.current_wave, publication.engines_running
        if (wave, running) != (self.current_wave, self.engines_running):
            self.current_wave = wave
            self.engines_running = running
            self.announce()

    def announce(self) -> None:
        """Wake every :meth:`wait_changed` waiter (a change, a death, a close)."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Wait for the next :meth:`announce`. Cancellation changes nothing."""
        await self._changed.wait()

"""Load balancing over data-parallel engines (pure logic, no I/O).

A data-parallel client keeps, per engine, the counts the engines last published
(waiting, running, KV-cache usage) and its own exact count of requests in flight there.
:class:`LeastLoaded` scores engines the way vLLM's ``DPLBAsyncMPClient`` does:

    score = max(client_count * in_flight, waiting + running)
            + waiting * 6 * max(0, kv_usage - 0.5)

the lowest score wins, and ties are broken by a start index that rotates on every
choice, so equal engines share requests round-robin instead of the first one taking
everything. Choosing an engine optimistically counts the request as waiting there until
the next published counts replace the figure (with several clients, each counts for all
of them: ``client_count``); each of this client's requests that finishes or is aborted
takes one off it until then, so counts published during a burst of load do not outlive
it. :class:`PowerOfTwoChoices` samples two engines and keeps the better: O(1) per
request for large data-parallel sizes.

An explicit ``data_parallel_rank`` on a request always wins.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

# Defined in trio_enginecore.errors with the other exceptions; re-exported here (and so
# from trio_enginecore.client) for the programs that import it from there.
from ...errors import EngineConsensusError

__all__ = [
    "EngineConsensusError",
    "EngineLoad",
    "LeastLoaded",
    "LoadBalancer",
    "PowerOfTwoChoices",
    "consensus",
    "score",
]

KV_PRESSURE_THRESHOLD = 0.5
KV_PRESSURE_WEIGHT = 6.0


@attrs.define
class EngineLoad:
    """What is known of one engine's load."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0
    """Requests this client sent there and that have not finished (exact)."""

    def request_left(self) -> None:
        """One of this client's requests there finished or was aborted.

        It leaves the published counts too, until the engines publish again: counts
        taken while it ran would otherwise keep it there, and a burst of requests right
        after a load would all go to the engines that happened to publish last.
        """
        self.in_flight -= 1
        if self.running:
            self.running -= 1
        elif self.waiting:
            self.waiting -= 1


def score(load: EngineLoad, client_count: int = 1) -> float:
    """vLLM's engine score: lower is better."""
    queued = max(client_count * load.in_flight, load.waiting + load.running)
    pressure = load.waiting * KV_PRESSURE_WEIGHT * max(0.0, load.kv_usage - KV_PRESSURE_THRESHOLD)
    return queued + pressure


class LoadBalancer(Protocol):
    """Chooses the engine (index) for a request."""

    def choose(self, loads: Sequence[EngineLoad], requested_rank: int | None) -> int: ...


def _explicit(loads: Sequence[EngineLoad], requested_rank: int | None) -> int | None:
    if requested_rank is None:
        return None
    if not 0 <= requested_rank < len(loads):
        raise ValueError(
            f"data_parallel_rank {requested_rank} is out of range: there are {len(loads)} engines"
        )
    return requested_rank


def _count_choice(load: EngineLoad, client_count: int) -> None:
    # Optimistic until the engines publish again: the request waits there now.
    load.waiting += client_count


@attrs.define
class LeastLoaded:
    """vLLM's policy: the lowest score, ties rotated."""

    client_count: int = 1
    _start: int = 0

    def choose(self, loads: Sequence[EngineLoad], requested_rank: int | None) -> int:
        explicit = _explicit(loads, requested_rank)
        if explicit is not None:
            _count_choice(loads[explicit], self.client_count)
            return explicit
        n = len(loads)
        best, best_score = self._start % n, float("inf")
        for offset in range(n):
            index = (self._start + offset) % n
            value = score(loads[index], self.client_count)
            if value < best_score:
                best, best_score = index, value
        self._start = (self._start + 1) % n
        _count_choice(loads[best], self.client_count)
        return best


@attrs.define
class PowerOfTwoChoices:
    """Two engines at random, the better of the two: O(1) per request."""

    client_count: int = 1
    rng: random.Random = attrs.field(factory=random.Random)

    def choose(self, loads: Sequence[EngineLoad], requested_rank: int | None) -> int:
        explicit = _explicit(loads, requested_rank)
        if explicit is not None:
            _count_choice(loads[explicit], self.client_count)
            return explicit
        if len(loads) == 1:
            choice = 0
        else:
            a, b = self.rng.sample(range(len(loads)), 2)
            choice = (
                a if score(loads[a], self.client_count) <= score(loads[b], self.client_count) else b
            )
        _count_choice(loads[choice], self.client_count)
        return choice


def consensus(method: str, results: Sequence[Any]) -> Any:
    """The answer every engine gave; raise if they disagree.

    Raises:
        EngineConsensusError: naming each engine's answer.
    """
    if not results:
        raise ValueError("no results to agree on")
    first = results[0]
    if all(result == first for result in results[1:]):
        return first
    answers = ", ".join(f"engine {i}: {result!r}" for i, result in enumerate(results))
    raise EngineConsensusError(f"engines disagree on {method}: {answers}")

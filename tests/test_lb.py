"""Load balancing over data-parallel engines: the pure scoring and routing logic."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from trio_enginecore.client import EngineLoad, LeastLoaded, PowerOfTwoChoices
from trio_enginecore.client._core._lb import consensus, score
from trio_enginecore.errors import EngineConsensusError


def test_score_is_vllms_formula() -> None:
    assert score(EngineLoad(waiting=2, running=3)) == 5
    # The client's own in-flight count, scaled by the number of clients, can dominate.
    assert score(EngineLoad(waiting=0, running=1, in_flight=4), client_count=2) == 8
    # Waiting requests are penalised under KV-cache pressure (above 50 % usage).
    assert score(EngineLoad(waiting=2, running=0, kv_usage=0.75)) == 2 + 2 * 6 * 0.25
    assert score(EngineLoad(waiting=2, running=0, kv_usage=0.4)) == 2


def test_least_loaded_picks_the_lowest_score() -> None:
    loads = [EngineLoad(running=5), EngineLoad(running=1), EngineLoad(running=3)]
    assert LeastLoaded().choose(loads, None) == 1


def test_a_choice_counts_the_request_as_waiting_until_the_next_publication() -> None:
    loads = [EngineLoad(), EngineLoad()]
    balancer = LeastLoaded(client_count=3)
    first = balancer.choose(loads, None)
    assert loads[first].waiting == 3
    assert balancer.choose(loads, None) != first


def test_ties_rotate_so_equal_engines_share_the_work() -> None:
    loads = [EngineLoad() for _ in range(4)]
    balancer = LeastLoaded()
    picks = []
    for _ in range(8):
        for load in loads:
            load.waiting = 0  # keep them tied: as if counts were just published
        picks.append(balancer.choose(loads, None))
    assert Counter(picks) == {0: 2, 1: 2, 2: 2, 3: 2}


def test_uniform_load_spreads_evenly() -> None:
    loads = [EngineLoad() for _ in range(3)]
    balancer = LeastLoaded()
    for _ in range(600):
        index = balancer.choose(loads, None)
        loads[index].in_flight += 1
    assert [load.in_flight for load in loads] == [200, 200, 200]


def test_an_explicit_rank_always_wins_and_is_checked() -> None:
    loads = [EngineLoad(), EngineLoad(running=100)]
    assert LeastLoaded().choose(loads, 1) == 1
    assert PowerOfTwoChoices().choose(loads, 1) == 1
    with pytest.raises(ValueError, match="out of range"):
        LeastLoaded().choose(loads, 2)
    with pytest.raises(ValueError, match="out of range"):
        PowerOfTwoChoices().choose(loads, -1)


def test_power_of_two_choices_keeps_the_better_of_two() -> None:
    loads = [EngineLoad(running=r) for r in (0, 50, 100, 150)]
    balancer = PowerOfTwoChoices(rng=random.Random(7))
    picks = Counter()
    for _ in range(400):
        for load, running in zip(loads, (0, 50, 100, 150), strict=True):
            load.waiting, load.running = 0, running
        picks[balancer.choose(loads, None)] += 1
    # The most loaded engine can never win a comparison; the least loaded wins most.
    assert picks[3] == 0
    assert picks[0] > picks[1] > picks[2]


def test_power_of_two_choices_with_one_engine() -> None:
    assert PowerOfTwoChoices().choose([EngineLoad()], None) == 0


def test_consensus_returns_the_common_answer_or_names_each_engine() -> None:
    assert consensus("is_sleeping", [True, True, True]) is True
    with pytest.raises(EngineConsensusError, match="engine 0: True, engine 1: False"):
        consensus("is_sleeping", [True, False])
    with pytest.raises(ValueError, match="no results"):
        consensus("is_sleeping", [])

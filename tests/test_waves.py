"""Request waves: the engine's rules and the coordinator's, as pure state machines."""

from __future__ import annotations

import msgspec
import pytest

from trio_enginecore.coordinator import CoordinatorState
from trio_enginecore.engine._waves import EngineWaveState
from trio_enginecore.protocol import (
    REPORTS_OWN_WAVES,
    CoordinatorPublication,
    EngineCoreOutputs,
    SchedulerStats,
    StartDPWave,
)


def wave_complete(engine: int, wave: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=engine, wave_complete=wave)


def start_wave(engine: int, wave: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=engine, start_wave=wave)


def counts(engine: int, waiting: int, running: int) -> EngineCoreOutputs:
    stats = SchedulerStats(num_waiting_reqs=waiting, num_running_reqs=running)
    return EngineCoreOutputs(engine_index=engine, scheduler_stats=stats)


# ------------------------------------------------------------------ the engine


def test_an_engine_starts_paused_in_wave_0() -> None:
    engine = EngineWaveState(rank=1)
    assert (engine.current_wave, engine.running) == (0, False)
    assert engine.on_idle() is None  # nothing to report while paused


def test_a_request_at_a_paused_engine_runs_it_and_asks_for_its_wave() -> None:
    # vLLM 0.33's rule: engines alone start waves, so the one that gets a request while
    # paused has the coordinator start the others, whatever wave the request carries.
    engine = EngineWaveState(rank=0)
    assert engine.on_request(0) == 0
    assert engine.running
    assert engine.on_request(0) is None  # running already: nothing to ask


def test_idleness_completes_the_wave_once() -> None:
    engine = EngineWaveState(rank=0)
    engine.on_request(0)
    assert engine.on_idle() == 0
    assert (engine.current_wave, engine.running) == (1, False)
    assert engine.on_idle() is None  # reported once


def test_a_request_for_a_later_wave_moves_the_engine_there() -> None:
    engine = EngineWaveState(rank=0)
    assert engine.on_request(5) == 5
    assert engine.on_idle() == 5


def test_a_stale_request_at_a_paused_engine_asks_for_a_new_wave() -> None:
    engine = EngineWaveState(rank=2, current_wave=3)
    assert engine.on_request(1) == 3
    assert engine.running
    # While running, a stale request is just work in the current wave.
    assert engine.on_request(1) is None


def test_start_dp_wave_runs_every_engine_but_the_excluded_one() -> None:
    excluded = EngineWaveState(rank=0)
    other = EngineWaveState(rank=1)
    for engine in (excluded, other):
        engine.on_start_wave(2, exclude=0)
    assert (excluded.current_wave, excluded.running) == (0, False)
    assert (other.current_wave, other.running) == (2, True)
    nobody_excluded = EngineWaveState(rank=0)
    nobody_excluded.on_start_wave(0, exclude=None)
    assert nobody_excluded.running


def test_start_dp_wave_for_a_finished_wave_is_ignored() -> None:
    engine = EngineWaveState(rank=1, current_wave=4)
    engine.on_start_wave(3, exclude=None)
    assert (engine.current_wave, engine.running) == (4, False)


# ------------------------------------------------------------- the coordinator


def published(state: CoordinatorState) -> tuple[int, bool]:
    publication = msgspec.msgpack.decode(state.publication(), type=CoordinatorPublication)
    return publication.current_wave, publication.engines_running


def own_reporters(state: CoordinatorState, *engines: int) -> None:
    for engine in engines:
        assert state.update(wave_complete(engine, REPORTS_OWN_WAVES)) is None


def test_a_paused_engine_asking_for_its_wave_starts_it_on_the_others() -> None:
    state = CoordinatorState(3)
    assert state.update(start_wave(1, 0)) == StartDPWave(0, 1)
    assert state.wave_changed
    assert published(state) == (0, True)
    # Running already: the same wave again is handled.
    assert state.update(start_wave(2, 0)) is None
    assert not state.wave_changed


def test_a_later_wave_overtakes_the_running_one() -> None:
    state = CoordinatorState(3, current_wave=2)
    assert state.update(start_wave(1, 2)) == StartDPWave(2, 1)
    assert state.update(start_wave(0, 3)) == StartDPWave(3, 0)
    assert published(state) == (3, True)
    # A start for an ended wave changes nothing.
    assert state.update(start_wave(2, 1)) is None


def test_rank_0_alone_ends_the_wave_of_engines_that_do_not_report_their_own() -> None:
    # vLLM's MoE ranks: rank 0 reports for the group after the all-reduce.
    state = CoordinatorState(2)
    state.update(start_wave(1, 0))
    state.update(wave_complete(0, 0))
    assert published(state) == (1, False)
    # A duplicate or late report of an ended wave changes nothing.
    state.update(wave_complete(0, 0))
    assert not state.wave_changed


def test_engines_reporting_their_own_waves_must_all_report_it() -> None:
    state = CoordinatorState(3)
    own_reporters(state, 0, 1, 2)
    state.update(start_wave(0, 0))
    for engine in (2, 0):
        state.update(wave_complete(engine, 0))
        assert state.engines_running
    state.update(wave_complete(1, 0))
    assert published(state) == (1, False)


def test_the_announcement_is_no_wave_and_changes_nothing_published() -> None:
    state = CoordinatorState(2)
    state.publication()
    own_reporters(state, 0, 1)
    assert not state.changed
    assert not state.wave_changed
    assert (state.current_wave, state.engines_running) == (0, False)


def test_completions_of_an_overtaken_wave_are_forgotten() -> None:
    state = CoordinatorState(2)
    own_reporters(state, 0, 1)
    state.update(start_wave(0, 0))
    state.update(wave_complete(0, 0))
    state.update(start_wave(0, 1))  # engine 0 moved on and got a request
    state.update(wave_complete(1, 0))  # too late: wave 1 is current
    assert (state.current_wave, state.engines_running) == (1, True)
    state.update(wave_complete(0, 1))
    state.update(wave_complete(1, 1))
    assert (state.current_wave, state.engines_running) == (2, False)


def test_engines_that_run_no_waves_leave_the_published_state_alone() -> None:
    # vLLM's dense DP ranks send counts and nothing about waves: wave 0, not running,
    # for good, and no START_DP_WAVE for them ever.
    state = CoordinatorState(2)
    for _ in range(3):
        assert state.update(counts(0, 1, 2)) is None
        assert state.update(counts(1, 0, 0)) is None
        assert published(state) == (0, False)


def test_reports_from_unknown_engines_are_ignored() -> None:
    state = CoordinatorState(2)
    state.publication()
    assert state.update(start_wave(9, 5)) is None
    state.update(wave_complete(-1, 0))
    assert not state.changed
    assert not state.wave_changed


def test_scaling_the_group_resizes_the_counts() -> None:
    state = CoordinatorState(2)
    state.update(counts(1, 4, 5))
    state.scale(3)
    assert state.counts == [(0, 0, 0.0), (4, 5, 0.0), (0, 0, 0.0)]
    state.scale(1)
    assert state.counts == [(0, 0, 0.0)]
    assert state.update(counts(1, 4, 5)) is None  # rank 1 is gone


def test_engines_removed_by_scaling_are_not_waited_for_to_end_a_wave() -> None:
    state = CoordinatorState(3)
    own_reporters(state, 0, 1, 2)
    state.update(start_wave(0, 0))
    state.scale(2)  # rank 2 is gone: its report will never come
    state.update(wave_complete(1, 0))
    assert state.engines_running
    state.update(wave_complete(0, 0))
    assert published(state) == (1, False)


@pytest.mark.parametrize("reporting", ["own", "rank 0 for all"])
def test_engines_and_coordinator_together_never_strand_a_running_wave(reporting: str) -> None:
    """Three engines, one coordinator, messages delivered in every interleaving a
    simple scheduler produces: after the work is done, the wave has ended. Engines
    report their own waves (the reference engines), or rank 0 reports for all once
    every engine is idle (vLLM's all-reduce)."""
    import itertools
    import random

    for seed in range(300):
        rng = random.Random(seed)
        state = CoordinatorState(3)
        engines = [EngineWaveState(rank) for rank in range(3)]
        busy = [0, 0, 0]
        to_coordinator: list[EngineCoreOutputs] = []
        to_engines: list[tuple[int, StartDPWave]] = []
        client_wave = 0
        if reporting == "own":
            to_coordinator.extend(wave_complete(rank, REPORTS_OWN_WAVES) for rank in range(3))

        def report_idle(
            busy: list[int],
            to_coordinator: list[EngineCoreOutputs],
            engines: list[EngineWaveState] = engines,
        ) -> None:
            if reporting == "own":
                for rank, engine in enumerate(engines):
                    if not busy[rank] and (done := engine.on_idle()) is not None:
                        to_coordinator.append(wave_complete(rank, done))
            elif not any(busy) and any(engine.running for engine in engines):
                for rank, engine in enumerate(engines):
                    done = engine.on_idle()
                    if rank == 0 and done is not None:
                        to_coordinator.append(wave_complete(rank, done))

        def broadcast(
            start: StartDPWave | None, to_engines: list[tuple[int, StartDPWave]] = to_engines
        ) -> None:
            if start is not None:
                to_engines.extend((rank, start) for rank in range(3))

        for _ in itertools.repeat(None, 60):
            action = rng.randrange(5)
            if action == 0:  # the client sends a request
                rank = rng.randrange(3)
                asked = engines[rank].on_request(client_wave)
                if asked is not None:
                    to_coordinator.append(start_wave(rank, asked))
                busy[rank] += 1
            elif action == 1 and any(busy):  # an engine finishes a request
                rank = rng.choice([r for r in range(3) if busy[r]])
                busy[rank] -= 1
            elif action == 2 and to_coordinator:
                broadcast(state.update(to_coordinator.pop(rng.randrange(len(to_coordinator)))))
            elif action == 3 and to_engines:
                rank, start = to_engines.pop(0)
                engines[rank].on_start_wave(start.wave, start.exclude_engine_index)
            else:  # idle engines report
                client_wave = state.current_wave
            report_idle(busy, to_coordinator)
        # Quiesce: finish all work, deliver everything.
        busy = [0, 0, 0]
        report_idle(busy, to_coordinator)
        while to_coordinator or to_engines:
            if to_engines:
                rank, start = to_engines.pop(0)
                engines[rank].on_start_wave(start.wave, start.exclude_engine_index)
            if to_coordinator:
                broadcast(state.update(to_coordinator.pop(0)))
            report_idle(busy, to_coordinator)
        assert not state.engines_running, seed
        assert not any(engine.running for engine in engines), seed

"""Request waves: the engine's rules and the coordinator's, as pure state machines."""

from __future__ import annotations

import msgspec

from trio_enginecore.engine._coordinator import CoordinatorState
from trio_enginecore.engine._waves import EngineWaveState
from trio_enginecore.protocol import EngineCoreOutputs, StartDPWave


def wave_complete(engine: int, wave: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=engine, wave_complete=wave)


def start_wave(engine: int, wave: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=engine, start_wave=wave)


# ------------------------------------------------------------------ the engine


def test_an_engine_starts_paused_in_wave_0() -> None:
    engine = EngineWaveState(rank=1)
    assert (engine.current_wave, engine.running) == (0, False)
    assert engine.on_idle() is None  # nothing to report while paused


def test_a_request_runs_the_engine_and_idleness_completes_the_wave() -> None:
    engine = EngineWaveState(rank=0)
    assert engine.on_request(0) is None
    assert engine.running
    assert engine.on_idle() == 0
    assert (engine.current_wave, engine.running) == (1, False)
    assert engine.on_idle() is None  # reported once


def test_a_request_for_a_later_wave_moves_the_engine_there() -> None:
    engine = EngineWaveState(rank=0)
    assert engine.on_request(5) is None
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
    _, wave, running = msgspec.msgpack.decode(state.publication())
    return wave, running


def test_a_client_request_while_paused_starts_the_wave_on_the_other_engines() -> None:
    state = CoordinatorState(3)
    assert state.client_request(engine_index=1, wave=0) == StartDPWave(0, 1)
    assert published(state) == (0, True)
    # Already running: nothing more to broadcast.
    assert state.client_request(engine_index=2, wave=0) is None
    assert not state.changed


def test_a_client_behind_on_waves_gets_every_engine_started() -> None:
    state = CoordinatorState(2, current_wave=3)
    assert state.client_request(engine_index=0, wave=1) == StartDPWave(3, None)


def test_the_wave_ends_when_every_engine_has_completed_it() -> None:
    state = CoordinatorState(3)
    state.client_request(engine_index=0, wave=0)
    state.publication()
    for engine in (2, 0):
        assert state.update(wave_complete(engine, 0)) is None
        assert state.engines_running
    state.update(wave_complete(1, 0))
    assert published(state) == (1, False)
    # A duplicate or late report of an ended wave changes nothing.
    state.update(wave_complete(1, 0))
    assert not state.changed


def test_an_engine_with_a_stale_request_starts_its_wave_everywhere_else() -> None:
    state = CoordinatorState(3, current_wave=2)
    assert state.update(start_wave(1, 2)) == StartDPWave(2, 1)
    assert published(state) == (2, True)
    # The same wave again, while running: already handled.
    assert state.update(start_wave(0, 2)) is None
    # A later wave overtakes the running one.
    assert state.update(start_wave(0, 3)) == StartDPWave(3, 0)
    assert published(state) == (3, True)


def test_completions_of_an_overtaken_wave_are_forgotten() -> None:
    state = CoordinatorState(2)
    state.client_request(engine_index=0, wave=0)
    state.update(wave_complete(0, 0))
    state.update(start_wave(0, 1))  # engine 0 moved on and got a stale request
    state.update(wave_complete(1, 0))  # too late: wave 1 is current
    assert (state.current_wave, state.engines_running) == (1, True)
    state.update(wave_complete(0, 1))
    state.update(wave_complete(1, 1))
    assert (state.current_wave, state.engines_running) == (2, False)


def test_reports_from_unknown_engines_are_ignored() -> None:
    state = CoordinatorState(2)
    state.publication()
    assert state.update(start_wave(9, 5)) is None
    state.update(wave_complete(-1, 0))
    assert not state.changed


def test_engines_and_coordinator_together_never_strand_a_running_wave() -> None:
    """Three engines, one coordinator, messages delivered in every interleaving a
    simple scheduler produces: after the work is done, the wave has ended."""
    import itertools
    import random

    for seed in range(300):
        rng = random.Random(seed)
        state = CoordinatorState(3)
        engines = [EngineWaveState(rank) for rank in range(3)]
        busy = [0, 0, 0]
        to_coordinator: list[EngineCoreOutputs] = []
        to_engines: list[tuple[int, StartDPWave]] = []
        client_wave, client_running = 0, False

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
                if not client_running:
                    client_running = True
                    broadcast(state.client_request(rank, client_wave))
            elif action == 1 and any(busy):  # an engine finishes a request
                rank = rng.choice([r for r in range(3) if busy[r]])
                busy[rank] -= 1
            elif action == 2 and to_coordinator:
                broadcast(state.update(to_coordinator.pop(rng.randrange(len(to_coordinator)))))
            elif action == 3 and to_engines:
                rank, start = to_engines.pop(0)
                engines[rank].on_start_wave(start.wave, start.exclude_engine_index)
            else:  # idle engines report
                client_wave, client_running = state.current_wave, state.engines_running
            for rank, engine in enumerate(engines):
                if not busy[rank] and (done := engine.on_idle()) is not None:
                    to_coordinator.append(wave_complete(rank, done))
        # Quiesce: finish all work, deliver everything.
        busy = [0, 0, 0]
        for rank, engine in enumerate(engines):
            if (done := engine.on_idle()) is not None:
                to_coordinator.append(wave_complete(rank, done))
        while to_coordinator or to_engines:
            if to_engines:
                rank, start = to_engines.pop(0)
                engines[rank].on_start_wave(start.wave, start.exclude_engine_index)
            if to_coordinator:
                broadcast(state.update(to_coordinator.pop(0)))
            for rank, engine in enumerate(engines):
                if (done := engine.on_idle()) is not None:
                    to_coordinator.append(wave_complete(rank, done))
        assert not state.engines_running, seed
        assert not any(engine.running for engine in engines), seed

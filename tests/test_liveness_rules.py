"""The rules that tell a dead or hung engine from a slow one, without any I/O.

The tasks applying them, with real engines, are tested in test_liveness.py.
"""

from __future__ import annotations

import pytest

from trio_enginecore import Liveness
from trio_enginecore.client._core._engines import EngineHandle
from trio_enginecore.client._core._liveness_rules import (
    DEFAULT_LIVENESS,
    RECONNECT_GRACE_S,
    ConnectionTable,
    ProgressClock,
)
from trio_enginecore.client._core._policy import Fail, Restart
from trio_enginecore.client._core._state import ClientState

A, B = b"\x00\x00", b"\x01\x00"

# ----------------------------------------------------------------- the settings


def test_the_defaults_notice_a_gone_engine_within_three_seconds() -> None:
    loss = DEFAULT_LIVENESS.connection_loss_s
    assert loss is not None
    assert loss <= 2.5  # the rest of 3 s is slack for a loaded host


def test_the_default_progress_deadline_is_a_minute_and_idle_engines_are_asked_every_5_s() -> None:
    assert DEFAULT_LIVENESS.progress_timeout_s == 60.0
    assert DEFAULT_LIVENESS.ping_interval_s == 5.0
    # A short deadline is asked for four times as often.
    assert Liveness(progress_timeout_s=2.0).ping_interval_s == 0.5


def test_heartbeats_are_libzmq_options_in_milliseconds() -> None:
    assert DEFAULT_LIVENESS.heartbeat_options == {
        "HEARTBEAT_IVL": 300,
        "HEARTBEAT_TIMEOUT": 1500,
    }
    # Never 0, which would turn them off in libzmq.
    assert Liveness(heartbeat_interval_s=1e-6).heartbeat_options["HEARTBEAT_IVL"] == 1


def test_each_check_can_be_turned_off_alone() -> None:
    no_heartbeats = Liveness(heartbeat_interval_s=None)
    assert no_heartbeats.heartbeat_options == {}
    assert no_heartbeats.connection_loss_s is None
    assert no_heartbeats.ping_interval_s is not None
    no_deadline = Liveness(progress_timeout_s=None)
    assert no_deadline.ping_interval_s is None
    assert no_deadline.connection_loss_s == pytest.approx(0.3 + 1.5 + RECONNECT_GRACE_S)


def test_the_settings_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Liveness(0.4, 1.2)  # type: ignore[misc]


# ------------------------------------------------------- whose connection it was


def test_a_claimed_connection_that_closes_names_its_engine() -> None:
    table = ConnectionTable()
    table.accepted(7)
    table.accepted(8)
    assert table.claim(7, A)
    assert table.claim(8, B)
    assert table.disconnected(8) == B
    assert not table.connected(B)
    assert table.connected(A)


def test_an_unclaimed_connection_that_closes_names_nobody() -> None:
    # A stranger, a port scanner, or an engine gone before its ready message.
    table = ConnectionTable()
    table.accepted(7)
    assert table.disconnected(7) is None
    assert table.disconnected(99) is None  # never seen: nothing happens


def test_an_engines_former_connection_closing_does_not_touch_its_new_one() -> None:
    # The engine reconnected (its second ready message came on fd 9) before the
    # monitor reported its first connection's end.
    table = ConnectionTable()
    table.accepted(7)
    table.claim(7, A)
    table.accepted(9)
    table.claim(9, A)
    assert table.disconnected(7) is None
    assert table.connected(A)
    assert table.disconnected(9) == A


def test_a_reused_descriptor_belongs_to_the_connection_accepted_last() -> None:
    table = ConnectionTable()
    table.accepted(7)
    table.claim(7, A)
    assert table.disconnected(7) == A
    table.accepted(7)  # the kernel hands out the same number to the next connection
    assert table.claim(7, B)
    assert table.disconnected(7) == B


def test_a_claim_on_a_connection_already_closed_fails() -> None:
    table = ConnectionTable()
    table.accepted(7)
    assert table.disconnected(7) is None
    assert not table.claim(7, A)
    assert not table.connected(A)
    assert len(table) == 0


def test_a_claim_on_a_connection_never_seen_takes_it_as_open() -> None:
    # The monitor's queue is bounded: an "accepted" event can be lost in a flood of
    # connections. The message proves the connection, so it is not taken for lost.
    table = ConnectionTable()
    assert table.claim(7, A)
    assert table.connected(A)
    assert table.disconnected(7) == A


# ------------------------------------------------------------------ progress


def test_an_engine_with_work_and_nothing_to_say_stalls() -> None:
    clock = ProgressClock()
    assert clock.observe(0.0, heard=3, busy=True, excused=False) == 0.0
    assert clock.observe(10.0, heard=3, busy=True, excused=False) == 10.0
    assert clock.observe(25.0, heard=3, busy=True, excused=False) == 25.0


def test_any_message_is_progress() -> None:
    clock = ProgressClock()
    clock.observe(0.0, heard=3, busy=True, excused=False)
    assert clock.observe(10.0, heard=4, busy=True, excused=False) == 0.0
    assert clock.observe(12.0, heard=4, busy=True, excused=False) == 2.0


def test_an_idle_engine_never_stalls() -> None:
    clock = ProgressClock()
    clock.observe(0.0, heard=3, busy=False, excused=False)
    assert clock.observe(100.0, heard=3, busy=False, excused=False) == 0.0
    # The clock starts when work does, not at the last message.
    assert clock.observe(101.0, heard=3, busy=True, excused=False) == 0.0
    assert clock.observe(103.0, heard=3, busy=True, excused=False) == 2.0


def test_time_in_a_callers_utility_does_not_count() -> None:
    clock = ProgressClock()
    clock.observe(0.0, heard=3, busy=True, excused=False)
    assert clock.observe(5.0, heard=3, busy=True, excused=True) == 0.0
    assert clock.observe(50.0, heard=3, busy=True, excused=True) == 0.0
    # The caller stopped waiting (answered, or gave up): the clock starts then.
    assert clock.observe(51.0, heard=3, busy=True, excused=False) == 0.0
    assert clock.observe(54.0, heard=3, busy=True, excused=False) == 3.0


# ----------------------------------------------------- where an engine stands


def one_engine_state(*, restarts: bool = False) -> tuple[ClientState, EngineHandle]:
    engine = EngineHandle.for_rank(0)
    policy = Restart() if restarts else Fail()
    return ClientState([engine], lambda engine, ids: None, policy=policy), engine


def test_a_suspect_engine_stays_in_service_until_it_shows_life() -> None:
    state, engine = one_engine_state()
    assert state.lifecycle.engine_suspect(engine, "its connection was lost")
    assert engine.alive
    assert engine.status().state == "suspect"
    assert engine.status().suspicion == "its connection was lost"
    assert state.failure is None
    assert not state.lifecycle.engine_suspect(engine, "again")  # not news
    state.lifecycle.engine_cleared(engine)
    assert engine.status().state == "alive"
    assert engine.status().suspicion is None


def test_a_suspect_engine_can_be_declared_dead() -> None:
    state, engine = one_engine_state()
    state.lifecycle.engine_suspect(engine, "no progress for 31 s")
    assert state.lifecycle.engine_died(engine, "no progress for 61 s")
    assert engine.status().state == "dead"
    assert engine.status().suspicion is None
    state.lifecycle.engine_cleared(engine)  # too late: dead is dead
    assert engine.status().state == "dead"


def test_a_dead_or_restarting_engine_is_never_suspect() -> None:
    state, engine = one_engine_state(restarts=True)
    state.lifecycle.engine_died(engine, "killed by signal 9")
    assert engine.status().state == "restarting"
    assert not state.lifecycle.engine_suspect(engine, "its connection was lost")
    assert engine.status().state == "restarting"


def test_a_failed_restart_is_recorded_and_the_engine_stays_restarting() -> None:
    state, engine = one_engine_state(restarts=True)
    state.lifecycle.engine_died(engine, "killed by signal 9")
    state.lifecycle.restart_failed(engine, "not ready within 60 s")
    assert engine.death == "its restart failed: not ready within 60 s"
    assert engine.restarting
    state.lifecycle.engine_back(engine)
    assert engine.status().state == "alive"
    assert engine.death is None


def test_closing_takes_every_engine_out_of_service() -> None:
    state, engine = one_engine_state()
    state.close()
    assert not state.lifecycle.engine_suspect(engine, "its connection was lost")
    state.lifecycle.engines_stopped()
    assert engine.status().state == "dead"
    assert engine.death == "stopped with the client"

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

A, B, C = b"\x00\x00", b"\x01\x00", b"\x02\x00"

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
    assert table.disconnected(8) == [B]
    assert not table.connected(B)
    assert table.connected(A)


def test_an_unclaimed_connection_that_closes_names_nobody() -> None:
    # A stranger, a port scanner, or an engine gone before its ready message.
    table = ConnectionTable()
    table.accepted(7)
    assert table.disconnected(7) == []
    assert table.disconnected(99) == []  # never seen: nothing happens


def test_an_engines_former_connection_closing_does_not_touch_its_new_one() -> None:
    # The engine reconnected (its second ready message came on fd 9) before the
    # monitor reported its first connection's end.
    table = ConnectionTable()
    table.accepted(7)
    table.claim(7, A)
    table.accepted(9)
    table.claim(9, A)
    assert table.disconnected(7) == []
    assert table.connected(A)
    assert table.disconnected(9) == [A]


def test_a_reused_descriptor_belongs_to_the_connection_accepted_last() -> None:
    table = ConnectionTable()
    table.accepted(7)
    table.claim(7, A)
    assert table.disconnected(7) == [A]
    table.accepted(7)  # the kernel hands out the same number to the next connection
    assert table.claim(7, B)
    assert table.disconnected(7) == [B]


def test_a_claim_on_a_connection_already_closed_fails() -> None:
    table = ConnectionTable()
    table.accepted(7)
    assert table.disconnected(7) == []
    assert not table.claim(7, A)
    assert not table.connected(A)
    assert len(table) == 0
    assert table.gone(A)  # adrift, and nothing may be its own


def test_a_claim_on_a_connection_never_seen_takes_it_as_open() -> None:
    # The monitor's queue is bounded: an "accepted" event can be lost in a flood of
    # connections. The message proves the connection, so it is not taken for lost.
    table = ConnectionTable()
    assert table.claim(7, A)
    assert table.connected(A)
    assert table.disconnected(7) == [A]


# ------------------------------------------- a connection made again, silently

HOST, OTHER_HOST = ("host", "10.0.0.2"), ("host", "10.0.0.3")


def lost_and_made_again(peer: object = HOST) -> ConnectionTable:
    """Engine A's connection (fd 7, from ``HOST``) reset; libzmq made a new one (fd 9)
    from ``peer``, and A sent nothing on it (vLLM's engines send their ready once)."""
    table = ConnectionTable()
    table.accepted(7, HOST)
    table.claim(7, A)
    assert table.disconnected(7) == [A]
    table.accepted(9, peer)
    return table


def test_a_lost_engine_with_no_new_connection_is_gone() -> None:
    table = ConnectionTable()
    table.accepted(7, HOST)
    table.claim(7, A)
    table.disconnected(7)
    assert table.candidates(A) == []
    assert table.gone(A)


def test_a_new_connection_from_where_the_lost_one_came_may_be_the_engines() -> None:
    table = lost_and_made_again()
    assert table.candidates(A) == [9]
    assert not table.gone(A)
    assert not table.connected(A)  # not until it answers


def test_a_connection_from_elsewhere_or_of_unknown_origin_is_not_the_engines() -> None:
    assert lost_and_made_again(OTHER_HOST).gone(A)
    assert lost_and_made_again(None).gone(A)


def test_a_connection_made_before_the_loss_is_not_the_engines() -> None:
    # While the ROUTER held the engine's identity on its first connection, a second
    # one carrying it would have been ignored: whoever made fd 8 is someone else.
    table = ConnectionTable()
    table.accepted(7, HOST)
    table.claim(7, A)
    table.accepted(8, HOST)
    table.disconnected(7)
    assert table.gone(A)


def test_an_engine_that_answers_is_placed_on_its_new_connection_and_watched_there() -> None:
    table = lost_and_made_again()
    table.confirm(A)
    assert table.connected(A)
    assert table.candidates(A) == []
    # Killed or stopped later: that connection's end is its loss, as the first one's.
    assert table.disconnected(9) == [A]
    assert table.gone(A)


def test_a_new_connection_lost_before_the_engine_answered_puts_it_at_risk_again() -> None:
    table = lost_and_made_again()
    assert table.disconnected(9) == [A]
    assert table.gone(A)
    table.accepted(11, HOST)  # made again once more (a network that flaps)
    assert not table.gone(A)


def test_a_connection_another_engine_claims_is_not_the_engines_any_more() -> None:
    table = lost_and_made_again()
    assert table.claim(9, B)  # B's ready message came on it: B's
    assert table.gone(A)
    assert table.connected(B)


def test_engines_of_one_host_made_again_together_share_their_candidates() -> None:
    table = ConnectionTable()
    for fd, engine in ((7, A), (8, B)):
        table.accepted(fd, HOST)
        table.claim(fd, engine)
    assert table.disconnected(7) == [A]
    assert table.disconnected(8) == [B]
    table.accepted(9, HOST)
    table.accepted(10, HOST)
    assert not table.gone(A)
    assert not table.gone(B)
    # Both answer: each has a connection, nobody can tell which.
    table.confirm(A)
    table.confirm(B)
    assert not table.connected(A)
    assert not table.connected(B)
    # One of the two connections ends: either engine may have lost it, and both
    # must answer again. The one that does holds the connection left, so the other
    # cannot have one: it is gone.
    assert sorted(table.disconnected(10)) == [A, B]
    assert not table.gone(A)
    assert not table.gone(B)
    table.confirm(A)
    assert table.connected(A)  # the only connection that may be its own
    assert table.gone(B)


def test_an_engine_that_answered_is_placed_once_the_others_took_theirs() -> None:
    table = ConnectionTable()
    for fd, engine in ((7, A), (8, B)):
        table.accepted(fd, HOST)
        table.claim(fd, engine)
    table.disconnected(7)
    table.disconnected(8)
    table.accepted(9, HOST)
    table.accepted(10, HOST)
    table.confirm(A)
    assert table.candidates(A) == [9, 10]
    assert table.claim(10, B)  # B reconnected with a ready message (the reference engine)
    assert table.connected(A)
    assert table.disconnected(9) == [A]


def test_an_engine_out_of_service_holds_no_connection() -> None:
    table = ConnectionTable()
    for fd, engine in ((7, A), (8, B), (9, C)):
        table.accepted(fd, HOST)
        table.claim(fd, engine)
        table.disconnected(fd)
    table.accepted(10, HOST)
    table.accepted(11, HOST)
    table.confirm(A)
    table.confirm(C)
    assert table.gone(B)  # the two connections are A's and C's
    table.forget(A)  # declared dead meanwhile (hung, say)
    assert not table.gone(B)


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

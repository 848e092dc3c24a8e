"""ClientState: the client's bookkeeping rules, checked with no sockets and no event loop.

Every rule here used to be observable only through a running client; the state object
decides them alone, so each is a few synchronous lines.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from trio_enginecore.client._core._engines import EngineHandle
from trio_enginecore.client._core._policy import Fail, RouteAround
from trio_enginecore.client._core._state import MAX_TOMBSTONES, ClientState
from trio_enginecore.client._core._stream import StreamFeed, open_request_stream
from trio_enginecore.errors import EngineDeadError, ProtocolError
from trio_enginecore.protocol import (
    EEP_NOTIFICATION_CALL_ID,
    FT_STATUS_CALL_ID,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    UtilityOutput,
    UtilityResult,
)


class Aborts:
    """The ``send_abort`` callback: records what would be sent, per engine rank."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, list[str]]] = []

    def __call__(self, engine: EngineHandle, wire_ids: list[str]) -> None:
        self.sent.append((engine.rank, wire_ids))


def make_state(engines: int = 1, *, route_around: bool = False) -> tuple[ClientState, Aborts]:
    aborts = Aborts()
    handles = [EngineHandle.for_rank(rank) for rank in range(engines)]
    policy = RouteAround() if route_around else Fail()
    state = ClientState(handles, aborts, max_pending_outputs=4, policy=policy)
    return state, aborts


def request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest.for_tokens([1, 2], request_id=request_id)


def message(*outputs: EngineCoreOutput, engine: int = 0) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=engine, outputs=list(outputs))


def out(request_id: str, *tokens: int, finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, list(tokens), finish_reason=finish)


def logprobs(columns: int) -> LogprobsLists:
    return LogprobsLists(
        np.zeros((1, columns), dtype=np.int32),
        np.zeros((1, columns), dtype=np.float32),
        np.zeros(1, dtype=np.int32),
    )


def stream_feed(state: ClientState, request_id: str) -> StreamFeed:
    feed, _ = open_request_stream(request_id, on_close=state.stream_closed)
    return feed


# ----------------------------------------------------------------- requests


def test_a_registered_request_is_in_flight_on_its_engine_until_its_finished_output() -> None:
    state, _ = make_state()
    engine = state.engines[0]
    wire = state.register(request("a"), engine, stream=None)
    assert wire.request_id == "a"
    assert "a" in state.ids_in_flight
    assert engine.load.in_flight == 1
    state.handle_outputs(message(out("a", 5)))
    assert engine.load.in_flight == 1
    state.handle_outputs(message(out("a", 6, finish=FinishReason.STOP)))
    assert "a" not in state.ids_in_flight
    assert engine.load.in_flight == 0
    batch = state.take_batch()
    assert batch is not None
    assert [o.new_token_ids for o in batch.outputs] == [[5], [6]]  # in arrival order


def test_a_finished_request_leaves_the_published_counts_until_the_next_publication() -> None:
    # Counts published while a burst ran outlive it until the engines publish again; the
    # client knows its own requests left, and the balancer must not steer around an
    # engine that is idle by now.
    state, _ = make_state(engines=2)
    first, second = state.engines
    for i in range(3):
        state.register(request(f"r{i}"), second, stream=None)
    second.load.waiting, second.load.running = 1, 2  # published mid-burst
    state.handle_outputs(message(out("r0", 1, finish=FinishReason.STOP), engine=1))
    assert (second.load.waiting, second.load.running, second.load.in_flight) == (1, 1, 2)
    state.handle_outputs(message(out("r1", 1, finish=FinishReason.STOP), engine=1))
    state.abort(["r2"])
    assert (second.load.waiting, second.load.running, second.load.in_flight) == (0, 0, 0)
    assert (first.load.waiting, first.load.running) == (0, 0)


def test_abort_sends_one_abort_per_engine_holding_the_requests() -> None:
    state, aborts = make_state(engines=2)
    first, second = state.engines
    for request_id, engine in [("a", first), ("b", second), ("c", first)]:
        state.register(request(request_id), engine, stream=None)
    state.abort(["a", "b", "c", "unknown"])
    assert sorted(aborts.sent) == [(0, ["a", "c"]), (1, ["b"])]
    assert state.statistics().requests_in_flight == 0
    assert (first.load.in_flight, second.load.in_flight) == (0, 0)


def test_abort_drops_outputs_already_waiting_for_get_output() -> None:
    state, _ = make_state()
    engine = state.engines[0]
    state.register(request("a"), engine, stream=None)
    state.register(request("b"), engine, stream=None)
    state.handle_outputs(message(out("a", 1), out("b", 2)))
    state.abort(["a"])
    batch = state.take_batch()
    assert batch is not None
    assert [o.request_id for o in batch.outputs] == ["b"]


def test_an_id_reused_after_its_abort_travels_under_a_fresh_wire_id() -> None:
    state, _ = make_state()
    engine = state.engines[0]
    state.register(request("a"), engine, stream=None)
    state.abort(["a"])
    reused = request("a")
    wire = state.register(reused, engine, stream=None)
    assert wire.request_id != "a"
    assert wire.request_id.startswith("a~")
    assert wire.external_req_id == "a"
    assert reused.request_id == "a"  # the caller's object is untouched
    # A late output of the old request is dropped; the new one's reaches the caller
    # under the caller's id.
    state.handle_outputs(message(out("a", 9)))
    state.handle_outputs(message(out(wire.request_id, 1, finish=FinishReason.STOP)))
    assert state.statistics().outputs_dropped == 1
    batch = state.take_batch()
    assert batch is not None
    assert [(o.request_id, o.new_token_ids) for o in batch.outputs] == [("a", [1])]
    assert state.user_ids == {}
    assert state.wire_ids == {}


def test_aborted_ids_are_remembered_within_a_bound() -> None:
    state, _ = make_state()
    engine = state.engines[0]
    for i in range(MAX_TOMBSTONES + 5):
        state.register(request(f"r{i}"), engine, stream=None)
        state.abort([f"r{i}"])
    assert len(state.tombstones) == MAX_TOMBSTONES
    assert "r0" not in state.tombstones
    assert f"r{MAX_TOMBSTONES + 4}" in state.tombstones


def test_requests_on_a_dead_engine_are_not_aborted_on_the_wire() -> None:
    state, aborts = make_state()
    engine = state.engines[0]
    state.register(request("a"), engine, stream=None)
    engine.state = "dead"
    state.abort(["a"])
    assert aborts.sent == []
    assert state.tombstones == {}


# ------------------------------------------------------------------ streams


def test_stream_outputs_go_to_the_stream_not_to_get_output() -> None:
    state, _ = make_state()
    feed = stream_feed(state, "s")
    state.register(request("s"), state.engines[0], stream=feed)
    state.register(request("b"), state.engines[0], stream=None)
    state.handle_outputs(message(out("s", 1), out("b", 2), out("s", 3)))
    assert feed.pending is not None
    assert feed.pending.new_token_ids == [1, 3]
    batch = state.take_batch()
    assert batch is not None
    assert [o.request_id for o in batch.outputs] == ["b"]


def test_leaving_a_stream_block_early_aborts_its_request_once() -> None:
    state, aborts = make_state()
    feed = stream_feed(state, "s")
    state.register(request("s"), state.engines[0], stream=feed)
    state.open_streams += 1
    state.stream_left(feed)
    assert aborts.sent == [(0, ["s"])]
    assert state.statistics().open_streams == 0
    # Its late outputs are dropped, not delivered to get_output().
    state.handle_outputs(message(out("s", 4)))
    assert state.take_batch() is None
    assert state.streams == {}


def test_a_stream_whose_outputs_cannot_be_merged_fails_alone_and_is_aborted() -> None:
    state, aborts = make_state()
    broken = stream_feed(state, "broken")
    fine = stream_feed(state, "fine")
    state.register(request("broken"), state.engines[0], stream=broken)
    state.register(request("fine"), state.engines[0], stream=fine)
    # Nobody reads "broken", so its outputs are merged: a row of 2 logprob candidates
    # cannot be followed by one of 3.
    first = out("broken", 1)
    first.new_logprobs = logprobs(2)
    second = out("broken", 2)
    second.new_logprobs = logprobs(3)
    state.handle_outputs(message(first, out("fine", 7)))
    state.handle_outputs(message(second, out("fine", 8)))
    assert broken.failure is not None
    assert broken.failure_type is ProtocolError
    assert aborts.sent == [(0, ["broken"])]
    assert state.statistics().protocol_errors == 1
    assert fine.pending is not None
    assert fine.pending.new_token_ids == [7, 8]
    assert fine.failure is None


def test_outputs_of_requests_not_in_flight_are_dropped_and_counted() -> None:
    state, _ = make_state()
    state.register(request("a"), state.engines[0], stream=None)
    state.handle_outputs(message(out("a", 1, finish=FinishReason.STOP)))
    state.handle_outputs(message(out("a", 2), out("never-sent", 3)))
    assert state.statistics().outputs_dropped == 2
    batch = state.take_batch()
    assert batch is not None
    assert [o.new_token_ids for o in batch.outputs] == [[1]]


def test_a_message_from_an_engine_the_client_does_not_have_is_dropped_whole() -> None:
    state, _ = make_state(engines=2)
    state.register(request("a"), state.engines[0], stream=None)
    state.handle_outputs(message(out("a", 1), engine=7))
    stats = state.statistics()
    assert (stats.protocol_errors, stats.messages_received, stats.requests_in_flight) == (1, 0, 1)
    assert state.take_batch() is None


# ---------------------------------------------------------------- utilities


def test_a_utility_reply_resolves_its_call_and_unknown_replies_are_ignored() -> None:
    state, _ = make_state()
    call_id, call = state.calls.new("is_sleeping", state.engines[0])
    state.handle_outputs(
        EngineCoreOutputs(utility_output=UtilityOutput(call_id + 1, None, UtilityResult(True)))
    )
    assert not call.done.is_set()
    state.handle_outputs(
        EngineCoreOutputs(utility_output=UtilityOutput(call_id, None, UtilityResult(False)))
    )
    assert call.done.is_set()
    assert call.reply is not None
    assert call.reply.result == UtilityResult(False)
    assert state.calls.end(call_id) is True
    assert state.calls.pending == {}


def test_engine_notifications_are_not_replies() -> None:
    state, _ = make_state()
    call_id, call = state.calls.new("is_sleeping", state.engines[0])
    # vLLM 0.34's fault-tolerance pushes may say "diagnosing" and carry a mask.
    ft_status = UtilityResult({"id": 0, "status": "diagnosing", "mask": [1, 0]})
    for notification in (
        UtilityOutput(EEP_NOTIFICATION_CALL_ID, None, None),
        UtilityOutput(FT_STATUS_CALL_ID, None, ft_status),
    ):
        state.handle_outputs(EngineCoreOutputs(utility_output=notification))
    assert list(state.calls.pending) == [call_id]
    assert not call.done.is_set()
    assert state.statistics().messages_received == 2


def test_an_abandoned_call_is_reported_as_unanswered() -> None:
    state, _ = make_state()
    call_id, _ = state.calls.new("sleep", state.engines[0])
    assert state.calls.end(call_id) is False
    assert state.calls.pending == {}


# ----------------------------------------------------------------- failures


def test_an_engine_death_fails_only_its_requests_and_every_pending_call() -> None:
    state, _ = make_state(engines=2)
    first, second = state.engines
    on_first = stream_feed(state, "x")
    on_second = stream_feed(state, "y")
    state.register(request("x"), first, stream=on_first)
    state.register(request("y"), second, stream=on_second)
    _, call = state.calls.new("is_sleeping", state.engines[0])
    waiter = state.batch_ready
    assert state.lifecycle.engine_died(first, "killed") is True
    assert state.lifecycle.engine_died(first, "again") is False
    assert on_first.failure is not None
    assert "killed" in on_first.failure
    assert on_second.failure is None
    assert "y" in state.ids_in_flight
    assert "x" not in state.ids_in_flight
    assert call.done.is_set()
    assert call.failure is not None
    assert waiter.is_set()
    with pytest.raises(EngineDeadError, match=r"engine rank 0.*killed"):
        state.raise_if_unusable()
    assert state.statistics().engines_alive == 1


def test_routing_around_a_death_fails_that_engines_requests_and_calls_only() -> None:
    state, aborts = make_state(engines=3, route_around=True)
    first, second, third = state.engines
    on_first, on_second = stream_feed(state, "x"), stream_feed(state, "y")
    state.register(request("x"), first, stream=on_first)
    state.register(request("y"), second, stream=on_second)
    state.register(request("b1"), first, stream=None)
    state.register(request("b2"), third, stream=None)
    _, owed_by_first = state.calls.new("is_sleeping", first)
    _, owed_by_second = state.calls.new("is_sleeping", second)

    assert state.lifecycle.engine_died(first, "killed by signal 9") is True

    assert state.failure is None
    assert not state.ended.is_set()
    state.raise_if_unusable()  # the client serves on
    assert on_first.failure is not None
    assert "engine rank 0 died: killed by signal 9" in on_first.failure
    assert on_second.failure is None
    assert owed_by_first.failure is not None
    assert not owed_by_second.done.is_set()
    assert "x" not in state.ids_in_flight
    assert "b1" not in state.ids_in_flight
    assert "y" in state.ids_in_flight
    assert "b2" in state.ids_in_flight
    # An ABORT for an engine that may still be running (one cut off, say).
    assert aborts.sent == [(0, ["x", "b1"])]


def test_a_batch_request_of_an_engine_routed_around_ends_with_a_local_error_output() -> None:
    state, _ = make_state(engines=2, route_around=True)
    first, _second = state.engines
    state.register(request("b"), first, stream=None)
    state.lifecycle.engine_died(first, "exited with code 1")
    delivered = state.take_batch()
    assert delivered is not None
    assert delivered.engine_index == 0
    (output,) = delivered.outputs
    assert output.request_id == "b"
    assert output.finish_reason is FinishReason.ERROR
    assert output.error is not None
    assert output.error.code == "engine_dead"
    assert output.error.retryable
    assert "engine rank 0 died: exited with code 1" in output.error.message
    assert state.take_batch() is None


def test_an_id_whose_engine_was_routed_around_is_retried_under_a_fresh_wire_id() -> None:
    """Should the engine come back (an attached engine cut off by the network), its
    late outputs for the old request must not reach the retry."""
    state, _ = make_state(engines=2, route_around=True)
    first, second = state.engines
    state.register(request("r"), first, stream=None)
    state.lifecycle.engine_died(first, "no answer to a liveness check")
    state.take_batch()
    retry = state.register(request("r"), second, stream=None)
    assert retry.request_id != "r"
    state.handle_outputs(message(out("r", 5, finish=FinishReason.STOP), engine=1))
    assert state.take_batch() is None
    assert state.statistics().outputs_dropped == 1


def test_routing_around_fails_the_client_only_when_no_engine_is_left() -> None:
    state, _ = make_state(engines=2, route_around=True)
    first, second = state.engines
    _, call = state.calls.new("is_sleeping", second)
    state.lifecycle.engine_died(first, "killed")
    assert state.failure is None
    assert state.lifecycle.engine_died(second, "exited with code 1") is True
    assert state.failure is not None
    assert state.failure.startswith("no engine is left: engine rank 1 died: exited")
    assert state.ended.is_set()
    assert call.failure is not None
    with pytest.raises(EngineDeadError, match="no engine is left"):
        state.raise_if_unusable()


def test_statistics_show_each_engines_state_and_why_it_died() -> None:
    state, _ = make_state(engines=2, route_around=True)
    first, second = state.engines
    state.register(request("a"), second, stream=None)
    state.lifecycle.engine_died(first, "killed by signal 9")
    statuses = state.statistics().engines
    assert [(e.rank, e.state, e.in_flight) for e in statuses] == [(0, "dead", 0), (1, "alive", 1)]
    assert statuses[0].death == "killed by signal 9"
    assert statuses[1].death is None
    assert state.statistics().engines_alive == 1


@pytest.mark.parametrize("route_around", [False, True])
def test_requests_an_engine_in_service_lost_fail_alone_whatever_the_policy(
    route_around: bool,
) -> None:
    state, _ = make_state(engines=1, route_around=route_around)
    (engine,) = state.engines
    feed = stream_feed(state, "s")
    state.register(request("s"), engine, stream=feed)
    state.register(request("b"), engine, stream=None)
    _, call = state.calls.new("is_sleeping", engine)
    state.lifecycle.requests_lost(engine, "sent a second ready message")
    assert state.failure is None  # the engine is still in service
    state.raise_if_unusable()
    assert engine.alive
    assert feed.failure is not None
    assert "second ready message" in feed.failure
    assert call.failure is not None
    delivered = state.take_batch()
    assert delivered is not None
    assert [(o.request_id, o.finish_reason) for o in delivered.outputs] == [
        ("b", FinishReason.ERROR)
    ]
    assert state.statistics().requests_in_flight == 0


def test_a_death_during_closing_is_no_news() -> None:
    state, _ = make_state()
    state.close()
    assert state.lifecycle.engine_died(state.engines[0], "exited") is False
    assert state.failure is None
    with pytest.raises(trio.ClosedResourceError):
        state.raise_if_unusable()


def test_closing_aborts_what_is_in_flight_and_fails_every_waiter() -> None:
    state, aborts = make_state()
    feed = stream_feed(state, "s")
    state.register(request("s"), state.engines[0], stream=feed)
    state.register(request("b"), state.engines[0], stream=None)
    _, call = state.calls.new("sleep", state.engines[0])
    state.close()
    assert aborts.sent == [(0, ["s", "b"])]
    assert feed.finished_received  # ended with a local ABORT output
    assert feed.pending is not None
    assert feed.pending.finish_reason is FinishReason.ABORT
    assert call.failure is not None
    assert call.failure.message == "the engine client was closed"
    assert state.statistics().requests_in_flight == 0


def test_the_clients_own_liveness_calls_are_not_counted_as_pending() -> None:
    state = ClientState([EngineHandle.for_rank(0)], lambda engine, ids: None)
    state.calls.new("is_sleeping", state.engines[0], internal=True)
    assert state.statistics().pending_utility_calls == 0
    call_id, _ = state.calls.new("is_sleeping", state.engines[0])
    assert state.statistics().pending_utility_calls == 1
    state.calls.end(call_id)
    assert state.statistics().pending_utility_calls == 0

"""The coalescing buffers: ``merge_outputs`` and ``BatchCollector`` (pure, no I/O)."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trio_enginecore.client._core._collector import BatchCollector, merge_outputs
from trio_enginecore.errors import ProtocolError
from trio_enginecore.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
    PrefillStats,
    RequestError,
    SchedulerStats,
)

TOP = 2  # logprobs per token besides the sampled one


def logprobs_for(tokens: list[int]) -> LogprobsLists:
    """One row per token, with values derived from the token so rows are recognisable."""
    ids = np.array([[t, t + 1000, t + 2000] for t in tokens], dtype=np.int64).reshape(-1, TOP + 1)
    values = -np.array([[t, t + 0.5, t + 0.25] for t in tokens], dtype=np.float32)
    ranks = np.array(tokens, dtype=np.int64) % 7
    return LogprobsLists(ids, values.reshape(-1, TOP + 1), ranks)


def output(
    *tokens: int, request_id: str = "r", finish: FinishReason | None = None, **fields: Any
) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, list(tokens), finish_reason=finish, **fields)


def assert_logprobs(actual: LogprobsLists | None, tokens: list[int]) -> None:
    assert actual is not None
    expected = logprobs_for(tokens)
    for got, want in zip(actual[:3], expected[:3], strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype


# ----------------------------------------------------------------- merge_outputs


def test_merge_concatenates_token_ids_and_returns_the_older_updated_in_place() -> None:
    older = output(1, 2)
    newer = output(3, 4, 5)
    merged = merge_outputs(older, newer)
    assert merged is older
    assert merged.new_token_ids == [1, 2, 3, 4, 5]
    assert merged.request_id == "r"
    assert newer.new_token_ids == [3, 4, 5]  # the newer one is left alone


def test_merge_takes_finish_reason_and_stop_reason_from_the_newer() -> None:
    merged = merge_outputs(output(1), output(2, finish=FinishReason.STOP, stop_reason="</s>"))
    assert merged.finish_reason is FinishReason.STOP
    assert merged.stop_reason == "</s>"
    assert merged.finished

    # Unconditionally the newer's, even when the newer has none.
    merged = merge_outputs(output(1, stop_reason=7), output(2))
    assert merged.finish_reason is None
    assert merged.stop_reason is None

    merged = merge_outputs(
        output(1, finish=FinishReason.LENGTH, stop_reason=3), output(finish=FinishReason.ABORT)
    )
    assert merged.finish_reason is FinishReason.ABORT
    assert merged.stop_reason is None


def test_merge_takes_the_error_of_the_newer() -> None:
    error = RequestError("internal", "the model raised", retryable=True)
    merged = merge_outputs(output(1), output(finish=FinishReason.ERROR, error=error))
    assert merged.error == error
    assert merged.finish_reason is FinishReason.ERROR

    newer_error = RequestError("other", "again")
    merged = merge_outputs(output(error=error), output(error=newer_error))
    assert merged.error == newer_error


def test_merge_concatenates_events_in_order() -> None:
    queued = EngineCoreEvent(EngineCoreEventType.QUEUED, 1.0)
    scheduled = EngineCoreEvent(EngineCoreEventType.SCHEDULED, 2.0)
    preempted = EngineCoreEvent(EngineCoreEventType.PREEMPTED, 3.0)

    merged = merge_outputs(output(events=[queued]), output(events=[scheduled, preempted]))
    assert merged.events == [queued, scheduled, preempted]

    assert merge_outputs(output(), output(events=[scheduled])).events == [scheduled]
    assert merge_outputs(output(events=[queued]), output()).events == [queued]
    assert merge_outputs(output(events=[queued]), output(events=[])).events == [queued]
    assert merge_outputs(output(), output()).events is None


def test_merge_does_not_share_the_newer_events_list() -> None:
    queued = EngineCoreEvent(EngineCoreEventType.QUEUED, 1.0)
    newer_events = [EngineCoreEvent(EngineCoreEventType.SCHEDULED, 2.0)]
    merged = merge_outputs(output(), output(events=newer_events))
    merge_outputs(merged, output(events=[queued]))
    assert len(newer_events) == 1


def test_merge_sums_nans() -> None:
    assert merge_outputs(output(num_nans_in_logits=2), output()).num_nans_in_logits == 2
    assert (
        merge_outputs(output(num_nans_in_logits=2), output(num_nans_in_logits=3)).num_nans_in_logits
        == 5
    )
    assert merge_outputs(output(), output()).num_nans_in_logits == 0


def test_merge_concatenates_logprobs_along_the_token_axis() -> None:
    older = output(1, 2, new_logprobs=logprobs_for([1, 2]))
    newer = output(3, new_logprobs=logprobs_for([3]))
    merged = merge_outputs(older, newer)
    assert merged.new_token_ids == [1, 2, 3]
    assert_logprobs(merged.new_logprobs, [1, 2, 3])
    assert merged.new_logprobs is not None
    assert merged.new_logprobs.logprobs.shape == (3, TOP + 1)
    assert merged.new_logprobs.sampled_token_ranks.shape == (3,)


def test_logprobs_that_cannot_follow_each_other_raise_and_leave_the_older_unchanged() -> None:
    older = output(1, 2, new_logprobs=logprobs_for([1, 2]))
    wider = LogprobsLists(
        np.zeros((1, TOP + 5), dtype=np.int64),
        np.zeros((1, TOP + 5), dtype=np.float32),
        np.zeros(1, dtype=np.int64),
    )
    with pytest.raises(ProtocolError, match="cannot follow each other"):
        merge_outputs(older, output(3, new_logprobs=wider))
    assert older.new_token_ids == [1, 2]
    assert_logprobs(older.new_logprobs, [1, 2])


@pytest.mark.parametrize("side", ["older", "newer", "both"])
def test_merge_logprobs_with_none_on_a_side(side: str) -> None:
    older = output(1, new_logprobs=None if side in ("older", "both") else logprobs_for([1]))
    newer = output(2, new_logprobs=None if side in ("newer", "both") else logprobs_for([2]))
    merged = merge_outputs(older, newer)
    if side == "both":
        assert merged.new_logprobs is None
    else:
        assert_logprobs(merged.new_logprobs, [2] if side == "older" else [1])


def test_merge_keeps_the_newest_value_that_was_set_for_other_fields() -> None:
    experts_old = np.arange(4, dtype=np.int32).reshape(2, 2)
    experts_new = np.arange(6, dtype=np.int32).reshape(3, 2)
    older = output(
        1,
        kv_transfer_params={"remote": "a"},
        routed_experts=experts_old,
        trace_headers={"traceparent": "x"},
        prefill_stats=PrefillStats(num_prompt_tokens=5),
    )
    newer = output(2, kv_transfer_params={"remote": "b"}, routed_experts=experts_new)
    merged = merge_outputs(older, newer)
    assert merged.kv_transfer_params == {"remote": "b"}
    assert merged.routed_experts is experts_new
    # Not set in the newer: the older value survives.
    assert merged.trace_headers == {"traceparent": "x"}
    assert merged.prefill_stats == PrefillStats(num_prompt_tokens=5)

    merged = merge_outputs(merged, output(3, mm_cache_miss_hashes=["h"]))
    assert merged.kv_transfer_params == {"remote": "b"}
    assert merged.routed_experts is experts_new
    assert merged.mm_cache_miss_hashes == ["h"]
    assert merged.new_token_ids == [1, 2, 3]


# A value to set for each field of EngineCoreOutput a merge must not lose; one added to
# the protocol later and missing here fails the test below.
_SET: dict[str, object] = {
    "new_logprobs": logprobs_for([2]),
    "new_prompt_logprobs_tensors": "prompt-logprobs",
    "pooling_output": "pooled",
    "events": [EngineCoreEvent(EngineCoreEventType.QUEUED, 1.0)],
    "kv_transfer_params": {"k": 1},
    "ec_transfer_params": {"e": 1},
    "trace_headers": {"t": "1"},
    "prefill_stats": PrefillStats(num_prompt_tokens=3),
    "routed_experts": np.zeros((1, 2), np.int32),
    "num_nans_in_logits": 2,
    "mm_cache_miss_hashes": ["h"],
    "new_sampling_mask": "mask",
    "spec_decode_metrics": "spec",
    "prompt_token_id_logprobs": "ptl",
    "error": RequestError("code", "message"),
    "watermarking": True,
}


@pytest.mark.parametrize(
    "field",
    [
        f.name
        for f in msgspec.structs.fields(EngineCoreOutput)
        if f.name not in ("request_id", "new_token_ids", "finish_reason", "stop_reason")
    ],
)
def test_no_field_of_a_newer_output_is_lost_in_a_merge(field: str) -> None:
    """The merge's fast path (only tokens and how they ended) must not be taken for an
    output that carries anything else."""
    assert field in _SET, f"EngineCoreOutput.{field} is new: say how it merges"
    newer = output(2, **{field: _SET[field]})
    merged = merge_outputs(output(1), newer)
    value = getattr(merged, field)
    if isinstance(value, np.ndarray) or field == "new_logprobs":
        assert value is not None
    else:
        assert value == _SET[field]
    assert merged.new_token_ids == [1, 2]


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=12),
    finish=st.none() | st.sampled_from(FinishReason),
    with_logprobs=st.booleans(),
)
def test_merging_random_deltas_left_to_right_gives_the_whole_sequence(
    tokens: list[int], cuts: list[int], finish: FinishReason | None, with_logprobs: bool
) -> None:
    bounds = [0, *sorted(min(c, len(tokens)) for c in cuts), len(tokens)]
    pieces = [tokens[a:b] for a, b in itertools.pairwise(bounds)]
    deltas = [
        output(
            *piece,
            new_logprobs=logprobs_for(piece) if with_logprobs else None,
            num_nans_in_logits=1,
        )
        for piece in pieces
    ]
    deltas[-1].finish_reason = finish

    merged = deltas[0]
    for delta in deltas[1:]:
        merged = merge_outputs(merged, delta)

    assert merged.new_token_ids == tokens
    assert merged.finish_reason == finish
    assert merged.num_nans_in_logits == len(deltas)
    if with_logprobs:
        assert_logprobs(merged.new_logprobs, tokens)
    else:
        assert merged.new_logprobs is None


# ----------------------------------------------------------------- BatchCollector


def message(
    engine_index: int = 0,
    *outputs: EngineCoreOutput,
    stats: SchedulerStats | None = None,
    finished: set[str] | None = None,
    timestamp: float = 1.0,
) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        engine_index=engine_index,
        outputs=list(outputs),
        scheduler_stats=stats,
        finished_requests=finished,
        timestamp=timestamp,
    )


def test_max_pending_must_be_at_least_one() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_pending"):
            BatchCollector(bad)
    assert BatchCollector(1).max_pending == 1
    assert BatchCollector().max_pending == 64


def test_take_on_an_empty_collector_returns_none() -> None:
    collector = BatchCollector(4)
    assert collector.take() is None
    assert len(collector) == 0
    collector.put(message())
    assert collector.take() is not None
    assert collector.take() is None


def test_a_consumer_that_keeps_up_gets_each_message_as_it_arrived() -> None:
    collector = BatchCollector(3)
    messages = [message(0, output(i, request_id=f"r{i}")) for i in range(3)]
    for m in messages:
        collector.put(m)
        assert len(collector) == 1
        assert collector.take() is m  # kept as it arrived
    assert len(collector) == 0
    assert collector.merged == 0
    assert collector.take() is None


def test_take_hands_over_an_engines_backlog_in_one_message_in_arrival_order() -> None:
    collector = BatchCollector(3)
    messages = [message(0, output(i, request_id=f"r{i}")) for i in range(3)]
    for i, m in enumerate(messages):
        collector.put(m)
        assert len(collector) == i + 1
    assert collector.merged == 0
    taken = collector.take()
    assert taken is messages[0]
    assert [o.request_id for o in taken.outputs] == ["r0", "r1", "r2"]
    assert len(collector) == 0
    assert collector.take() is None


def test_past_the_bound_messages_merge_into_the_newest_of_the_same_engine() -> None:
    collector = BatchCollector(2)
    first = message(0, output(1, request_id="a"), stats=SchedulerStats(step_counter=1))
    second = message(
        0, output(2, request_id="a"), stats=SchedulerStats(step_counter=2), finished={"x"}
    )
    collector.put(first)
    collector.put(second)
    collector.put(
        message(
            0,
            output(3, request_id="a"),
            output(9, request_id="b", finish=FinishReason.STOP),
            stats=SchedulerStats(step_counter=3),
            finished={"b"},
            timestamp=5.0,
        )
    )
    collector.put(message(0, output(4, request_id="a"), finished=None, timestamp=6.0))
    assert len(collector) == 2
    assert collector.merged == 2

    # Past the bound the newest message absorbed the next ones; take() then hands over
    # the whole backlog of the engine at once.
    assert [o.new_token_ids for o in second.outputs] == [[2], [3], [9], [4]]
    merged = collector.take()
    assert merged is first
    assert [(o.request_id, o.new_token_ids) for o in merged.outputs] == [
        ("a", [1]),
        ("a", [2]),
        ("a", [3]),
        ("b", [9]),
        ("a", [4]),
    ]
    # The latest stats that were sent (the last message had none).
    assert merged.scheduler_stats == SchedulerStats(step_counter=3)
    assert merged.finished_requests == {"x", "b"}
    assert merged.timestamp == 6.0
    assert merged.engine_index == 0
    assert collector.take() is None


def test_finished_requests_union_starts_from_none() -> None:
    collector = BatchCollector(1)
    collector.put(message(0, output(1)))
    collector.put(message(0, finished={"a"}))
    collector.put(message(0, finished={"b"}))
    collector.put(message(0, finished=set()))
    merged = collector.take()
    assert merged is not None
    assert merged.finished_requests == {"a", "b"}
    assert collector.merged == 3


def test_messages_of_another_engine_are_not_merged_into_it() -> None:
    collector = BatchCollector(1)
    collector.put(message(0, output(1, request_id="e0")))
    collector.put(message(1, output(2, request_id="e1")))  # no engine-1 message: appended
    assert len(collector) == 2
    assert collector.merged == 0

    collector.put(message(0, output(3, request_id="e0")))  # merges into the engine-0 one
    collector.put(message(1, output(4, request_id="e1")))  # merges into the engine-1 one
    assert len(collector) == 2
    assert collector.merged == 2

    by_engine = {}
    while (taken := collector.take()) is not None:
        by_engine[taken.engine_index] = taken
    assert [o.new_token_ids for o in by_engine[0].outputs] == [[1], [3]]
    assert [o.new_token_ids for o in by_engine[1].outputs] == [[2], [4]]
    assert {o.request_id for o in by_engine[0].outputs} == {"e0"}
    assert {o.request_id for o in by_engine[1].outputs} == {"e1"}


def test_merge_picks_the_newest_pending_message_of_the_engine() -> None:
    collector = BatchCollector(3)
    old0 = message(0, output(1))
    new0 = message(0, output(2))
    other = message(1, output(3))
    for m in (old0, new0, other):
        collector.put(m)
    collector.put(message(0, output(4)))
    assert [o.new_token_ids for o in old0.outputs] == [[1]]
    assert [o.new_token_ids for o in new0.outputs] == [[2], [4]]
    assert [o.new_token_ids for o in other.outputs] == [[3]]
    # take() hands over engine 0's backlog in order, then engine 1's message.
    taken = [collector.take() for _ in range(2)]
    assert taken == [old0, other]
    assert [o.new_token_ids for o in old0.outputs] == [[1], [2], [4]]
    assert collector.take() is None


def test_scheduler_stats_only_messages_are_kept_and_merged() -> None:
    collector = BatchCollector(1)
    collector.put(message(0, stats=SchedulerStats(num_running_reqs=1)))
    collector.put(message(0, stats=SchedulerStats(num_running_reqs=2)))
    taken = collector.take()
    assert taken is not None
    assert taken.outputs == []
    assert taken.scheduler_stats == SchedulerStats(num_running_reqs=2)


def test_the_collector_is_usable_again_after_draining() -> None:
    collector = BatchCollector(1)
    collector.put(message(0, output(1)))
    collector.put(message(0, output(2)))
    taken = collector.take()
    assert taken is not None
    assert [o.new_token_ids for o in taken.outputs] == [[1], [2]]
    fresh = message(0, output(3))
    collector.put(fresh)
    assert collector.take() is fresh


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("take"), st.just(0), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(max_pending=st.integers(1, 5), ops=_ops)
def test_no_output_is_ever_lost(max_pending: int, ops: list[tuple[str, int, int]]) -> None:
    collector = BatchCollector(max_pending)
    engines = 3
    counter = 0
    puts = 0
    put_outputs: dict[int, list[int]] = {e: [] for e in range(engines)}
    taken_outputs: dict[int, list[int]] = {e: [] for e in range(engines)}
    taken_messages = 0

    def drain_one() -> bool:
        nonlocal taken_messages
        taken = collector.take()
        if taken is None:
            return False
        taken_messages += 1
        for o in taken.outputs:
            # engine_index stays truthful: every output belongs to the message's engine.
            assert o.request_id == f"engine-{taken.engine_index}"
            taken_outputs[taken.engine_index].extend(o.new_token_ids)
        return True

    for op, engine, n_outputs in ops:
        if op == "put":
            outs = []
            for _ in range(n_outputs):
                outs.append(output(counter, request_id=f"engine-{engine}"))
                put_outputs[engine].append(counter)
                counter += 1
            collector.put(message(engine, *outs))
            puts += 1
            # Past the bound only an engine with nothing pending can add a message.
            assert len(collector) <= max_pending + engines - 1
        else:
            before = len(collector)
            assert drain_one() == (before > 0)
            # One take hands over everything pending from the oldest message's engine.
            assert len(collector) <= max(before - 1, 0)

    while drain_one():
        pass
    assert len(collector) == 0
    assert taken_outputs == put_outputs
    # Every message put was handed over at the head of a take or folded into one.
    assert taken_messages <= puts

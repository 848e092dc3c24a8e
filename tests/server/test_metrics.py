"""vLLM's Prometheus metrics (``trio_enginecore.server._metrics``; pure: fed by hand).

Request lifecycles recorded as the server records them (engine messages with their
engine timestamps and events, then the finish), checked in the text exposition as a
Prometheus server reads it; the exposition checked sample for sample against
``prometheus_client``'s own metric classes. Names, types, labels and buckets against
vLLM's own registry: ``tests/interop/test_metrics_names.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from trio_enginecore.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    PrefillStats,
    RequestError,
    SchedulerStats,
)
from trio_enginecore.server._metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    VllmMetrics,
    histogram_buckets,
)

QUEUED, SCHEDULED, PREEMPTED = (
    EngineCoreEventType.QUEUED,
    EngineCoreEventType.SCHEDULED,
    EngineCoreEventType.PREEMPTED,
)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def metrics(
    engines: Iterable[int] = (0,), *, created_series: bool = True
) -> tuple[VllmMetrics, Clock]:
    clock = Clock()
    m = VllmMetrics(
        model_name="tiny",
        max_model_len=1024,
        engine_indexes=engines,
        created_series=created_series,
        clock=clock,
    )
    return m, clock


def samples(m: VllmMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the exposition, as a Prometheus server parses it."""
    found: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in found, key
            found[key] = s.value
    return found


def value(m: VllmMetrics, name: str, engine: str = "0", **labels: str) -> float:
    key = (name, frozenset({"model_name": "tiny", "engine": engine, **labels}.items()))
    return samples(m)[key]


def message(
    *outputs: EngineCoreOutput,
    ts: float,
    engine: int = 0,
    stats: SchedulerStats | None = None,
) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        engine_index=engine, outputs=list(outputs), timestamp=ts, scheduler_stats=stats
    )


def events(*pairs: tuple[EngineCoreEventType, float]) -> list[EngineCoreEvent]:
    return [EngineCoreEvent(kind, at) for kind, at in pairs]


# ------------------------------------------------------------------ lifecycles


def test_one_request_from_arrival_to_finish() -> None:
    m, clock = metrics()
    m.add_request(["r"], prompt_tokens=7, max_tokens=16, arrival_time=1000.0)
    # Queued at 50.0, scheduled at 50.25 (engine clock); first token at 50.5, received
    # 0.125 s after arrival; then two steps of 0.5 s and 1.0 s.
    first = EngineCoreOutput(
        "r",
        [1],
        events=events((QUEUED, 50.0), (SCHEDULED, 50.25)),
        prefill_stats=PrefillStats(7, 5, 2, 2, 0, 0),
    )
    m.record_engine_outputs(message(first, ts=50.5), now=1000.125)
    m.record_engine_outputs(message(EngineCoreOutput("r", [2, 3]), ts=51.0), now=1000.6)
    last = EngineCoreOutput("r", [4], finish_reason=FinishReason.LENGTH)
    m.record_engine_outputs(message(last, ts=52.0), now=1001.6)
    clock.now = 1002.0
    m.finish_request("r", FinishReason.LENGTH)
    assert m.pending_requests == 0

    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(m, "vllm:generation_tokens_total") == 4
    assert value(m, "vllm:prompt_tokens_total") == 7
    assert value(m, "vllm:prompt_tokens_cached_total") == 2
    assert value(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == 5
    assert value(m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 2
    # Histograms: one observation each, with vLLM's intervals.
    expected = {
        "vllm:time_to_first_token_seconds": 0.125,
        "vllm:e2e_request_latency_seconds": 2.0,
        "vllm:request_queue_time_seconds": 0.25,
        "vllm:request_prefill_time_seconds": 0.25,
        "vllm:request_decode_time_seconds": 1.5,
        "vllm:request_inference_time_seconds": 1.75,
        "vllm:request_time_per_output_token_seconds": 0.5,  # 1.5 s / (4 - 1) tokens
        "vllm:request_prompt_tokens": 7,
        "vllm:request_generation_tokens": 4,
        "vllm:request_params_max_tokens": 16,
        "vllm:request_params_n": 1,
        "vllm:request_max_num_generation_tokens": 4,
        "vllm:request_num_preemptions": 0,
        "vllm:request_prefill_kv_computed_tokens": 5,
    }
    for name, observed in expected.items():
        assert value(m, f"{name}_count") == 1, name
        assert value(m, f"{name}_sum") == observed, name
    # Inter-token latency: two observations (0.5 s and 1.0 s), in their buckets; the
    # bounds are inclusive ("le").
    assert value(m, "vllm:inter_token_latency_seconds_count") == 2
    assert value(m, "vllm:inter_token_latency_seconds_sum") == 1.5
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.4") == 0
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.5") == 1
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="1.0") == 2
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="+Inf") == 2
    # Tokens per step: 5 computed + 1, then 2, then 1.
    assert value(m, "vllm:iteration_tokens_total_count") == 3
    assert value(m, "vllm:iteration_tokens_total_sum") == 9
    assert value(m, "vllm:iteration_tokens_total_bucket", le="1.0") == 1
    assert value(m, "vllm:iteration_tokens_total_bucket", le="8.0") == 3


def test_counters_end_in_total_and_histograms_have_cumulative_buckets() -> None:
    m, _ = metrics()
    text = m.render().decode()
    assert "# TYPE vllm:generation_tokens_total counter" in text
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 0.0' in text
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
    assert "# TYPE vllm:num_requests_running gauge" in text
    m.add_request(["r"], prompt_tokens=1, max_tokens=None)
    m.record_step(0, [EngineCoreOutput("r", [1])], 1.0, now=1000.0)
    m.finish_request("r", "stop", now=1000.0 + 3.0)
    # 3.0 s: not in the buckets up to 2.5, in every bucket from 5.0 on.
    buckets = {
        labels["le"]: count
        for (name, labels_set), count in samples(m).items()
        if name == "vllm:e2e_request_latency_seconds_bucket"
        and (labels := dict(labels_set))["engine"] == "0"
    }
    bounds = [*REQUEST_LATENCY_BUCKETS, math.inf]
    assert list(buckets) == [("+Inf" if b == math.inf else repr(float(b))) for b in bounds]
    assert [buckets[k] for k in buckets] == [0] * 7 + [1] * 15
    # No max_tokens: vLLM observes max_tokens only when the request had one.
    assert value(m, "vllm:request_params_max_tokens_count") == 0


def test_preemptions_count_and_the_first_scheduling_counts() -> None:
    m, _ = metrics()
    m.add_request(["r"], prompt_tokens=3, max_tokens=8, arrival_time=990.0)
    m.record_step(
        0,
        [EngineCoreOutput("r", [1], events=events((QUEUED, 10.0), (SCHEDULED, 11.0)))],
        12.0,
        now=1000.0,
    )
    # Preempted, then scheduled again: the queue time stays the first wait.
    later = EngineCoreOutput("r", [2], events=events((PREEMPTED, 12.5), (SCHEDULED, 13.5)))
    m.record_step(0, [later], 14.0, now=1002.0)
    m.record_step(0, [EngineCoreOutput("r", [3], events=events((PREEMPTED, 14.1)))], 15.0)
    m.finish_request("r", "length", now=1004.0)
    assert value(m, "vllm:num_preemptions_total") == 2
    assert value(m, "vllm:request_num_preemptions_sum") == 2
    assert value(m, "vllm:request_num_preemptions_bucket", le="1.0") == 0
    assert value(m, "vllm:request_num_preemptions_bucket", le="2.0") == 1
    assert value(m, "vllm:request_queue_time_seconds_sum") == 1.0
    assert value(m, "vllm:request_prefill_time_seconds_sum") == 1.0
    assert value(m, "vllm:request_inference_time_seconds_sum") == 4.0


def test_n_requests_count_n_and_the_longest_child_once() -> None:
    m, _ = metrics()
    m.add_request(["0_r", "1_r", "2_r"], prompt_tokens=4, max_tokens=10)
    m.record_step(0, [EngineCoreOutput(i, [1]) for i in ("0_r", "1_r", "2_r")], 1.0)
    m.record_step(0, [EngineCoreOutput("1_r", [2, 3, 4])], 2.0)
    for child in ("0_r", "1_r"):
        m.finish_request(child, "length")
        assert value(m, "vllm:request_params_n_count") == 0  # not until the last
    m.finish_request("2_r", "stop")
    assert value(m, "vllm:request_params_n_count") == 1
    assert value(m, "vllm:request_params_n_sum") == 3
    assert value(m, "vllm:request_max_num_generation_tokens_sum") == 4
    # Each child is a request of its own for the rest, as in vLLM.
    assert value(m, "vllm:request_success_total", finished_reason="length") == 2
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_generation_tokens_count") == 3
    assert value(m, "vllm:request_params_max_tokens_count") == 3


def test_aborted_requests_count_nothing_as_in_vllm() -> None:
    m, _ = metrics()
    m.add_request(["a"], prompt_tokens=2, max_tokens=5)
    m.add_request(["0_b", "1_b"], prompt_tokens=2, max_tokens=5)
    m.record_step(0, [EngineCoreOutput("a", [1]), EngineCoreOutput("0_b", [1])], 1.0)
    m.forget_request("a")  # the client went away
    m.finish_request("0_b", "stop")  # one child finished, the other was aborted
    m.forget_request("1_b")
    m.forget_request("never-added")
    m.finish_request("a", "stop")  # too late: forgotten
    assert m.pending_requests == 0
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_params_n_count") == 0
    assert value(m, "vllm:generation_tokens_total") == 2  # produced all the same


def test_outputs_of_unknown_requests_and_rejected_requests_are_ignored() -> None:
    m, _ = metrics()
    m.add_request(["r"], prompt_tokens=2, max_tokens=5)
    error = RequestError("paused", "the engine is paused")
    m.record_step(
        0, [EngineCoreOutput("late", [1, 2]), EngineCoreOutput("r", [], error=error)], 1.0
    )
    assert m.pending_requests == 0
    assert value(m, "vllm:generation_tokens_total") == 0
    assert value(m, "vllm:time_to_first_token_seconds_count") == 0
    # A step with outputs is a step, even if none is counted (vLLM observes 0).
    assert value(m, "vllm:iteration_tokens_total_count") == 1
    m.record_step(0, [], 2.0)  # no outputs: no step
    assert value(m, "vllm:iteration_tokens_total_count") == 1


def test_without_events_or_prefill_statistics() -> None:
    """An engine without log_stats sends no events: the queue, prefill and inference
    times are not observed; one without PrefillStats (the reference engine) has its
    prompt counted as computed."""
    m, _ = metrics()
    m.add_request(["r"], prompt_tokens=6, max_tokens=5)
    m.record_step(0, [EngineCoreOutput("r", [1])], 5.0)
    m.record_step(0, [EngineCoreOutput("r", [2], finish_reason=FinishReason.LENGTH)], 5.25)
    m.finish_request("r", "length")
    for name in ("queue_time", "prefill_time", "inference_time"):
        assert value(m, f"vllm:request_{name}_seconds_count") == 0, name
    assert value(m, "vllm:request_decode_time_seconds_sum") == 0.25
    assert value(m, "vllm:prompt_tokens_total") == 6
    assert value(m, "vllm:prompt_tokens_by_source_total", source="local_compute") == 6
    assert value(m, "vllm:request_prefill_kv_computed_tokens_sum") == 6


def test_scheduler_stats_per_engine() -> None:
    m, _ = metrics(engines=(0, 1))
    stats = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=2,
        num_skipped_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_stats={"requests": 2, "queries": 40, "hits": 16, "reset": False},
        connector_prefix_cache_stats={
            "queries": 24,
            "hits": 8,
            "hits_by_source": {"host": 5, "disk": 3, "unknown-tier": 9},
        },
    )
    m.record_engine_outputs(message(ts=1.0, engine=1, stats=stats))
    m.record_engine_outputs(message(ts=2.0, engine=1, stats=stats))
    assert value(m, "vllm:num_requests_running", engine="1") == 3
    assert value(m, "vllm:num_requests_running", engine="0") == 0
    assert value(m, "vllm:num_requests_waiting", engine="1") == 3  # waiting + deferred
    assert value(m, "vllm:num_requests_waiting_by_reason", engine="1", reason="capacity") == 2
    assert value(m, "vllm:num_requests_waiting_by_reason", engine="1", reason="deferred") == 1
    assert value(m, "vllm:kv_cache_usage_perc", engine="1") == 0.25
    # Counters add each message's figures (the engine sends them per interval).
    assert value(m, "vllm:prefix_cache_queries_total", engine="1") == 80
    assert value(m, "vllm:prefix_cache_hits_total", engine="1") == 32
    assert value(m, "vllm:external_prefix_cache_queries_total", engine="1") == 48
    assert value(m, "vllm:external_prefix_cache_hits_total", engine="1") == 16
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    assert value(m, by_source, engine="1", source="device") == 32
    assert value(m, by_source, engine="1", source="host") == 10
    assert value(m, by_source, engine="1", source="disk") == 6
    assert value(m, by_source, engine="1", source="p2p") == 0


def test_statistics_that_are_not_numbers_count_as_zero() -> None:
    m, _ = metrics()
    stats = SchedulerStats(prefix_cache_stats={"queries": "many", "hits": None})
    m.record_scheduler_stats(0, stats)
    assert value(m, "vllm:prefix_cache_queries_total") == 0


def test_an_engine_first_heard_of_later_gets_its_series() -> None:
    m, _ = metrics(engines=(0,))
    m.add_request(["r"], prompt_tokens=1, max_tokens=2)
    m.record_step(3, [EngineCoreOutput("r", [1])], 1.0)
    m.finish_request("r", "stop")
    assert value(m, "vllm:request_success_total", engine="3", finished_reason="stop") == 1
    assert value(m, "vllm:request_success_total", engine="0", finished_reason="stop") == 0


def test_request_finished_before_any_output_counts_on_the_first_engine() -> None:
    m, _ = metrics(engines=(2, 1))
    m.add_request(["r"], prompt_tokens=1, max_tokens=2)
    m.finish_request("r", "abort")
    assert value(m, "vllm:request_success_total", engine="1", finished_reason="abort") == 1


def test_finish_reasons_by_name() -> None:
    m, _ = metrics()
    for reason in FinishReason:
        m.add_request([str(reason)], prompt_tokens=1, max_tokens=1)
        m.finish_request(str(reason), str(reason))
        assert value(m, "vllm:request_success_total", finished_reason=str(reason)) == 1
    with pytest.raises(ValueError, match="not a finish reason: 'done'"):
        m.finish_request("x", "done")


# ------------------------------------------------------------------ other events


def test_cache_config_info_is_a_gauge_labelled_with_the_config() -> None:
    m, _ = metrics(engines=(0, 1))
    assert not any(name == "vllm:cache_config_info" for name, _ in samples(m))
    info = {"block_size": "16", "enable_prefix_caching": True, "num_gpu_blocks": 1000}
    m.set_cache_config_info(0, info)
    m.set_cache_config_info(1, {**info, "num_gpu_blocks": 999})
    found = {
        labels: v for (name, labels), v in samples(m).items() if name == "vllm:cache_config_info"
    }
    assert found == {
        frozenset(
            {
                "block_size": "16",
                "enable_prefix_caching": "True",
                "num_gpu_blocks": n,
                "engine": e,
            }.items()
        ): 1.0
        for n, e in (("1000", "0"), ("999", "1"))
    }
    with pytest.raises(ValueError, match="has keys"):
        m.set_cache_config_info(2, {"block_size": "16"})
    with pytest.raises(ValueError, match="'engine'"):
        VllmMetrics(model_name="x", max_model_len=8).set_cache_config_info(0, {"engine": "0"})


def test_sleep_state_and_admission_rejections() -> None:
    m, _ = metrics(engines=(0, 1))
    assert value(m, "vllm:engine_sleep_state", engine="1", sleep_state="awake") == 1
    m.record_sleep_state(sleep=1, level=2)
    assert value(m, "vllm:engine_sleep_state", engine="1", sleep_state="awake") == 0
    assert value(m, "vllm:engine_sleep_state", engine="1", sleep_state="discard_all") == 1
    assert value(m, "vllm:engine_sleep_state", engine="0", sleep_state="weights_offloaded") == 0
    m.record_sleep_state(sleep=0)
    assert value(m, "vllm:engine_sleep_state", engine="0", sleep_state="awake") == 1
    m.record_admission_rejection("max_num_queued_reqs")
    key = (
        "vllm:admission_rejections_total",
        frozenset({"model_name": "tiny", "reason": "max_num_queued_reqs"}.items()),
    )
    assert samples(m)[key] == 1
    with pytest.raises(ValueError, match="reason must be one of"):
        m.record_admission_rejection("too_many")


# ------------------------------------------------------------------ buckets


def test_buckets_are_vllms() -> None:
    assert histogram_buckets("request_tokens", max_model_len=1024) == (
        1, 2, 5, 10, 20, 50, 100, 200, 500, 1000,
    )  # fmt: skip
    assert histogram_buckets("request_tokens", max_model_len=1000)[-1] == 1000
    assert histogram_buckets("request_tokens", max_model_len=4)[-1] == 2
    assert histogram_buckets("inter_token_latency") == INTER_TOKEN_LATENCY_BUCKETS
    assert histogram_buckets("request_params_n", overrides={"request_params_n": [1, 4]}) == (1, 4)
    with pytest.raises(ValueError, match="max_model_len is required"):
        histogram_buckets("request_tokens")
    with pytest.raises(ValueError, match="unknown histogram bucket family"):
        histogram_buckets("kv_cache_residency")
    with pytest.raises(ValueError, match="increasing"):
        histogram_buckets("request_params_n", overrides={"request_params_n": [2, 1]})
    with pytest.raises(ValueError, match="unknown histogram bucket families"):
        VllmMetrics(model_name="x", max_model_len=8, bucket_overrides={"ttft": [1.0]})


def test_bucket_overrides_and_large_models() -> None:
    m = VllmMetrics(
        model_name="tiny",
        max_model_len=2_000_000,
        bucket_overrides={"time_to_first_token": [0.5, 1.5]},
    )
    les = [
        dict(labels)["le"]
        for name, labels in samples(m)
        if name == "vllm:request_prompt_tokens_bucket"
    ]
    # Written as prometheus_client writes floats (Go's format past 1e6).
    assert les[-3:] == ["1e+06", "2e+06", "+Inf"]
    ttft = [
        dict(labels)["le"]
        for name, labels in samples(m)
        if name == "vllm:time_to_first_token_seconds_bucket"
    ]
    assert ttft == ["0.5", "1.5", "+Inf"]


# ------------------------------------------------------------------ exposition


def test_the_exposition_is_prometheus_clients_sample_for_sample() -> None:
    """What vLLM's Counter, Gauge and Histogram objects would expose after the same
    observations: the same samples, the ``_created`` ones included (their values are
    times, compared as present)."""
    m, _ = metrics(engines=(0, 1))
    m.add_request(["r"], prompt_tokens=3, max_tokens=9)
    m.record_step(1, [EngineCoreOutput("r", [1])], 1.0)
    m.record_step(1, [EngineCoreOutput("r", [2, 3])], 1.3)
    m.record_step(1, [EngineCoreOutput("r", [4])], 3.3)
    m.finish_request("r", "stop")
    m.record_scheduler_stats(0, SchedulerStats(num_running_reqs=2))

    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "", labels, registry=registry)
    tokens = Counter("vllm:generation_tokens", "", labels, registry=registry)
    success = Counter("vllm:request_success", "", [*labels, "finished_reason"], registry=registry)
    itl = Histogram(
        "vllm:inter_token_latency_seconds",
        "",
        labels,
        buckets=INTER_TOKEN_LATENCY_BUCKETS,
        registry=registry,
    )
    for engine in ("0", "1"):
        running.labels("tiny", engine)
        tokens.labels("tiny", engine)
        itl.labels("tiny", engine)
        for reason in FinishReason:
            success.labels("tiny", engine, str(reason))
    running.labels("tiny", "0").set(2)
    tokens.labels("tiny", "1").inc(4)
    success.labels("tiny", "1", "stop").inc()
    for latency in (1.3 - 1.0, 3.3 - 1.3):
        itl.labels("tiny", "1").observe(latency)

    def comparable(
        collected: Iterable[Sample],
    ) -> set[tuple[str, frozenset[tuple[str, str]], float]]:
        return {
            (s.name, frozenset(s.labels.items()), 0.0 if s.name.endswith("_created") else s.value)
            for s in collected
        }

    theirs = {family.name: family for family in registry.collect()}
    ours = {family.name: family for family in m.registry.collect() if family.name in theirs}
    assert set(ours) == set(theirs)
    for name, family in theirs.items():
        assert ours[name].type == family.type, name
        assert comparable(ours[name].samples) == comparable(family.samples), name


def test_created_series_can_be_left_out() -> None:
    m, _ = metrics(created_series=False)
    assert not [name for name, _ in samples(m) if name.endswith("_created")]
    with_created, _ = metrics()
    assert [name for name, _ in samples(with_created) if name.endswith("_created")]


def test_openmetrics_when_asked_for() -> None:
    m, _ = metrics()
    body, content_type = m.render_for("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    body, content_type = m.render_for(None)
    assert content_type == m.content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert body == m.render()


def test_each_object_has_its_own_registry() -> None:
    first, _ = metrics()
    second, _ = metrics()
    first.add_request(["r"], prompt_tokens=1, max_tokens=1)
    first.finish_request("r", "stop")
    assert value(first, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(second, "vllm:request_success_total", finished_reason="stop") == 0
    assert not [f for f in REGISTRY.collect() if f.name.startswith("vllm:")]
    # Registering a clashing name in its registry is refused, as for any collector.
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Counter("vllm:generation_tokens", "", registry=first.registry)

"""Our ``/metrics`` against vLLM's own ``PrometheusStatLogger``: the families, and
the values recorded for the same engine messages.

vLLM's side (``vllm_side/metric_families.py``, the release under test) builds the
``PrometheusStatLogger`` its API server builds, for the tiny model's ``VllmConfig``
and two engines, and dumps its registry: each ``vllm:`` family's name, type, label
names, series (label values), sample names and histogram buckets as exposed. Ours
(:class:`~trio_enginecore.server._metrics.VllmMetrics`) is built from the same inputs
(served model name, ``max_model_len``, engine indexes, ``CacheConfig.metrics_info()``)
and must expose exactly the same for every family it has; the families of vLLM's it
does not have are named here, so that a release adding one fails this test.

Then :data:`SCENARIO` (requests with ``n`` 1 and 2, engine messages of two engines
with engine timestamps, QUEUED / SCHEDULED / PREEMPTED events, prefill and scheduler
statistics, prefix-cache hits by tier, a request the engine rejects, an output of an
unknown request, a client abort, an abort by the engine) goes through vLLM's
``OutputProcessor`` and ``PrometheusStatLogger.record`` as ``AsyncLLM`` runs them, and
through ours as the server records them (its scheduler statistics as vLLM encodes them
on the wire, decoded by our protocol): every sample must be equal.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import msgspec
import pytest

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
from trio_enginecore.server._metrics import VllmMetrics

from .support import VllmProcess, error_lines, newest_release_only, require_vllm

require_vllm()
newest_release_only("our metrics are vLLM's newest PrometheusStatLogger's")

ENGINES = 2

NOT_OURS = {
    # vLLM's PerfMetricsProm (estimated FLOPs and memory traffic per GPU, from the
    # engine's perf_stats): we have no model to estimate them from.
    "vllm:estimated_flops_per_gpu",
    "vllm:estimated_read_bytes_per_gpu",
    "vllm:estimated_write_bytes_per_gpu",
}
"""vLLM's families (with this configuration) that we do not expose."""

REQUIRED = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens",
    "vllm:cache_config_info",
}
"""What the server's dashboards need, at least."""


Q, S, P = 1, 2, 3  # EngineCoreEventType: QUEUED, SCHEDULED, PREEMPTED
STOP, LENGTH, ABORT = 0, 1, 2

SCENARIO: dict[str, Any] = {
    "requests": [
        {"id": "a", "n": 1, "prompt_tokens": 7, "max_tokens": 16, "arrival": 1000.0},
        {"id": "b", "n": 1, "prompt_tokens": 3, "max_tokens": 4, "arrival": 1000.25},
        {
            "id": "c",
            "n": 2,
            "children": ["0_c", "1_c"],
            "prompt_tokens": 5,
            "max_tokens": 6,
            "arrival": 1000.5,
        },
        {"id": "d", "n": 1, "prompt_tokens": 2, "max_tokens": 8, "arrival": 1000.5},
        {"id": "e", "n": 1, "prompt_tokens": 2, "max_tokens": 8, "arrival": 1000.5},
    ],
    # Times are multiples of 1/8 s, exact in binary: sums are equal in any order.
    "messages": [
        {
            "engine": 0,
            "ts": 50.5,
            "now": 1000.75,
            "outputs": [
                {"id": "a", "tokens": [1], "events": [[Q, 50.0], [S, 50.25]], "prefill": [7, 5, 2, 2, 0, 0]},  # noqa: E501
                {"id": "e", "tokens": [], "error": "paused"},
                {"id": "ghost", "tokens": [9, 9]},
            ],
            "stats": {
                "running": 1, "waiting": 2, "skipped": 1, "kv_cache_usage": 0.125,
                "prefix": {"requests": 1, "queries": 7, "hits": 2},
            },
        },
        {
            "engine": 1,
            "ts": 80.0,
            "now": 1001.0,
            "outputs": [
                {"id": "b", "tokens": [1, 2], "events": [[Q, 79.0], [S, 79.5]], "prefill": [3, 3, 0, 0, 0, 0]},  # noqa: E501
                {"id": "d", "tokens": [1], "events": [[Q, 79.25], [S, 79.5]], "prefill": [2, 2, 0, 0, 0, 0]},  # noqa: E501
            ],
            "stats": {
                "running": 2, "waiting": 0, "skipped": 0, "kv_cache_usage": 0.5,
                "prefix": {"requests": 2, "queries": 5, "hits": 0},
                "connector": {"queries": 16, "hits": 8, "hits_by_source": {"host": 5, "disk": 3}},
            },
        },
        {
            "engine": 0,
            "ts": 51.0,
            "now": 1001.25,
            "outputs": [
                {"id": "a", "tokens": [2, 3]},
                {"id": "0_c", "tokens": [1], "events": [[Q, 50.5], [S, 50.75]], "prefill": [5, 1, 4, 4, 0, 0]},  # noqa: E501
                {"id": "1_c", "tokens": [1], "events": [[Q, 50.5], [S, 50.75]], "prefill": [5, 5, 0, 0, 0, 0]},  # noqa: E501
            ],
        },
        {
            "engine": 1,
            "ts": 81.0,
            "now": 1002.0,
            "abort": ["d"],  # the client went away before this message
            "outputs": [
                {"id": "b", "tokens": [], "events": [[P, 80.5], [S, 80.75]]},
                {"id": "d", "tokens": [2]},
            ],
        },
        {
            "engine": 0,
            "ts": 52.0,
            "now": 1002.5,
            "outputs": [
                {"id": "a", "tokens": [4], "finish": LENGTH},
                {"id": "0_c", "tokens": [2, 3], "finish": STOP},
                {"id": "1_c", "tokens": [2]},
            ],
        },
        {
            "engine": 1,
            "ts": 82.5,
            "now": 1003.0,
            "outputs": [{"id": "b", "tokens": [3, 4], "finish": LENGTH}],
            "stats": {
                "running": 0, "waiting": 0, "skipped": 0, "kv_cache_usage": 0.0,
                "prefix": {"queries": 0, "hits": 0},
            },
        },
        {
            "engine": 0,
            "ts": 53.0,
            "now": 1003.25,
            "outputs": [],
            "stats": {
                "running": 1, "waiting": 0, "skipped": 3, "kv_cache_usage": 0.25,
                "prefix": {"queries": 4, "hits": 4},
            },
        },
        {
            "engine": 0,
            "ts": 54.0,
            "now": 1003.5,
            "outputs": [{"id": "1_c", "tokens": [3], "finish": ABORT}],
        },
    ],
}  # fmt: skip
"""The engine messages both sides record, in order."""


@pytest.fixture(scope="module")
def vllm_reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's families and its values after :data:`SCENARIO` (one run of its side)."""
    directory = tmp_path_factory.mktemp("metrics")
    scenario = directory / "scenario.json"
    scenario.write_text(json.dumps(SCENARIO), encoding="utf-8")
    process = VllmProcess("metric_families.py", [str(ENGINES), str(scenario)], directory / "log")
    try:
        families = process.next_report(300)
        values = process.next_report(120)
    finally:
        process.stop()
    assert families["event"] == "families", families
    assert values["event"] == "values", values
    assert error_lines(process.log()) == []
    return families, values


def _ours(report: dict[str, Any]) -> VllmMetrics:
    metrics = VllmMetrics(
        model_name=report["model_name"],
        max_model_len=report["max_model_len"],
        engine_indexes=range(ENGINES),
    )
    for engine in range(ENGINES):
        metrics.set_cache_config_info(engine, report["cache_config_info"])
    return metrics


def _families(metrics: VllmMetrics) -> dict[str, dict[str, Any]]:
    """Our families, in the form the vLLM side reports its own."""
    found: dict[str, dict[str, Any]] = {}
    for family in metrics.registry.collect():
        series: list[dict[str, str]] = []
        buckets: list[str] = []
        label_names: list[str] | None = None
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            if label_names is None:
                label_names = list(labels)
            if labels not in series:
                series.append(labels)
            if sample.name.endswith("_bucket") and not series[1:]:
                buckets.append(sample.labels["le"])
        found[family.name] = {
            "name": family.name,
            "type": family.type,
            "label_names": label_names,
            "series": series,
            "samples": sorted({s.name for s in family.samples}),
            "buckets": buckets or None,
        }
    return found


def _comparable(family: dict[str, Any]) -> dict[str, Any]:
    # Series in any order: Prometheus does not order them.
    return {
        **family,
        "series": sorted(tuple(sorted(labels.items())) for labels in family["series"]),
    }


def test_our_metric_families_are_vllms(
    vllm_reports: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    report, _ = vllm_reports
    theirs = {family["name"]: family for family in report["families"]}
    ours = _families(_ours(report))
    assert REQUIRED - set(ours) == set(), "families the server needs"
    assert set(theirs) - set(ours) == NOT_OURS, f"vLLM {report['vllm']} has new families"
    assert set(ours) - set(theirs) == set(), "families vLLM does not have"
    for name in sorted(ours):
        assert _comparable(ours[name]) == _comparable(theirs[name]), name
    print(f"vLLM {report['vllm']}: {len(ours)} families equal, {sorted(NOT_OURS)} not ours")


def _replay(metrics: VllmMetrics, scenario: dict[str, Any], stats: dict[str, str]) -> None:
    """The scenario as the server records it: requests added, each message recorded
    as it arrives, a finish reported by the text layer right after its message, the
    client's aborts forgotten."""
    for spec in scenario["requests"]:
        metrics.add_request(
            spec.get("children", [spec["id"]]),
            prompt_tokens=spec["prompt_tokens"],
            max_tokens=spec["max_tokens"],
            arrival_time=spec["arrival"],
        )
    for number, raw_message in enumerate(scenario["messages"]):
        for request_id in raw_message.get("abort", ()):
            metrics.forget_request(request_id)
        outputs = [
            EngineCoreOutput(
                raw["id"],
                list(raw["tokens"]),
                finish_reason=None if raw.get("finish") is None else FinishReason(raw["finish"]),
                events=None
                if raw.get("events") is None
                else [EngineCoreEvent(EngineCoreEventType(t), at) for t, at in raw["events"]],
                prefill_stats=None if raw.get("prefill") is None else PrefillStats(*raw["prefill"]),
                error=None
                if raw.get("error") is None
                else RequestError(raw["error"], raw["error"]),
            )
            for raw in raw_message["outputs"]
        ]
        encoded = stats.get(str(number))
        message = EngineCoreOutputs(
            engine_index=raw_message["engine"],
            outputs=outputs,
            timestamp=raw_message["ts"],
            scheduler_stats=None
            if encoded is None
            else msgspec.msgpack.decode(base64.b64decode(encoded), type=SchedulerStats),
        )
        metrics.record_engine_outputs(message, now=raw_message["now"])
        for output in outputs:
            if output.finish_reason is not None:
                metrics.finish_request(output.request_id, output.finish_reason, raw_message["now"])


def test_we_record_what_vllm_records(
    vllm_reports: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    report, values = vllm_reports
    metrics = _ours(report)
    _replay(metrics, SCENARIO, values["stats"])
    assert metrics.pending_requests == 0

    def key(name: str, labels: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted(labels.items()))

    theirs = {
        key(name, labels): value
        for name, labels, value in values["samples"]
        if name.rpartition("_")[0] not in NOT_OURS
    }
    ours = {
        key(s.name, s.labels): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }
    assert set(ours) == set(theirs)
    different = {k: (ours[k], theirs[k]) for k in ours if not math.isclose(ours[k], theirs[k])}
    assert different == {}, f"(ours, vLLM {report['vllm']}'s)"
    # The scenario reaches what it is about (not all zeros on both sides).
    recorded = {k[0]: v for k, v in ours.items() if v}
    for name in (
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:request_queue_time_seconds_sum",
        "vllm:inter_token_latency_seconds_sum",
        "vllm:request_params_n_sum",
        "vllm:prompt_tokens_cached_by_source_total",
        "vllm:external_prefix_cache_hits_total",
    ):
        assert name in recorded, name
    print(f"vLLM {report['vllm']}: {len(ours)} samples equal")

"""vLLM's Prometheus metrics (the release installed): the families its
``PrometheusStatLogger`` registers, and the values it records for a scripted run.

Usage: ``metric_families.py ENGINES [SCENARIO_JSON]``

Builds the ``VllmConfig`` of the tiny llama (:func:`common.vllm_config`, stats on,
served model name ``tiny``) and a ``PrometheusStatLogger`` for engine indexes
``0 .. ENGINES-1``, then ``log_engine_initialized()`` (which registers
``vllm:cache_config_info``), as ``AsyncLLM`` does. Reports every ``vllm:`` family of
the registry: its name, type, label names, series (label values), sample names and a
histogram's bucket boundaries (the ``le`` labels, as exposed), with the
``max_model_len`` and ``CacheConfig.metrics_info()`` used::

    @{"event": "families", "vllm": "0.34.0", "max_model_len": 1024,
      "model_name": "tiny", "cache_config_info": {...}, "families": [...]}

With a scenario (``tests/interop/test_metrics_names.py`` writes it: requests, then
engine messages with their engine timestamps, events, prefill and scheduler
statistics, finishes and client aborts), runs it as ``AsyncLLM`` runs engine
messages: requests registered with vLLM's ``OutputProcessor`` (``n > 1`` through a
``ParentRequest``), and for each message an ``IterationStats`` stamped with the
message's ``now``, ``process_outputs`` at its engine timestamp, then
``PrometheusStatLogger.record``. Reports the scheduler statistics of each message as
msgspec encodes them on the wire (base64), then every sample of the registry::

    @{"event": "values", "stats": {"3": "<base64>", ...}, "samples": [[name, labels, value], ...]}
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import say, vllm_config, write_model


def dump_families(registry: Any) -> list[dict[str, Any]]:
    families: list[dict[str, Any]] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
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
        families.append(
            {
                "name": family.name,
                "type": family.type,
                "label_names": label_names,
                "series": series,
                "samples": sorted({s.name for s in family.samples}),
                "buckets": buckets or None,
            }
        )
    return families


def run_scenario(logger: Any, scenario: dict[str, Any]) -> dict[str, str]:
    """Run the scenario through vLLM's output processor and ``logger``; returns each
    message's scheduler statistics as msgspec encodes them, by message index."""
    import msgspec
    from vllm.outputs import RequestError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import (
        EngineCoreEvent,
        EngineCoreEventType,
        EngineCoreOutput,
        EngineCoreRequest,
        FinishReason,
    )
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.engine.parallel_sampling import ParentRequest
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.stats import (
        IterationStats,
        PrefillStats,
        PrefixCacheStats,
        SchedulerStats,
    )

    processor = OutputProcessor(None, log_stats=True)
    for spec in scenario["requests"]:
        sampling = SamplingParams(n=spec["n"], max_tokens=spec["max_tokens"], detokenize=False)
        request = EngineCoreRequest(
            request_id=spec["id"],
            prompt_token_ids=list(range(1, spec["prompt_tokens"] + 1)),
            mm_features=None,
            sampling_params=sampling,
            pooling_params=None,
            arrival_time=spec["arrival"],
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=spec["id"],
        )
        queue = RequestOutputCollector(sampling.output_kind, spec["id"])
        if spec["n"] == 1:
            processor.add_request(request, None, None, 0, queue)
            continue
        # As AsyncLLM fans out: the last child is the request itself.
        parent = ParentRequest(request)
        for index in range(spec["n"]):
            child_id, child_params = parent.get_child_info(index)
            assert child_id == spec["children"][index], (child_id, spec["children"])
            child = request if index == spec["n"] - 1 else _copy(request)
            child.request_id = child_id
            child.sampling_params = child_params
            processor.add_request(child, None, parent, index, queue)

    def prefix(raw: dict[str, Any]) -> Any:
        return PrefixCacheStats(
            requests=raw.get("requests", 0),
            queries=raw["queries"],
            hits=raw["hits"],
            hits_by_source={CacheHitSource(k): v for k, v in raw.get("hits_by_source", {}).items()},
        )

    encoded: dict[str, str] = {}
    for number, message in enumerate(scenario["messages"]):
        if message.get("abort"):
            processor.abort_requests(message["abort"], internal=False)
        outputs = [
            EngineCoreOutput(
                request_id=raw["id"],
                new_token_ids=list(raw["tokens"]),
                finish_reason=None if raw.get("finish") is None else FinishReason(raw["finish"]),
                events=None
                if raw.get("events") is None
                else [EngineCoreEvent(EngineCoreEventType(t), at) for t, at in raw["events"]],
                prefill_stats=None if raw.get("prefill") is None else PrefillStats(*raw["prefill"]),
                error=None
                if raw.get("error") is None
                else RequestError(code=raw["error"], message=raw["error"]),
            )
            for raw in message["outputs"]
        ]
        stats = None
        if message.get("stats") is not None:
            raw = message["stats"]
            stats = SchedulerStats(
                num_running_reqs=raw["running"],
                num_waiting_reqs=raw["waiting"],
                num_skipped_waiting_reqs=raw["skipped"],
                kv_cache_usage=raw["kv_cache_usage"],
                prefix_cache_stats=prefix(raw["prefix"]),
                connector_prefix_cache_stats=None
                if raw.get("connector") is None
                else prefix(raw["connector"]),
            )
            encoded[str(number)] = base64.b64encode(msgspec.msgpack.encode(stats)).decode()
        iteration = IterationStats() if outputs else None
        if iteration is not None:
            iteration.iteration_timestamp = message["now"]
            processor.process_outputs(outputs, message["ts"], iteration)
        logger.record(
            scheduler_stats=stats, iteration_stats=iteration, engine_idx=message["engine"]
        )
    return encoded


def _copy(request: Any) -> Any:
    import copy

    return copy.copy(request)


def main() -> None:
    engines = int(sys.argv[1])
    scenario_path = sys.argv[2] if len(sys.argv) > 2 else None
    import vllm
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    config = vllm_config(write_model("llama"), disable_log_stats=False, served_model_name="tiny")
    logger = PrometheusStatLogger(config, engine_indexes=list(range(engines)))
    logger.log_engine_initialized()
    say(
        event="families",
        vllm=vllm.__version__,
        max_model_len=config.model_config.max_model_len,
        model_name=config.model_config.served_model_name,
        cache_config_info=config.cache_config.metrics_info(),
        families=dump_families(REGISTRY),
    )
    if scenario_path is None:
        return
    scenario = json.loads(Path(scenario_path).read_text(encoding="utf-8"))
    encoded = run_scenario(logger, scenario)
    samples = [
        [sample.name, sample.labels, sample.value]
        for family in REGISTRY.collect()
        if family.name.startswith("vllm:")
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]
    say(event="values", stats=encoded, samples=samples)


if __name__ == "__main__":
    main()

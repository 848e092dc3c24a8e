"""vLLM's Prometheus metrics, for the server's ``/metrics`` (pure: no Trio, no I/O).

:class:`VllmMetrics` exposes what vLLM 0.34's ``PrometheusStatLogger``
(``vllm/v1/metrics/loggers.py``) exposes, under the same names, types, label names,
label values and histogram buckets (the token-count buckets scaled by
``max_model_len`` as vLLM scales them), so that dashboards made for vLLM work
unchanged. The interop suite holds it to vLLM's own registry
(``tests/interop/test_metrics_names.py``).

What is computed where follows vLLM's frontend (``IterationStats``,
``RequestStateStats``, ``FinishedRequestStats``, ``SchedulerStats`` in
``vllm/v1/metrics/stats.py``):

* per engine message (:meth:`VllmMetrics.record_engine_outputs`): prompt and
  generation token counters, tokens per step, preemptions (from the engine's
  ``PREEMPTED`` events), time to first token (this process's clock against the
  request's arrival), inter-token latency (``EngineCoreOutputs.timestamp``, the
  engine's monotonic clock, between a request's outputs), and the scheduler's
  gauges and prefix-cache counters (``SchedulerStats``, sent only by engines that run
  with ``log_stats``);
* per finished request (:meth:`VllmMetrics.finish_request`): success by finish
  reason, end-to-end latency, token counts, ``n`` and ``max_tokens``, and the queue,
  prefill, decode and inference times from the engine's ``QUEUED`` and ``SCHEDULED``
  events and output timestamps.

Where vLLM has no data to compare with: an engine that runs without ``log_stats``
sends no events, so a request's queue, prefill and inference times are not observed
at all (vLLM records no statistics then); an engine that sends no ``PrefillStats``
(the reference engine) has its prompt counted as computed, from the prompt length
given to :meth:`~VllmMetrics.add_request`. Where the server's shape differs from
vLLM's: vLLM finds stop strings as it records, so it counts nothing of a request
after its stop string; here the finish comes from the text layer, and outputs
recorded before :meth:`~VllmMetrics.finish_request` are counted (the end-to-end
latency too runs to that call).

The metrics are plain numbers behind one custom collector, not
``prometheus_client`` metric objects: an observation is a bisection and two
additions (a fifth of the cost of ``prometheus_client``'s ``Histogram.observe`` on a
labelled child kept at hand). The exposition is ``prometheus_client``'s own, from a
registry of this object's (never the global one), sample for sample what its metric
classes would expose. Record and render from one thread.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal, cast, final

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from ..protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)

__all__ = [
    "BUCKET_FAMILIES",
    "INTER_TOKEN_LATENCY_BUCKETS",
    "ITERATION_TOKENS_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
    "REQUEST_NUM_PREEMPTIONS_BUCKETS",
    "REQUEST_PARAMS_N_BUCKETS",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "VllmMetrics",
    "histogram_buckets",
]

# ------------------------------------------------------------------ buckets (buckets.py)

REQUEST_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's ``REQUEST_LATENCY_BUCKETS``: e2e, queue, inference, prefill, decode times."""
TIME_TO_FIRST_TOKEN_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's ``TIME_TO_FIRST_TOKEN_BUCKETS``."""
INTER_TOKEN_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""vLLM's ``INTER_TOKEN_LATENCY_BUCKETS``: inter-token latency, time per output token."""
ITERATION_TOKENS_BUCKETS: Final[tuple[float, ...]] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
"""vLLM's ``ITERATION_TOKENS_BUCKETS``: tokens per engine step."""
REQUEST_PARAMS_N_BUCKETS: Final[tuple[float, ...]] = (1, 2, 5, 10, 20)
"""vLLM's ``REQUEST_PARAMS_N_BUCKETS``."""
REQUEST_NUM_PREEMPTIONS_BUCKETS: Final[tuple[float, ...]] = (1, 2, 3, 4, 5, 10, 20)
"""vLLM's ``REQUEST_NUM_PREEMPTIONS_BUCKETS``."""

BUCKET_FAMILIES: Final = frozenset(
    {
        "request_latency",
        "time_to_first_token",
        "inter_token_latency",
        "iteration_tokens",
        "request_params_n",
        "request_num_preemptions",
        "request_tokens",
    }
)
"""The bucket families a histogram draws from (vLLM's ``BucketFamilyKey``, less the
opt-in ``kv_cache_residency``): the keys of ``bucket_overrides``."""

_STATIC_BUCKETS: Final[dict[str, tuple[float, ...]]] = {
    "request_latency": REQUEST_LATENCY_BUCKETS,
    "time_to_first_token": TIME_TO_FIRST_TOKEN_BUCKETS,
    "inter_token_latency": INTER_TOKEN_LATENCY_BUCKETS,
    "iteration_tokens": ITERATION_TOKENS_BUCKETS,
    "request_params_n": REQUEST_PARAMS_N_BUCKETS,
    "request_num_preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS,
}


def histogram_buckets(
    family: str,
    *,
    max_model_len: int | None = None,
    overrides: Mapping[str, Sequence[float]] | None = None,
) -> tuple[float, ...]:
    """The upper bounds of a histogram family's buckets, as vLLM's
    ``histogram_buckets``: an override if given, else the defaults; the token-count
    family (``"request_tokens"``) is the 1-2-5 series up to ``max_model_len``.

    Raises:
        ValueError: an unknown family, ``"request_tokens"`` without ``max_model_len``,
            or an override that is empty or not increasing.
    """
    if family not in BUCKET_FAMILIES:
        raise ValueError(f"unknown histogram bucket family {family!r}: {sorted(BUCKET_FAMILIES)}")
    if overrides is not None and (custom := overrides.get(family)) is not None:
        bounds = tuple(float(b) for b in custom)
        if not bounds or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"buckets of {family!r} must be increasing and non-empty: {custom}")
        return bounds
    if family == "request_tokens":
        if max_model_len is None:
            raise ValueError("max_model_len is required for the 'request_tokens' buckets")
        return tuple(_one_two_five(max_model_len))
    return _STATIC_BUCKETS[family]


def _one_two_five(max_value: int) -> Iterator[float]:
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return
            yield value
        exponent += 1


# ------------------------------------------------------------------ label values

_FINISH_REASONS: Final = tuple(FinishReason)
_FINISH_LABELS: Final = tuple(str(reason) for reason in _FINISH_REASONS)
_FINISH_BY_NAME: Final[dict[str, FinishReason]] = {
    str(reason): reason for reason in _FINISH_REASONS
}
_WAITING_REASONS: Final = ("capacity", "deferred")
_SLEEP_STATES: Final = ("awake", "weights_offloaded", "discard_all")
_PROMPT_SOURCES: Final = ("local_compute", "local_cache_hit", "external_kv_transfer")
_CACHE_HIT_SOURCES: Final = ("device", "host", "p2p", "disk", "external_unspecified")
_CACHE_HIT_INDEX: Final = {source: i for i, source in enumerate(_CACHE_HIT_SOURCES)}
_ADMISSION_REASONS: Final = ("max_num_queued_reqs", "max_num_queued_tokens")

_QUEUED: Final = EngineCoreEventType.QUEUED
_SCHEDULED: Final = EngineCoreEventType.SCHEDULED
_PREEMPTED: Final = EngineCoreEventType.PREEMPTED


def _number(value: object) -> float:
    """A statistic an engine sent in a plain map: a number, or 0 for anything else
    (the map is not typed on the wire, and a metric must not fail the receive path)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    return 0


# ------------------------------------------------------------------ storage


@final
class _Histogram:
    """One histogram series: counts per bucket (the last is ``+Inf``), and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


@final
class _Engine:
    """Every series of one engine (the ``engine`` label), as plain numbers."""

    __slots__ = (
        "cached_by_source",
        "created",
        "decode_time",
        "e2e_latency",
        "external_prefix_cache_hits",
        "external_prefix_cache_queries",
        "generation_tokens",
        "index",
        "inference_time",
        "inter_token_latency",
        "iteration_tokens",
        "kv_cache_usage",
        "labels",
        "max_num_generation_tokens",
        "mm_cache_hits",
        "mm_cache_queries",
        "params_max_tokens",
        "params_n",
        "preemptions",
        "prefill_kv_computed",
        "prefill_time",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "prompt_tokens",
        "prompt_tokens_by_source",
        "prompt_tokens_cached",
        "queue_time",
        "request_generation_tokens",
        "request_num_preemptions",
        "request_prompt_tokens",
        "running",
        "sleep_state",
        "success",
        "time_per_output_token",
        "time_to_first_token",
        "waiting",
        "waiting_by_reason",
    )

    def __init__(
        self, index: int, model_name: str, buckets: Mapping[str, tuple[float, ...]]
    ) -> None:
        self.index = index
        self.labels = (model_name, str(index))
        self.created = time.time()
        # Gauges.
        self.running = 0.0
        self.waiting = 0.0
        self.waiting_by_reason = [0.0] * len(_WAITING_REASONS)
        self.sleep_state = [1.0, 0.0, 0.0]  # awake, as vLLM starts
        self.kv_cache_usage = 0.0
        # Counters.
        self.prefix_cache_queries = 0.0
        self.prefix_cache_hits = 0.0
        self.external_prefix_cache_queries = 0.0
        self.external_prefix_cache_hits = 0.0
        self.mm_cache_queries = 0.0
        self.mm_cache_hits = 0.0
        self.preemptions = 0
        self.prompt_tokens = 0
        self.prompt_tokens_by_source = [0] * len(_PROMPT_SOURCES)
        self.prompt_tokens_cached = 0
        self.cached_by_source = [0.0] * len(_CACHE_HIT_SOURCES)
        self.generation_tokens = 0
        self.success = [0] * len(_FINISH_REASONS)
        # Histograms.
        tokens = buckets["request_tokens"]
        latency = buckets["request_latency"]
        per_token = buckets["inter_token_latency"]
        self.request_prompt_tokens = _Histogram(tokens)
        self.request_generation_tokens = _Histogram(tokens)
        self.iteration_tokens = _Histogram(buckets["iteration_tokens"])
        self.max_num_generation_tokens = _Histogram(tokens)
        self.params_n = _Histogram(buckets["request_params_n"])
        self.params_max_tokens = _Histogram(tokens)
        self.time_to_first_token = _Histogram(buckets["time_to_first_token"])
        self.inter_token_latency = _Histogram(per_token)
        self.time_per_output_token = _Histogram(per_token)
        self.e2e_latency = _Histogram(latency)
        self.queue_time = _Histogram(latency)
        self.inference_time = _Histogram(latency)
        self.prefill_time = _Histogram(latency)
        self.decode_time = _Histogram(latency)
        self.request_num_preemptions = _Histogram(buckets["request_num_preemptions"])
        self.prefill_kv_computed = _Histogram(tokens)


@final
class _Parent:
    """The ``n`` engine requests of one request with ``n > 1`` (vLLM's ParentRequest)."""

    __slots__ = ("abandoned", "max_generated", "n", "unfinished")

    def __init__(self, n: int) -> None:
        self.n = n
        self.unfinished = n
        self.max_generated = 0
        self.abandoned = False


@final
class _Request:
    """What is known of one engine request (vLLM's RequestStateStats)."""

    __slots__ = (
        "arrival",
        "cached_tokens",
        "engine",
        "first_ts",
        "generated",
        "last_ts",
        "max_tokens",
        "parent",
        "preemptions",
        "prefilling",
        "prompt_tokens",
        "queued_ts",
        "scheduled_ts",
    )

    def __init__(
        self, prompt_tokens: int, max_tokens: int | None, arrival: float, parent: _Parent | None
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.parent = parent
        self.engine: _Engine | None = None
        self.prefilling = True
        self.generated = 0
        self.preemptions = 0
        self.cached_tokens = 0
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        self.first_ts = 0.0
        self.last_ts = 0.0


# ------------------------------------------------------------------ the metrics


@final
class VllmMetrics:
    """vLLM 0.34's Prometheus metrics of one served model, and what records them.

    ::

        metrics = VllmMetrics(model_name="tiny", max_model_len=1024, engine_indexes=[0])
        metrics.add_request(["cmpl-1"], prompt_tokens=5, max_tokens=16)
        metrics.record_engine_outputs(message)          # every engine message
        metrics.finish_request("cmpl-1", "length")      # when the text layer says so
        body = metrics.render()                         # GET /metrics

    A request's life: :meth:`add_request` when it is sent (its engine request ids),
    :meth:`record_engine_outputs` (or :meth:`record_step` and
    :meth:`record_scheduler_stats`) for every engine message as it arrives, then
    :meth:`finish_request` with the finish reason the text layer gives (a stop string
    found there is ``"stop"``, as in vLLM), or :meth:`forget_request` if it was aborted
    by the client (vLLM counts no statistics for those). Outputs of requests it does not
    know are ignored, as vLLM's output processor ignores them.

    Args:
        model_name: the served model name (label ``model_name``).
        max_model_len: scales the token-count histograms' buckets, as in vLLM.
        engine_indexes: the engines whose series exist from the start (label
            ``engine``); an engine first heard of later gets its series then.
        bucket_overrides: bucket bounds per family (``BUCKET_FAMILIES``:
            ``request_latency``, ``time_to_first_token``, ...), as vLLM's
            ``--custom-histogram-buckets``.
        created_series: expose the ``_created`` samples of counters and histograms, as
            ``prometheus_client`` does unless ``PROMETHEUS_DISABLE_CREATED_SERIES`` is
            set.
        clock: the clock of arrival times and of the ``now`` arguments (seconds; the
            differences matter, not the epoch).
    """

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        engine_indexes: Iterable[int] = (0,),
        bucket_overrides: Mapping[str, Sequence[float]] | None = None,
        created_series: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        unknown = set(bucket_overrides or ()) - BUCKET_FAMILIES
        if unknown:
            raise ValueError(f"unknown histogram bucket families: {sorted(unknown)}")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._buckets = {
            family: histogram_buckets(
                family, max_model_len=max_model_len, overrides=bucket_overrides
            )
            for family in BUCKET_FAMILIES
        }
        self._clock = clock
        self._engines: dict[int, _Engine] = {}
        for index in engine_indexes:
            self._engine(index)
        self._requests: dict[str, _Request] = {}
        self._admission_rejections = [0] * len(_ADMISSION_REASONS)
        self._admission_created = time.time()
        self._cache_config: tuple[tuple[str, ...], dict[int, tuple[str, ...]]] | None = None
        self.registry = CollectorRegistry()
        """The registry holding these metrics (and only these, unless you add more)."""
        self.registry.register(_Collector(self, created_series))

    content_type: Final = CONTENT_TYPE_PLAIN_0_0_4
    """The content type of :meth:`render`'s body (Prometheus' text format 0.0.4)."""

    @property
    def pending_requests(self) -> int:
        """Engine requests added and neither finished nor forgotten."""
        return len(self._requests)

    def _engine(self, index: int) -> _Engine:
        engine = self._engines.get(index)
        if engine is None:
            engine = self._engines[index] = _Engine(index, self.model_name, self._buckets)
        return engine

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        request_ids: Sequence[str],
        *,
        prompt_tokens: int,
        max_tokens: int | None,
        arrival_time: float | None = None,
    ) -> None:
        """A request was sent: its engine requests' ids (``n`` of them with ``n > 1``),
        its prompt's length in tokens and its ``max_tokens``. ``arrival_time`` (on the
        ``clock``, now by default) is when it reached the server: its time to first
        token and end-to-end latency count from there."""
        arrival = self._clock() if arrival_time is None else arrival_time
        parent = _Parent(len(request_ids)) if len(request_ids) > 1 else None
        requests = self._requests
        for request_id in request_ids:
            requests[request_id] = _Request(prompt_tokens, max_tokens, arrival, parent)

    def forget_request(self, request_id: str) -> None:
        """Drop an engine request without counting it (aborted by the client, or failed
        before the engine ran it); unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None and request.parent is not None:
            request.parent.abandoned = True

    def finish_request(
        self,
        request_id: str,
        reason: FinishReason | str,
        now: float | None = None,
        *,
        generated: int | None = None,
    ) -> None:
        """An engine request finished for ``reason`` (a
        :class:`~trio_enginecore.protocol.FinishReason` or its name, as
        ``CompletionOutput.finish_reason``): count it and observe its latencies and
        sizes. Unknown (or already finished) ids are ignored. ``generated``: the tokens
        the request generated, as its output says; tokens recorded past them (outputs
        that arrived after a stop string ended it, before this call) are taken back
        from the generation counter, as vLLM, which finds stop strings as it records,
        never counts them.

        Raises:
            ValueError: ``reason`` is no finish reason.
        """
        if isinstance(reason, str):
            found = _FINISH_BY_NAME.get(reason)
            if found is None:
                raise ValueError(f"not a finish reason: {reason!r}; one of {_FINISH_LABELS}")
            reason = found
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if now is None:
            now = self._clock()
        engine = request.engine
        if engine is None:  # finished before any output: counted on the first engine
            engine = self._engine(min(self._engines, default=0))
        if generated is not None and request.generated > generated:
            engine.generation_tokens -= request.generated - generated
            request.generated = generated
        engine.success[reason] += 1
        engine.e2e_latency.observe(now - request.arrival)
        decode = request.last_ts - request.first_ts
        if request.scheduled_ts:  # the engine sent its events (log_stats)
            engine.queue_time.observe(request.scheduled_ts - request.queued_ts)
            engine.prefill_time.observe(request.first_ts - request.scheduled_ts)
            engine.inference_time.observe(request.last_ts - request.scheduled_ts)
        engine.decode_time.observe(decode)
        engine.request_num_preemptions.observe(request.preemptions)
        engine.prefill_kv_computed.observe(request.prompt_tokens - max(request.cached_tokens, 0))
        engine.request_prompt_tokens.observe(request.prompt_tokens)
        generated = request.generated
        engine.request_generation_tokens.observe(generated)
        engine.time_per_output_token.observe(decode / (generated - 1) if generated > 1 else 0)
        if request.max_tokens:
            engine.params_max_tokens.observe(request.max_tokens)
        parent = request.parent
        if parent is None:
            engine.max_num_generation_tokens.observe(generated)
            engine.params_n.observe(1)
        else:
            parent.max_generated = max(parent.max_generated, generated)
            parent.unfinished -= 1
            if parent.unfinished == 0 and not parent.abandoned:
                engine.max_num_generation_tokens.observe(parent.max_generated)
                engine.params_n.observe(parent.n)

    # ------------------------------------------------------------ engine messages

    def record_engine_outputs(self, message: EngineCoreOutputs, now: float | None = None) -> None:
        """One engine message as it arrived: its outputs (:meth:`record_step`, at its
        ``timestamp``) and its scheduler statistics (:meth:`record_scheduler_stats`).
        Call it for every message, in order, before the outputs are merged or changed
        (tokens cut at a stop string still count, as in vLLM)."""
        if message.outputs:
            self.record_step(message.engine_index, message.outputs, message.timestamp, now)
        if message.scheduler_stats is not None:
            self.record_scheduler_stats(message.engine_index, message.scheduler_stats)

    def record_step(
        self,
        engine_index: int,
        outputs: Sequence[EngineCoreOutput],
        timestamp: float,
        now: float | None = None,
    ) -> None:
        """The outputs of one engine step (vLLM's ``IterationStats``): ``timestamp`` is
        the engine's (``EngineCoreOutputs.timestamp``), ``now`` this process's
        (``clock``), by default read here."""
        if not outputs:
            return
        if now is None:
            now = self._clock()
        engine = self._engines.get(engine_index) or self._engine(engine_index)
        find = self._requests.get
        bisect_left = bisect.bisect_left
        itl = engine.inter_token_latency
        itl_bounds = itl.bounds
        itl_counts = itl.counts
        itl_sum = 0.0
        generated = 0
        computed = 0
        for output in outputs:
            request = find(output.request_id)
            if request is None:
                continue  # unknown, finished or aborted: ignored, as vLLM does
            if output.error is not None:
                # Rejected by the engine before it ran it: vLLM counts nothing.
                self.forget_request(output.request_id)
                continue
            new = len(output.new_token_ids)
            generated += new
            request.generated += new
            request.engine = engine
            if output.events is not None:
                self._events(engine, request, output)
            if request.prefilling:
                computed += self._first_output(engine, request, output, now, timestamp)
            else:
                value = timestamp - request.last_ts
                itl_counts[bisect_left(itl_bounds, value)] += 1
                itl_sum += value
            request.last_ts = timestamp
        itl.sum += itl_sum
        engine.generation_tokens += generated
        # The step's tokens: the prompt tokens it computed, and those it generated.
        engine.iteration_tokens.observe(computed + generated)

    def _first_output(
        self,
        engine: _Engine,
        request: _Request,
        output: EngineCoreOutput,
        now: float,
        timestamp: float,
    ) -> int:
        """The first output of a request: its time to first token and prompt
        statistics; returns the prompt tokens the engine computed."""
        request.prefilling = False
        request.first_ts = timestamp
        engine.time_to_first_token.observe(now - request.arrival)
        stats = output.prefill_stats
        if stats is None:
            # An engine without prefill statistics (the reference engine): the whole
            # prompt counts as computed.
            total = computed = request.prompt_tokens
            cached = local = external = 0
        else:
            total = stats.num_prompt_tokens
            computed = stats.num_computed_tokens
            cached = stats.num_cached_tokens
            local = stats.num_local_cached_tokens
            external = stats.num_external_cached_tokens
            request.cached_tokens = cached
        engine.prompt_tokens += total
        by_source = engine.prompt_tokens_by_source
        by_source[0] += computed
        by_source[1] += local
        by_source[2] += external
        engine.prompt_tokens_cached += cached
        return computed

    @staticmethod
    def _events(engine: _Engine, request: _Request, output: EngineCoreOutput) -> None:
        assert output.events is not None
        for event in output.events:
            kind = event.type
            if kind == _QUEUED:
                request.queued_ts = event.timestamp
            elif kind == _SCHEDULED:
                if request.scheduled_ts == 0.0:  # the first scheduling only
                    request.scheduled_ts = event.timestamp
            elif kind == _PREEMPTED:
                engine.preemptions += 1
                request.preemptions += 1

    def record_scheduler_stats(self, engine_index: int, stats: SchedulerStats) -> None:
        """An engine's scheduler statistics (``EngineCoreOutputs.scheduler_stats``)."""
        engine = self._engines.get(engine_index) or self._engine(engine_index)
        engine.running = stats.num_running_reqs
        waiting, skipped = stats.num_waiting_reqs, stats.num_skipped_waiting_reqs
        engine.waiting = waiting + skipped
        engine.waiting_by_reason[0] = waiting
        engine.waiting_by_reason[1] = skipped
        engine.kv_cache_usage = stats.kv_cache_usage
        prefix = stats.prefix_cache_stats
        if prefix:
            hits = _number(prefix.get("hits"))
            engine.prefix_cache_queries += _number(prefix.get("queries"))
            engine.prefix_cache_hits += hits
            engine.cached_by_source[0] += hits  # "device"
        connector = stats.connector_prefix_cache_stats
        if connector:
            engine.external_prefix_cache_queries += _number(connector.get("queries"))
            engine.external_prefix_cache_hits += _number(connector.get("hits"))
            by_source: object = connector.get("hits_by_source")
            if isinstance(by_source, dict):
                cached = engine.cached_by_source
                for source, tokens in cast("dict[object, object]", by_source).items():
                    index = _CACHE_HIT_INDEX.get(str(source))
                    if index is not None:
                        cached[index] += _number(tokens)

    # ------------------------------------------------------------ other events

    def set_cache_config_info(self, engine_index: int, info: Mapping[str, object]) -> None:
        """``vllm:cache_config_info`` of an engine: a gauge at 1 labelled with the
        engine's ``CacheConfig.metrics_info()`` (vLLM 0.34 engines send it in their
        ready message, ``cache_config_info``) and ``engine``.

        Raises:
            ValueError: the keys differ from those an engine gave before (the gauge's
                label names are fixed once it exists), or include ``engine``.
        """
        names = tuple(info)
        if "engine" in names:
            raise ValueError("cache config info cannot have a key 'engine' (it is added)")
        if self._cache_config is None:
            self._cache_config = (names, {})
        elif self._cache_config[0] != names:
            raise ValueError(
                f"cache config info of engine {engine_index} has keys {list(names)}, "
                f"not {list(self._cache_config[0])} as before"
            )
        self._cache_config[1][engine_index] = tuple(str(v) for v in info.values())

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        """The engines were put to sleep (``sleep=1`` at ``level`` 1 or 2) or woken
        (``sleep=0``): ``vllm:engine_sleep_state`` of every engine, as vLLM sets it."""
        state = [1.0, 0.0, 0.0]
        if sleep == 1:
            state = [0.0, 1.0 if level == 1 else 0.0, 1.0 if level == 2 else 0.0]
        for engine in self._engines.values():
            engine.sleep_state = list(state)

    def record_admission_rejection(self, reason: str) -> None:
        """A request was refused by a queue limit (``vllm:admission_rejections``):
        ``"max_num_queued_reqs"`` or ``"max_num_queued_tokens"``.

        Raises:
            ValueError: another reason.
        """
        try:
            index = _ADMISSION_REASONS.index(reason)
        except ValueError:
            raise ValueError(
                f"reason must be one of {_ADMISSION_REASONS}, not {reason!r}"
            ) from None
        self._admission_rejections[index] += 1

    # ------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """The metrics in Prometheus' text format (:attr:`content_type`)."""
        return generate_latest(self.registry)

    def render_for(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics in the format an ``Accept`` header asks for (Prometheus' text
        formats or OpenMetrics, as ``prometheus_client``'s own handlers choose), and
        its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


# ------------------------------------------------------------------ the collector

_Kind = Literal["gauge", "counter", "histogram"]


@final
class _Family:
    """How one of vLLM's metric families is read from an engine's numbers."""

    __slots__ = ("doc", "extra", "kind", "name", "read")

    def __init__(
        self,
        name: str,
        kind: _Kind,
        doc: str,
        read: Callable[[_Engine], Any],
        extra: tuple[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.doc = doc
        self.read = read
        self.extra = extra


def _families() -> tuple[_Family, ...]:
    g: _Kind = "gauge"
    c: _Kind = "counter"
    h: _Kind = "histogram"
    return (
        _Family("vllm:num_requests_running", g, "Number of requests in model execution batches.", lambda e: e.running),  # noqa: E501
        _Family("vllm:num_requests_waiting", g, "Number of requests waiting to be processed.", lambda e: e.waiting),  # noqa: E501
        _Family(
            "vllm:num_requests_waiting_by_reason", g,
            "Number of waiting requests by reason ('capacity': waiting for scheduling "
            "capacity; 'deferred': deferred by transient constraints).",
            lambda e: e.waiting_by_reason, ("reason", _WAITING_REASONS),
        ),
        _Family(
            "vllm:engine_sleep_state", g,
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
            "engine is awake; weights_offloaded = 1 means sleep level 1; "
            "discard_all = 1 means sleep level 2.",
            lambda e: e.sleep_state, ("sleep_state", _SLEEP_STATES),
        ),
        _Family("vllm:kv_cache_usage_perc", g, "KV-cache usage. 1 means 100 percent usage.", lambda e: e.kv_cache_usage),  # noqa: E501
        _Family("vllm:prefix_cache_queries", c, "Prefix cache queries, in terms of number of queried tokens.", lambda e: e.prefix_cache_queries),  # noqa: E501
        _Family("vllm:prefix_cache_hits", c, "Prefix cache hits, in terms of number of cached tokens.", lambda e: e.prefix_cache_hits),  # noqa: E501
        _Family("vllm:external_prefix_cache_queries", c, "External prefix cache queries from the KV connector, in tokens.", lambda e: e.external_prefix_cache_queries),  # noqa: E501
        _Family("vllm:external_prefix_cache_hits", c, "External prefix cache hits from the KV connector, in tokens.", lambda e: e.external_prefix_cache_hits),  # noqa: E501
        _Family("vllm:mm_cache_queries", c, "Multi-modal cache queries, in terms of number of queried items.", lambda e: e.mm_cache_queries),  # noqa: E501
        _Family("vllm:mm_cache_hits", c, "Multi-modal cache hits, in terms of number of cached items.", lambda e: e.mm_cache_hits),  # noqa: E501
        _Family("vllm:num_preemptions", c, "Cumulative number of preemption from the engine.", lambda e: e.preemptions),  # noqa: E501
        _Family("vllm:prompt_tokens", c, "Number of prefill tokens processed.", lambda e: e.prompt_tokens),  # noqa: E501
        _Family("vllm:prompt_tokens_by_source", c, "Number of prompt tokens by source.", lambda e: e.prompt_tokens_by_source, ("source", _PROMPT_SOURCES)),  # noqa: E501
        _Family("vllm:prompt_tokens_cached", c, "Number of cached prompt tokens (local + external).", lambda e: e.prompt_tokens_cached),  # noqa: E501
        _Family("vllm:prompt_tokens_cached_by_source", c, "Prefix-cache hit tokens by the cache tier that supplied them.", lambda e: e.cached_by_source, ("source", _CACHE_HIT_SOURCES)),  # noqa: E501
        _Family("vllm:generation_tokens", c, "Number of generation tokens processed.", lambda e: e.generation_tokens),  # noqa: E501
        _Family("vllm:request_success", c, "Count of successfully processed requests.", lambda e: e.success, ("finished_reason", _FINISH_LABELS)),  # noqa: E501
        _Family("vllm:request_prompt_tokens", h, "Number of prefill tokens processed.", lambda e: e.request_prompt_tokens),  # noqa: E501
        _Family("vllm:request_generation_tokens", h, "Number of generation tokens processed.", lambda e: e.request_generation_tokens),  # noqa: E501
        _Family("vllm:iteration_tokens_total", h, "Histogram of number of tokens per engine_step.", lambda e: e.iteration_tokens),  # noqa: E501
        _Family("vllm:request_max_num_generation_tokens", h, "Histogram of maximum number of requested generation tokens.", lambda e: e.max_num_generation_tokens),  # noqa: E501
        _Family("vllm:request_params_n", h, "Histogram of the n request parameter.", lambda e: e.params_n),  # noqa: E501
        _Family("vllm:request_params_max_tokens", h, "Histogram of the max_tokens request parameter.", lambda e: e.params_max_tokens),  # noqa: E501
        _Family("vllm:time_to_first_token_seconds", h, "Histogram of time to first token in seconds.", lambda e: e.time_to_first_token),  # noqa: E501
        _Family("vllm:inter_token_latency_seconds", h, "Histogram of inter-token latency in seconds.", lambda e: e.inter_token_latency),  # noqa: E501
        _Family("vllm:request_time_per_output_token_seconds", h, "Histogram of time_per_output_token_seconds per request.", lambda e: e.time_per_output_token),  # noqa: E501
        _Family("vllm:e2e_request_latency_seconds", h, "Histogram of e2e request latency in seconds.", lambda e: e.e2e_latency),  # noqa: E501
        _Family("vllm:request_queue_time_seconds", h, "Histogram of time spent in WAITING phase for request.", lambda e: e.queue_time),  # noqa: E501
        _Family("vllm:request_inference_time_seconds", h, "Histogram of time spent in RUNNING phase for request.", lambda e: e.inference_time),  # noqa: E501
        _Family("vllm:request_prefill_time_seconds", h, "Histogram of time spent in PREFILL phase for request.", lambda e: e.prefill_time),  # noqa: E501
        _Family("vllm:request_decode_time_seconds", h, "Histogram of time spent in DECODE phase for request.", lambda e: e.decode_time),  # noqa: E501
        _Family("vllm:request_num_preemptions", h, "Histogram of the number of times a request was preempted.", lambda e: e.request_num_preemptions),  # noqa: E501
        _Family("vllm:request_prefill_kv_computed_tokens", h, "Histogram of new KV tokens computed during prefill (excluding cached tokens).", lambda e: e.prefill_kv_computed),  # noqa: E501
    )  # fmt: skip


_FAMILIES: Final = _families()
_LABEL_NAMES: Final = ("model_name", "engine")

_ADMISSION_REJECTIONS: Final = "vllm:admission_rejections"
_CACHE_CONFIG_INFO: Final = "vllm:cache_config_info"


@final
class _Collector(Collector):
    """Reads a :class:`VllmMetrics` into ``prometheus_client``'s metric families,
    sample for sample as its ``Gauge``, ``Counter`` and ``Histogram`` expose them."""

    def __init__(self, metrics: VllmMetrics, created_series: bool) -> None:
        self._metrics = metrics
        self._created = created_series

    def describe(self) -> Iterable[Metric]:
        # The names, for the registry's collision check.
        families: list[Metric] = [self._empty(f) for f in _FAMILIES]
        families.append(CounterMetricFamily(_ADMISSION_REJECTIONS, "", labels=()))
        families.append(GaugeMetricFamily(_CACHE_CONFIG_INFO, "", labels=()))
        return families

    @staticmethod
    def _empty(family: _Family) -> Metric:
        if family.kind == "gauge":
            return GaugeMetricFamily(family.name, family.doc, labels=())
        if family.kind == "counter":
            return CounterMetricFamily(family.name, family.doc, labels=())
        return HistogramMetricFamily(family.name, family.doc, labels=())

    def collect(self) -> Iterable[Metric]:
        metrics = self._metrics
        engines = [metrics._engines[i] for i in sorted(metrics._engines)]  # pyright: ignore[reportPrivateUsage]
        created = self._created
        for family in _FAMILIES:
            labels: list[str] = list(_LABEL_NAMES)
            if family.extra is not None:
                labels.append(family.extra[0])
            read = family.read
            if family.kind == "histogram":
                histograms = HistogramMetricFamily(family.name, family.doc, labels=labels)
                for engine in engines:
                    _add_histogram(histograms, engine, read(engine), created)
                yield histograms
                continue
            metric: GaugeMetricFamily | CounterMetricFamily
            if family.kind == "gauge":
                metric = GaugeMetricFamily(family.name, family.doc, labels=labels)
            else:
                metric = CounterMetricFamily(family.name, family.doc, labels=labels)
            for engine in engines:
                value = read(engine)
                if family.extra is None:
                    _add_value(metric, engine.labels, value, engine.created, created)
                else:
                    for extra, item in zip(family.extra[1], value, strict=True):
                        _add_value(metric, (*engine.labels, extra), item, engine.created, created)
            yield metric
        rejections = CounterMetricFamily(
            _ADMISSION_REJECTIONS,
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=("model_name", "reason"),
        )
        for reason, count in zip(
            _ADMISSION_REASONS,
            metrics._admission_rejections,  # pyright: ignore[reportPrivateUsage]
            strict=True,
        ):
            _add_value(
                rejections,
                (metrics.model_name, reason),
                count,
                metrics._admission_created,  # pyright: ignore[reportPrivateUsage]
                created,
            )
        yield rejections
        cache_config = metrics._cache_config  # pyright: ignore[reportPrivateUsage]
        if cache_config is not None:
            names, per_engine = cache_config
            info = GaugeMetricFamily(
                _CACHE_CONFIG_INFO,
                "Information of the LLMEngine CacheConfig",
                labels=(*names, "engine"),
            )
            for index in sorted(per_engine):
                info.add_metric((*per_engine[index], str(index)), 1.0)
            yield info


def _add_value(
    metric: GaugeMetricFamily | CounterMetricFamily,
    labels: Sequence[str],
    value: float,
    created_at: float,
    created: bool,
) -> None:
    if isinstance(metric, CounterMetricFamily):
        metric.add_metric(labels, value, created=created_at if created else None)
    else:
        metric.add_metric(labels, value)


def _add_histogram(
    metric: HistogramMetricFamily, engine: _Engine, histogram: _Histogram, created: bool
) -> None:
    cumulative = 0
    buckets: list[tuple[str, float]] = []
    for le, count in zip(_le_labels(histogram.bounds), histogram.counts, strict=True):
        cumulative += count
        buckets.append((le, cumulative))
    metric.add_metric(engine.labels, buckets, histogram.sum)
    if created:
        labels: dict[str, str] = dict(zip(_LABEL_NAMES, engine.labels, strict=True))
        metric.add_sample(f"{metric.name}_created", labels, engine.created)


@functools.cache
def _le_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` labels of a histogram's buckets, ``+Inf`` last, written as
    ``prometheus_client`` writes them (Go's float format: ``1.0``, ``2560.0``,
    ``1e+06``)."""
    return (*(_go_float(float(bound)) for bound in bounds), "+Inf")


def _go_float(value: float) -> str:
    # prometheus_client.utils.floatToGoString, for the finite positive bounds.
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text

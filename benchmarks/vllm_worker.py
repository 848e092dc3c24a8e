# mypy: disable-error-code="import-not-found"
"""Run ONE measurement with vLLM 0.33's real ``AsyncMPClient``, in the vLLM environment.

    <vllm env>/bin/python benchmarks/vllm_worker.py '<spec json>'

The interop environment that ``nox -s interop`` builds (``.nox/vllm-0.33-<hash>``) runs
this script; :mod:`benchmarks.run` starts it as the ``vllm`` client, in the same
rotation as the others, against the same engine (``trio-enginecore serve``, which
speaks vLLM's wire format) or the same flooding fake engine (``benchmarks.flood``).

It imports vLLM, the standard library, msgspec and zmq only: never ``trio_enginecore``
(that environment does not have it) nor anything else of this checkout, and it is run
by path so that the checkout is not on ``sys.path``. The protocol with the
orchestrator is :mod:`benchmarks.worker`'s: on stdout the line ``READY`` once the
client has received the engine's ready message, then, as the last line, one JSON
object with the figures (``{"error": ...}`` and exit status 1 on failure); vLLM logs on
stderr. The figures have the same names and meaning as the other clients'.

The client is vLLM's, as shipped: ``AsyncMPClient(vllm_config, executor_class, False,
client_addresses={"input_address": ..., "output_address": ...})``, the way vLLM attaches
to engines managed elsewhere. It binds the input ROUTER and the output PULL, waits for
the ready message and starts its receive task in the running event loop. The
``VllmConfig`` is built from ``EngineArgs`` for a tiny model that is only a
``config.json`` (no weights, no tokenizer): with ``client_addresses`` the client starts
no engine, so neither the config's model nor the executor class is used beyond its
construction. Requests are vLLM's own ``EngineCoreRequest``, with the prompts, lengths
and ``arrival_time`` of the other clients' (``trio_enginecore._bench.make_request``);
one ``SamplingParams(max_tokens=T, ignore_eos=True)`` is shared by the requests of a
measurement (vLLM's client does not change it), so vLLM's side builds its requests more
cheaply than the Trio client does (about 2 µs against 3 µs each here): the ratios err
against the Trio client, if at all.

Workloads (the spec as for :mod:`benchmarks.worker`):

* ``generate`` (``concurrency``, ``tokens``, ``duration_s``): the closed loop of the
  batch API, as vLLM's ``AsyncLLM`` drives the client: ``add_request_async`` for each
  request, ``get_output_async`` for each message, a new request for each finished one;
  the requests still in flight at the deadline are aborted in one
  ``abort_requests_async``.
* ``utility`` (``calls``): sequential ``call_utility_async("is_sleeping")`` round trips
  (what ``is_sleeping_async`` sends, without its per-engine ``gather``).
* ``recv`` (``batch``): the receive path against ``benchmarks.flood``.

After the client is ready, and before ``READY``, the worker calls vLLM's own
``freeze_gc_heap()``, as vLLM's API server does once it has started: without it every
full collection walks the hundreds of thousands of objects that importing vLLM and
torch leaves (``"freeze_gc": false`` in the spec skips it, to see the difference).
``"gc_threshold": [g0, g1, g2]`` then sets the collector's thresholds, as for every
other client of a tuned series.

``messages`` counts the messages ``get_output_async`` returned (those with outputs:
the ones the other clients count, utility replies aside).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

WORKLOADS = ("generate", "utility", "recv")

_TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


# ------------------------------------------------- figures (as trio_enginecore._bench)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def generate_summary(
    wall: float, cpu: float, requests: int, tokens: int, messages: int, latencies: list[float]
) -> dict[str, Any]:
    return {
        "wall_s": wall,
        "client_cpu_s": cpu,
        "requests": requests,
        "output_tokens": tokens,
        "messages": messages,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "tokens_per_s": tokens / wall if wall else math.nan,
        "requests_per_s": requests / wall if wall else math.nan,
        "cpu_us_per_token": 1e6 * cpu / tokens if tokens else math.nan,
        "cpu_us_per_message": 1e6 * cpu / messages if messages else math.nan,
    }


def utility_summary(samples: list[float], cpu_s: float) -> dict[str, Any]:
    return {
        "calls": len(samples),
        "rtt_p50_s": percentile(samples, 50),
        "rtt_p99_s": percentile(samples, 99),
        "rtt_mean_s": statistics.fmean(samples) if samples else math.nan,
        "cpu_us_per_call": 1e6 * cpu_s / len(samples) if samples else math.nan,
    }


def recv_summary(wall: float, cpu: float, messages: int, outputs: int) -> dict[str, Any]:
    return {
        "wall_s": wall,
        "client_cpu_s": cpu,
        "messages": messages,
        "outputs": outputs,
        "messages_per_s": messages / wall if wall else math.nan,
        "outputs_per_s": outputs / wall if wall else math.nan,
        "cpu_us_per_message": 1e6 * cpu / messages if messages else math.nan,
    }


# ----------------------------------------------------------------- vLLM's side


class Requests:
    """vLLM ``EngineCoreRequest``\\ s like ``trio_enginecore._bench.make_request``'s."""

    def __init__(self, tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine import EngineCoreRequest

        self._request = EngineCoreRequest
        self._sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)

    def make(self, request_id: str, prompt_len: int = 8) -> Any:
        prompt = [(hash(request_id) % 1000) + i for i in range(prompt_len)]
        return self._request(
            request_id=request_id,
            prompt_token_ids=prompt,
            mm_features=None,
            sampling_params=self._sampling,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )


def vllm_config(model_dir: str) -> Any:
    """The ``VllmConfig`` for a tiny model that exists only as ``config.json``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    Path(model_dir, "config.json").write_text(json.dumps(_TINY_LLAMA))
    args = EngineArgs(
        model=model_dir,
        skip_tokenizer_init=True,
        load_format="dummy",
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        disable_log_stats=True,
    )
    return args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def connect(spec: dict[str, Any], model_dir: str) -> Any:
    """vLLM's ``AsyncMPClient`` attached to the engine started elsewhere (call it in
    the running loop: it then starts its receive task)."""
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.executor.abstract import Executor

    addresses = {"input_address": spec["input_address"], "output_address": spec["output_address"]}
    # With client_addresses the executor class is never used: no engine is started.
    return AsyncMPClient(vllm_config(model_dir), Executor, False, client_addresses=addresses)


# ------------------------------------------------------------------- workloads


async def measure_generate(
    client: Any, *, concurrency: int, tokens: int, duration_s: float
) -> dict[str, Any]:
    """The batch API's closed loop, as ``benchmarks.baselines.asyncio_vllm``'s."""
    loop = asyncio.get_running_loop()
    requests = Requests(tokens)
    latencies: list[float] = []
    started_at: dict[str, float] = {}
    counter = tokens_seen = messages = 0
    deadline = loop.time() + duration_s
    cpu0, wall0 = time.process_time(), time.perf_counter()

    def next_request() -> Any:
        nonlocal counter
        counter += 1
        return requests.make(f"bench-{counter}")

    try:
        async with asyncio.timeout_at(deadline):
            for _ in range(concurrency):
                request = next_request()
                started_at[request.request_id] = loop.time()
                await client.add_request_async(request)
            while True:
                batch = await client.get_output_async()
                messages += 1
                for output in batch.outputs:
                    tokens_seen += len(output.new_token_ids)
                    if output.finish_reason is not None:
                        now = loop.time()
                        latencies.append(now - started_at.pop(output.request_id))
                        request = next_request()
                        started_at[request.request_id] = now
                        await client.add_request_async(request)
    except TimeoutError:
        pass
    await client.abort_requests_async(list(started_at))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return generate_summary(wall, cpu, len(latencies), tokens_seen, messages, latencies)


async def measure_utility_rtt(client: Any, *, calls: int) -> dict[str, Any]:
    samples: list[float] = []
    cpu0 = time.process_time()
    for _ in range(calls):
        started = time.perf_counter()
        await client.call_utility_async("is_sleeping")
        samples.append(time.perf_counter() - started)
    return utility_summary(samples, time.process_time() - cpu0)


async def measure_recv(client: Any, *, batch: int, timeout_s: float = 300.0) -> dict[str, Any]:
    requests = Requests(64)
    request_ids = [f"recv-{i}" for i in range(batch)]
    for request_id in request_ids:
        await client.add_request_async(requests.make(request_id))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    finished = outputs = messages = 0
    async with asyncio.timeout(timeout_s):
        while finished < batch:
            batch_outputs = await client.get_output_async()
            messages += 1
            for output in batch_outputs.outputs:
                outputs += 1
                if output.finish_reason is not None:
                    finished += 1
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    # Hang up: the flooder waits for one more message from us before it exits.
    await client.abort_requests_async(request_ids)
    return recv_summary(wall, cpu, messages, outputs)


async def _run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm.utils.gc_utils import freeze_gc_heap

    with tempfile.TemporaryDirectory(prefix="tecb-vllm-model-") as model_dir:
        client = connect(spec, model_dir)
        try:
            # As vLLM's API server does once started: the startup heap (vLLM, torch,
            # transformers...) is frozen, so that collections do not walk it.
            if spec.get("freeze_gc", True):
                freeze_gc_heap()
            if spec.get("gc_threshold"):  # as benchmarks.worker.tune_gc (not importable here)
                gc.set_threshold(*(int(t) for t in spec["gc_threshold"]))
            print("READY", flush=True)
            workload = spec["workload"]
            if workload == "generate":
                return await measure_generate(
                    client,
                    concurrency=int(spec["concurrency"]),
                    tokens=int(spec["tokens"]),
                    duration_s=float(spec["duration_s"]),
                )
            if workload == "utility":
                return await measure_utility_rtt(client, calls=int(spec["calls"]))
            return await measure_recv(client, batch=int(spec.get("batch", 256)))
        finally:
            client.shutdown()


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("client") != "vllm":
        raise ValueError("this worker runs the 'vllm' client only")
    if spec.get("workload") not in WORKLOADS:
        raise ValueError(f"the vllm client runs {WORKLOADS}, not {spec.get('workload')!r}")
    for key in ("input_address", "output_address"):
        if not isinstance(spec.get(key), str):
            raise ValueError(f"the spec needs {key!r}")
    result = asyncio.run(_run(spec))
    import vllm

    result["vllm_version"] = vllm.__version__
    result["gc_threshold_0"] = gc.get_threshold()[0]
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    status = 0
    try:
        if len(args) != 1:
            raise ValueError("usage: python benchmarks/vllm_worker.py '<spec json>'")
        spec = json.loads(args[0])
        if not isinstance(spec, dict):
            raise ValueError("the spec must be a JSON object")
        result = run_spec(spec)
        if "trio_enginecore" in sys.modules:  # the comparison would not be vLLM's alone
            raise RuntimeError("trio_enginecore was imported into the vLLM worker")
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        result = {"error": f"{type(exc).__name__}: {exc}"}
        status = 1
    print(json.dumps(result), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

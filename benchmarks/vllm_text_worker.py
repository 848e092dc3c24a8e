"""vLLM's side of the text-stream benchmark (``benchmarks/text.py``), in vLLM's environment.

    <vLLM env>/bin/python benchmarks/vllm_text_worker.py '<spec json>'

Run by path, from a temporary directory, with the interpreter of the vLLM 0.34
environment that ``nox -s "interop(vllm='0.34')"`` builds: nothing of this checkout
but ``tests/interop/vllm_side`` (the counter executor and the tiny model's settings)
is importable here, and ``trio_enginecore`` is never imported. Two roles, chosen by the
spec's ``role``:

* ``model``: write the model directory's ``config.json`` (the tokenizer files are
  there already): the interop tests' tiny llama with the tokenizer's vocabulary.
* ``engine``: vLLM's engine core for *our* frontend. vLLM's supervisor
  (``launch_core_engines``) starts one ``EngineCoreProc`` for a client that bound its
  own sockets at ``input_address`` (ROUTER) and ``output_address`` (PULL), exactly as
  vLLM's ``AsyncLLM`` starts its own (the ``attach`` way of the interop tests). Prints
  ``@{"event": "started", "pids": [...]}`` once the engine is ready, then watches it
  until its stdin closes, SIGTERM or its parent's exit.
* ``frontend``: vLLM's ``AsyncLLM``, as shipped, which launches its own engine core
  child with the same settings. Prints ``@{"event": "ready", ...}`` after a warm-up
  and after freezing its startup heap (as vLLM's API server does), then reads one
  JSON command a line on stdin and answers each with one ``@{...}`` line:

  - ``{"cmd": "measure", "concurrency": C, "requests": N, "stop": [...]}``: a closed
    loop of ``C`` asyncio tasks, each running requests one after the other (one
    ``AsyncLLM.generate`` iterated to its end per request) until ``N`` requests have
    been started; the answer holds the process's CPU seconds over the run
    (``time.process_time()``: this process and all its threads, not the engine core
    child), the wall time, and the output tokens and text characters received.
  - ``{"cmd": "quit"}``.

Both roles build the engine the same way (``engine_settings``): the tiny llama of
``tests/interop/vllm_side/common.py`` with the model directory's vocabulary, served by
the counter executor (next token = last + 1, modulo the vocabulary; no step delay),
room in the KV cache for every request of the largest concurrency at once, so that the
scheduler never preempts. Stats logging is off in the frontend (``disable_log_stats``):
our frontend keeps no such statistics either.

Reports are lines starting with ``@`` (vLLM may print other lines on stdout); logs go
to stderr.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The counter executor and the tiny model's settings, shared with the interop tests.
VLLM_SIDE = Path(__file__).resolve().parent.parent / "tests" / "interop" / "vllm_side"
sys.path.insert(0, str(VLLM_SIDE))

BLOCK_SIZE = 16  # the counter executor's KV block size (fake_executor.BLOCK_SIZE)


def say(**fields: Any) -> None:
    """One report line for the orchestrator."""
    print("@" + json.dumps(fields), flush=True)


def engine_settings(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``EngineArgs`` overrides both roles share (besides ``common.engine_args``'s)."""
    max_num_seqs = int(spec["max_num_seqs"])
    max_model_len = int(spec["max_model_len"])
    return {
        # The tokenizer is the model directory's; the engine core needs none, but both
        # roles load the same configuration.
        "skip_tokenizer_init": False,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        # Every request of the largest concurrency fits at full length: no preemption.
        "num_gpu_blocks_override": max_num_seqs * math.ceil(max_model_len / BLOCK_SIZE) + 64,
    }


def vllm_config(spec: dict[str, Any]) -> Any:
    from common import vllm_config as build  # tests/interop/vllm_side/common.py

    return build(spec["model_dir"], **engine_settings(spec))


# ------------------------------------------------------------------- model role


def write_model_config(spec: dict[str, Any]) -> int:
    """Write the model directory's ``config.json``: the interop tests' tiny llama with
    the tokenizer's vocabulary, so that the counter model walks every token id."""
    from common import MODELS  # tests/interop/vllm_side/common.py

    config = {
        **MODELS["llama"],
        "vocab_size": int(spec["vocab_size"]),
        "max_position_embeddings": int(spec["max_model_len"]),
    }
    Path(spec["model_dir"], "config.json").write_text(json.dumps(config, indent=2))
    say(event="written", config=config)
    return 0


# ------------------------------------------------------------------ engine role


def run_engine(spec: dict[str, Any]) -> int:
    from common import exit_with_parent
    from fake_executor import CounterExecutor
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines

    exit_with_parent()
    config = vllm_config(spec)

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def stop_at_end_of_input() -> None:
        # The orchestrator closes our stdin when it is done: stop then, as on SIGTERM.
        sys.stdin.read()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_at_end_of_input, name="stdin-watch", daemon=True).start()
    addresses = EngineZmqAddresses(inputs=[spec["input_address"]], outputs=[spec["output_address"]])
    manager = None
    try:
        with launch_core_engines(config, CounterExecutor, False, addresses) as launch:
            manager = launch.engine_manager
        assert manager is not None
        say(event="started", pids=[process.pid for process in manager.processes])
        manager.monitor_engine_liveness()
    finally:
        if manager is not None:
            manager.shutdown()
    return 0


# ---------------------------------------------------------------- frontend role


class CollectorTime:
    """The time the garbage collector ran (``gc.callbacks``): CPU time of the thread
    that allocated, part of the frontend's CPU figure."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began


async def measure(
    llm: Any, prompts: list[str], *, concurrency: int, requests: int, stop: list[str], tokens: int
) -> dict[str, Any]:
    """A closed loop of ``concurrency`` tasks until ``requests`` requests have run."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        stop=list(stop) or None,
    )
    counts = dict.fromkeys(("started", "tokens", "chars", "outputs", "stopped", "prompt_tokens"), 0)
    run_id = time.monotonic_ns()

    async def slot() -> None:
        while counts["started"] < requests:
            number = counts["started"]
            counts["started"] += 1
            request_id = f"bench-{run_id}-{number}"
            first = True
            async for output in llm.generate(prompts[number % len(prompts)], params, request_id):
                completion = output.outputs[0]
                if first:
                    counts["prompt_tokens"] += len(output.prompt_token_ids or ())
                    first = False
                counts["outputs"] += 1
                counts["tokens"] += len(completion.token_ids)
                counts["chars"] += len(completion.text)
                if completion.finish_reason == "stop":
                    counts["stopped"] += 1

    collections0 = [g["collections"] for g in gc.get_stats()]
    collector = CollectorTime()
    gc.callbacks.append(collector)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    # The collector's runs per generation: a figure's variance follows the full ones.
    gc.callbacks.remove(collector)
    collections = [g["collections"] - c for g, c in zip(gc.get_stats(), collections0, strict=True)]
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "requests": counts.pop("started"),
        **counts,
        "gc_collections": collections,
        "gc_s": collector.seconds,
    }


async def serve_frontend(spec: dict[str, Any]) -> None:
    import vllm
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.monotonic()
    llm = AsyncLLM.from_vllm_config(vllm_config(spec), disable_log_stats=True)
    try:
        prompts: list[str] = spec["prompts"]
        tokens = int(spec["output_tokens"])
        # A warm-up (lazy imports, first allocations, the engine's first steps), then
        # the startup heap frozen, as vLLM's API server freezes it once started.
        await measure(llm, prompts, concurrency=8, requests=16, stop=[], tokens=16)
        freeze_gc_heap()
        import psutil

        # The engine core (and multiprocessing's helpers, idle): the orchestrator reads
        # their CPU time around each measurement, to tell whose pace it was.
        children = [child.pid for child in psutil.Process().children(recursive=True)]
        say(
            event="ready",
            startup_s=time.monotonic() - started,
            vllm_version=vllm.__version__,
            engine_pids=children,
        )
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            command = json.loads(line)
            if command["cmd"] == "quit":
                return
            result = await measure(
                llm,
                prompts,
                concurrency=int(command["concurrency"]),
                requests=int(command["requests"]),
                stop=list(command.get("stop") or ()),
                tokens=tokens,
            )
            say(event="measured", **result)
    finally:
        llm.shutdown()
        # Gone now, while the interpreter is whole: its __del__ shuts it down again,
        # which fails noisily at interpreter exit.
        del llm


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) != 1:
            raise ValueError("usage: vllm_text_worker.py '<spec json>'")
        spec = json.loads(args[0])
        if spec.get("role") == "model":
            return write_model_config(spec)
        if spec.get("role") == "engine":
            return run_engine(spec)
        if spec.get("role") != "frontend":
            raise ValueError(f"unknown role {spec.get('role')!r}")
        asyncio.run(serve_frontend(spec))
        if "trio_enginecore" in sys.modules:  # the comparison would not be vLLM's alone
            raise RuntimeError("trio_enginecore was imported into the vLLM worker")
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        say(event="error", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

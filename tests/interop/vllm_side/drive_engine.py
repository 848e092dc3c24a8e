"""Drive an engine with vLLM's own engine-core clients, and report what happened.

Runs inside the vLLM environment (0.33 or 0.34). vLLM's ``AsyncMPClient`` or
``SyncMPClient`` binds ``--input-address`` (ROUTER) and ``--output-address`` (PULL), as
vLLM's ``client_addresses`` does for engines managed elsewhere, waits for the engine's
ready message, then runs the scenarios in order and prints one ``@{json}`` report per
scenario: raw observations (tokens, finish reasons, utility results, exception
types); the test decides what is right. Without the two addresses the client starts
vLLM's own engine core (counter executor) itself, as ``AsyncLLM`` does: the reference
the same scenarios give on vLLM's side.

``SyncMPClient.__init__`` takes no ``client_addresses`` (only ``AsyncMPClient`` does);
for it the addresses are given to ``MPClient.__init__``, the constructor
``SyncMPClient`` calls, and everything else is vLLM's code as shipped: in 0.34 that
includes packing every prompt as an int32 array before sending it.

The scenario code is written once, for asyncio: with ``SyncMPClient`` every call runs
in one sender thread (vLLM's sync client is not thread-safe) and ``get_output()`` in
another.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

from common import exit_with_parent, say, vllm_config, write_model

# ------------------------------------------------------------------ the clients


def _type_name(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


class Outputs:
    """Every EngineCoreOutput received, by request id, with arrival times."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, int | None] = {}
        self.stop_reason: dict[str, Any] = {}
        self.arrivals: dict[str, list[float]] = {}
        self.messages = 0
        self.error: BaseException | None = None
        self.error_at: float | None = None
        self.changed = asyncio.Event()

    def take(self, outputs: Any) -> None:
        now = time.monotonic()
        self.messages += 1
        for output in outputs.outputs:
            rid = output.request_id
            self.tokens.setdefault(rid, []).extend(output.new_token_ids)
            self.arrivals.setdefault(rid, []).append(now)
            if output.finish_reason is not None:
                self.finish[rid] = int(output.finish_reason)
                self.stop_reason[rid] = output.stop_reason
        self.changed.set()

    def fail(self, exc: BaseException) -> None:
        self.error, self.error_at = exc, time.monotonic()
        self.changed.set()

    async def wait_for(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.error is not None:
                return False
            self.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)
        return True


class AsyncAdapter:
    """vLLM's AsyncMPClient, as vLLM's AsyncLLM uses it."""

    def __init__(self, config: Any, executor: Any, addresses: dict[str, str] | None) -> None:
        from vllm.v1.engine.core_client import AsyncMPClient

        self.client = AsyncMPClient(config, executor, False, client_addresses=addresses)
        self.outputs = Outputs()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self) -> None:
        while True:
            try:
                outputs = await self.client.get_output_async()
            except Exception as exc:
                self.outputs.fail(exc)
                return
            self.outputs.take(outputs)

    async def add(self, request: Any) -> None:
        await self.client.add_request_async(request)

    async def abort(self, ids: list[str]) -> None:
        await self.client.abort_requests_async(ids)

    async def utility(self, name: str, *args: Any) -> Any:
        return await self.client.call_utility_async(name, *args)

    async def method(self, name: str, *args: Any) -> Any:
        """One of the client's typed methods (``sleep`` -> ``sleep_async``)."""
        return await getattr(self.client, f"{name}_async")(*args)

    def has_method(self, name: str) -> bool:
        return hasattr(self.client, f"{name}_async")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.client.shutdown()


class SyncAdapter:
    """vLLM's SyncMPClient, as vLLM's LLMEngine uses it."""

    def __init__(self, config: Any, executor: Any, addresses: dict[str, str] | None) -> None:
        from vllm.v1.engine.core_client import MPClient, SyncMPClient

        original = MPClient.__init__

        def with_addresses(client: Any, *args: Any, **kwargs: Any) -> None:
            kwargs["client_addresses"] = addresses
            original(client, *args, **kwargs)

        if addresses is None:  # the client starts vLLM's engine itself
            self.client = SyncMPClient(config, executor, False)
        else:
            with mock.patch.object(MPClient, "__init__", with_addresses):
                self.client = SyncMPClient(config, executor, False)
        self.outputs = Outputs()
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sender")
        self._stopped = threading.Event()

    def start(self) -> None:
        loop = asyncio.get_running_loop()

        def collect() -> None:
            while not self._stopped.is_set():
                try:
                    outputs = self.client.get_output()
                except Exception as exc:
                    loop.call_soon_threadsafe(self.outputs.fail, exc)
                    return
                loop.call_soon_threadsafe(self.outputs.take, outputs)

        threading.Thread(target=collect, name="collector", daemon=True).start()

    async def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._sender, function, *args)

    async def add(self, request: Any) -> None:
        await self._call(self.client.add_request, request)

    async def abort(self, ids: list[str]) -> None:
        await self._call(self.client.abort_requests, ids)

    async def utility(self, name: str, *args: Any) -> Any:
        return await self._call(self.client.call_utility, name, *args)

    async def method(self, name: str, *args: Any) -> Any:
        return await self._call(getattr(self.client, name), *args)

    def has_method(self, name: str) -> bool:
        return hasattr(self.client, name)

    def close(self) -> None:
        self._stopped.set()
        self.client.shutdown()
        self._sender.shutdown(wait=False)


# ---------------------------------------------------------------- the scenarios


def make_request(request_id: str, prompt: list[int], **sampling: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=SamplingParams(**sampling),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


def exact_prompts(count: int) -> Iterator[tuple[str, list[int], int]]:
    """``count`` requests: id, prompt, max_tokens (all different)."""
    for i in range(count):
        yield f"exact-{i}", [100 * i + j for j in range(1, 2 + i % 5)], 8 + i


async def scenario_exact(client: Any, count: int) -> dict[str, Any]:
    requests = list(exact_prompts(count))
    for rid, prompt, max_tokens in requests:
        await client.add(make_request(rid, prompt, max_tokens=max_tokens))
    ids = {rid for rid, _, _ in requests}
    out = client.outputs
    done = await out.wait_for(lambda: ids <= out.finish.keys(), 60)
    return {
        "done": done,
        "requests": [
            {
                "id": rid,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "tokens": out.tokens.get(rid, []),
                "finish": out.finish.get(rid),
            }
            for rid, prompt, max_tokens in requests
        ],
    }


# Prompt lengths around the 256-byte limit of an inline raw extension: vLLM 0.34's
# clients pack a prompt as int32s, inline up to 63 tokens (252 bytes), as a frame of its
# own from 64 on; 0.33's send a list of ints, whatever the length.
LONG_PROMPTS = (63, 64, 1000)


async def scenario_long(client: Any) -> dict[str, Any]:
    cases = [(f"long-{n}", [(7 * i) % 30000 + 1 for i in range(n)]) for n in LONG_PROMPTS]
    for rid, prompt in cases:
        await client.add(make_request(rid, prompt, max_tokens=8))
    out = client.outputs
    done = await out.wait_for(lambda: {rid for rid, _ in cases} <= out.finish.keys(), 60)
    return {
        "done": done,
        "requests": [
            {
                "id": rid,
                "prompt": prompt,
                "tokens": out.tokens.get(rid, []),
                "finish": out.finish.get(rid),
            }
            for rid, prompt in cases
        ],
    }


async def scenario_stop(client: Any) -> dict[str, Any]:
    # Prompts ending at 10, 20, ...: the counter reaches the stop token after 5 tokens.
    cases = [(f"stop-{i}", [1, 10 * (i + 1)], 10 * (i + 1) + 5) for i in range(8)]
    for rid, prompt, stop in cases:
        await client.add(make_request(rid, prompt, max_tokens=50, stop_token_ids=[stop]))
    out = client.outputs
    ids = {rid for rid, _, _ in cases}
    done = await out.wait_for(lambda: ids <= out.finish.keys(), 60)
    return {
        "done": done,
        "requests": [
            {
                "id": rid,
                "prompt": prompt,
                "stop_token": stop,
                "tokens": out.tokens.get(rid, []),
                "finish": out.finish.get(rid),
                "stop_reason": out.stop_reason.get(rid),
            }
            for rid, prompt, stop in cases
        ],
    }


async def scenario_abort(client: Any) -> dict[str, Any]:
    out = client.outputs
    aborted = [f"abort-{i}" for i in range(8)]
    kept = "abort-kept"
    for rid in aborted:
        await client.add(make_request(rid, [7], max_tokens=1000))
    await client.add(make_request(kept, [7], max_tokens=200))
    # Abort mid-way: once every one of them has produced a few tokens.
    started = await out.wait_for(lambda: all(len(out.tokens.get(r, ())) >= 5 for r in aborted), 30)
    before = {rid: len(out.tokens.get(rid, [])) for rid in aborted}
    await client.abort(aborted)
    aborted_at = time.monotonic()
    finished = await out.wait_for(lambda: kept in out.finish, 30)
    await asyncio.sleep(1.0)  # anything still coming for the aborted ones would be here
    last = max((t for rid in aborted for t in out.arrivals.get(rid, [])), default=aborted_at)
    counts = await client.utility("get_request_counts")
    return {
        "started": started,
        "kept_finished": finished,
        "kept_tokens": out.tokens.get(kept, []),
        "kept_finish": out.finish.get(kept),
        "tokens_before_abort": before,
        "tokens_total": {rid: len(out.tokens.get(rid, [])) for rid in aborted},
        "aborted_finish": {rid: out.finish.get(rid) for rid in aborted},
        "last_output_after_abort_s": last - aborted_at,
        # The kept request finished ~190 steps after the abort was sent: by then the
        # engine had long processed the abort (it does between steps).
        "kept_finished_after_abort_s": (
            out.arrivals[kept][-1] - aborted_at if out.arrivals.get(kept) else None
        ),
        "request_counts": counts,
    }


async def _try(call: Any) -> dict[str, Any]:
    try:
        return {"result": _plain(await call)}
    except Exception as exc:
        return {"error": _type_name(exc), "message": str(exc)}


def _plain(value: Any) -> Any:
    """A utility result as JSON can hold it (sets and tuples as sorted lists)."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value


async def scenario_utilities(client: Any) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest

    lora = LoRARequest(lora_name="adapter-1", lora_int_id=1, lora_path="/nonexistent/adapter-1")
    calls: list[tuple[str, Any]] = [
        ("is_sleeping", client.method("is_sleeping")),
        ("sleep", client.method("sleep", 1)),
        ("is_sleeping_asleep", client.method("is_sleeping")),
        ("wake_up", client.method("wake_up")),
        ("is_sleeping_awake", client.method("is_sleeping")),
        ("reset_prefix_cache", client.method("reset_prefix_cache")),
        ("get_supported_tasks", client.method("get_supported_tasks")),
        ("list_loras_empty", client.method("list_loras")),
        ("add_lora", client.method("add_lora", lora)),
        ("list_loras", client.method("list_loras")),
        ("pin_lora", client.method("pin_lora", 1)),
        ("remove_lora", client.method("remove_lora", 1)),
        ("list_loras_removed", client.method("list_loras")),
        ("execute_dummy_batch", client.method("execute_dummy_batch")),
        ("set_weight_version", client.method("set_weight_version", "v7")),
        ("get_weight_version", client.method("get_weight_version")),
        ("profile_start", client.method("profile", True)),
        ("profile_stop", client.method("profile", False)),
        ("pause_scheduler", client.utility("pause_scheduler", "abort", True)),
        ("is_scheduler_paused", client.utility("is_scheduler_paused")),
        ("is_sleeping_paused", client.method("is_sleeping")),
        ("resume_scheduler", client.utility("resume_scheduler")),
        ("is_scheduler_paused_resumed", client.utility("is_scheduler_paused")),
        ("get_request_counts", client.utility("get_request_counts")),
        ("no_such_method", client.utility("no_such_method")),
    ]
    results = {}
    for name, call in calls:  # one after the other: each may depend on the one before
        results[name] = await _try(call)
    return results


async def scenario_utilities_034(client: Any) -> dict[str, Any]:
    """vLLM 0.34's new and changed utilities, through the client's typed methods where
    it has them (``sleep`` sends 3 arguments, ``release_kv_cache_memory`` 1; the sync
    client has no ``checkpoint_*`` methods: those go as plain utility calls, as do
    ``is_inference_ready`` and a 3-argument ``pause_scheduler``), then one request to
    show that the engine serves after the checkpoint cycle."""

    def typed(name: str, *args: Any) -> Any:
        if client.has_method(name):
            return client.method(name, *args)
        return client.utility(name, *args)

    def ready() -> Any:
        return client.utility("is_inference_ready")

    calls: list[tuple[str, Callable[[], Any]]] = [
        ("is_inference_ready", ready),
        ("checkpoint_state", lambda: typed("checkpoint_state")),
        ("sleep", lambda: typed("sleep", 1, "abort", True)),
        ("is_sleeping_asleep", lambda: typed("is_sleeping")),
        ("is_inference_ready_asleep", ready),
        ("wake_up", lambda: typed("wake_up")),
        ("is_inference_ready_awake", ready),
        ("pause_scheduler", lambda: client.utility("pause_scheduler", "abort", True, True)),
        ("is_inference_ready_paused", ready),
        ("release_kv_cache_memory", lambda: typed("release_kv_cache_memory", True)),
        ("is_sleeping_released", lambda: typed("is_sleeping")),
        ("wake_up_kv_cache", lambda: typed("wake_up", ["kv_cache"])),
        ("is_inference_ready_woken", ready),
        ("checkpoint_prepare", lambda: typed("checkpoint_prepare", "wait")),
        ("checkpoint_state_prepared", lambda: typed("checkpoint_state")),
        ("is_inference_ready_prepared", ready),
        ("sleep_while_prepared", lambda: typed("sleep", 1, "abort", True)),
        ("checkpoint_prepare_again", lambda: typed("checkpoint_prepare", "wait")),
        ("checkpoint_restore", lambda: typed("checkpoint_restore")),
        ("checkpoint_state_restored", lambda: typed("checkpoint_state")),
        ("is_inference_ready_restored", ready),
        ("checkpoint_restore_again", lambda: typed("checkpoint_restore")),
    ]
    results: dict[str, Any] = {}
    for name, call in calls:  # one after the other: each may depend on the one before
        results[name] = await _try(call())
    out = client.outputs
    await client.add(make_request("after-checkpoint", [77], max_tokens=6))
    done = await out.wait_for(lambda: "after-checkpoint" in out.finish, 30)
    results["after"] = {
        "done": done,
        "tokens": out.tokens.get("after-checkpoint", []),
        "finish": out.finish.get("after-checkpoint"),
    }
    return results


async def scenario_fault(client: Any) -> dict[str, Any]:
    out = client.outputs
    injected = await _try(client.utility("inject_fault"))
    injected_at = time.monotonic()
    add = await _try(client.add(make_request("fault-victim", [3], max_tokens=100)))
    await out.wait_for(lambda: False, 20)  # returns as soon as the error arrives
    after = await _try(client.add(make_request("fault-after", [3], max_tokens=4)))
    return {
        "inject_fault": injected,
        "add": add,
        "error": _type_name(out.error) if out.error is not None else None,
        "error_message": str(out.error) if out.error is not None else None,
        "detected_after_s": (out.error_at - injected_at) if out.error_at else None,
        "add_after_death": after,
    }


async def run(args: argparse.Namespace) -> None:
    from fake_executor import CounterExecutor

    config = vllm_config(write_model("llama"))
    if args.sleep_mode:
        # vLLM refuses enable_sleep_mode on a CPU when it builds the config (its sleep
        # mode needs a CUDA-like device); set afterwards, it only lets vLLM 0.34's own
        # engine prepare for a process checkpoint, for which the counter executor has
        # no memory to release.
        config.model_config.enable_sleep_mode = True
    addresses = None
    if args.input_address is not None:
        addresses = {"input_address": args.input_address, "output_address": args.output_address}
    adapter = AsyncAdapter if args.client == "async" else SyncAdapter
    say(event="binding")
    start = time.monotonic()
    client = adapter(config, CounterExecutor, addresses)
    say(scenario="ready", ready_s=time.monotonic() - start)
    client.start()
    try:
        for name in args.scenarios:
            try:
                if name == "exact":
                    report = await scenario_exact(client, args.concurrency)
                elif name == "long":
                    report = await scenario_long(client)
                elif name == "stop":
                    report = await scenario_stop(client)
                elif name == "abort":
                    report = await scenario_abort(client)
                elif name == "utilities":
                    report = await scenario_utilities(client)
                elif name == "utilities_034":
                    report = await scenario_utilities_034(client)
                elif name == "fault":
                    report = await scenario_fault(client)
                else:
                    raise ValueError(f"unknown scenario {name!r}")
            except Exception as exc:
                report = {"crashed": _type_name(exc), "traceback": traceback.format_exc()}
            say(scenario=name, **report)
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--client", choices=["async", "sync"], required=True)
    parser.add_argument("--input-address", help="without both: vLLM's own engine")
    parser.add_argument("--output-address")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sleep-mode", action="store_true", help="for vLLM's own engine")
    parser.add_argument("scenarios", nargs="+")
    args = parser.parse_args()
    if (args.input_address is None) != (args.output_address is None):
        parser.error("give both --input-address and --output-address, or neither")
    if args.sleep_mode and args.input_address is not None:
        parser.error("--sleep-mode is a setting of vLLM's own engine")
    exit_with_parent()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

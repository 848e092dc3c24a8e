"""One contract, every client.

The same behaviours, checked through a thin harness for each client kind: the Trio
multiprocess client (launching its engine, and attached to an engine the test starts),
the Trio in-process client, the blocking multiprocess client, the blocking in-process
client, and the client over the fake transport that :mod:`trio_enginecore.testing`
ships (so the test double users test against keeps the same contract). Blocking
clients are driven from worker threads with ``trio.to_thread``. Where a behaviour
cannot exist for a kind (no engine process to kill in-process) the test says so by its
parameters, and the client's docstring says why.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreClient,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    InprocClient,
    SyncMPClient,
    UtilityCallError,
    open_engine_client,
)
from trio_enginecore.client import TrioEngineClient
from trio_enginecore.client._multiprocess._launch import serve_arguments
from trio_enginecore.engine import CounterModel
from trio_enginecore.errors import EngineConsensusError
from trio_enginecore.protocol import LoRARequest, SamplingKeywords
from trio_enginecore.testing import FakeEngine, open_fake_engine_client

from .enginepeer import serve_command
from .support import children_of_this_process, open_fds, stop_process, with_changed_sampling

KINDS = [
    "trio-launched",
    "trio-attached",
    "trio-inproc",
    "sync",
    "sync-dp",
    "inproc-sync",
    "fake",
]
# The shipped test double has no fault injection (FakeEngine.kill() is its way to die).
WITH_FAULT_INJECTION = [kind for kind in KINDS if kind != "fake"]
WITH_PROCESS = ["trio-launched", "sync", "sync-dp"]
BLOCKING = ["sync", "sync-dp", "inproc-sync"]
# Two data-parallel engines behind one client, on both faces (the one-engine contract
# above runs "sync-dp" too; the Trio data-parallel clients have tests/test_dp_client.py).
DATA_PARALLEL = ["trio-dp", "sync-dp"]


class Harness:
    """The client operations the contract needs, awaitable for every kind."""

    def __init__(self, kind: str, client: TrioEngineClient | EngineCoreClient) -> None:
        self.kind = kind
        self.client = client

    async def _run(self, name: str, *args: Any) -> Any:
        method: Callable[..., Any] = getattr(self.client, name)
        if isinstance(self.client, EngineCoreClient):
            return await trio.to_thread.run_sync(partial(method, *args))
        return await method(*args)

    async def add(self, req: EngineCoreRequest) -> None:
        await self._run("add_request", req)

    async def get_output(self) -> EngineCoreOutputs:
        return await self._run("get_output")  # type: ignore[no-any-return]

    async def abort(self, ids: list[str]) -> None:
        await self._run("abort_requests", ids)

    async def call(self, name: str, *args: Any) -> Any:
        return await self._run(name, *args)

    @property
    def engine_pid(self) -> int | None:
        return self.client.engine_pids[0] if hasattr(self.client, "engine_pids") else None

    def in_flight(self) -> int:
        return self.client.statistics().requests_in_flight


@asynccontextmanager
async def open_harness(kind: str, **config: Any) -> AsyncIterator[Harness]:
    engine_config = EngineConfig(**config)
    if kind.endswith("-dp"):
        engine_config = attrs.evolve(engine_config, data_parallel_size=2)
    if kind in ("trio-launched", "trio-dp"):
        async with open_engine_client(engine_config) as client:
            yield Harness(kind, client)
    elif kind == "trio-inproc":
        async with open_engine_client(engine_config, multiprocess=False) as inproc:
            yield Harness(kind, inproc)
    elif kind == "fake":
        engine = FakeEngine(
            step_time_s=engine_config.step_time_s, max_loras=engine_config.max_loras
        )
        async with open_fake_engine_client(engine) as fake:
            yield Harness(kind, fake)
    elif kind == "trio-attached":
        async with _attached(engine_config) as attached:
            yield Harness(kind, attached)
    else:
        factory = (
            partial(SyncMPClient, engine_config)
            if kind in ("sync", "sync-dp")
            else partial(InprocClient, engine_config)
        )
        blocking: EngineCoreClient = await trio.to_thread.run_sync(factory)
        try:
            yield Harness(kind, blocking)
        finally:
            await trio.to_thread.run_sync(blocking.close)


@asynccontextmanager
async def _attached(config: EngineConfig) -> AsyncIterator[TrioEngineClient]:
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    inp, out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    args = ["--input-address", inp, "--output-address", out, *serve_arguments(config)]
    # No nursery here, so the client's own exception reaches the test unwrapped.
    process = await trio.lowlevel.open_process(serve_command(*args))
    try:
        async with open_engine_client(config, input_address=inp, output_address=out) as client:
            yield client
    finally:
        await stop_process(process)


async def collect(harness: Harness, requests: dict[str, list[int]]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    pending = set(requests)
    while pending:
        outputs = await harness.get_output()
        for output in outputs.outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finish_reason is not None:
                pending.discard(output.request_id)
    return tokens


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_exact_counter_sequences_for_100_concurrent_requests(kind: str) -> None:
    prompts = {f"r{i}": [i * 11 + 1] for i in range(100)}
    with trio.fail_after(60):
        async with open_harness(kind) as harness:
            for rid, prompt in prompts.items():
                await harness.add(
                    EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=12)
                )
            tokens = await collect(harness, prompts)
            assert harness.in_flight() == 0
    for rid, prompt in prompts.items():
        assert tokens[rid] == CounterModel.expected_tokens(prompt, 12), rid


async def test_abort_forgets_the_request_on_the_engine(kind: str) -> None:
    with trio.fail_after(30):
        async with open_harness(kind) as harness:
            await harness.add(
                EngineCoreRequest.for_tokens([1], request_id="long", max_tokens=100_000)
            )
            await harness.add(EngineCoreRequest.for_tokens([50], request_id="short", max_tokens=3))
            first = await harness.get_output()
            await harness.abort(["long", "never-existed"])
            assert harness.in_flight() <= 1
            mine = [o for o in first.outputs if o.request_id == "short"]
            short = [t for o in mine for t in o.new_token_ids]
            if not any(o.finish_reason is not None for o in mine):
                short += (await collect(harness, {"short": [50]}))["short"]
            assert short == [51, 52, 53]
            # After the abort returned, no output of "long" is ever delivered.
            assert harness.in_flight() == 0
            assert await harness.call("get_request_counts") == (0, 0)
            assert harness.in_flight() == 0


async def test_every_utility_wrapper(kind: str) -> None:
    with trio.fail_after(30):
        async with open_harness(kind, max_loras=1) as harness:
            call = harness.call
            assert await call("get_supported_tasks") == ("generate",)
            assert await call("is_sleeping") is False
            await call("sleep", 1)
            assert await call("is_sleeping") is True
            await call("wake_up")
            assert await call("is_sleeping") is False
            assert await call("add_lora", LoRARequest("a", 3, "/a")) is True
            assert await call("add_lora", LoRARequest("b", 4, "/b")) is False
            assert await call("list_loras") == {3}
            assert await call("pin_lora", 3) is True
            assert await call("remove_lora", 3) is True
            assert await call("remove_lora", 3) is False
            assert await call("reset_prefix_cache") is True
            await call("profile", True)
            await call("profile", False)
            await call("execute_dummy_batch")
            await call("set_weight_version", "w1")
            assert await call("get_weight_version") == "w1"
            await call("pause_scheduler", "keep")
            assert await call("is_scheduler_paused") is True
            await call("resume_scheduler")
            assert await call("is_scheduler_paused") is False
            assert await call("get_request_counts") == (0, 0)


async def test_utility_failure_raises_utility_call_error(kind: str) -> None:
    with trio.fail_after(30):
        async with open_harness(kind) as harness:
            with pytest.raises(UtilityCallError, match="no_such_utility"):
                await harness.call("call_utility", "no_such_utility")
            with pytest.raises(UtilityCallError, match="profiler is not running"):
                await harness.call("profile", False)
            assert await harness.call("is_sleeping") is False


@pytest.mark.parametrize("kind", WITH_FAULT_INJECTION)
async def test_a_fatal_engine_error_raises_engine_dead_error(kind: str) -> None:
    with trio.fail_after(30):
        try:
            async with open_harness(kind, enable_fault_injection=True) as harness:
                await harness.add(
                    EngineCoreRequest.for_tokens([1], request_id="victim", max_tokens=100_000)
                )
                await harness.get_output()
                await harness.call("call_utility", "inject_fault")
                with pytest.raises(EngineDeadError):
                    while True:
                        await harness.get_output()
                with pytest.raises(EngineDeadError):
                    await harness.add(
                        EngineCoreRequest.for_tokens([1], request_id="after", max_tokens=3)
                    )
        except EngineDeadError:
            # Trio clients report the death again when their block exits (documented);
            # blocking clients' close() does not raise.
            assert kind not in BLOCKING
        else:
            assert kind in BLOCKING


@pytest.mark.parametrize("kind", WITH_PROCESS)
async def test_kill_9_of_the_engine_raises_engine_dead_error(kind: str) -> None:
    with trio.fail_after(30):
        try:
            async with open_harness(kind) as harness:
                await harness.add(
                    EngineCoreRequest.for_tokens([1], request_id="victim", max_tokens=100_000)
                )
                await harness.get_output()
                pid = harness.engine_pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(EngineDeadError, match="signal 9"):
                    while True:
                        await harness.get_output()
        except EngineDeadError:
            assert kind.startswith("trio")


async def test_clean_shutdown_leaves_no_process_or_fd(kind: str) -> None:
    fds_before = open_fds()
    with trio.fail_after(30):
        async with open_harness(kind) as harness:
            await harness.add(EngineCoreRequest.for_tokens([1], request_id="r", max_tokens=100_000))
            await harness.get_output()
            pid = harness.engine_pid
        # Leaving with a request in flight: it is aborted, the engine stopped.
    assert children_of_this_process() == []
    if pid is not None:
        assert not os.path.exists(f"/proc/{pid}")
    assert open_fds() - fds_before == set()


async def test_finished_outputs_carry_the_finish_reason(kind: str) -> None:
    with trio.fail_after(30):
        async with open_harness(kind) as harness:
            await harness.add(
                EngineCoreRequest.for_tokens(
                    [5], request_id="stop", max_tokens=50, stop_token_ids=[9]
                )
            )
            outputs: list[Any] = []
            while not outputs or outputs[-1].finish_reason is None:
                outputs += (await harness.get_output()).outputs
            assert [t for o in outputs for t in o.new_token_ids] == [6, 7, 8, 9]
            assert outputs[-1].finish_reason is FinishReason.STOP
            assert outputs[-1].stop_reason == 9


@pytest.mark.parametrize("kind", DATA_PARALLEL)
async def test_with_two_engines_the_wrappers_ask_every_engine(kind: str) -> None:
    with trio.fail_after(30):
        async with open_harness(kind, step_time_s=0.01) as harness:
            call = harness.call
            # sleep() puts every engine to sleep, not rank 0 alone.
            await call("sleep", 1)
            assert await call("call_utility_all", "is_sleeping") == [True, True]
            assert await call("is_sleeping") is True
            assert await call("wake_up") is True
            assert await call("call_utility_all", "is_sleeping") == [False, False]
            assert await call("is_sleeping") is False

            # The untyped call goes to rank 0 only; then there is no single answer.
            await call("call_utility", "sleep", 1)
            assert await call("call_utility_all", "is_sleeping") == [True, False]
            with pytest.raises(EngineConsensusError, match="engine 0: True, engine 1: False"):
                await call("is_sleeping")
            assert await call("wake_up") is True
            assert await call("call_utility_all", "is_sleeping") == [False, False]

            # The counts are summed over the engines, with requests running on both.
            ids = [f"r{rank}-{i}" for rank in range(2) for i in range(2)]
            for request_id in ids:
                rank = int(request_id[1])
                await harness.add(
                    EngineCoreRequest.for_tokens(
                        [1], request_id=request_id, max_tokens=100_000, data_parallel_rank=rank
                    )
                )
            while await call("get_request_counts_per_engine") != [(0, 2), (0, 2)]:
                await trio.sleep(0.02)
            assert await call("get_request_counts") == (0, 4)
            await harness.abort(ids)
            assert harness.in_flight() == 0


# A wrong type for every field of SamplingParams a user sets (the keywords of
# EngineCoreRequest.for_tokens), plus values out of range. Each is set after the
# parameters were built, as a program that mutates them would; building them with the
# value raises the same error (tests/test_field_checks.py).
BAD_SAMPLING: dict[str, tuple[Any, type[Exception], str]] = {
    "n": (2.5, TypeError, "SamplingParams.n must be an int, got float 2.5"),
    "presence_penalty": ("0.5", TypeError, "presence_penalty must be a float, got str"),
    "frequency_penalty": (None, TypeError, "frequency_penalty must be a float, got NoneType"),
    "repetition_penalty": ([1.0], TypeError, "repetition_penalty must be a float, got list"),
    "temperature": ("hot", TypeError, "temperature must be a float, got str 'hot'"),
    "top_p": (True, TypeError, "top_p must be a float, got bool True"),
    "top_k": (1.5, TypeError, "top_k must be an int, got float"),
    "min_p": ("0", TypeError, "min_p must be a float, got str"),
    "seed": ("1", TypeError, "SamplingParams.seed must be an int or None, got str '1'"),
    "stop": ([1], TypeError, r"stop must be a str or a list of str or None, .*item 0 is int 1"),
    "stop_token_ids": (["a"], TypeError, r"stop_token_ids must be a list of int .*item 0"),
    "ignore_eos": ("yes", TypeError, "ignore_eos must be a bool, got str 'yes'"),
    "max_tokens": ("5", TypeError, "max_tokens must be an int or None, got str '5'"),
    "min_tokens": (None, TypeError, "min_tokens must be an int, got NoneType"),
    "logprobs": (1.0, TypeError, "logprobs must be an int or None, got float"),
    "prompt_logprobs": ("1", TypeError, "prompt_logprobs must be an int or None"),
    "detokenize": (1, TypeError, "detokenize must be a bool, got int 1"),
    "skip_special_tokens": ("no", TypeError, "skip_special_tokens must be a bool"),
    "include_stop_str_in_output": (0, TypeError, "include_stop_str_in_output must be a bool"),
    "output_kind": ("delta", TypeError, "output_kind must be a RequestOutputKind"),
    "stream_interval": (2.0, TypeError, "stream_interval must be an int or None"),
    "structured_outputs": ({"json": "{}"}, TypeError, "structured_outputs must be a Structured"),
    "logit_bias": ({"5": 1.0}, TypeError, "logit_bias must be a dict of int to float"),
    "allowed_token_ids": ((1, 2), TypeError, "allowed_token_ids must be a list of int or None"),
    "extra_args": ({1: "x"}, TypeError, "extra_args must be a dict of str to anything"),
    "bad_words": ("word", TypeError, "bad_words must be a list of str or None, got str"),
}
BAD_VALUES: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "a seed beyond 64 bits": ({"seed": 2**64}, ValueError, "seed is 18446744073709551616"),
    "max_tokens of 0": ({"max_tokens": 0}, ValueError, "max_tokens must be at least 1"),
    "a temperature of 5": ({"temperature": 5.0}, ValueError, "temperature must be in"),
    "an empty stop string": ({"stop": [""]}, ValueError, "stop cannot contain an empty"),
    "a NaN repetition penalty": (
        {"repetition_penalty": float("nan")},
        ValueError,
        "repetition_penalty must be finite",
    ),
}


def _with_sampling(request_id: str, **changes: Any) -> EngineCoreRequest:
    request = EngineCoreRequest.for_tokens([3, 4], request_id=request_id, max_tokens=4)
    return with_changed_sampling(request, **changes)


def test_the_bad_sampling_table_covers_every_keyword_a_user_sets() -> None:
    assert set(BAD_SAMPLING) == set(SamplingKeywords.__annotations__)


async def test_every_bad_sampling_field_is_named_and_the_client_serves_on(kind: str) -> None:
    cases = [
        ({name: value}, error, message) for name, (value, error, message) in BAD_SAMPLING.items()
    ]
    cases += BAD_VALUES.values()
    with trio.fail_after(60):
        async with open_harness(kind) as harness:
            for number, (changes, error, message) in enumerate(cases):
                with pytest.raises(error, match=message):
                    await harness.add(_with_sampling(f"bad-{number}", **changes))
                assert harness.in_flight() == 0
            assert await harness.call("get_request_counts") == (0, 0)
            await harness.add(_with_sampling("good"))
            tokens = await collect(harness, {"good": [3, 4]})
    assert tokens["good"] == CounterModel.expected_tokens([3, 4], 4)

"""TrioMPClient against real engine processes (launched, and attached).

Every test uses the real stack: ``open_engine_client`` launching ``trio-enginecore
serve`` (or an engine started by the test, in attach mode), ZeroMQ over ipc:// in a
private directory, the counter model so every token is predictable. Each test has an
absolute timeout and checks that in-flight bookkeeping returns to zero.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    EngineStartupError,
    FinishReason,
    TrioMPClient,
    UtilityCallError,
    connect_engine_client,
    open_engine_client,
)
from trio_enginecore.protocol import LoRARequest

from .enginepeer import serve_command
from .support import (
    children_of_this_process,
    expected,
    open_fds,
    process_is_running,
    schedule_points,
    stream_tokens,
)


def assert_idle(client: TrioMPClient) -> None:
    stats = client.statistics()
    assert stats.requests_in_flight == 0
    assert stats.open_streams == 0
    assert stats.pending_utility_calls == 0


@asynccontextmanager
async def attached_client(
    *engine_args: str, **client_kwargs: object
) -> AsyncIterator[TrioMPClient]:
    """A client in attach mode, with an engine the test starts itself."""
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    inp, out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    command = serve_command("--input-address", inp, "--output-address", out, *engine_args)
    async with trio.open_nursery() as nursery:
        process = await nursery.start(partial(trio.run_process, command, check=False))
        try:
            async with open_engine_client(
                EngineConfig(), input_address=inp, output_address=out, **client_kwargs
            ) as client:
                yield client
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()


@asynccontextmanager
async def launched_client(**config: object) -> AsyncIterator[TrioMPClient]:
    async with open_engine_client(EngineConfig(**config)) as client:  # type: ignore[arg-type]
        yield client


@pytest.fixture(params=["launched", "attached"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def client_in(mode: str, **config: object) -> object:
    if mode == "launched":
        return launched_client(**config)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in config.items()]
    return attached_client(*args)


# ------------------------------------------------------------------------ streams


async def test_500_concurrent_streams_receive_exact_gap_free_sequences(mode: str) -> None:
    prompts = {f"s{i}": [i * 37 % 30000, i] for i in range(500)}
    results: dict[str, list[int]] = {}
    with trio.fail_after(90):
        async with client_in(mode) as client:  # type: ignore[attr-defined]
            async with trio.open_nursery() as nursery:
                for rid, prompt in prompts.items():

                    async def run(rid: str = rid, prompt: list[int] = prompt) -> None:
                        results[rid] = await stream_tokens(
                            client,
                            EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=24),
                        )

                    nursery.start_soon(run)
            assert_idle(client)
            assert client.statistics().tokens_received == 500 * 24
    for rid, prompt in prompts.items():
        assert results[rid] == expected(prompt, 24), rid


async def test_batch_api_delivers_the_same_tokens(mode: str) -> None:
    prompts = {f"b{i}": [i + 1] for i in range(100)}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished: set[str] = set()
    with trio.fail_after(60):
        async with client_in(mode) as client:  # type: ignore[attr-defined]
            for rid, prompt in prompts.items():
                await client.add_request(
                    EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=20)
                )
            while len(finished) < len(prompts):
                outputs = await client.get_output()
                for output in outputs.outputs:
                    tokens[output.request_id] += output.new_token_ids
                    if output.finish_reason is not None:
                        assert output.finish_reason is FinishReason.LENGTH
                        finished.add(output.request_id)
            assert_idle(client)
    for rid, prompt in prompts.items():
        assert tokens[rid] == expected(prompt, 20)


async def test_streamed_requests_are_not_delivered_through_get_output() -> None:
    with trio.fail_after(30):
        async with launched_client() as client:
            await client.add_request(
                EngineCoreRequest.for_tokens([1], request_id="batch", max_tokens=5)
            )
            assert await stream_tokens(
                client, EngineCoreRequest.for_tokens([100], request_id="streamed", max_tokens=5)
            ) == expected([100], 5)
            seen: list[str] = []
            while "batch" not in seen or len([r for r in seen if r == "batch"]) < 5:
                outputs = await client.get_output()
                seen += [o.request_id for o in outputs.outputs for _ in o.new_token_ids]
            assert set(seen) == {"batch"}


async def test_cancelling_half_the_streams_aborts_exactly_those_on_the_engine() -> None:
    rng = random.Random(1234)
    ids = [f"c{i}" for i in range(200)]
    cancelled = set(rng.sample(ids, 100))
    results: dict[str, list[int]] = {}
    partial_counts: dict[str, int] = {}
    with trio.fail_after(60):
        async with launched_client(step_time_s=0.002) as client:

            async def run(rid: str) -> None:
                prompt = [int(rid[1:]) * 10]
                if rid not in cancelled:
                    results[rid] = await stream_tokens(
                        client, EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=40)
                    )
                    return
                received = 0
                with trio.CancelScope() as scope:
                    async with client.stream(
                        EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=100_000)
                    ) as outputs:
                        async for output in outputs:
                            received += len(output.new_token_ids)
                            if received >= rng.randint(1, 30):
                                scope.cancel()
                partial_counts[rid] = received

            async with trio.open_nursery() as nursery:
                for rid in ids:
                    nursery.start_soon(run, rid)
            # The engine forgot every cancelled request: nothing waits or runs there.
            assert await client.get_request_counts() == (0, 0)
            assert_idle(client)
    for rid in set(ids) - cancelled:
        assert results[rid] == expected([int(rid[1:]) * 10], 40)
    assert set(partial_counts) == cancelled
    assert all(n < 100_000 for n in partial_counts.values())


async def test_a_slow_reader_delays_no_other_stream_and_gets_every_token_merged() -> None:
    with trio.fail_after(60):
        async with launched_client(step_time_s=0.002) as client:
            slow_chunks: list[list[int]] = []
            fast_done = trio.Event()

            async def slow() -> None:
                async with client.stream(
                    EngineCoreRequest.for_tokens([7], request_id="slow", max_tokens=200)
                ) as outputs:
                    async for output in outputs:
                        slow_chunks.append(output.new_token_ids)
                        await fast_done.wait()  # the slow reader does not read meanwhile

            async def fast() -> None:
                tokens = await stream_tokens(
                    client, EngineCoreRequest.for_tokens([1000], request_id="fast", max_tokens=100)
                )
                assert tokens == expected([1000], 100)
                fast_done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                nursery.start_soon(fast)
            assert_idle(client)
    assert [t for chunk in slow_chunks for t in chunk] == expected([7], 200)
    # The outputs that piled up while the slow reader waited arrived merged.
    assert max(len(chunk) for chunk in slow_chunks) > 1


async def test_leaving_a_stream_early_aborts_it_once() -> None:
    with trio.fail_after(30):
        async with launched_client(step_time_s=0.002) as client:
            async with client.stream(
                EngineCoreRequest.for_tokens([1], request_id="early", max_tokens=100_000)
            ) as outputs:
                async for _ in outputs:
                    break
            assert await client.get_request_counts() == (0, 0)
            assert_idle(client)
            with pytest.raises(KeyError):
                async with client.stream(
                    EngineCoreRequest.for_tokens([1], request_id="raiser", max_tokens=100_000)
                ) as outputs:
                    await outputs.receive()
                    raise KeyError("user error")
            assert await client.get_request_counts() == (0, 0)


async def test_abort_requests_ends_a_stream_with_abort() -> None:
    with trio.fail_after(30):
        async with launched_client(step_time_s=0.002) as client:
            async with client.stream(
                EngineCoreRequest.for_tokens([1], request_id="a", max_tokens=100_000)
            ) as outputs:
                await outputs.receive()
                await client.abort_requests(["a", "unknown-id"])
                last = None
                async for output in outputs:
                    last = output
                assert last is not None
                assert last.finish_reason is FinishReason.ABORT
            assert await client.get_request_counts() == (0, 0)
            assert_idle(client)


async def test_add_requests_sends_a_batch_with_one_checkpoint() -> None:
    prompts = {f"m{i}": [i * 3 + 1] for i in range(50)}
    with trio.fail_after(30):
        async with launched_client() as client:
            points = await schedule_points(
                lambda: client.add_requests(
                    EngineCoreRequest.for_tokens(p, request_id=rid, max_tokens=5)
                    for rid, p in prompts.items()
                )
            )
            assert points == 1
            tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
            while client.statistics().requests_in_flight:
                for output in (await client.get_output()).outputs:
                    tokens[output.request_id] += output.new_token_ids
            assert_idle(client)
    for rid, prompt in prompts.items():
        assert tokens[rid] == expected(prompt, 5)


async def test_add_requests_is_all_or_nothing() -> None:
    with trio.fail_after(30):
        async with launched_client(step_time_s=0.01) as client:
            await client.add_requests(
                [EngineCoreRequest.for_tokens([1], request_id="a", max_tokens=100_000)]
            )
            with pytest.raises(ValueError, match="'x' appears twice"):
                await client.add_requests(
                    [
                        EngineCoreRequest.for_tokens([1], request_id="x", max_tokens=5),
                        EngineCoreRequest.for_tokens([1], request_id="x", max_tokens=5),
                    ]
                )
            with pytest.raises(ValueError, match="in flight"):
                await client.add_requests(
                    [
                        EngineCoreRequest.for_tokens([1], request_id="y", max_tokens=5),
                        EngineCoreRequest.for_tokens([1], request_id="a", max_tokens=5),
                    ]
                )
            with trio.CancelScope() as scope:
                scope.cancel()
                await client.add_requests(
                    [EngineCoreRequest.for_tokens([1], request_id="z", max_tokens=5)]
                )
            # Only "a" was ever sent: the engine holds exactly one request.
            assert client.statistics().requests_in_flight == 1
            assert sum(await client.get_request_counts()) == 1
            await client.abort_requests(["a"])
            assert_idle(client)


async def test_duplicate_request_ids_are_refused_while_in_flight() -> None:
    with trio.fail_after(30):
        async with launched_client(step_time_s=0.002) as client:
            await client.add_request(
                EngineCoreRequest.for_tokens([1], request_id="dup", max_tokens=100_000)
            )
            with pytest.raises(ValueError, match="already in flight"):
                await client.add_request(
                    EngineCoreRequest.for_tokens([1], request_id="dup", max_tokens=3)
                )
            await client.abort_requests(["dup"])
            assert_idle(client)


# ---------------------------------------------------------------------- utilities


async def test_typed_utility_wrappers_return_typed_results() -> None:
    with trio.fail_after(30):
        async with launched_client(max_loras=2) as client:
            assert await client.get_supported_tasks() == ("generate",)
            assert await client.is_sleeping() is False
            await client.sleep()
            assert await client.is_sleeping() is True
            assert await client.wake_up() is True  # vLLM 0.33's answer: fully awake
            assert await client.add_lora(LoRARequest("a", 1, "/a")) is True
            assert await client.add_lora(LoRARequest("b", 2, "/b")) is True
            assert await client.add_lora(LoRARequest("c", 3, "/c")) is False
            assert await client.list_loras() == {1, 2}
            assert await client.pin_lora(1) is True
            assert await client.remove_lora(2) is True
            assert await client.list_loras() == {1}
            assert await client.reset_prefix_cache() is True
            await client.profile(True)
            await client.profile(False)
            await client.execute_dummy_batch()
            assert await client.get_weight_version() is None
            await client.set_weight_version("v7")
            assert await client.get_weight_version() == "v7"
            await client.pause_scheduler("keep")
            assert await client.is_scheduler_paused() is True
            await client.resume_scheduler()
            assert await client.is_scheduler_paused() is False
            assert await client.get_request_counts() == (0, 0)
            assert_idle(client)


async def test_utility_failure_raises_utility_call_error_with_the_engine_message() -> None:
    with trio.fail_after(30):
        async with launched_client() as client:
            with pytest.raises(UtilityCallError) as info:
                await client.call_utility("no_such_method")
            assert info.value.method == "no_such_method"
            assert "no_such_method" in info.value.engine_message
            with pytest.raises(UtilityCallError, match="profiler is not running"):
                await client.profile(False)
            assert await client.is_sleeping() is False  # the engine keeps serving
            assert_idle(client)


async def test_a_cancelled_utility_call_leaves_no_state_and_its_late_reply_is_dropped() -> None:
    with trio.fail_after(30):
        async with launched_client(step_time_s=0.01) as client:
            # pause(wait) replies only when running requests finish: a slow call.
            await client.add_request(
                EngineCoreRequest.for_tokens([1], request_id="r", max_tokens=50)
            )
            await client.get_output()  # running now
            with trio.move_on_after(0.05) as scope:
                await client.pause_scheduler("wait")
            assert scope.cancelled_caught
            assert client.statistics().pending_utility_calls == 0
            while client.statistics().requests_in_flight:
                await client.get_output()
            # The late reply arrived and was dropped; the client still works.
            assert await client.is_scheduler_paused() is True
            await client.resume_scheduler()
            assert_idle(client)


# ------------------------------------------------------------------------ failure


async def test_kill_9_fails_every_waiter_promptly_and_the_block_raises_one_error() -> None:
    fds_before = open_fds()
    failures: list[BaseException] = []
    with trio.fail_after(30):
        with pytest.raises(EngineDeadError) as info:
            async with launched_client(step_time_s=0.002) as client:
                pid = client.engine_pids[0]
                assert pid is not None

                async def waiter(i: int) -> None:
                    try:
                        await stream_tokens(
                            client,
                            EngineCoreRequest.for_tokens(
                                [1], request_id=f"k{i}", max_tokens=100_000
                            ),
                        )
                    except EngineDeadError as exc:
                        failures.append(exc)
                        raise

                async def utility_waiter() -> None:
                    await client.pause_scheduler("wait")

                with trio.CancelScope() as scope:
                    try:
                        async with trio.open_nursery() as nursery:
                            for i in range(10):
                                nursery.start_soon(waiter, i)
                            nursery.start_soon(utility_waiter)
                            await trio.sleep(0.2)
                            killed_at = trio.current_time()
                            os.kill(pid, signal.SIGKILL)
                    except* EngineDeadError:
                        scope.cancel()
                assert trio.current_time() - killed_at < 1.0
                assert len(failures) == 10
                assert client.is_dead
                with pytest.raises(EngineDeadError):
                    await client.get_output()
                with pytest.raises(EngineDeadError):
                    await client.add_request(EngineCoreRequest.for_tokens([1], request_id="after"))
    assert "killed by signal 9" in str(info.value)
    assert children_of_this_process() == []
    assert open_fds() - fds_before == set()


@pytest.mark.parametrize("fate", ["killed", "hung"])
async def test_an_attached_engine_killed_or_stopped_fails_its_requests_after_the_checks(
    fate: str,
) -> None:
    # No child process of ours to watch: its connection is what tells.
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    inp, out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    command = serve_command("--input-address", inp, "--output-address", out, "--step-time-s=0.01")
    failures: list[float] = []
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(partial(trio.run_process, command, check=False))
        try:
            with trio.fail_after(30), pytest.raises(EngineDeadError) as info:
                async with open_engine_client(
                    EngineConfig(), input_address=inp, output_address=out
                ) as client:
                    flowing = trio.Event()

                    async def doomed(i: int) -> None:
                        request = EngineCoreRequest.for_tokens([i], max_tokens=100_000)
                        with pytest.raises(EngineDeadError):
                            async with client.stream(request) as outputs:
                                async for _ in outputs:
                                    flowing.set()
                        failures.append(trio.current_time() - stopped_at)

                    async with trio.open_nursery() as requests:
                        for i in range(4):
                            requests.start_soon(doomed, i)
                        await flowing.wait()
                        stopped_at = trio.current_time()
                        process.send_signal(signal.SIGKILL if fate == "killed" else signal.SIGSTOP)
        finally:
            process.kill()
            if fate == "hung":
                process.send_signal(signal.SIGCONT)
    assert "its connection was lost" in str(info.value)
    assert len(failures) == 4
    assert max(failures) < 3.0  # what the default Liveness() promises


async def test_without_liveness_checks_a_killed_attached_engine_goes_unnoticed() -> None:
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    inp, out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    command = serve_command("--input-address", inp, "--output-address", out)
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(partial(trio.run_process, command, check=False))
        with trio.fail_after(30):
            async with open_engine_client(
                EngineConfig(), input_address=inp, output_address=out, liveness=None
            ) as client:
                process.kill()
                await process.wait()
                with trio.move_on_after(2.5) as waiting:
                    await client.is_sleeping()
                assert waiting.cancelled_caught
                assert not client.is_dead


async def test_block_raises_engine_dead_error_if_the_engine_died_meanwhile() -> None:
    with trio.fail_after(30), pytest.raises(EngineDeadError, match=r"exited|killed"):
        async with launched_client() as client:
            pid = client.engine_pids[0]
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            with trio.fail_after(5):
                while not client.is_dead:
                    await trio.sleep(0.01)


async def test_engine_core_dead_fails_waiters_with_the_reason() -> None:
    with trio.fail_after(30), pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD"):
        async with (
            launched_client(enable_fault_injection=True, step_time_s=0.002) as client,
            client.stream(
                EngineCoreRequest.for_tokens([1], request_id="victim", max_tokens=100_000)
            ) as outputs,
        ):
            await outputs.receive()
            await client.call_utility("inject_fault")
            async for _ in outputs:
                pass


async def test_user_exception_propagates_unchanged_and_the_engine_is_stopped() -> None:
    error = RuntimeError("mine")
    with trio.fail_after(30):
        with pytest.raises(RuntimeError) as info:
            async with launched_client() as client:
                pid = client.engine_pids[0]
                await client.add_request(
                    EngineCoreRequest.for_tokens([1], request_id="r", max_tokens=100_000)
                )
                raise error
    assert info.value is error
    assert info.value.__context__ is None
    assert pid is not None
    assert not Path(f"/proc/{pid}").exists()


async def test_the_cancelled_exception_leaving_the_block_is_the_bodys_own() -> None:
    inside: list[BaseException] = []
    outside: list[BaseException] = []
    with trio.fail_after(30):
        with trio.CancelScope() as outer:
            try:
                async with launched_client() as client:
                    outer.cancel()
                    try:
                        await client.is_sleeping()
                    except trio.Cancelled as exc:
                        inside.append(exc)
                        raise
            except trio.Cancelled as exc:
                outside.append(exc)
                raise
    assert outer.cancelled_caught
    assert len(inside) == 1
    assert outside[0] is inside[0]


async def test_a_normal_exit_leaves_no_process_fd_or_directory_behind() -> None:
    fds_before = open_fds()
    with trio.fail_after(30):
        async with launched_client() as client:
            assert await stream_tokens(
                client, EngineCoreRequest.for_tokens([1], request_id="r", max_tokens=4)
            ) == [2, 3, 4, 5]
            ipc_dir = client.transport.control.ipc_dir
            assert ipc_dir is not None
            assert Path(ipc_dir).is_dir()
    assert not Path(ipc_dir).exists()
    assert children_of_this_process() == []
    assert open_fds() - fds_before == set()


async def test_outer_cancellation_propagates_unchanged_and_the_engine_is_stopped() -> None:
    pid = None
    with trio.fail_after(30):
        with trio.CancelScope() as outer:
            async with launched_client(step_time_s=0.002) as client:
                pid = client.engine_pids[0]
                async with client.stream(
                    EngineCoreRequest.for_tokens([1], request_id="r", max_tokens=100_000)
                ) as outputs:
                    await outputs.receive()
                    outer.cancel()
                    await trio.sleep_forever()
    assert outer.cancelled_caught
    assert pid is not None
    assert not Path(f"/proc/{pid}").exists()
    assert children_of_this_process() == []


async def test_an_engine_that_never_becomes_ready_gives_a_startup_error_in_time() -> None:
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    with trio.fail_after(30):
        start = trio.current_time()
        with pytest.raises(EngineStartupError, match="never sent its ready message"):
            async with open_engine_client(
                EngineConfig(),
                input_address=f"ipc://{tmp}/in",
                output_address=f"ipc://{tmp}/out",
                ready_timeout_s=0.5,
            ):
                pass  # pragma: no cover
        assert 0.5 <= trio.current_time() - start < 5


async def test_an_engine_that_crashes_at_startup_is_reported_with_its_stderr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An engine command that dies at once, with a message on stderr.
    import trio_enginecore.client._multiprocess._launch as mp

    def broken_command(config: EngineConfig, address: str, **_: object) -> list[str]:
        return [
            sys.executable,
            "-c",
            "import sys; sys.stderr.write('boom: no GPU\\n'); sys.exit(7)",
        ]

    monkeypatch.setattr(mp, "engine_command", broken_command)
    with trio.fail_after(30):
        with pytest.raises(EngineStartupError) as info:
            async with open_engine_client(EngineConfig(), ready_timeout_s=20):
                pass  # pragma: no cover
    message = str(info.value)
    assert "exited with code 7" in message
    assert "boom: no GPU" in message
    assert children_of_this_process() == []


ORPHAN_SCRIPT = """
import os, sys, trio
from trio_enginecore import open_engine_client

async def main():
    async with open_engine_client() as client:
        print(client.engine_pids[0], flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_an_engine_does_not_outlive_a_client_killed_with_sigkill() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            process = await nursery.start(
                partial(
                    trio.run_process,
                    [sys.executable, "-c", ORPHAN_SCRIPT],
                    stdout=subprocess.PIPE,
                    check=False,
                )
            )
            assert process.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await process.stdout.receive_some(100)
            engine_pid = int(line)
            assert Path(f"/proc/{engine_pid}").exists()
            process.kill()
        # The engine notices it was orphaned and exits on its own.
        while process_is_running(engine_pid):
            await trio.sleep(0.1)


async def test_cancelling_the_startup_stops_the_engine_and_returns_promptly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trio_enginecore.client._multiprocess._launch as mp

    def slow_command(config: EngineConfig, address: str, **_: object) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    monkeypatch.setattr(mp, "engine_command", slow_command)
    with trio.fail_after(10):
        with trio.move_on_after(0.5) as scope:
            async with open_engine_client(EngineConfig(), ready_timeout_s=30):
                pass  # pragma: no cover
        assert scope.cancelled_caught
    assert children_of_this_process() == []


async def test_connect_engine_client_runs_in_the_callers_nursery() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            client = await connect_engine_client(nursery, EngineConfig())
            try:
                assert await stream_tokens(
                    client, EngineCoreRequest.for_tokens([3], request_id="n", max_tokens=3)
                ) == [4, 5, 6]
            finally:
                await client.aclose()
        # The nursery could exit: every task of the client ended with aclose().
    assert children_of_this_process() == []


async def test_statistics_snapshot_is_frozen_and_counts() -> None:
    with trio.fail_after(30):
        async with launched_client() as client:
            before = client.statistics()
            await stream_tokens(
                client, EngineCoreRequest.for_tokens([1], request_id="x", max_tokens=10)
            )
            after = client.statistics()
            assert before.tokens_received == 0
            assert after.tokens_received == 10
            assert after.engines_alive == 1
            with pytest.raises(AttributeError):
                after.tokens_received = 0  # type: ignore[misc]
            assert_idle(client)


async def test_a_scope_cancelled_while_its_client_shuts_down_ends_as_cancelled() -> None:
    """A cancel scope around the client cancelled while the client stops its engines
    (a second Ctrl-C, a deadline): the cancellation goes on up and the scope absorbs
    it, as any cancellation; no EngineDeadError claims the client failed."""

    async def cancel_soon(scope: trio.CancelScope) -> None:
        await trio.sleep(0.02)
        scope.cancel()

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            async with open_engine_client(EngineConfig(data_parallel_size=2)) as client:
                request = EngineCoreRequest.for_tokens([1, 2, 3], max_tokens=2)
                await client.add_request(request)
                nursery.start_soon(cancel_soon, scope)  # lands during the shutdown
        assert scope.cancelled_caught

"""DPLBTrioMPClient: one client balancing over three real engine processes."""

from __future__ import annotations

import os
import signal

import pytest
import trio
import trio.testing

from trio_enginecore import EngineConfig, EngineDeadError, open_engine_client
from trio_enginecore.client import DPLBTrioMPClient
from trio_enginecore.errors import EngineConsensusError
from trio_enginecore.protocol import EngineCoreRequest

from .support import children_of_this_process, expected


async def test_600_concurrent_streams_over_3_engines_complete_exactly() -> None:
    prompts = {f"s{i}": [i * 7 + 1] for i in range(600)}
    results: dict[str, list[int]] = {}
    with trio.fail_after(90):
        async with open_engine_client(EngineConfig(data_parallel_size=3)) as client:
            assert isinstance(client, DPLBTrioMPClient)
            assert len([pid for pid in client.engine_pids if pid]) == 3

            async def run(rid: str) -> None:
                tokens: list[int] = []
                async with client.stream(
                    EngineCoreRequest.for_tokens(prompts[rid], request_id=rid, max_tokens=16)
                ) as outputs:
                    async for output in outputs:
                        tokens += output.new_token_ids
                results[rid] = tokens

            async with trio.open_nursery() as nursery:
                for rid in prompts:
                    nursery.start_soon(run, rid)
            assert client.statistics().requests_in_flight == 0
    for rid, prompt in prompts.items():
        assert results[rid] == expected(prompt, 16), rid
    assert children_of_this_process() == []


async def test_uniform_load_is_balanced_and_aborts_go_only_to_the_owning_engine() -> None:
    config = EngineConfig(data_parallel_size=3, step_time_s=0.005, max_num_seqs=1024)
    with trio.fail_after(60):
        async with open_engine_client(config) as client:
            scopes: dict[str, trio.CancelScope] = {}
            started = 0
            all_started = trio.Event()

            async def hold(rid: str) -> None:
                nonlocal started
                with trio.CancelScope() as scope:
                    scopes[rid] = scope
                    async with client.stream(
                        EngineCoreRequest.for_tokens([1], request_id=rid, max_tokens=100_000)
                    ) as outputs:
                        await outputs.receive()
                        started += 1
                        if started == 600:
                            all_started.set()
                        async for _ in outputs:
                            pass

            async with trio.open_nursery() as nursery:
                for i in range(600):
                    nursery.start_soon(hold, f"h{i}")
                await all_started.wait()
                per_engine = await client.get_request_counts_per_engine()
                totals = [w + r for w, r in per_engine]
                assert sum(totals) == 600
                mean = sum(totals) / 3
                assert all(abs(t - mean) <= 0.2 * mean for t in totals), totals
                # Cancel every other stream: each abort must reach only its engine, so
                # every engine ends up holding exactly what the client thinks it holds.
                for i in range(0, 600, 2):
                    scopes[f"h{i}"].cancel()
                await trio.testing.wait_all_tasks_blocked()
                owners = client._state.inflight  # pyright: ignore[reportPrivateUsage]
                expected_per_engine = [0, 0, 0]
                for engine in owners.values():
                    expected_per_engine[engine.rank] += 1
                per_engine = await client.get_request_counts_per_engine()
                assert [w + r for w, r in per_engine] == expected_per_engine
                assert sum(expected_per_engine) == 300
                nursery.cancel_scope.cancel()
            assert await client.get_request_counts() == (0, 0)
            assert client.statistics().requests_in_flight == 0


async def test_an_explicit_rank_on_the_request_is_honoured() -> None:
    with trio.fail_after(30):
        async with open_engine_client(EngineConfig(data_parallel_size=3)) as client:
            for rank in (2, 2, 0, 1):
                await client.add_request(
                    EngineCoreRequest.for_tokens(
                        [1],
                        request_id=f"r{rank}-{trio.current_time()}",
                        data_parallel_rank=rank,
                        max_tokens=4,
                    )
                )
            seen: dict[int, int] = {}
            finished = 0
            while finished < 4:
                outputs = await client.get_output()
                for output in outputs.outputs:
                    if output.finish_reason is not None:
                        finished += 1
                        seen[outputs.engine_index] = seen.get(outputs.engine_index, 0) + 1
            assert seen == {2: 2, 0: 1, 1: 1}


async def test_utilities_reach_every_engine_and_must_agree() -> None:
    with trio.fail_after(30):
        async with open_engine_client(EngineConfig(data_parallel_size=3)) as client:
            await client.sleep()  # a typed wrapper: every engine
            assert await client.call_utility_all("is_sleeping") == [True, True, True]
            assert await client.is_sleeping() is True
            await client.wake_up()
            await client.call_utility("sleep")  # untyped: rank 0 only
            assert await client.call_utility_all("is_sleeping") == [True, False, False]
            with pytest.raises(EngineConsensusError, match="engine 0: True, engine 1: False"):
                await client.is_sleeping()
            await client.wake_up()
            assert await client.get_request_counts_per_engine() == [(0, 0)] * 3


async def test_killing_one_rank_fails_its_requests_and_then_the_client() -> None:
    failures: list[str] = []
    finished: list[str] = []
    config = EngineConfig(data_parallel_size=3, step_time_s=0.005)
    with trio.fail_after(30), pytest.raises(EngineDeadError, match="signal 9"):
        async with open_engine_client(config) as client:
            victim_pid = client.engine_pids[1]
            assert victim_pid is not None

            async def run(i: int) -> None:
                # Pin requests to ranks so we know whose they are.
                req = EngineCoreRequest.for_tokens(
                    [1], request_id=f"k{i}", data_parallel_rank=i % 3, max_tokens=4
                )
                assert req.sampling_params is not None
                req.sampling_params.max_tokens = 300
                try:
                    async with client.stream(req) as outputs:
                        async for _ in outputs:
                            pass
                    finished.append(req.request_id)
                except EngineDeadError:
                    failures.append(req.request_id)

            async with trio.open_nursery() as nursery:
                for i in range(9):
                    nursery.start_soon(run, i)
                await trio.sleep(0.3)
                os.kill(victim_pid, signal.SIGKILL)
                with trio.fail_after(2):
                    while len(failures) < 3:
                        await trio.sleep(0.01)
            # Exactly rank 1's requests failed; the others finished their tokens.
            assert sorted(failures) == ["k1", "k4", "k7"]
            assert sorted(finished) == ["k0", "k2", "k3", "k5", "k6", "k8"]
            with pytest.raises(EngineDeadError):
                await client.add_request(EngineCoreRequest.for_tokens([1], request_id="after"))
    assert children_of_this_process() == []


async def test_the_coordinators_counts_reach_the_client_and_it_stops_with_it() -> None:
    config = EngineConfig(data_parallel_size=3, step_time_s=0.01, max_num_seqs=4)
    with trio.fail_after(30):
        async with open_engine_client(config) as client:
            tasks = client.transport.control.socket_tasks
            assert len(tasks) == 2  # the coordinator, and the watch of the connections
            async with trio.open_nursery() as nursery:
                for i in range(30):
                    nursery.start_soon(
                        client.add_request,
                        EngineCoreRequest.for_tokens([1], request_id=f"c{i}", max_tokens=100_000),
                    )
            engines = client._state.engines  # pyright: ignore[reportPrivateUsage]
            # The engines report, the coordinator publishes, the client folds it in:
            # the published counts end up equal to what the engines say directly.
            # 30 requests balanced 10 per engine, 4 running (max_num_seqs) and 6 waiting.
            while [(e.load.waiting, e.load.running) for e in engines] != [(6, 4)] * 3:
                await trio.sleep(0.05)
            assert await client.get_request_counts_per_engine() == [(6, 4)] * 3
            assert client.engines_running
            # The wave ends when every engine has nothing left. (An engine that got the
            # START_DP_WAVE before its first request may have started a second wave.)
            await client.abort_requests([f"c{i}" for i in range(30)])
            while client.engines_running or client.current_wave < 1:
                await client.wait_wave_change()
    assert all(done.is_set() for _, done in tasks)
    assert children_of_this_process() == []


async def test_engine_core_dead_fails_only_the_engine_that_sent_it() -> None:
    """ENGINE_CORE_DEAD is one anonymous frame; the sender's exit identifies it."""
    config = EngineConfig(data_parallel_size=2, step_time_s=0.01, enable_fault_injection=True)
    failures: dict[str, BaseException] = {}
    tokens = {"on-0": 0, "on-1": 0}
    with trio.fail_after(30):
        with pytest.raises(EngineDeadError):
            async with open_engine_client(config) as client:

                async def stream(rid: str, rank: int) -> None:
                    try:
                        async with client.stream(
                            EngineCoreRequest.for_tokens(
                                [1], request_id=rid, data_parallel_rank=rank, max_tokens=100_000
                            )
                        ) as outs:
                            async for output in outs:
                                tokens[rid] += len(output.new_token_ids)
                    except EngineDeadError as exc:
                        failures[rid] = exc

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stream, "on-0", 0)
                    nursery.start_soon(stream, "on-1", 1)
                    while min(tokens.values()) == 0:
                        await trio.sleep(0.01)
                    engines = client._state.engines  # pyright: ignore[reportPrivateUsage]
                    await client._call_engines([engines[1]], "inject_fault", ())  # pyright: ignore[reportPrivateUsage]
                    while "on-1" not in failures:
                        await trio.sleep(0.01)
                    # The other engine's request is untouched and keeps streaming.
                    before = tokens["on-0"]
                    while tokens["on-0"] < before + 5:
                        await trio.sleep(0.01)
                    nursery.cancel_scope.cancel()
    message = str(failures["on-1"])
    assert "engine rank 1" in message
    assert "exited with code 1" in message
    assert "fault injected" in message  # the engine's own last words, from its stderr
    assert "on-0" not in failures


async def test_waiting_for_a_wave_change_ends_when_the_client_closes_or_an_engine_dies() -> None:
    errors: list[BaseException] = []
    woken = trio.Event()

    async def waiter(client: DPLBTrioMPClient, *, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()  # parked in wait_wave_change() before the caller resumes
        try:
            await client.wait_wave_change()
        except (EngineDeadError, trio.ClosedResourceError) as exc:
            errors.append(exc)
            woken.set()

    config = EngineConfig(data_parallel_size=2)
    with trio.fail_after(30):
        async with trio.open_nursery() as outer, open_engine_client(config) as client:
            assert isinstance(client, DPLBTrioMPClient)
            await outer.start(waiter, client)
        assert len(errors) == 1
        assert isinstance(errors[0], trio.ClosedResourceError)

        woken = trio.Event()
        async with trio.open_nursery() as outer:
            with pytest.raises(EngineDeadError):
                async with open_engine_client(config) as client:
                    assert isinstance(client, DPLBTrioMPClient)
                    await outer.start(waiter, client)
                    pid = client.engine_pids[1]
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
                    await woken.wait()
        assert isinstance(errors[1], EngineDeadError)

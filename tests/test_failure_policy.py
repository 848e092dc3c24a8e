"""What an engine's death does to a client with several engines, by policy.

``on_engine_failure="fail"`` (the default, vLLM's behaviour) fails the client on the
first death. ``"route_around"`` takes the dead (or hung) rank out of routing: its
requests fail naming it, every other request and stream goes on exactly, new requests
go to the survivors, and the client fails only when no engine is left. These tests kill
and stop real engine processes in the middle of hundreds of streams.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
from functools import partial

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    open_engine_client,
)
from trio_enginecore.client import ClientOptions, TrioMPClient
from trio_enginecore.client._core._policy import Restart, RestartBudget

from .support import children_of_this_process, expected, open_fds, process_is_running

STREAMS = 300
LOAD_S = 20.0
"""How long the restart test keeps its load going, five kills within it."""
TOKENS = 30
VICTIM = 1

CONFIG = EngineConfig(data_parallel_size=3, step_time_s=0.01)


def restarts(client: TrioMPClient) -> int:
    return sum(engine.restarts for engine in client.statistics().engines)


def prompt(i: int) -> list[int]:
    return [i % 97 + 1, i % 13 + 1]


async def stream_one(
    client: TrioMPClient,
    i: int,
    done: dict[int, list[int]],
    dead: dict[int, str],
    first_output: trio.Semaphore | None = None,
    *,
    rank: int | None = None,
) -> None:
    request = EngineCoreRequest.for_tokens(
        prompt(i), request_id=f"r{i}", max_tokens=TOKENS, data_parallel_rank=rank
    )
    tokens: list[int] = []
    try:
        async with client.stream(request) as outputs:
            async for output in outputs:
                if not tokens and first_output is not None:
                    first_output.release()
                tokens += output.new_token_ids
    except EngineDeadError as exc:
        dead[i] = str(exc)
    else:
        done[i] = tokens


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
async def test_routing_around_a_rank_killed_or_hung_during_300_streams(
    sig: signal.Signals,
) -> None:
    done: dict[int, list[int]] = {}
    dead: dict[int, str] = {}
    fds_before = open_fds()
    with trio.fail_after(90):
        async with open_engine_client(CONFIG, on_engine_failure="route_around") as client:
            victim = client.engine_pids[VICTIM]
            assert victim is not None
            started = trio.Semaphore(0, max_value=STREAMS)
            async with trio.open_nursery() as nursery:
                # Each stream names its rank, so that which ones were on the victim is
                # known exactly; the requests after the death are balanced.
                for i in range(STREAMS):
                    nursery.start_soon(
                        partial(stream_one, client, i, done, dead, started, rank=i % 3)
                    )
                for _ in range(STREAMS):  # every stream is under way, none has finished
                    await started.acquire()
                os.kill(victim, sig)
            # Only the victim's requests failed, each naming it; every other request
            # streamed exactly what it would have without the death.
            on_victim = {i for i in range(STREAMS) if i % 3 == VICTIM}
            assert dead
            assert set(dead) <= on_victim
            assert set(range(STREAMS)) - on_victim <= set(done)
            assert len(done) + len(dead) == STREAMS
            for message in dead.values():
                assert f"engine rank {VICTIM}, pid {victim} died" in message
                if sig is signal.SIGSTOP:
                    assert "its connection was lost" in message
            for i, tokens in done.items():
                assert tokens == expected(prompt(i), TOKENS), i
            # The client serves on with the survivors.
            assert client.failure is None
            assert not client.is_dead
            stats = client.statistics()
            assert stats.engines_alive == 2
            assert [e.state for e in stats.engines] == ["alive", "dead", "alive"]
            assert stats.requests_in_flight == 0
            after: dict[int, list[int]] = {}
            async with trio.open_nursery() as nursery:
                for i in range(STREAMS, STREAMS + 60):
                    nursery.start_soon(stream_one, client, i, after, dead)
            assert sorted(after) == list(range(STREAMS, STREAMS + 60))
            assert all(tokens == expected(prompt(i), TOKENS) for i, tokens in after.items())
            assert await client.is_sleeping() is False  # the typed utilities: survivors
            with pytest.raises(EngineDeadError, match=f"data_parallel_rank {VICTIM} is out"):
                await client.add_request(
                    EngineCoreRequest.for_tokens([1], data_parallel_rank=VICTIM)
                )
    # A hung engine we launched was killed; nothing is left behind.
    assert not process_is_running(victim)
    assert children_of_this_process() == []
    assert open_fds() - fds_before == set()


async def test_a_batch_request_on_a_rank_routed_around_ends_with_an_error_output() -> None:
    config = EngineConfig(data_parallel_size=2, step_time_s=0.01)
    with trio.fail_after(60):
        async with open_engine_client(config, on_engine_failure="route_around") as client:
            victim = client.engine_pids[0]
            assert victim is not None
            await client.add_requests(
                [
                    EngineCoreRequest.for_tokens(
                        [3], request_id=f"b{rank}", max_tokens=10_000, data_parallel_rank=rank
                    )
                    for rank in (0, 1)
                ]
            )
            os.kill(victim, signal.SIGKILL)
            finished: dict[str, FinishReason] = {}
            while "b0" not in finished:
                for output in (await client.get_output()).outputs:
                    if output.finish_reason is not None:
                        finished[output.request_id] = output.finish_reason
                        assert output.error is not None
                        assert output.error.code == "engine_dead"
                        assert output.error.retryable
                        assert f"engine rank 0, pid {victim} died" in output.error.message
            assert finished == {"b0": FinishReason.ERROR}
            # The other rank's request is still running: it can be aborted as usual,
            # and a retry of the failed one goes to the survivor and completes.
            await client.abort_requests(["b1"])
            await client.add_request(
                EngineCoreRequest.for_tokens([3], request_id="b0", max_tokens=4)
            )
            tokens: list[int] = []
            while True:
                outputs = (await client.get_output()).outputs
                assert {o.request_id for o in outputs} <= {"b0"}
                tokens += [t for o in outputs for t in o.new_token_ids]
                if any(o.finish_reason is not None for o in outputs):
                    break
            assert tokens == expected([3], 4)
            assert client.statistics().engines[1].in_flight == 0


async def test_when_no_engine_is_left_the_client_fails_with_one_engine_dead_error() -> None:
    config = EngineConfig(data_parallel_size=2, step_time_s=0.01)
    with trio.fail_after(60):
        with pytest.raises(EngineDeadError, match="no engine is left") as caught:
            async with open_engine_client(config, on_engine_failure="route_around") as client:
                first, second = client.engine_pids
                assert first is not None
                assert second is not None
                os.kill(first, signal.SIGKILL)
                while client.statistics().engines_alive == 2:
                    await trio.sleep(0.02)
                assert not client.is_dead
                os.kill(second, signal.SIGKILL)
                failure = await client.wait_failed()
                assert "no engine is left: engine rank 1" in str(failure)
                with pytest.raises(EngineDeadError, match="no engine is left"):
                    await client.add_request(EngineCoreRequest.for_tokens([1]))
    assert not isinstance(caught.value, BaseExceptionGroup)
    assert children_of_this_process() == []


async def test_the_default_policy_still_fails_the_client_on_the_first_death() -> None:
    config = EngineConfig(data_parallel_size=2, step_time_s=0.01)
    assert ClientOptions().on_engine_failure == "fail"
    with trio.fail_after(60):
        with pytest.raises(EngineDeadError, match="engine rank 1"):
            async with open_engine_client(config) as client:
                victim = client.engine_pids[1]
                assert victim is not None
                os.kill(victim, signal.SIGKILL)
                await client.wait_failed()
                assert client.statistics().engines[0].state == "alive"
    assert children_of_this_process() == []


async def test_a_batch_naming_a_rank_out_of_range_or_service_sends_none_of_it() -> None:
    config = EngineConfig(data_parallel_size=2, step_time_s=0.01)
    with trio.fail_after(60):
        async with open_engine_client(config, on_engine_failure="route_around") as client:
            good = EngineCoreRequest.for_tokens([1], request_id="good", max_tokens=2)
            with pytest.raises(ValueError, match="data_parallel_rank 5 is out of range"):
                await client.add_requests(
                    [good, EngineCoreRequest.for_tokens([1], data_parallel_rank=5)]
                )
            assert client.statistics().requests_in_flight == 0
            victim = client.engine_pids[1]
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            while client.statistics().engines_alive == 2:
                await trio.sleep(0.02)
            with pytest.raises(EngineDeadError, match="data_parallel_rank 1 is out of service"):
                await client.add_requests(
                    [good, EngineCoreRequest.for_tokens([1], data_parallel_rank=1)]
                )
            stats = client.statistics()
            assert stats.requests_in_flight == 0
            assert [e.in_flight for e in stats.engines] == [0, 0]


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="on_engine_failure"):
        ClientOptions(on_engine_failure="retry")  # type: ignore[arg-type]


# ------------------------------------------------------------------ restart


def test_the_restart_budget_backs_off_doubling_and_gives_up_within_its_window() -> None:
    budget = RestartBudget(Restart(max_restarts=3, window_s=10, backoff_s=0.5, max_backoff_s=1.5))
    assert budget.next_delay(0.0) == 0.5
    assert budget.next_delay(1.0) == 1.0
    assert budget.next_delay(3.0) == 1.5  # doubled to 2.0, capped
    assert budget.next_delay(4.0) is None  # three within 10 s: spent
    assert budget.restarts == 3
    # Once the first falls out of the window, one more is allowed, backed off as the
    # third of the window would be.
    assert budget.next_delay(10.6) == 1.5
    assert budget.next_delay(10.7) is None


def test_peeking_at_the_restart_budget_counts_nothing() -> None:
    """The restart's log line, written when the engine dies, gives the delay its
    restart will wait (``peek_delay``), before the restart counts it (``next_delay``)."""
    budget = RestartBudget(Restart(max_restarts=2, window_s=10, backoff_s=0.5))
    assert [budget.peek_delay(0.0), budget.peek_delay(0.0)] == [0.5, 0.5]
    assert budget.restarts == 0
    assert budget.next_delay(0.0) == 0.5
    assert budget.peek_delay(1.0) == budget.next_delay(1.0) == 1.0
    assert budget.peek_delay(2.0) is None
    assert budget.restarts == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_restarts", 0), ("max_restarts", 1.5), ("window_s", 0), ("backoff_s", -1.0)],
)
def test_restart_settings_out_of_range_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"Restart.{field} must be"):
        Restart(**{field: value})


async def test_restart_with_engines_started_elsewhere_is_refused() -> None:
    with pytest.raises(ValueError, match="restarts engines this client launches"):
        async with open_engine_client(
            EngineConfig(),
            input_address="ipc:///tmp/nowhere-in",
            output_address="ipc:///tmp/nowhere-out",
            on_engine_failure="restart",
        ):
            pass  # pragma: no cover


async def test_a_killed_engine_is_restarted_and_requests_wait_for_it() -> None:
    """One engine: while it restarts there is none in service, so a new request waits
    for it (bounded by ``Restart.wait_s``) instead of failing."""
    with trio.fail_after(60):
        async with open_engine_client(
            EngineConfig(step_time_s=0.01), on_engine_failure=Restart(backoff_s=0.3)
        ) as client:
            (first,) = client.engine_pids
            assert first is not None
            victim = EngineCoreRequest.for_tokens([5], request_id="v", max_tokens=100_000)
            with pytest.raises(EngineDeadError, match=f"engine rank 0, pid {first} died"):
                async with client.stream(victim) as outputs:
                    await outputs.receive()
                    os.kill(first, signal.SIGKILL)
                    async for _ in outputs:
                        pass
            assert client.statistics().engines[0].state == "restarting"
            assert not client.is_dead
            # The same id again: it waits for the restarted engine, and is exact.
            again = EngineCoreRequest.for_tokens([5], request_id="v", max_tokens=8)
            async with client.stream(again) as outputs:
                tokens = [t async for o in outputs for t in o.new_token_ids]
            assert tokens == expected([5], 8)
            (second,) = client.engine_pids
            assert second not in (None, first)
            status = client.statistics().engines[0]
            assert (status.state, status.restarts, status.death) == ("alive", 1, None)
            assert await client.is_sleeping() is False
    assert not process_is_running(first)
    assert second is not None
    assert not process_is_running(second)
    assert children_of_this_process() == []


async def test_a_request_cancelled_while_waiting_for_a_restart_leaves_nothing_behind() -> None:
    with trio.fail_after(60):
        async with open_engine_client(
            EngineConfig(step_time_s=0.01), on_engine_failure=Restart(backoff_s=2.0)
        ) as client:
            (pid,) = client.engine_pids
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            while client.statistics().engines[0].state in ("alive", "suspect"):
                await trio.sleep(0.02)
            with trio.move_on_after(0.3) as waited:
                await client.add_request(EngineCoreRequest.for_tokens([1], request_id="w"))
            assert waited.cancelled_caught
            assert client.statistics().requests_in_flight == 0
            await client.add_request(
                EngineCoreRequest.for_tokens([1], request_id="w", max_tokens=3)
            )
            tokens: list[int] = []
            while True:
                outputs = (await client.get_output()).outputs
                tokens += [t for o in outputs for t in o.new_token_ids]
                if any(o.finish_reason is not None for o in outputs):
                    break
            assert tokens == expected([1], 3)


async def test_an_engine_that_keeps_dying_is_given_up_and_then_the_client_fails() -> None:
    policy = Restart(max_restarts=1, window_s=60, backoff_s=0.05, wait_s=20)
    with trio.fail_after(60):
        with pytest.raises(EngineDeadError, match="no engine is left") as caught:
            async with open_engine_client(
                EngineConfig(step_time_s=0.01), on_engine_failure=policy
            ) as client:
                for _ in range(2):
                    await client.is_sleeping()  # waits for the restart after the first
                    (pid,) = client.engine_pids
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
                    while client.statistics().engines[0].state in ("alive", "suspect"):
                        await trio.sleep(0.02)
                failure = await client.wait_failed()
                assert "not restarted again: it needed 1 restart(s) within 60 s" in str(failure)
                assert client.statistics().engines[0].state == "dead"
    assert "killed by signal 9" in str(caught.value)
    assert children_of_this_process() == []


async def test_a_hung_engine_is_killed_and_restarted() -> None:
    with trio.fail_after(60):
        async with open_engine_client(
            EngineConfig(step_time_s=0.01), on_engine_failure="restart"
        ) as client:
            (pid,) = client.engine_pids
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            while client.statistics().engines[0].state in ("alive", "suspect"):  # until noticed
                await trio.sleep(0.02)
            assert "its connection was lost" in str(client.statistics().engines[0].death)
            request = EngineCoreRequest.for_tokens([2], request_id="after", max_tokens=4)
            async with client.stream(request) as outputs:  # waits for the restart
                tokens = [t async for o in outputs for t in o.new_token_ids]
            assert tokens == expected([2], 4)
            assert client.statistics().engines[0].restarts == 1
            assert not process_is_running(pid)
    assert children_of_this_process() == []


async def test_five_kills_during_a_20_s_load_on_two_restarting_engines() -> None:
    """Random kills of either rank while streams run for 20 s: each stream is exact or fails
    naming the engine killed under it; every kill is followed by a restart; the
    client never fails, and nothing is left after the block."""
    rng = random.Random(16)
    config = EngineConfig(data_parallel_size=2, step_time_s=0.005)
    policy = Restart(max_restarts=10, backoff_s=0.05, max_backoff_s=0.2)
    done = 0
    failures: list[str] = []
    killed: list[int] = []
    fds_before = open_fds()
    with trio.fail_after(120):
        async with open_engine_client(config, on_engine_failure=policy) as client:

            async def load(worker: int) -> None:
                nonlocal done
                for n in itertools.count():
                    i = worker * 10_000 + n
                    request = EngineCoreRequest.for_tokens(
                        prompt(i), request_id=f"w{i}", max_tokens=rng.randint(1, 40)
                    )
                    tokens: list[int] = []
                    try:
                        async with client.stream(request) as outputs:
                            async for output in outputs:
                                tokens += output.new_token_ids
                    except EngineDeadError as exc:
                        failures.append(str(exc))
                    else:
                        assert tokens == expected(prompt(i), request.sampling_params.max_tokens)
                        done += 1

            async with trio.open_nursery() as nursery:
                load_ends = trio.current_time() + LOAD_S
                for worker in range(24):
                    nursery.start_soon(load, worker)
                for kills in range(1, 6):
                    await trio.sleep(rng.uniform(1.0, 3.0))
                    pid = client.engine_pids[rng.randrange(2)]
                    assert pid is not None
                    killed.append(pid)
                    os.kill(pid, signal.SIGKILL)
                    while restarts(client) < kills:  # noticed, restarted, back in service
                        await trio.sleep(0.02)
                # The load goes on after the last restart: the engines serve it all.
                await trio.sleep_until(max(load_ends, trio.current_time() + 0.5))
                nursery.cancel_scope.cancel()
            stats = client.statistics()
            assert sum(e.restarts for e in stats.engines) == 5
            assert [e.state for e in stats.engines] == ["alive", "alive"]
            assert not client.is_dead
    assert done > 100
    assert failures
    for failure in failures:
        assert any(f"pid {pid} died" in failure for pid in killed), failure
    assert not any(process_is_running(pid) for pid in killed)
    assert children_of_this_process() == []
    assert open_fds() - fds_before == set()  # the dead engines' pipes and lifelines

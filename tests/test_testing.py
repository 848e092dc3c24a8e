"""trio_enginecore.testing: the scripted fake engine users test their code with.

No process and no socket here, so these tests run on Trio's virtual clock.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_enginecore import EngineCoreRequest, EngineDeadError, FinishReason, UtilityCallError
from trio_enginecore.testing import FakeEngine, open_fake_engine_client

from .support import schedule_points


async def test_unscripted_requests_count_like_the_counter_model(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = FakeEngine(step_time_s=0.5)
    async with open_fake_engine_client(engine) as client:
        tokens: list[int] = []
        async with client.stream(
            EngineCoreRequest.for_tokens([7], request_id="r", max_tokens=4)
        ) as outputs:
            async for output in outputs:
                tokens += output.new_token_ids
                last = output
        assert tokens == [8, 9, 10, 11]
        assert last.finish_reason is FinishReason.LENGTH
        # Four steps of 0.5 s of virtual time, none of real time.
        assert trio.current_time() == pytest.approx(2.0)
        assert [r.request_id for r in engine.requests] == ["r"]


async def test_scripted_steps_and_finish_reason(autojump_clock: trio.testing.MockClock) -> None:
    engine = FakeEngine(step_time_s=1.0)
    engine.script("s", [[1, 2], [3]], finish_reason=FinishReason.STOP, stop_reason=3)
    async with open_fake_engine_client(engine) as client:
        await client.add_request(EngineCoreRequest.for_tokens([0], request_id="s", max_tokens=100))
        first = (await client.get_output()).outputs[0]
        second = (await client.get_output()).outputs[0]
    assert first.new_token_ids == [1, 2]
    assert first.finish_reason is None
    assert second.new_token_ids == [3]
    assert second.finish_reason is FinishReason.STOP
    assert second.stop_reason == 3


async def test_leaving_a_stream_early_is_recorded_as_an_abort(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = FakeEngine(step_time_s=1.0)
    async with open_fake_engine_client(engine) as client:
        with trio.move_on_after(2.5):
            async with client.stream(
                EngineCoreRequest.for_tokens([0], request_id="long", max_tokens=1000)
            ) as outputs:
                async for _ in outputs:
                    pass
        await trio.testing.wait_all_tasks_blocked()
        assert engine.aborted == ["long"]
        assert engine.in_flight == 0
        assert client.statistics().requests_in_flight == 0


async def test_utilities_default_scripted_and_failing() -> None:
    engine = FakeEngine()
    engine.on_utility("get_weight_version", lambda: "v3")

    def explode(level: int = 1) -> None:
        raise RuntimeError("out of memory")

    async with open_fake_engine_client(engine) as client:
        assert await client.get_supported_tasks() == ("generate",)
        assert await client.is_sleeping() is False
        await client.sleep()
        assert await client.is_sleeping() is True
        assert await client.get_weight_version() == "v3"
        engine.on_utility("sleep", explode)
        with pytest.raises(UtilityCallError, match="out of memory"):
            await client.sleep()
        # Every typed utility answers as the reference engine's does...
        await client.profile()
        with pytest.raises(UtilityCallError, match="profiler is already running"):
            await client.profile()
        # ... and a method the engine does not have fails as on a real engine.
        with pytest.raises(UtilityCallError, match="no utility 'collective_rpc'"):
            await client.call_utility("collective_rpc", "x")
    assert ("sleep", (1,)) in engine.utility_calls


async def test_kill_fails_every_waiter_and_the_block(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = FakeEngine(step_time_s=1.0)
    failures: list[BaseException] = []
    with pytest.raises(EngineDeadError, match="power cut"):
        async with open_fake_engine_client(engine) as client:

            async def reader(i: int) -> None:
                try:
                    async with client.stream(
                        EngineCoreRequest.for_tokens([0], request_id=f"r{i}", max_tokens=100)
                    ) as outputs:
                        async for _ in outputs:
                            pass
                except EngineDeadError as exc:
                    failures.append(exc)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(reader, i)
                await trio.sleep(2.5)
                engine.kill("power cut")
    assert len(failures) == 3


async def test_wake_up_reports_whether_the_engine_is_fully_awake() -> None:
    engine = FakeEngine()
    async with open_fake_engine_client(engine) as client:
        assert await client.wake_up() is True
        engine.on_utility("wake_up", lambda tags=None: False)  # vLLM: partly asleep
        assert await client.wake_up(["weights"]) is False
        engine.on_utility("wake_up", lambda tags=None: None)  # an engine answering nothing
        assert await client.wake_up() is True


async def test_add_requests_hands_a_batch_over_with_one_schedule_point() -> None:
    engine = FakeEngine()
    async with open_fake_engine_client(engine) as client:
        batch = [EngineCoreRequest.for_tokens([i], request_id=f"b{i}") for i in range(5)]
        assert await schedule_points(lambda: client.add_requests(batch)) == 1
        assert [request.request_id for request in engine.requests] == [f"b{i}" for i in range(5)]


async def test_a_cancelled_batch_is_sent_whole_or_not_at_all() -> None:
    for delay_ticks in range(4):
        engine = FakeEngine()
        async with open_fake_engine_client(engine) as client:
            batch = [
                EngineCoreRequest.for_tokens([i], request_id=f"c{delay_ticks}-{i}")
                for i in range(10)
            ]
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_after, scope, delay_ticks)
                    await client.add_requests(batch)
            assert len(engine.requests) in (0, 10), (delay_ticks, len(engine.requests))
            await client.abort_requests(request.request_id for request in batch)


async def _cancel_after(scope: trio.CancelScope, ticks: int) -> None:
    for _ in range(ticks):
        await trio.lowlevel.checkpoint()
    scope.cancel()


async def test_the_fake_engine_forgets_an_aborted_request_at_once() -> None:
    """As an engine does when it reads the ABORT: a call right after ``abort_requests``
    does not count the request (the play task that produced it ends later)."""
    async with open_fake_engine_client(FakeEngine(step_time_s=0.001)) as client:
        for i in range(50):
            await client.add_request(
                EngineCoreRequest.for_tokens([1], request_id=f"long-{i}", max_tokens=10_000)
            )
            await client.abort_requests([f"long-{i}"])
            assert await client.get_request_counts() == (0, 0)

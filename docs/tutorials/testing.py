"""Testing your application: a scripted fake engine on Trio's virtual clock."""

from __future__ import annotations

import trio
import trio.testing

from trio_enginecore import (
    AsyncEngineCoreClient,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
)
from trio_enginecore.testing import FakeEngine, open_fake_engine_client

# ---------------------------------------------------------------- the application


async def complete(
    client: AsyncEngineCoreClient, request_id: str, prompt: list[int], *, timeout_s: float = 5.0
) -> tuple[list[int], str]:
    """Collect one generation; give up after ``timeout_s`` (the request is aborted)."""
    request = EngineCoreRequest.for_tokens(prompt, request_id=request_id, max_tokens=64)
    tokens: list[int] = []
    outcome = "timeout"
    with trio.move_on_after(timeout_s):
        try:
            async with client.stream(request) as outputs:
                async for output in outputs:
                    tokens += output.new_token_ids
                    if output.finish_reason is not None:
                        outcome = str(output.finish_reason)
        except EngineDeadError:
            outcome = "engine died"
    return tokens, outcome


# ----------------------------------------------------- its tests (pytest-trio style)


async def test_collects_every_token_and_the_finish_reason() -> None:
    engine = FakeEngine(step_time_s=0.1)
    engine.script("r1", [[10, 11], [12], [13]], finish_reason=FinishReason.STOP)
    async with open_fake_engine_client(engine) as client:
        tokens, outcome = await complete(client, "r1", [1, 2, 3])
    assert tokens == [10, 11, 12, 13]
    assert outcome == "stop"
    assert abs(trio.current_time() - 0.3) < 1e-9  # three steps of 0.1 s, virtual


async def test_gives_up_after_the_timeout_and_aborts_the_request() -> None:
    engine = FakeEngine(step_time_s=1.0)  # 64 tokens would take 64 (virtual) seconds
    async with open_fake_engine_client(engine) as client:
        tokens, outcome = await complete(client, "slow", [0], timeout_s=5.0)
        await trio.testing.wait_all_tasks_blocked()
    assert outcome == "timeout"
    assert tokens == [1, 2, 3, 4]  # one token per second for 5 s, the 5th not yet out
    assert engine.aborted == ["slow"]  # leaving the stream aborted it on the engine
    assert abs(trio.current_time() - 5.0) < 1e-9


async def test_reports_an_engine_death() -> None:
    engine = FakeEngine(step_time_s=1.0)
    result: list[tuple[list[int], str]] = []

    async def run(client: AsyncEngineCoreClient) -> None:
        result.append(await complete(client, "victim", [0]))

    try:
        async with open_fake_engine_client(engine) as client, trio.open_nursery() as nursery:
            nursery.start_soon(run, client)
            await trio.sleep(2.5)
            engine.kill("the GPU fell off the bus")
    except EngineDeadError as exc:
        # Like every Trio client, the block reports the death when it ends.
        print(f"   the client's block raised EngineDeadError: {exc}")
    assert result == [([1, 2], "engine died")]


def main() -> None:
    tests = [
        test_collects_every_token_and_the_finish_reason,
        test_gives_up_after_the_timeout_and_aborts_the_request,
        test_reports_an_engine_death,
    ]
    for test in tests:
        # What pytest-trio's `autojump_clock` fixture does: time jumps ahead whenever
        # every task is waiting, so the 64-second generation above takes no real time.
        clock = trio.testing.MockClock(autojump_threshold=0)
        trio.run(test, clock=clock)
        print(f"passed: {test.__name__}")


if __name__ == "__main__":
    main()

"""The asyncio adapter of the "From an asyncio application" tutorial, under asyncio.

The tutorial's program is imported as a module and its ``AsyncioEngineClient`` driven
from ``asyncio.run``: cancelling a task at any point of a stream must leave nothing
running on the engine, and the client must serve the next request exactly.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    RequestFailedError,
    SyncMPClient,
)
from trio_enginecore.engine import CounterModel

PROGRAM = Path(__file__).resolve().parents[1] / "docs" / "tutorials" / "from_asyncio.py"
CONFIG = EngineConfig(model="counter", step_time_s=0.01)


def load_tutorial() -> ModuleType:
    spec = importlib.util.spec_from_file_location("from_asyncio_tutorial", PROGRAM)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


tutorial = load_tutorial()


def run_with_engine(
    test: Callable[[Any], Awaitable[None]], *, max_streams: int | None = None
) -> None:
    async def main() -> None:
        if max_streams is None:
            async with tutorial.open_asyncio_client(CONFIG) as engine:
                await test(engine)
            return
        client = await asyncio.to_thread(SyncMPClient, CONFIG)
        engine = tutorial.AsyncioEngineClient(client, max_streams=max_streams)
        try:
            await test(engine)
        finally:
            await asyncio.to_thread(engine.close)

    asyncio.run(main())


async def assert_nothing_left(engine: Any) -> None:
    # The calls run in order on the call thread: this one comes after every abort.
    assert await engine.call(engine.client.get_request_counts) == (0, 0)
    assert engine.client.statistics().requests_in_flight == 0
    prompt = [5, 6, 7]
    tokens = await tutorial.generate(engine, EngineCoreRequest.for_tokens(prompt, max_tokens=6))
    assert tokens == CounterModel.expected_tokens(prompt, 6)


def test_cancelling_a_task_mid_generation_aborts_its_request() -> None:
    async def test(engine: Any) -> None:
        received: list[int] = []
        enough = asyncio.Event()

        async def consume() -> None:
            request = EngineCoreRequest.for_tokens([1, 2, 3], max_tokens=10_000)
            async with engine.stream(request) as outputs:
                async for output in outputs:
                    received.extend(output.new_token_ids)
                    if len(received) >= 5:
                        enough.set()

        task = asyncio.create_task(consume())
        await enough.wait()
        assert await engine.call(engine.client.get_request_counts) == (0, 1)
        task.cancel()
        await asyncio.wait([task])
        assert task.cancelled()
        assert received == CounterModel.expected_tokens([1, 2, 3], len(received))
        await assert_nothing_left(engine)

    run_with_engine(test)


@pytest.mark.parametrize("second_cancel", [False, True], ids=["once", "twice"])
def test_cancelling_at_any_point_of_a_stream_leaves_nothing_running(second_cancel: bool) -> None:
    async def test(engine: Any) -> None:
        async def consume() -> None:
            request = EngineCoreRequest.for_tokens([1], max_tokens=10_000)
            async with engine.stream(request) as outputs:
                async for _ in outputs:
                    pass

        # Cancel after 0 to 7 trips through the event loop: before the entry was
        # handed to the call thread, while the thread runs it, once outputs flow.
        for trial in range(100):
            task = asyncio.create_task(consume())
            for _ in range(trial % 8):
                await asyncio.sleep(0)
            task.cancel()
            if second_cancel:  # a second cancellation, during the abort
                await asyncio.sleep(0)
                task.cancel()
            await asyncio.wait([task])
        await assert_nothing_left(engine)

    run_with_engine(test)


def test_a_timeout_aborts_the_request() -> None:
    async def test(engine: Any) -> None:
        request = EngineCoreRequest.for_tokens([1], max_tokens=10_000)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await tutorial.generate(engine, request)
        await assert_nothing_left(engine)

    run_with_engine(test)


def test_many_concurrent_streams_and_a_rejected_one() -> None:
    # More streams at once than reader threads: each gets exactly its tokens (the
    # outputs of a stream nobody reads meanwhile are merged, never lost); a rejected
    # request raises RequestFailedError from its own stream only.
    async def test(engine: Any) -> None:
        async def rejected() -> None:
            request = EngineCoreRequest.for_tokens([], request_id="bad", max_tokens=3)
            with pytest.raises(RequestFailedError, match="at least one token"):
                await tutorial.generate(engine, request)

        async with asyncio.TaskGroup() as group:
            tasks = {
                n: group.create_task(
                    tutorial.generate(engine, EngineCoreRequest.for_tokens([n], max_tokens=12))
                )
                for n in range(1, 25)
            }
            group.create_task(rejected())
        for n, task in tasks.items():
            assert task.result() == CounterModel.expected_tokens([n], 12), n
        await assert_nothing_left(engine)

    run_with_engine(test, max_streams=4)  # fewer reader threads than streams


def test_an_engine_death_fails_the_open_streams() -> None:
    async def test(engine: Any) -> None:
        started = asyncio.Event()

        async def consume() -> None:
            request = EngineCoreRequest.for_tokens([1], max_tokens=10_000)
            async with engine.stream(request) as outputs:
                async for _ in outputs:
                    started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        os.kill(engine.client.engine_pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="killed by signal 9"):
            await asyncio.wait_for(task, timeout=10)
        with pytest.raises(EngineDeadError):
            await tutorial.generate(engine, EngineCoreRequest.for_tokens([1], max_tokens=2))

    # Leaving open_asyncio_client's block does not raise (SyncMPClient.close never does).
    run_with_engine(test)

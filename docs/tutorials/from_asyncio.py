"""From an asyncio application: the blocking client's streams, on threads."""

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self, TypeVar

from trio_enginecore import EngineConfig, EngineCoreOutput, EngineCoreRequest, SyncMPClient
from trio_enginecore.engine import CounterModel

T = TypeVar("T")

CONFIG = EngineConfig(model="counter", step_time_s=0.01)


class OutputStream:
    """One request's outputs, for ``async for``; ends after the finished one."""

    def __init__(self, outputs: Iterator[EngineCoreOutput], reads: ThreadPoolExecutor) -> None:
        self._outputs = outputs
        self._reads = reads

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> EngineCoreOutput:
        # One blocking step of the client's stream, on a reader thread: None at the end.
        loop = asyncio.get_running_loop()
        output = await loop.run_in_executor(self._reads, next, self._outputs, None)
        if output is None:
            raise StopAsyncIteration
        return output


class AsyncioEngineClient:
    """A SyncMPClient for asyncio code.

    Blocking calls run on one call thread, one at a time and in the order they were
    made: sending a stream's request, leaving it, the utilities. A stream waiting for
    its next output waits on a reader thread.
    """

    def __init__(self, client: SyncMPClient, max_streams: int = 64) -> None:
        self.client = client
        self._loop = asyncio.get_running_loop()
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-calls")
        self._reads = ThreadPoolExecutor(max_streams, thread_name_prefix="engine-reads")

    async def call(self, method: Callable[..., T], *args: Any) -> T:
        """Run a blocking method of the client on the call thread."""
        return await self._loop.run_in_executor(self._calls, method, *args)

    @contextlib.asynccontextmanager
    async def stream(self, request: EngineCoreRequest) -> AsyncGenerator[OutputStream, None]:
        """Send the request; leaving the block before it finished aborts it."""
        outputs = self.client.stream(request)
        try:
            await self.call(outputs.__enter__)
            yield OutputStream(outputs, self._reads)
        finally:
            # Leaving the client's stream aborts the request if it has not finished.
            # It queues behind the entry on the call thread, so it comes after it even
            # if the entry is still running; the shield keeps a second cancellation
            # from dropping it.
            await asyncio.shield(self.call(outputs.__exit__, None, None, None))

    def close(self) -> None:
        """Run the calls already made, stop the engine, end the threads (blocking)."""
        self._calls.shutdown(wait=True)
        self.client.close()  # a read still waiting raises EngineDeadError, and ends
        self._reads.shutdown(wait=True)


@contextlib.asynccontextmanager
async def open_asyncio_client(config: EngineConfig) -> AsyncGenerator[AsyncioEngineClient, None]:
    # Starting the engine takes a moment, and closing it too: both in a thread.
    engine = AsyncioEngineClient(await asyncio.to_thread(SyncMPClient, config))
    try:
        yield engine
    finally:
        await asyncio.to_thread(engine.close)


# ------------------------------------------------------------------------- the demo


async def generate(engine: AsyncioEngineClient, request: EngineCoreRequest) -> list[int]:
    token_ids: list[int] = []
    async with engine.stream(request) as outputs:
        async for output in outputs:
            token_ids.extend(output.new_token_ids)
    return token_ids


async def concurrent_tasks(engine: AsyncioEngineClient) -> None:
    print("1. three asyncio tasks, one stream each")
    async with asyncio.TaskGroup() as group:
        tasks = {
            n: group.create_task(
                generate(engine, EngineCoreRequest.for_tokens([100 * n], max_tokens=4))
            )
            for n in (1, 2, 3)
        }
    for n, task in tasks.items():
        print(f"   task {n}: {task.result()}")


async def cancel_a_task(engine: AsyncioEngineClient) -> None:
    print("2. cancelling a task mid-generation")
    received: list[int] = []
    running = asyncio.Event()

    async def long_generation() -> None:
        async with engine.stream(
            EngineCoreRequest.for_tokens([1, 2, 3], max_tokens=10_000)
        ) as outputs:
            async for output in outputs:
                received.extend(output.new_token_ids)
                running.set()

    task = asyncio.create_task(long_generation())
    await running.wait()
    counts = await engine.call(engine.client.get_request_counts)
    print(f"   while streaming, the engine has (waiting, running) = {counts}")
    await asyncio.sleep(0.1)
    task.cancel()
    await asyncio.wait([task])
    print(f"   cancelled: {task.cancelled()}, after {len(received)} tokens")
    # The calls run in order: this one comes after the abort the task sent.
    counts = await engine.call(engine.client.get_request_counts)
    print(f"   after the cancellation, (waiting, running) = {counts}")
    tokens = await generate(engine, EngineCoreRequest.for_tokens([7, 8, 9], max_tokens=5))
    expected = CounterModel.expected_tokens([7, 8, 9], 5)
    print(f"   the next request: {tokens}, as the counter model predicts: {tokens == expected}")


async def time_out(engine: AsyncioEngineClient) -> None:
    print("3. asyncio.timeout() around a stream")
    try:
        async with asyncio.timeout(0.2):
            await generate(engine, EngineCoreRequest.for_tokens([1, 2, 3], max_tokens=10_000))
    except TimeoutError:
        print("   timed out: True")
    counts = await engine.call(engine.client.get_request_counts)
    print(f"   after the timeout, (waiting, running) = {counts}")


async def main() -> None:
    async with open_asyncio_client(CONFIG) as engine:
        print(f"engine ready (pid {engine.client.engine_pids[0]})")
        await concurrent_tasks(engine)
        await cancel_a_task(engine)
        await time_out(engine)
    print("engine stopped")


if __name__ == "__main__":
    asyncio.run(main())

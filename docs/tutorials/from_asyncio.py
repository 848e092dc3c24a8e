"""From an asyncio application: the blocking client on two threads, streams on top."""

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self, TypeVar

import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineDeadError,
    SyncMPClient,
)
from trio_enginecore.engine import CounterModel

T = TypeVar("T")

CONFIG = EngineConfig(model="counter", step_time_s=0.01)


class OutputStream:
    """One request's outputs, for ``async for``; ends after the finished one."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[EngineCoreOutput | EngineDeadError] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> EngineCoreOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, EngineDeadError):
            raise item
        self.finished = item.finished
        return item


class AsyncioEngineClient:
    """A SyncMPClient for asyncio code.

    Blocking calls run on one call thread, one at a time and in the order they were
    made. One reader thread receives every output message and hands each output to
    its request's stream, on the event loop.
    """

    def __init__(self, client: SyncMPClient) -> None:
        self.client = client
        self._loop = asyncio.get_running_loop()
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-calls")
        self._streams: dict[str, OutputStream] = {}
        self._reader = threading.Thread(
            target=self._read_outputs, name="engine-outputs", daemon=True
        )
        self._reader.start()

    async def call(self, method: Callable[..., T], *args: Any) -> T:
        """Run a blocking method of the client on the call thread."""
        return await self._loop.run_in_executor(self._calls, method, *args)

    @contextlib.asynccontextmanager
    async def stream(self, request: EngineCoreRequest) -> AsyncIterator[OutputStream]:
        """Send the request; leaving the block before it finished aborts it."""
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already in flight")
        stream = self._streams[request_id] = OutputStream()
        try:
            await self.call(self.client.add_request, request)
            yield stream
        finally:
            del self._streams[request_id]
            if not stream.finished:
                # Cancelled or left early. The abort queues behind the add on the call
                # thread, so it comes after it even if the add is still running; the
                # shield keeps a second cancellation from dropping it.
                await asyncio.shield(self.call(self.client.abort_requests, [request_id]))

    def _read_outputs(self) -> None:
        """The reader thread: each output message, handed to the event loop."""
        while True:
            try:
                message = self.client.get_output()
            except EngineDeadError as exc:
                self._loop.call_soon_threadsafe(self._fail, str(exc))
                return
            except trio.ClosedResourceError:
                return  # close() was called
            self._loop.call_soon_threadsafe(self._deliver, message.outputs)

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:  # None: its stream was left, the request aborted
                stream.queue.put_nowait(output)

    def _fail(self, reason: str) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(reason))

    def close(self) -> None:
        """Run the calls already made, stop the engine, end both threads (blocking)."""
        self._calls.shutdown(wait=True)
        self.client.close()
        self._reader.join()


@contextlib.asynccontextmanager
async def open_asyncio_client(config: EngineConfig) -> AsyncIterator[AsyncioEngineClient]:
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

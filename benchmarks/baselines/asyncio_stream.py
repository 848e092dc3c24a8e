"""Per-request streams in asyncio, served the way vLLM 0.33's ``AsyncLLM`` serves them.

The client underneath is :class:`~benchmarks.baselines.asyncio_vllm.AsyncMPClient`
(vLLM's engine-core client design, our codec); on top of it :class:`AsyncLLMStreams`
reproduces what ``vllm/v1/engine/async_llm.py`` and ``output_processor.py`` do for
streams, without the detokenizing and the ``RequestOutput`` building (the Trio
streams yield the engine's outputs too):

* one output-handler task loops on ``await get_output_async()``, walks each message's
  outputs in chunks of ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` (128) with an
  ``await asyncio.sleep(0)`` between chunks, and puts each output into its request's
  :class:`~benchmarks.baselines.asyncio_vllm.RequestOutputCollector` (forgetting the
  request when the output is its last, as the output processor does);
* a collector merges outputs its reader has not taken yet (delta mode: the token ids
  are appended to the pending output) and wakes the reader through an
  ``asyncio.Event``;
* each request is read by its own task through :meth:`AsyncLLMStreams.generate`,
  ``out = collector.get_nowait() or await collector.get()`` until finished; a stream
  left early (cancelled) forgets its collector and sends its own ABORT, as
  ``AsyncLLM.generate`` does (the Trio streams also send one ABORT per stream left).

The workloads mirror :mod:`trio_enginecore._bench`'s stream mode (same closed loop,
same result keys). Run one with :func:`run`.
"""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from trio_enginecore._bench import generate_summary, make_request, rss_bytes
from trio_enginecore.protocol import EngineCoreOutput, EngineCoreRequest

from .asyncio_vllm import AsyncMPClient, RequestOutputCollector

__all__ = ["CHUNK_SIZE", "AsyncLLMStreams", "measure_generate", "measure_idle_streams", "run"]

CHUNK_SIZE: Final = 128
"""vLLM's ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` default."""


class AsyncLLMStreams:
    """AsyncLLM's output handler and per-request collectors over an AsyncMPClient.

    :meth:`start` starts the output-handler task (AsyncLLM starts it with the first
    request); :meth:`stop` cancels it.
    """

    def __init__(self, client: AsyncMPClient) -> None:
        self.client = client
        self.collectors: dict[str, RequestOutputCollector] = {}
        self.requests_sent = 0
        self.on_sent: Callable[[], None] | None = None
        """Called after each request is sent (the idle-streams count)."""
        self._handler: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._handler is None:
            self._handler = asyncio.create_task(self._output_handler())

    async def stop(self) -> None:
        if self._handler is not None:
            self._handler.cancel()
            await asyncio.gather(self._handler, return_exceptions=True)
            self._handler = None

    async def _output_handler(self) -> None:
        get_output_async = self.client.get_output_async
        collectors = self.collectors
        try:
            while True:
                outputs = (await get_output_async()).outputs
                num_outputs = len(outputs)
                for start in range(0, num_outputs, CHUNK_SIZE):
                    end = start + CHUNK_SIZE
                    # OutputProcessor.process_outputs: each output to its request.
                    for output in outputs[start:end]:
                        request_id = output.request_id
                        collector = collectors.get(request_id)
                        if collector is None:
                            continue  # aborted meanwhile
                        if output.finish_reason is not None:
                            del collectors[request_id]
                        collector.put(output)
                    if end < num_outputs:
                        await asyncio.sleep(0)
        except Exception as exc:  # propagate_error: every open stream raises it
            for collector in collectors.values():
                collector.put(exc)
            collectors.clear()

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Send ``request``; yield its outputs (merged when the reader falls behind)."""
        request_id = request.request_id
        collector = RequestOutputCollector()
        self.collectors[request_id] = collector
        try:
            await self.client.add_request_async(request)
            self.requests_sent += 1
            if self.on_sent is not None:
                self.on_sent()
            finished = False
            while not finished:
                # As AsyncLLM: drain without awaiting when an output is already there.
                out = collector.get_nowait() or await collector.get()
                finished = out.finish_reason is not None
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            if self.collectors.pop(request_id, None) is not None:
                await self.client.abort_requests_async([request_id])
            raise


# --------------------------------------------------------------------- workloads


async def measure_generate(
    streams: AsyncLLMStreams, *, concurrency: int, tokens: int, duration_s: float
) -> dict[str, Any]:
    """Closed loop of ``concurrency`` per-request streams, as
    ``_bench.measure_generate(mode="stream")``: each of ``concurrency`` tasks opens a
    stream, reads it to the end, and opens the next until the deadline; the streams
    open at the deadline are cancelled (each sends its ABORT)."""
    loop = asyncio.get_running_loop()
    client = streams.client
    latencies: list[float] = []
    counter = 0
    tokens_seen = 0
    messages_before = client.messages_received
    deadline = loop.time() + duration_s
    cpu0, wall0 = time.process_time(), time.perf_counter()

    async def worker() -> None:
        nonlocal counter, tokens_seen
        while loop.time() < deadline:
            counter += 1
            request = make_request(f"bench-{counter}", tokens)
            started = loop.time()
            async for output in streams.generate(request):
                tokens_seen += len(output.new_token_ids)
            latencies.append(loop.time() - started)

    try:
        async with asyncio.timeout_at(deadline), asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(worker())
    except TimeoutError:
        pass
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    messages = client.messages_received - messages_before
    return generate_summary(wall, cpu, len(latencies), tokens_seen, messages, latencies)


async def measure_idle_streams(streams: AsyncLLMStreams, *, streams_count: int) -> dict[str, Any]:
    """Memory per open stream on a paused engine: ``streams_count`` tasks, each in
    :meth:`AsyncLLMStreams.generate` waiting for its first output. Reports this
    process's resident-memory growth divided by the number of streams, then the bytes
    Python holds per stream from a second round traced with :mod:`tracemalloc`, as
    the Trio client's workload does."""
    client = streams.client
    await client.call_utility_async("pause_scheduler", "keep", True)
    rss = await _idle_streams_growth(streams, streams_count, "idle", rss_bytes)
    tracemalloc.start()
    try:
        traced = await _idle_streams_growth(
            streams, streams_count, "traced", lambda: tracemalloc.get_traced_memory()[0]
        )
    finally:
        tracemalloc.stop()
    await client.call_utility_async("resume_scheduler")
    return {
        "streams": streams_count,
        "rss_growth_bytes": rss,
        "bytes_per_stream": rss / streams_count,
        "traced_bytes_per_stream": traced / streams_count,
    }


async def _idle_streams_growth(
    streams: AsyncLLMStreams, streams_count: int, prefix: str, memory: Callable[[], int]
) -> int:
    all_open = asyncio.Event()
    sent_before = streams.requests_sent

    def on_sent() -> None:
        if streams.requests_sent - sent_before == streams_count:
            all_open.set()

    streams.on_sent = on_sent

    async def hold(i: int) -> None:
        async for _ in streams.generate(make_request(f"{prefix}-{i}", 64)):
            break

    gc.collect()
    before = memory()
    tasks = [asyncio.create_task(hold(i)) for i in range(streams_count)]
    await all_open.wait()
    streams.on_sent = None
    gc.collect()
    after = memory()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return after - before


# ------------------------------------------------------------------------ driver


async def _run(spec: dict[str, Any], on_ready: Callable[[], None]) -> dict[str, Any]:
    client = await AsyncMPClient.connect(spec["input_address"], spec["output_address"])
    streams = AsyncLLMStreams(client)
    try:
        streams.start()
        on_ready()
        workload = spec["workload"]
        if workload == "generate":
            return await measure_generate(
                streams,
                concurrency=int(spec["concurrency"]),
                tokens=int(spec["tokens"]),
                duration_s=float(spec["duration_s"]),
            )
        if workload == "idle_streams":
            return await measure_idle_streams(streams, streams_count=int(spec["streams"]))
        raise ValueError(f"asyncio-stream runs generate and idle_streams, not {workload!r}")
    finally:
        await streams.stop()
        client.close()


def run(spec: dict[str, Any], on_ready: Callable[[], None]) -> dict[str, Any]:
    """Run one workload (``spec`` as for :mod:`benchmarks.worker`)."""
    return asyncio.run(_run(spec, on_ready))

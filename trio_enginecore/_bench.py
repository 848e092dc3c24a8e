"""Measuring the Trio client against a real engine (``trio-enginecore bench``).

The workloads here drive a client that is already attached to (or launched with) an
engine; they return plain dicts of figures so that the comparison harness in
``benchmarks/`` can run the same workloads for its baselines and report ratios.
CPU figures are the *client process's* CPU time (``time.process_time``), not wall time.
"""

from __future__ import annotations

import gc
import math
import resource
import secrets
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final, Literal, TextIO

import trio

from ._addresses import free_tcp_ports
from .client import TrioEngineClient, open_engine_client
from .client._multiprocess._launch import serve_arguments
from .config import EngineConfig
from .protocol import EngineCoreRequest

__all__ = [
    "ProgressLine",
    "abort_summary",
    "format_table",
    "generate_summary",
    "make_request",
    "measure_abort_latency",
    "measure_generate",
    "measure_idle_streams",
    "measure_utility_rtt",
    "percentile",
    "rss_bytes",
    "run_cli_bench",
    "utility_summary",
]

Mode = Literal["batch", "stream"]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def make_request(request_id: str, tokens: int, prompt_len: int = 8) -> EngineCoreRequest:
    """A counter-model request producing exactly ``tokens`` tokens.

    Its prompt is derived from ``request_id``, so that requests differ; every client of
    the benchmark builds its requests here, so that they send the same bytes.
    """
    prompt = [(hash(request_id) % 1000) + i for i in range(prompt_len)]
    # A fixed arrival time: no clock read per request in the figures.
    return EngineCoreRequest.for_tokens(
        prompt, request_id=request_id, arrival_time=0.0, max_tokens=tokens, ignore_eos=True
    )


PROGRESS_INTERVAL_S: Final = 5.0
"""Off a terminal, the least time between two progress lines."""


class ProgressLine:
    """Progress on a stream (stderr by default).

    On a terminal, :meth:`update` redraws one line in place (``\\r``) and :meth:`done`
    ends it. Elsewhere (a pipe, a CI log) every call prints a plain line instead, but
    only if ``interval_s`` has passed since the last one, so that a log is not flooded.
    """

    def __init__(self, stream: TextIO | None = None, *, interval_s: float = PROGRESS_INTERVAL_S):
        self._stream = stream if stream is not None else sys.stderr
        self.tty = self._stream.isatty()
        self._interval_s = interval_s
        self._last = -math.inf
        self._drawn = 0

    def note(self, text: str) -> None:
        """A line of its own (a heading): always on a terminal, else rate-limited."""
        if self.tty:
            self._clear()
            print(text, file=self._stream, flush=True)
        else:
            self._plain(text)

    def update(self, text: str) -> None:
        """The current state: redrawn in place on a terminal, else rate-limited."""
        if self.tty:
            padding = " " * max(0, self._drawn - len(text))
            print(f"\r{text}{padding}", end="", file=self._stream, flush=True)
            self._drawn = len(text)
        else:
            self._plain(text)

    def done(self, text: str) -> None:
        """The final state: ends the redrawn line on a terminal, else rate-limited."""
        if self.tty:
            self.update(text)
            print(file=self._stream, flush=True)
            self._drawn = 0
        else:
            self._plain(text)

    def _clear(self) -> None:
        if self._drawn:
            print("\r" + " " * self._drawn + "\r", end="", file=self._stream, flush=True)
            self._drawn = 0

    def _plain(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last >= self._interval_s:
            self._last = now
            print(text.strip(), file=self._stream, flush=True)


async def measure_generate(
    client: TrioEngineClient,
    *,
    concurrency: int,
    tokens: int,
    duration_s: float,
    mode: Mode,
    progress: ProgressLine | None = None,
    prompt_len: int = 8,
) -> dict[str, Any]:
    """Closed loop: keep ``concurrency`` requests of ``tokens`` tokens (after prompts of
    ``prompt_len`` tokens) in flight.

    Runs for ``duration_s`` seconds; every request that finishes is replaced by a new
    one. Requests still in flight at the deadline are aborted; only tokens received
    before the deadline count.

    Returns:
        wall_s, client_cpu_s, requests (completed), output_tokens, messages,
        latency_p50_s / latency_p99_s (request submitted -> finished), and the
        derived tokens_per_s, requests_per_s, cpu_us_per_token, cpu_us_per_message.
    """
    latencies: list[float] = []
    counter = 0
    tokens_seen = 0
    stats_before = client.statistics()
    deadline = trio.current_time() + duration_s
    cpu0, wall0 = time.process_time(), time.perf_counter()

    # Unique across measurements on one client: outputs of the previous measurement's
    # aborted requests may still wait in the client's get_output() buffer.
    prefix = f"bench-{secrets.token_hex(4)}"

    def next_id() -> str:
        nonlocal counter
        counter += 1
        return f"{prefix}-{counter}"

    if mode == "stream":

        async def worker() -> None:
            nonlocal tokens_seen
            while trio.current_time() < deadline:
                request = make_request(next_id(), tokens, prompt_len)
                started = trio.current_time()
                async with client.stream(request) as outputs:
                    async for output in outputs:
                        tokens_seen += len(output.new_token_ids)
                latencies.append(trio.current_time() - started)

        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)
                if progress is not None:
                    nursery.start_soon(
                        _show_progress, progress, lambda: tokens_seen, deadline, duration_s
                    )
    else:
        started_at: dict[str, float] = {}
        with trio.move_on_at(deadline):
            for _ in range(concurrency):
                request = make_request(next_id(), tokens, prompt_len)
                started_at[request.request_id] = trio.current_time()
                await client.add_request(request)
            async with trio.open_nursery() as nursery:
                if progress is not None:
                    nursery.start_soon(
                        _show_progress, progress, lambda: tokens_seen, deadline, duration_s
                    )
                while True:
                    batch = await client.get_output()
                    replacements: list[EngineCoreRequest] = []
                    for output in batch.outputs:
                        if output.request_id not in started_at:
                            continue  # left over from an earlier measurement
                        tokens_seen += len(output.new_token_ids)
                        if output.finish_reason is not None:
                            now = trio.current_time()
                            latencies.append(now - started_at.pop(output.request_id))
                            request = make_request(next_id(), tokens, prompt_len)
                            started_at[request.request_id] = now
                            replacements.append(request)
                    if replacements:
                        await client.add_requests(replacements)
        await client.abort_requests(list(started_at))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if mode == "stream":
        await trio.lowlevel.checkpoint()
    stats_after = client.statistics()
    messages = stats_after.messages_received - stats_before.messages_received
    return generate_summary(wall, cpu, len(latencies), tokens_seen, messages, latencies)


def generate_summary(
    wall: float, cpu: float, requests: int, tokens: int, messages: int, latencies: list[float]
) -> dict[str, Any]:
    """The figures of a generate run (shared with the baselines)."""
    return {
        "wall_s": wall,
        "client_cpu_s": cpu,
        "requests": requests,
        "output_tokens": tokens,
        "messages": messages,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "tokens_per_s": tokens / wall if wall else math.nan,
        "requests_per_s": requests / wall if wall else math.nan,
        "cpu_us_per_token": 1e6 * cpu / tokens if tokens else math.nan,
        "cpu_us_per_message": 1e6 * cpu / messages if messages else math.nan,
    }


async def measure_utility_rtt(client: TrioEngineClient, *, calls: int) -> dict[str, Any]:
    """Sequential ``is_sleeping`` round trips: p50/p99 latency and client CPU per call."""
    samples: list[float] = []
    cpu0 = time.process_time()
    for _ in range(calls):
        started = time.perf_counter()
        await client.is_sleeping()
        samples.append(time.perf_counter() - started)
    return utility_summary(samples, time.process_time() - cpu0)


def utility_summary(samples: list[float], cpu_s: float) -> dict[str, Any]:
    """The figures of a utility round-trip run (shared with the baselines)."""
    return {
        "calls": len(samples),
        "rtt_p50_s": percentile(samples, 50),
        "rtt_p99_s": percentile(samples, 99),
        "rtt_mean_s": statistics.fmean(samples) if samples else math.nan,
        "cpu_us_per_call": 1e6 * cpu_s / len(samples) if samples else math.nan,
    }


async def measure_abort_latency(client: TrioEngineClient, *, samples: int) -> dict[str, Any]:
    """Cancel a running stream; time until the engine reports the request gone.

    Each sample opens a stream on a long request, receives one output, cancels the
    stream's scope and polls ``get_request_counts`` until the engine holds nothing.
    The figure therefore includes one utility round trip.
    """
    latencies: list[float] = []
    for i in range(samples):
        started = time.perf_counter()
        with trio.CancelScope() as scope:
            async with client.stream(make_request(f"abort-{i}", 1_000_000)) as outputs:
                await outputs.receive()
                started = time.perf_counter()
                scope.cancel()
                await trio.lowlevel.checkpoint()
        while await client.get_request_counts() != (0, 0):
            pass
        latencies.append(time.perf_counter() - started)
    return abort_summary(latencies)


def abort_summary(latencies: list[float]) -> dict[str, Any]:
    """The figures of an abort-latency run (shared with the baselines)."""
    return {
        "samples": len(latencies),
        "abort_p50_s": percentile(latencies, 50),
        "abort_p99_s": percentile(latencies, 99),
    }


def rss_bytes() -> int:
    """This process's resident memory, from /proc."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize()


async def measure_idle_streams(client: TrioEngineClient, *, streams: int) -> dict[str, Any]:
    """Memory per open stream: ``streams`` streams waiting on a paused engine.

    The engine's scheduler is paused (``keep``) so no stream receives anything; each
    stream is a task waiting for its next output in ``async for``. Reports the
    resident-memory growth of this process divided by the number of streams (task,
    stream and bookkeeping, and the allocator's overhead on a first use), then, from a
    second round traced with :mod:`tracemalloc`, the bytes Python holds per stream
    (``traced_bytes_per_stream``).
    """
    await client.pause_scheduler("keep")
    try:
        rss = await _idle_streams_growth(client, streams, "idle", rss_bytes)
        tracemalloc.start()
        try:
            traced = await _idle_streams_growth(
                client, streams, "traced", lambda: tracemalloc.get_traced_memory()[0]
            )
        finally:
            tracemalloc.stop()
    finally:
        await client.resume_scheduler()
    return {
        "streams": streams,
        "rss_growth_bytes": rss,
        "bytes_per_stream": rss / streams,
        "traced_bytes_per_stream": traced / streams,
    }


async def _idle_streams_growth(
    client: TrioEngineClient, streams: int, prefix: str, memory: Callable[[], int]
) -> int:
    """How much ``memory()`` grows while ``streams`` idle streams are open."""
    all_open = trio.Event()
    opened = 0

    async def hold(i: int) -> None:
        nonlocal opened
        async with client.stream(make_request(f"{prefix}-{i}", 64)) as outputs:
            opened += 1
            if opened == streams:
                all_open.set()
            async for _ in outputs:  # how streams are read (the guides, the tutorials)
                break

    gc.collect()
    before = memory()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(hold, i)
        await all_open.wait()
        gc.collect()
        after = memory()
        nursery.cancel_scope.cancel()
    return after - before


async def _show_progress(
    progress: ProgressLine, tokens: Callable[[], int], deadline: float, duration_s: float
) -> None:
    width = 30
    try:
        while True:
            left = max(0.0, deadline - trio.current_time())
            done = int(width * (1 - left / duration_s)) if duration_s else width
            bar = "#" * done + "." * (width - done)
            progress.update(f"  [{bar}] {tokens():>10,} tokens")
            await trio.sleep(0.25)
    finally:
        # The workload's deadline cancels this task: finish the line either way.
        progress.done(f"  [{'#' * width}] {tokens():>10,} tokens")


# ------------------------------------------------------------ trio-enginecore bench


async def run_cli_bench(
    *,
    concurrency: list[int],
    tokens: int,
    step_time_s: float,
    duration_s: float,
    modes: list[Mode],
    model: str,
    transport: Literal["ipc", "tcp"],
    utility_calls: int,
) -> list[dict[str, Any]]:
    """What ``trio-enginecore bench`` runs: one engine, each workload in turn."""
    config = EngineConfig(
        model=model, step_time_s=step_time_s, max_num_seqs=max(concurrency), max_model_len=8192
    )
    rows: list[dict[str, Any]] = []
    progress = ProgressLine()
    async with _engine_client(config, transport) as client:
        progress.note(f"engine ready (model {model!r}, {transport}); measuring")
        for c in concurrency:
            for mode in modes:
                progress.note(f"{mode:>6} C={c:<5} T={tokens}")
                figures = await measure_generate(
                    client,
                    concurrency=c,
                    tokens=tokens,
                    duration_s=duration_s,
                    mode=mode,
                    progress=progress,
                )
                rows.append({"workload": "generate", "mode": mode, "concurrency": c, **figures})
        if utility_calls:
            figures = await measure_utility_rtt(client, calls=utility_calls)
            rows.append({"workload": "utility", **figures})
    return rows


def _engine_client(
    config: EngineConfig, transport: str
) -> AbstractAsyncContextManager[TrioEngineClient]:
    if transport == "ipc":
        return open_engine_client(config)
    return _tcp_engine_client(config)


@asynccontextmanager
async def _tcp_engine_client(config: EngineConfig) -> AsyncGenerator[TrioEngineClient, None]:
    """An engine on loopback TCP, attached (the ipc default launches it itself)."""
    input_port, output_port = free_tcp_ports(2)
    input_address = f"tcp://127.0.0.1:{input_port}"
    output_address = f"tcp://127.0.0.1:{output_port}"
    command = [
        sys.executable,
        "-m",
        "trio_enginecore",
        "serve",
        "--exit-with-parent",
        "--input-address",
        input_address,
        "--output-address",
        output_address,
        "--log-level",
        "WARNING",
        *serve_arguments(config),
    ]
    # Its own session, as the engines the client launches: Ctrl-C reaches this process
    # only, which stops the engine itself when it leaves the block.
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, start_new_session=True
    )
    try:
        async with open_engine_client(
            config, input_address=input_address, output_address=output_address
        ) as client:
            yield client
    finally:
        with trio.CancelScope(shield=True):
            process.terminate()
            with trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text summary table of ``run_cli_bench`` rows."""
    lines = [
        f"{'workload':<10}{'mode':<8}{'C':>6}{'tokens/s':>12}{'req/s':>9}"
        f"{'CPU us/tok':>12}{'CPU us/msg':>12}{'p50 ms':>9}{'p99 ms':>9}"
    ]
    for row in rows:
        if row["workload"] == "generate":
            lines.append(
                f"{'generate':<10}{row['mode']:<8}{row['concurrency']:>6}"
                f"{row['tokens_per_s']:>12,.0f}{row['requests_per_s']:>9,.1f}"
                f"{row['cpu_us_per_token']:>12.2f}{row['cpu_us_per_message']:>12.1f}"
                f"{1e3 * row['latency_p50_s']:>9.1f}{1e3 * row['latency_p99_s']:>9.1f}"
            )
        else:
            lines.append(
                f"{'utility':<10}{'rtt':<8}{'':>6}{'':>12}{'':>9}"
                f"{'':>12}{row['cpu_us_per_call']:>12.1f}"
                f"{1e3 * row['rtt_p50_s']:>9.2f}{1e3 * row['rtt_p99_s']:>9.2f}"
            )
    return "\n".join(lines)

"""An asyncio engine-core client built the way vLLM 0.33's ``AsyncMPClient`` is.

Only the concurrency design differs from the Trio client: the codec is ours
(:class:`~trio_enginecore.serial.MsgpackEncoder` and
``MsgpackDecoder(EngineCoreOutputs)``) and the requests are the same
(:func:`trio_enginecore._bench.make_request`). The design is vLLM's:

* one ``zmq.asyncio.Context`` (``io_threads=2``), a ROUTER input socket and a PULL
  output socket, both bound, high-water marks 0 (unbounded queues);
* the client waits for the engine's ready message (``[identity, payload]`` on the
  ROUTER) before sending anything;
* a background task, :meth:`AsyncMPClient.process_outputs_socket`, loops on
  ``await output_socket.recv_multipart(copy=False)``, checks the ``ENGINE_CORE_DEAD``
  sentinel, decodes, resolves utility futures (a dict keyed by
  ``uuid.uuid1().int >> 64``) and puts every message with outputs or scheduler stats
  into an unbounded ``asyncio.Queue``;
* requests are sent with ``await input_socket.send_multipart(..., copy=False)`` from the
  caller's task; ``get_output_async`` is ``await outputs_queue.get()``.

An awaited ``zmq.asyncio`` receive that finds a message already queued returns a
finished future, and awaiting a finished future does not yield to the event loop: while
messages keep arriving the receive task moves them all into the queue before any other
task runs. That is vLLM's behaviour, reproduced on purpose.

The workloads mirror :mod:`trio_enginecore._bench` (same closed-loop semantics, same
result keys), plus ``recv`` (:func:`measure_recv`, the receive path against
``benchmarks.flood``). Run one with :func:`run`.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import zmq
import zmq.asyncio

from trio_enginecore._bench import (
    abort_summary,
    generate_summary,
    make_request,
    rss_bytes,
    utility_summary,
)
from trio_enginecore.errors import EngineDeadError, ProtocolError
from trio_enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
)
from trio_enginecore.serial import Buffer, MsgpackDecoder, MsgpackEncoder

from . import recv_summary

__all__ = [
    "AsyncMPClient",
    "RequestOutputCollector",
    "measure_abort_latency",
    "measure_generate",
    "measure_idle_streams",
    "measure_recv",
    "measure_utility_rtt",
    "run",
]

_ADD: Final = EngineCoreRequestType.ADD.value
_ABORT: Final = EngineCoreRequestType.ABORT.value
_UTILITY: Final = EngineCoreRequestType.UTILITY.value


def _make_socket(ctx: zmq.asyncio.Context, socket_type: int, address: str) -> zmq.asyncio.Socket:
    """A bound socket with vLLM's options (unbounded queues)."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


class AsyncMPClient:
    """vLLM's asyncio engine-core client design, attached to an engine started elsewhere.

    Create it with :meth:`connect` (binds, waits for the engine's ready message, starts
    the receive task); :meth:`close` when done.
    """

    def __init__(self, input_address: str, output_address: str, *, client_index: int = 0):
        self.client_index = client_index
        self.ctx = zmq.asyncio.Context(zmq.Context(io_threads=2))
        self.input_socket = _make_socket(self.ctx, zmq.ROUTER, input_address)
        self.output_socket = _make_socket(self.ctx, zmq.PULL, output_address)
        self.encoder = MsgpackEncoder()
        self.decoder: MsgpackDecoder[EngineCoreOutputs] = MsgpackDecoder(EngineCoreOutputs)
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] = asyncio.Queue()
        self.utility_results: dict[int, asyncio.Future[Any]] = {}
        self.engine_identity = b""
        self.ready: EngineCoreReadyResponse | None = None
        self.engine_dead = False
        self.messages_received = 0
        self.max_queue_depth = 0
        self.output_queue_task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls, input_address: str, output_address: str, *, ready_timeout_s: float = 60.0
    ) -> AsyncMPClient:
        """Bind both sockets, wait for the engine's ready message, start receiving."""
        client = cls(input_address, output_address)
        try:
            async with asyncio.timeout(ready_timeout_s):
                identity, payload = await client.input_socket.recv_multipart()
            client.engine_identity = identity
            if payload:
                client.ready = MsgpackDecoder(EngineCoreReadyResponse).decode(payload)
            client.output_queue_task = asyncio.create_task(client.process_outputs_socket())
        except BaseException:
            client.close()
            raise
        return client

    # ------------------------------------------------------------ receive task

    async def process_outputs_socket(self) -> None:
        """The receive task: socket -> decode -> utility futures or the outputs queue."""
        output_socket = self.output_socket
        decoder = self.decoder
        outputs_queue = self.outputs_queue
        utility_results = self.utility_results
        try:
            while True:
                frames = await output_socket.recv_multipart(copy=False)
                self.messages_received += 1
                if len(frames) == 1 and frames[0].buffer == ENGINE_CORE_DEAD:  # type: ignore[comparison-overlap]
                    self.engine_dead = True
                    raise EngineDeadError("the engine reported ENGINE_CORE_DEAD")
                # zmq.Frame supports the buffer protocol: decode straight from the frames.
                outputs = decoder.decode(cast("Sequence[Buffer]", frames))
                if outputs.utility_output is not None:
                    _process_utility_output(outputs.utility_output, utility_results)
                    continue
                if outputs.outputs or outputs.scheduler_stats is not None:
                    outputs_queue.put_nowait(outputs)
                    # Not in vLLM; costs one comparison per message.
                    if outputs_queue.qsize() > self.max_queue_depth:
                        self.max_queue_depth = outputs_queue.qsize()
        except (EngineDeadError, ProtocolError, zmq.ZMQError) as exc:
            for future in utility_results.values():
                if not future.done():
                    future.set_exception(exc)
            utility_results.clear()
            outputs_queue.put_nowait(exc)
        except asyncio.CancelledError:
            outputs_queue.put_nowait(EngineDeadError("the receive task was cancelled"))
            raise

    # -------------------------------------------------------------- requests

    async def _send_input(self, request_type: bytes, payload: object) -> None:
        if self.engine_dead:
            raise EngineDeadError("the engine is dead")
        message = (self.engine_identity, request_type, *self.encoder.encode(payload))
        await self.input_socket.send_multipart(  # pyright: ignore[reportUnknownMemberType]
            message, copy=False
        )

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Send an ADD; the outputs arrive through :meth:`get_output_async`."""
        request.client_index = self.client_index
        await self._send_input(_ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Send an ABORT for these requests (nothing if the list is empty)."""
        if request_ids and not self.engine_dead:
            await self._send_input(_ABORT, request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call a utility method on the engine and return its untyped result."""
        call_id = uuid.uuid1().int >> 64
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = future
        await self._send_input(
            _UTILITY, UtilityRequest(self.client_index, call_id, method, tuple(args))
        )
        return await future

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message with outputs (raises the receive task's failure)."""
        outputs = await self.outputs_queue.get()
        if isinstance(outputs, Exception):
            raise outputs
        return outputs

    def close(self) -> None:
        """Stop the receive task and close everything (nothing blocks)."""
        if self.output_queue_task is not None:
            self.output_queue_task.cancel()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()


def _process_utility_output(
    output: UtilityOutput, utility_results: dict[int, asyncio.Future[Any]]
) -> None:
    future = utility_results.pop(output.call_id, None)
    if future is None or future.done():
        return
    if output.failure_message is not None:
        future.set_exception(Exception(output.failure_message))
    else:
        future.set_result(None if output.result is None else output.result.result)


class RequestOutputCollector:
    """A per-request slot as vLLM 0.33's ``RequestOutputCollector`` (delta mode).

    The dispatcher :meth:`put`\\ s outputs without waiting: the first wakes the reader
    through an ``asyncio.Event``, later ones are merged into it until the reader takes
    it (token ids appended, the newest finish and stop reasons kept), as
    ``RequestOutput.add(aggregate=True)`` merges; an exception replaces what is
    pending. The request's task takes what is pending with :meth:`get` or
    :meth:`get_nowait`.
    """

    __slots__ = ("output", "ready")

    def __init__(self) -> None:
        self.output: EngineCoreOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: EngineCoreOutput | Exception) -> None:
        pending = self.output
        if pending is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(pending, EngineCoreOutput):
            pending.new_token_ids.extend(output.new_token_ids)
            pending.finish_reason = output.finish_reason
            pending.stop_reason = output.stop_reason

    async def get(self) -> EngineCoreOutput:
        while (output := self.output) is None:
            await self.ready.wait()
        self.output = None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output

    def get_nowait(self) -> EngineCoreOutput | None:
        output = self.output
        if output is not None:
            self.output = None
            self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


# --------------------------------------------------------------------- workloads


async def measure_generate(
    client: AsyncMPClient, *, concurrency: int, tokens: int, duration_s: float
) -> dict[str, Any]:
    """Closed loop through the batch API, as ``_bench.measure_generate(mode="batch")``."""
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    started_at: dict[str, float] = {}
    counter = 0
    tokens_seen = 0
    messages_before = client.messages_received
    deadline = loop.time() + duration_s
    cpu0, wall0 = time.process_time(), time.perf_counter()

    def next_request() -> EngineCoreRequest:
        nonlocal counter
        counter += 1
        return make_request(f"bench-{counter}", tokens)

    try:
        async with asyncio.timeout_at(deadline):
            for _ in range(concurrency):
                request = next_request()
                started_at[request.request_id] = loop.time()
                await client.add_request_async(request)
            while True:
                batch = await client.get_output_async()
                for output in batch.outputs:
                    tokens_seen += len(output.new_token_ids)
                    if output.finish_reason is not None:
                        now = loop.time()
                        latencies.append(now - started_at.pop(output.request_id))
                        request = next_request()
                        started_at[request.request_id] = now
                        await client.add_request_async(request)
    except TimeoutError:
        pass
    await client.abort_requests_async(list(started_at))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    messages = client.messages_received - messages_before
    result = generate_summary(wall, cpu, len(latencies), tokens_seen, messages, latencies)
    # Extra (asyncio only): the deepest the outputs queue got, a sign of the receive
    # task running ahead of the consumer without yielding.
    result["max_queue_depth"] = client.max_queue_depth
    return result


async def measure_recv(
    client: AsyncMPClient, *, batch: int, timeout_s: float = 300.0
) -> dict[str, Any]:
    """Receive path against the flooding fake engine (``benchmarks.flood``).

    Adds ``batch`` requests, then consumes messages through ``get_output_async`` until
    every request has finished; the clock starts once the requests are sent.
    """
    request_ids = [f"recv-{i}" for i in range(batch)]
    for request_id in request_ids:
        await client.add_request_async(make_request(request_id, 64))
    messages_before = client.messages_received
    cpu0, wall0 = time.process_time(), time.perf_counter()
    finished = outputs = 0
    async with asyncio.timeout(timeout_s):
        while finished < batch:
            for output in (await client.get_output_async()).outputs:
                outputs += 1
                if output.finish_reason is not None:
                    finished += 1
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    messages = client.messages_received - messages_before
    # Hang up: the flooder waits for one more message from us before it exits.
    await client.abort_requests_async(request_ids)
    result = recv_summary(wall, cpu, messages, outputs)
    result["max_queue_depth"] = client.max_queue_depth
    return result


async def measure_utility_rtt(client: AsyncMPClient, *, calls: int) -> dict[str, Any]:
    """Sequential ``is_sleeping`` round trips."""
    samples: list[float] = []
    cpu0 = time.process_time()
    for _ in range(calls):
        started = time.perf_counter()
        await client.call_utility_async("is_sleeping")
        samples.append(time.perf_counter() - started)
    return utility_summary(samples, time.process_time() - cpu0)


async def measure_abort_latency(client: AsyncMPClient, *, samples: int) -> dict[str, Any]:
    """Abort a running request; time until the engine reports no request left.

    Each sample submits a long request, waits for its first output, sends ABORT and
    polls ``get_request_counts`` until it is ``(0, 0)`` (one utility round trip is
    therefore included, as in the Trio figure).
    """
    latencies: list[float] = []
    for i in range(samples):
        request_id = f"abort-{i}"
        await client.add_request_async(make_request(request_id, 1_000_000))
        while True:
            batch = await client.get_output_async()
            # Late outputs of the previous samples' aborted requests are skipped.
            if any(o.request_id == request_id for o in batch.outputs):
                break
        started = time.perf_counter()
        await client.abort_requests_async([request_id])
        while list(await client.call_utility_async("get_request_counts")) != [0, 0]:
            pass
        latencies.append(time.perf_counter() - started)
    return abort_summary(latencies)


async def measure_idle_streams(client: AsyncMPClient, *, streams: int) -> dict[str, Any]:
    """Memory per open request stream on a paused engine, as AsyncLLM holds them.

    Each stream is an asyncio task that sends its request and awaits its
    :class:`RequestOutputCollector`, fed by a dispatcher task reading
    ``get_output_async`` (AsyncLLM's output handler). Reports this process's
    resident-memory growth divided by the number of streams.
    """
    await client.call_utility_async("pause_scheduler", "keep", True)
    collectors: dict[str, RequestOutputCollector] = {}
    all_open = asyncio.Event()
    opened = 0

    async def dispatcher() -> None:
        while True:
            batch = await client.get_output_async()
            for output in batch.outputs:
                collector = collectors.get(output.request_id)
                if collector is not None:
                    collector.put(output)

    async def hold(i: int) -> None:
        nonlocal opened
        request_id = f"idle-{i}"
        collector = RequestOutputCollector()
        collectors[request_id] = collector
        try:
            await client.add_request_async(make_request(request_id, 64))
            opened += 1
            if opened == streams:
                all_open.set()
            finished = False
            while not finished:
                finished = (await collector.get()).finish_reason is not None
        finally:
            del collectors[request_id]

    dispatch_task = asyncio.create_task(dispatcher())
    await asyncio.sleep(0)
    gc.collect()
    before = rss_bytes()
    tasks = [asyncio.create_task(hold(i)) for i in range(streams)]
    await all_open.wait()
    gc.collect()
    after = rss_bytes()
    ids = list(collectors)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.abort_requests_async(ids)
    dispatch_task.cancel()
    await asyncio.gather(dispatch_task, return_exceptions=True)
    await client.call_utility_async("resume_scheduler")
    return {
        "streams": streams,
        "rss_growth_bytes": after - before,
        "bytes_per_stream": (after - before) / streams,
    }


# ------------------------------------------------------------------------ driver


async def _run(spec: dict[str, Any], on_ready: Callable[[], None]) -> dict[str, Any]:
    client = await AsyncMPClient.connect(spec["input_address"], spec["output_address"])
    try:
        on_ready()
        workload = spec["workload"]
        if workload == "generate":
            result = await measure_generate(
                client,
                concurrency=int(spec["concurrency"]),
                tokens=int(spec["tokens"]),
                duration_s=float(spec["duration_s"]),
            )
        elif workload == "recv":
            result = await measure_recv(client, batch=int(spec.get("batch", 256)))
        elif workload == "utility":
            result = await measure_utility_rtt(client, calls=int(spec["calls"]))
        elif workload == "abort":
            result = await measure_abort_latency(client, samples=int(spec["samples"]))
        elif workload == "idle_streams":
            result = await measure_idle_streams(client, streams=int(spec["streams"]))
        else:
            raise ValueError(f"unknown workload {workload!r} for the asyncio client")
    finally:
        client.close()
    return result


def run(spec: dict[str, Any], on_ready: Callable[[], None]) -> dict[str, Any]:
    """Run one engine workload (``spec`` as for :mod:`benchmarks.worker`).

    ``on_ready`` is called once the engine's ready message has arrived, just before the
    measurement starts.
    """
    return asyncio.run(_run(spec, on_ready))

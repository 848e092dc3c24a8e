"""The practical limit: blocking pyzmq, the same decoding and dispatch, no event loop.

One thread does everything: a ROUTER input socket and a PULL output socket (both bound,
high-water marks 0), the engine's ready message first, then blocking receives
(``recv_multipart(copy=False)``; a ``poll`` with the time left bounds the wait so the
deadline is kept) that decode each message with ``MsgpackDecoder(EngineCoreOutputs)`` and
dispatch it per request, and synchronous sends of the replacement requests. There are no
streams (nothing can wait on its own), so ``idle_streams`` does not apply.

The workloads mirror :mod:`trio_enginecore._bench` (same closed-loop semantics, same
result keys), plus ``recv`` (:func:`measure_recv`, the receive path against
``benchmarks.flood``). Run one with :func:`run`.
"""

from __future__ import annotations

import collections
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import zmq

from trio_enginecore._bench import (
    abort_summary,
    generate_summary,
    make_request,
    utility_summary,
)
from trio_enginecore.errors import EngineDeadError, EngineStartupError, UtilityCallError
from trio_enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
)
from trio_enginecore.serial import Buffer, MsgpackDecoder, MsgpackEncoder

from . import recv_summary

__all__ = [
    "BlockingClient",
    "measure_abort_latency",
    "measure_generate",
    "measure_recv",
    "measure_utility_rtt",
    "run",
]

_ADD: Final = EngineCoreRequestType.ADD.value
_ABORT: Final = EngineCoreRequestType.ABORT.value
_UTILITY: Final = EngineCoreRequestType.UTILITY.value


def _make_socket(ctx: zmq.Context[Any], socket_type: int, address: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


class BlockingClient:
    """A single-threaded blocking engine-core client attached to an engine.

    The constructor binds both sockets and waits for the engine's ready message.
    """

    def __init__(
        self, input_address: str, output_address: str, *, ready_timeout_s: float = 60.0
    ) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.input_socket = _make_socket(self.ctx, zmq.ROUTER, input_address)
        self.output_socket = _make_socket(self.ctx, zmq.PULL, output_address)
        self.encoder = MsgpackEncoder()
        self.decoder: MsgpackDecoder[EngineCoreOutputs] = MsgpackDecoder(EngineCoreOutputs)
        self.messages_received = 0
        # Step outputs that arrived while a utility call was waiting for its reply.
        self._backlog: collections.deque[EngineCoreOutputs] = collections.deque()
        self.ready: EngineCoreReadyResponse | None = None
        try:
            if not self.input_socket.poll(int(ready_timeout_s * 1000)):
                raise EngineStartupError(
                    f"the engine sent no ready message within {ready_timeout_s:g} s"
                )
            identity, payload = self.input_socket.recv_multipart()
            self.engine_identity = identity
            if payload:
                self.ready = MsgpackDecoder(EngineCoreReadyResponse).decode(payload)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()

    # ------------------------------------------------------------------ sending

    def _send(self, request_type: bytes, payload: object) -> None:
        message = (self.engine_identity, request_type, *self.encoder.encode(payload))
        self.input_socket.send_multipart(message, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        request.client_index = 0
        self._send(_ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(_ABORT, request_ids)

    # ---------------------------------------------------------------- receiving

    def _recv(self, deadline: float) -> EngineCoreOutputs | None:
        """The next decoded message, or None if none arrived before ``deadline``."""
        sock = self.output_socket
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                left = deadline - time.perf_counter()
                if left <= 0 or not sock.poll(math.ceil(left * 1000)):
                    return None
                continue
            self.messages_received += 1
            if len(frames) == 1 and frames[0].buffer == ENGINE_CORE_DEAD:  # type: ignore[comparison-overlap]
                raise EngineDeadError("the engine reported ENGINE_CORE_DEAD")
            return self.decoder.decode(cast("Sequence[Buffer]", frames))

    def get_output(self, deadline: float) -> EngineCoreOutputs | None:
        """The next message with outputs (or stats), or None at ``deadline``."""
        if self._backlog:
            return self._backlog.popleft()
        while True:
            outputs = self._recv(deadline)
            if outputs is None:
                return None
            if outputs.utility_output is not None:
                continue  # a late reply to a call that gave up; nobody waits for it
            if outputs.outputs or outputs.scheduler_stats is not None:
                return outputs

    def call_utility(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """Send a utility call and block until its reply (matched by call id)."""
        call_id = uuid.uuid1().int >> 64
        self._send(_UTILITY, UtilityRequest(0, call_id, method, tuple(args)))
        deadline = time.perf_counter() + timeout_s
        while True:
            outputs = self._recv(deadline)
            if outputs is None:
                raise TimeoutError(f"no reply to {method!r} within {timeout_s:g} s")
            reply = outputs.utility_output
            if reply is not None and reply.call_id == call_id:
                if reply.failure_message is not None:
                    raise UtilityCallError(method, reply.failure_message)
                return None if reply.result is None else reply.result.result
            if outputs.outputs or outputs.scheduler_stats is not None:
                self._backlog.append(outputs)


# --------------------------------------------------------------------- workloads


def measure_generate(
    client: BlockingClient, *, concurrency: int, tokens: int, duration_s: float
) -> dict[str, Any]:
    """Closed loop, as ``_bench.measure_generate(mode="batch")``, in one thread."""
    latencies: list[float] = []
    started_at: dict[str, float] = {}
    counter = 0
    tokens_seen = 0
    messages_before = client.messages_received
    cpu0, wall0 = time.process_time(), time.perf_counter()
    deadline = wall0 + duration_s

    def next_request() -> EngineCoreRequest:
        nonlocal counter
        counter += 1
        return make_request(f"bench-{counter}", tokens)

    for _ in range(concurrency):
        request = next_request()
        started_at[request.request_id] = time.perf_counter()
        client.add_request(request)
    while True:
        batch = client.get_output(deadline)
        if batch is None:
            break
        now = time.perf_counter()
        if now >= deadline:
            break  # arrived after the deadline: not counted
        for output in batch.outputs:
            tokens_seen += len(output.new_token_ids)
            if output.finish_reason is not None:
                latencies.append(now - started_at.pop(output.request_id))
                request = next_request()
                started_at[request.request_id] = now
                client.add_request(request)
    client.abort_requests(list(started_at))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    messages = client.messages_received - messages_before
    return generate_summary(wall, cpu, len(latencies), tokens_seen, messages, latencies)


def measure_recv(client: BlockingClient, *, batch: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """Receive path against the flooding fake engine (``benchmarks.flood``).

    Adds ``batch`` requests, then receives until every request has finished; the clock
    starts once the requests are sent.
    """
    request_ids = [f"recv-{i}" for i in range(batch)]
    for request_id in request_ids:
        client.add_request(make_request(request_id, 64))
    messages_before = client.messages_received
    cpu0, wall0 = time.process_time(), time.perf_counter()
    deadline = wall0 + timeout_s
    finished = outputs = 0
    while finished < batch:
        received = client.get_output(deadline)
        if received is None:
            raise TimeoutError(f"{batch - finished} request(s) unfinished after {timeout_s:g} s")
        for output in received.outputs:
            outputs += 1
            if output.finish_reason is not None:
                finished += 1
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    messages = client.messages_received - messages_before
    # Hang up: the flooder waits for one more message from us before it exits.
    client.abort_requests(request_ids)
    return recv_summary(wall, cpu, messages, outputs)


def measure_utility_rtt(client: BlockingClient, *, calls: int) -> dict[str, Any]:
    """Sequential ``is_sleeping`` round trips: blocking send, blocking receive."""
    samples: list[float] = []
    cpu0 = time.process_time()
    for _ in range(calls):
        started = time.perf_counter()
        client.call_utility("is_sleeping")
        samples.append(time.perf_counter() - started)
    return utility_summary(samples, time.process_time() - cpu0)


def measure_abort_latency(
    client: BlockingClient, *, samples: int, timeout_s: float = 30.0
) -> dict[str, Any]:
    """Submit a long request, wait for its first output, ABORT, poll until (0, 0)."""
    latencies: list[float] = []
    for i in range(samples):
        request_id = f"abort-{i}"
        client.add_request(make_request(request_id, 1_000_000))
        deadline = time.perf_counter() + timeout_s
        while True:
            batch = client.get_output(deadline)
            if batch is None:
                raise TimeoutError(f"no output for {request_id!r} within {timeout_s:g} s")
            # Late outputs of the previous samples' aborted requests are skipped.
            if any(o.request_id == request_id for o in batch.outputs):
                break
        started = time.perf_counter()
        client.abort_requests([request_id])
        while list(client.call_utility("get_request_counts")) != [0, 0]:
            pass
        latencies.append(time.perf_counter() - started)
    return abort_summary(latencies)


# ------------------------------------------------------------------------ driver


def run(spec: dict[str, Any], on_ready: Callable[[], None]) -> dict[str, Any]:
    """Run one engine workload (``spec`` as for :mod:`benchmarks.worker`).

    ``on_ready`` is called once the engine's ready message has arrived, just before the
    measurement starts.
    """
    workload = spec["workload"]
    if workload == "idle_streams":
        return {"skipped": "no streams in a blocking loop"}
    if workload not in ("generate", "recv", "utility", "abort"):
        raise ValueError(f"unknown workload {workload!r} for the blocking client")
    client = BlockingClient(spec["input_address"], spec["output_address"])
    try:
        on_ready()
        if workload == "generate":
            return measure_generate(
                client,
                concurrency=int(spec["concurrency"]),
                tokens=int(spec["tokens"]),
                duration_s=float(spec["duration_s"]),
            )
        if workload == "recv":
            return measure_recv(client, batch=int(spec.get("batch", 256)))
        if workload == "utility":
            return measure_utility_rtt(client, calls=int(spec["calls"]))
        return measure_abort_latency(client, samples=int(spec["samples"]))
    finally:
        client.close()

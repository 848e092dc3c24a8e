"""Run ONE measurement in this process: ``python -m benchmarks.worker '<spec json>'``.

The orchestrator starts a fresh worker per measurement. The protocol it relies on:

* stdout carries nothing but, for workloads that use an engine, the line ``READY``
  (printed and flushed once the client is connected, has received the engine's ready
  message and has frozen its startup heap (``freeze_gc``), just before measuring; the
  orchestrator samples the engine's CPU time then and at exit), and, as the last line,
  one JSON object with the figures. If the measurement fails that object is
  ``{"error": "..."}`` and the exit status is 1. Logs and tracebacks go to stderr.
  Figures that have no value (no samples) are NaN, written as the bare ``NaN`` that
  Python's ``json`` reads back.
* The spec is a JSON object:

  - ``client``: ``trio-batch``, ``trio-stream``, ``asyncio``, ``asyncio-stream`` or
    ``blocking`` for the engine workloads (``asyncio-stream`` runs ``generate`` and
    ``idle_streams`` only); ``trio``, ``raw-pyzmq`` or ``memcpy`` for ``array``. (The
    ``vllm`` client is not run here but by ``benchmarks/vllm_worker.py``, in the vLLM
    environment, with the same protocol.)
  - ``workload``: ``generate`` (``concurrency``, ``tokens``, ``duration_s``),
    ``recv`` (``batch``, default 256: the receive path against the flooding fake engine
    ``benchmarks.flood``, through the batch API), ``utility`` (``calls``), ``abort``
    (``samples``), ``idle_streams`` (``streams``; skipped by ``blocking``, which then
    connects to nothing and prints no ``READY``) or ``array`` (``mib``, default 64;
    ``repeats``, default 5).
  - ``input_address``, ``output_address``: where the client BINDS its ROUTER and PULL
    sockets; an engine (``trio-enginecore serve --input-address A --output-address B``)
    has already been started to connect to them.

The Trio clients run :mod:`trio_enginecore._bench`'s workloads on
``open_engine_client(EngineConfig(), input_address=..., output_address=...)``
(``trio-batch`` drives ``generate`` through the batch API, ``trio-stream`` through
per-request streams; the other workloads are the same for both). The baselines are in
:mod:`benchmarks.baselines`. CPU figures are ``time.process_time()`` deltas: the
whole process, every thread (libzmq's I/O threads included).

The ``array`` workload needs no engine and prints no ``READY``: it times moving one
``mib`` MiB float32 array from a sender to a receiver in this process, the median over
``repeats`` transfers after one warm-up, from the start of the send to the decoded
array in hand:

* ``trio``: a PUSH and a PULL :class:`~trio_enginecore._zmq.TrioSocket` over ipc://,
  the array inside an ``EngineCoreOutputs`` (``EngineCoreOutput.routed_experts``)
  encoded with our codec (the array goes out as a zero-copy aux frame), received with
  ``recv_multipart(copy_leading=1)`` and decoded; ``zero_copy`` says whether the decoded
  array shares memory with the received frame.
* ``raw-pyzmq``: the same bytes as a single frame, blocking pyzmq PUSH in a thread and
  PULL in the main thread (``recv(copy=False)`` wrapped with ``np.frombuffer``), no codec.
* ``memcpy``: ``np.copyto`` into a preallocated, already written (warm) destination.

``rx_cpu_ms_per_msg`` cannot separate the receiving side from the sending side (and
libzmq's I/O threads) inside one process: it is the whole process's CPU time per
transfer, sender included, for all three.
"""

from __future__ import annotations

import gc
import json
import logging
import queue
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt
import trio
import zmq

from trio_enginecore import _bench
from trio_enginecore._zmq import make_socket
from trio_enginecore.client import Liveness, TrioEngineClient, open_engine_client
from trio_enginecore.config import EngineConfig
from trio_enginecore.protocol import EngineCoreOutput, EngineCoreOutputs
from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder

from .baselines import recv_summary

__all__ = ["main", "run_spec"]

ENGINE_CLIENTS: Final = ("trio-batch", "trio-stream", "asyncio", "asyncio-stream", "blocking")
ARRAY_CLIENTS: Final = ("trio", "raw-pyzmq", "memcpy")
ENGINE_WORKLOADS: Final = ("generate", "recv", "utility", "abort", "idle_streams")


def tune_gc(spec: dict[str, Any]) -> None:
    """Apply the spec's ``gc_threshold`` (``gc.set_threshold`` arguments), if any: the
    one-line tuning an application serving thousands of streams can make at startup
    (see the performance guide), given to every client of a tuned series alike."""
    threshold = spec.get("gc_threshold")
    if threshold:
        gc.set_threshold(*(int(t) for t in threshold))


def _ready_announcer(spec: dict[str, Any]) -> Callable[[], None]:
    """What a client calls once connected: freeze the startup heap, then ``READY``.

    Every client gets what vLLM's API server does once it has started (and what the
    ``vllm`` worker does with vLLM's own ``freeze_gc_heap()``): the objects alive after
    startup are frozen, so that full collections do not walk the modules and the
    engine's ready response again and again. Measured on the receive path: 0.17 s of
    full collections in 0.77 s of CPU without it. ``"freeze_gc": false`` in the spec
    skips it, to see the difference. ``"gc_threshold": [g0, g1, g2]`` also sets the
    collector's thresholds (:func:`tune_gc`).
    """

    def ready() -> None:
        if spec.get("freeze_gc", True):
            gc.collect()
            gc.freeze()
        tune_gc(spec)
        print("READY", flush=True)

    return ready


# ----------------------------------------------------------------- engine workloads


async def _recv_trio(
    client: TrioEngineClient, *, batch: int, timeout_s: float = 300.0
) -> dict[str, Any]:
    """Receive path against ``benchmarks.flood`` through the batch API.

    Adds ``batch`` requests, then consumes ``get_output()`` until every request has
    finished; the clock starts once the requests are sent.
    """
    request_ids = [f"recv-{i}" for i in range(batch)]
    for request_id in request_ids:
        await client.add_request(_bench.make_request(request_id, 64))
    messages_before = client.statistics().messages_received
    cpu0, wall0 = time.process_time(), time.perf_counter()
    finished = outputs = 0
    with trio.fail_after(timeout_s):
        while finished < batch:
            for output in (await client.get_output()).outputs:
                outputs += 1
                if output.finish_reason is not None:
                    finished += 1
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    messages = client.statistics().messages_received - messages_before
    return recv_summary(wall, cpu, messages, outputs)


async def _run_trio(spec: dict[str, Any], on_ready: Callable[[], None]) -> dict[str, Any]:
    workload = spec["workload"]
    async with open_engine_client(
        EngineConfig(),
        input_address=spec["input_address"],
        output_address=spec["output_address"],
        # The flooding fake engine reads no input while it floods, so it would answer
        # no liveness check: one flood longer than the checks' deadline was an engine
        # death. The baselines check nothing either.
        liveness=None if workload == "recv" else Liveness(),
    ) as client:
        on_ready()
        if workload == "generate":
            return await _bench.measure_generate(
                client,
                concurrency=int(spec["concurrency"]),
                tokens=int(spec["tokens"]),
                duration_s=float(spec["duration_s"]),
                mode="stream" if spec["client"] == "trio-stream" else "batch",
            )
        if workload == "recv":
            return await _recv_trio(client, batch=int(spec.get("batch", 256)))
        if workload == "utility":
            return await _bench.measure_utility_rtt(client, calls=int(spec["calls"]))
        if workload == "abort":
            return await _bench.measure_abort_latency(client, samples=int(spec["samples"]))
        return await _bench.measure_idle_streams(client, streams=int(spec["streams"]))


def _run_engine_workload(spec: dict[str, Any]) -> dict[str, Any]:
    client = spec["client"]
    ready = _ready_announcer(spec)
    if client in ("trio-batch", "trio-stream"):
        return trio.run(_run_trio, spec, ready)
    if client == "asyncio":
        from .baselines import asyncio_vllm

        return asyncio_vllm.run(spec, ready)
    if client == "asyncio-stream":
        from .baselines import asyncio_stream

        return asyncio_stream.run(spec, ready)
    from .baselines import blocking

    return blocking.run(spec, ready)


# ------------------------------------------------------------------ array workload


def _test_array(mib: int) -> npt.NDArray[np.float32]:
    # np.full writes every element: the sender's pages are resident before timing.
    return np.full(mib * 1024 * 1024 // 4, 1.5, dtype=np.float32)


def _array_result(
    mib: int, durations: list[float], cpu_s: float, repeats: int, *, zero_copy: bool
) -> dict[str, Any]:
    nbytes = mib * 1024 * 1024
    return {
        "mib": mib,
        "repeats": repeats,
        "gb_per_s": statistics.median(nbytes / d / 1e9 for d in durations),
        "rx_cpu_ms_per_msg": 1e3 * cpu_s / len(durations),
        "zero_copy": zero_copy,
    }


async def _array_trio(mib: int, repeats: int) -> dict[str, Any]:
    array = _test_array(mib)
    message = EngineCoreOutputs(outputs=[EngineCoreOutput("array", [], routed_experts=array)])
    encoder = MsgpackEncoder()
    decoder: MsgpackDecoder[EngineCoreOutputs] = MsgpackDecoder(EngineCoreOutputs)
    ctx: zmq.Context[Any] = zmq.Context()
    durations: list[float] = []
    zero_copy = True
    cpu0 = cpu = 0.0
    try:
        with (
            tempfile.TemporaryDirectory(prefix="tecbench-") as tmp,
            make_socket(ctx, zmq.PULL) as pull,
            make_socket(ctx, zmq.PUSH) as push,
        ):
            address = f"ipc://{tmp}/array"
            pull.bind(address)
            push.connect(address)
            for i in range(repeats + 1):
                if i == 1:
                    cpu0 = time.process_time()
                started = time.perf_counter()
                await push.send_multipart(encoder.encode(message), copy=False)
                frames = await pull.recv_multipart(copy_leading=1)
                received = decoder.decode(frames).outputs[0].routed_experts
                elapsed = time.perf_counter() - started
                assert received is not None
                assert received.shape == array.shape
                assert received[-1] == array[-1]
                zero_copy = zero_copy and bool(
                    np.shares_memory(received, np.frombuffer(frames[1], dtype=np.uint8))
                )
                if i:
                    durations.append(elapsed)
                del received, frames
            cpu = time.process_time() - cpu0
    finally:
        ctx.term()
    return _array_result(mib, durations, cpu, repeats, zero_copy=zero_copy)


def _array_raw_pyzmq(mib: int, repeats: int) -> dict[str, Any]:
    array = _test_array(mib)
    ctx: zmq.Context[Any] = zmq.Context()
    go: queue.SimpleQueue[bool] = queue.SimpleQueue()
    durations: list[float] = []
    zero_copy = True
    cpu0 = cpu = 0.0
    with tempfile.TemporaryDirectory(prefix="tecbench-") as tmp:
        address = f"ipc://{tmp}/array"
        pull: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        push: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
        for sock in (pull, push):
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
        pull.bind(address)
        push.connect(address)

        def sender() -> None:
            while go.get():
                push.send(array.data, copy=False)

        thread = threading.Thread(target=sender, name="raw-pyzmq-sender")
        thread.start()
        try:
            for i in range(repeats + 1):
                if i == 1:
                    cpu0 = time.process_time()
                started = time.perf_counter()
                go.put(True)
                frame = pull.recv(copy=False)
                received = np.frombuffer(frame.buffer, dtype=np.float32)
                elapsed = time.perf_counter() - started
                assert received.shape == array.shape
                assert received[-1] == array[-1]
                zero_copy = zero_copy and bool(
                    np.shares_memory(received, np.frombuffer(frame.buffer, dtype=np.uint8))
                )
                if i:
                    durations.append(elapsed)
                del received, frame
            cpu = time.process_time() - cpu0
        finally:
            go.put(False)
            thread.join()
            pull.close(linger=0)
            push.close(linger=0)
            ctx.term()
    return _array_result(mib, durations, cpu, repeats, zero_copy=zero_copy)


def _array_memcpy(mib: int, repeats: int) -> dict[str, Any]:
    array = _test_array(mib)
    destination = np.empty_like(array)
    np.copyto(destination, array)  # warm: every destination page is mapped
    durations: list[float] = []
    cpu0 = time.process_time()
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(destination, array)
        durations.append(time.perf_counter() - started)
    cpu = time.process_time() - cpu0
    assert destination[-1] == array[-1]
    return _array_result(mib, durations, cpu, repeats, zero_copy=False)


def _run_array_workload(spec: dict[str, Any]) -> dict[str, Any]:
    mib = int(spec.get("mib", 64))
    repeats = int(spec.get("repeats", 5))
    if mib < 1 or repeats < 1:
        raise ValueError(f"mib and repeats must be at least 1, got {mib} and {repeats}")
    client = spec["client"]
    if client == "trio":
        return trio.run(_array_trio, mib, repeats)
    if client == "raw-pyzmq":
        return _array_raw_pyzmq(mib, repeats)
    return _array_memcpy(mib, repeats)


# ------------------------------------------------------------------------ driver


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Validate ``spec`` and run its measurement; returns the figures."""
    client, workload = spec.get("client"), spec.get("workload")
    if workload == "array":
        if client not in ARRAY_CLIENTS:
            raise ValueError(f"array workload: client must be one of {ARRAY_CLIENTS}")
        return _run_array_workload(spec)
    if workload not in ENGINE_WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}")
    if client not in ENGINE_CLIENTS:
        raise ValueError(f"{workload} workload: client must be one of {ENGINE_CLIENTS}")
    for key in ("input_address", "output_address"):
        if not isinstance(spec.get(key), str):
            raise ValueError(f"the spec needs {key!r}")
    result = _run_engine_workload(spec)
    # What the collector ran with (the tuned series' proof that the tuning took).
    result["gc_threshold_0"] = gc.get_threshold()[0]
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="worker %(levelname)s %(message)s"
    )
    status = 0
    try:
        if len(args) != 1:
            raise ValueError("usage: python -m benchmarks.worker '<spec json>'")
        spec: Any = json.loads(args[0])
        if not isinstance(spec, dict):
            raise ValueError("the spec must be a JSON object")
        result = run_spec(cast("dict[str, Any]", spec))
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        result = {"error": f"{type(exc).__name__}: {exc}"}
        status = 1
    print(json.dumps(result), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Re-attaching to an engine started on its own (attach mode).

One ``trio-enginecore serve --input-address A --output-address B`` process serves
clients one after another: a client leaving, cleanly or killed with SIGKILL, does not
stop it; the next client attaching to A and B gets the ready message and exact
results; the departed client's requests no longer run on the engine. Real processes,
real sockets (ipc:// in a private temp dir), an absolute timeout on every test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio
import zmq

from trio_enginecore import EngineConfig, EngineCoreRequest, open_engine_client
from trio_enginecore._zmq import make_socket
from trio_enginecore.client import TrioEngineClient
from trio_enginecore.engine import CounterModel, EngineCoreProc, addresses_for
from trio_enginecore.engine._links import drop_queued_input
from trio_enginecore.protocol import EngineCoreReadyResponse, EngineCoreRequestType
from trio_enginecore.serial import MsgpackDecoder

from .enginepeer import RANK0, EnginePeer, make_request, serve_command, tokens_of
from .support import (
    children_of_this_process,
    open_fds,
    process_is_running,
    read_line,
    stop_process,
    stream_tokens,
)

# A step takes 2 ms, so a request of 10**5 tokens runs for minutes: a departed client's
# requests would still be running long after every bound of these tests.
ENGINE_ARGS = ("--step-time-s", "0.002", "--max-model-len", "200000", "--max-num-seqs", "32")
LONG = 100_000
# Generous: a loaded 2-core machine starts Python slowly; none of these is a speed claim.
READY_TIMEOUT_S = 20.0


@attrs.define
class Standalone:
    process: trio.Process
    input_address: str
    output_address: str

    @asynccontextmanager
    async def client(self) -> AsyncIterator[TrioEngineClient]:
        async with open_engine_client(
            EngineConfig(),
            input_address=self.input_address,
            output_address=self.output_address,
            ready_timeout_s=READY_TIMEOUT_S,
        ) as client:
            yield client


@asynccontextmanager
async def standalone_engine() -> AsyncIterator[Standalone]:
    """An engine in attach mode, started by the test, not by any client.

    On exit it gets SIGTERM and must drain and exit 0 (SIGKILL after 10 s otherwise),
    leaving no child process and no file descriptor of this process behind.
    """
    fds_before = open_fds()
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    inp, out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    command = serve_command("--input-address", inp, "--output-address", out, *ENGINE_ARGS)
    process = await trio.lowlevel.open_process(command)
    try:
        yield Standalone(process, inp, out)
        # (c): the same process served everybody, and is still serving.
        assert process.returncode is None, f"the engine exited with {process.returncode}"
        assert process_is_running(process.pid)
    finally:
        await stop_process(process, grace_s=10)
        shutil.rmtree(tmp, ignore_errors=True)
    assert process.returncode == 0
    assert children_of_this_process() == []
    leaked = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in open_fds() - fds_before}
    assert leaked == {}


async def exact_results(client: TrioEngineClient, tag: str, n: int = 6) -> None:
    """Stream ``n`` requests at once; each must get exactly the counter's tokens."""
    prompts = {f"{tag}-{i}": [i * 1000 + 1, i * 1000 + 5] for i in range(n)}
    results: dict[str, list[int]] = {}

    async def one(rid: str, prompt: list[int]) -> None:
        request = EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=24)
        results[rid] = await stream_tokens(client, request)

    async with trio.open_nursery() as nursery:
        for rid, prompt in prompts.items():
            nursery.start_soon(one, rid, prompt)
    for rid, prompt in prompts.items():
        assert results[rid] == CounterModel.expected_tokens(prompt, 24), rid


async def engine_holds_nothing(client: TrioEngineClient) -> None:
    """Wait (bounded) until the engine reports nothing waiting or running.

    The engine notices a departure asynchronously, so a first answer may come before
    it did; the bound is far above the milliseconds this takes.
    """
    counts = await client.get_request_counts()
    with trio.fail_after(10):
        while counts != (0, 0):
            await trio.sleep(0.02)
            counts = await client.get_request_counts()


async def test_five_clients_in_turn_each_get_the_ready_message_and_exact_results() -> None:
    instance_ids = set()
    with trio.fail_after(120):
        async with standalone_engine() as engine:
            for k in range(5):
                async with engine.client() as client:
                    assert client.engines[0] is not None
                    instance_ids.add(client.engines[0].instance_id)
                    # Whatever the client before left running is gone from the engine.
                    await engine_holds_nothing(client)
                    await exact_results(client, f"c{k}")
                    # Leave with requests in flight: a clean departure.
                    async with trio.open_nursery() as nursery:
                        for i in range(3):
                            long = EngineCoreRequest.for_tokens(
                                [7 + i], request_id=f"c{k}-long-{i}", max_tokens=LONG
                            )
                            nursery.start_soon(stream_tokens, client, long)
                        while sum(await client.get_request_counts()) < 3:
                            await trio.sleep(0.01)
                        nursery.cancel_scope.cancel()
                assert engine.process.returncode is None
    # One engine, the same instance, answered every client.
    assert len(instance_ids) == 1


KILLED_CLIENT = """
import sys, trio
from trio_enginecore import EngineConfig, EngineCoreRequest, open_engine_client

async def main(inp, out):
    async with open_engine_client(EngineConfig(), input_address=inp, output_address=out,
                                  ready_timeout_s=20) as client:
        streaming = trio.Semaphore(0)

        async def one(i):
            request = EngineCoreRequest.for_tokens([i + 1], request_id=f"doomed-{i}",
                                                   max_tokens=100_000)
            async with client.stream(request) as outputs:
                async for output in outputs:
                    if output.new_token_ids:
                        streaming.release()
                        break
                # Keep the request running: hold the stream open, never abort.
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
            for _ in range(8):
                await streaming.acquire()
            # Pipeline a few more ADDs right before dying.
            for i in range(8, 12):
                await client.add_request(EngineCoreRequest.for_tokens(
                    [i + 1], request_id=f"doomed-{i}", max_tokens=100_000))
            print("streaming", flush=True)
            await trio.sleep_forever()

trio.run(main, sys.argv[1], sys.argv[2])
"""


async def test_a_client_killed_mid_stream_leaves_nothing_running_for_the_next() -> None:
    instance_ids = set()
    with trio.fail_after(120):
        async with standalone_engine() as engine:
            async with engine.client() as client:
                assert client.engines[0] is not None
                instance_ids.add(client.engines[0].instance_id)
                await exact_results(client, "before")
            for round_ in range(2):
                async with trio.open_nursery() as nursery:
                    doomed = await nursery.start(
                        partial(
                            trio.run_process,
                            [
                                sys.executable,
                                "-c",
                                KILLED_CLIENT,
                                engine.input_address,
                                engine.output_address,
                            ],
                            stdout=subprocess.PIPE,
                            check=False,
                        )
                    )
                    assert doomed.stdout is not None
                    line = await read_line(doomed.stdout, what="the client program")
                    assert line == b"streaming\n"
                    doomed.kill()
                    await doomed.stdout.aclose()
                assert doomed.returncode == -signal.SIGKILL
                async with engine.client() as client:
                    assert client.engines[0] is not None
                    instance_ids.add(client.engines[0].instance_id)
                    # Before this client sends any request: the engine holds none of
                    # the killed client's 12.
                    await engine_holds_nothing(client)
                    await exact_results(client, f"after-{round_}")
                    assert await client.get_request_counts() == (0, 0)
                assert engine.process.returncode is None
    assert len(instance_ids) == 1


def _bind_peer(ctx: zmq.Context[Any], inp: str, out: str) -> EnginePeer:
    router = make_socket(ctx, zmq.ROUTER)
    pull = make_socket(ctx, zmq.PULL)
    router.bind(inp)
    pull.bind(out)
    return EnginePeer(router, pull)


async def test_what_a_departed_client_sent_unread_never_reaches_the_engine_core() -> None:
    """The orderings a stalled engine sees, in-process so the test can stall it.

    A client sends ADDs and leaves, and the next client binds, while the engine's Trio
    thread is blocked: libzmq's I/O thread meanwhile queues the ADDs on the engine's
    input socket, reports the departure, reconnects and reports the arrival, so the
    engine's tasks find all of it at once, in some order. Whatever the order, the next
    client gets the ready message first and the engine holds none of those ADDs.
    """
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    inp, out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    ctx: zmq.Context[Any] = zmq.Context()
    engine = EngineCoreProc(EngineConfig(step_time_s=0.002, max_model_len=200_000), ctx)
    peer_ctx: zmq.Context[Any] = zmq.Context()
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(engine.run, addresses_for([inp], [out])))
                peer = _bind_peer(peer_ctx, inp, out)
                for round_ in range(6):
                    identity, payload = await peer.router.recv_multipart()
                    assert identity == RANK0
                    # The ready message, and nothing of the previous client's is left.
                    MsgpackDecoder(EngineCoreReadyResponse).decode([payload])
                    assert engine.core.num_requests == 0
                    counts = await peer.call("get_request_counts")
                    assert counts.result is not None
                    assert counts.result.result == [0, 0]
                    await peer.add(make_request(f"real-{round_}", [round_ + 3], max_tokens=5))
                    results = await peer.collect({f"real-{round_}"})
                    assert tokens_of(results[f"real-{round_}"]) == CounterModel.expected_tokens(
                        [round_ + 3], 5
                    )
                    for i in range(20):
                        request = make_request(f"stale-{round_}-{i}", [i + 1], max_tokens=LONG)
                        peer.router.send_multipart_nowait(
                            [RANK0, EngineCoreRequestType.ADD.value, *peer.encoder.encode(request)]
                        )
                    # Stall the engine: leave (flushing the ADDs), let the next client
                    # bind, and give libzmq time to reconnect, all without a checkpoint.
                    peer.router.close(linger=2000)
                    peer.pull.close(linger=0)
                    peer_ctx.term()
                    peer_ctx = zmq.Context()
                    peer = _bind_peer(peer_ctx, inp, out)
                    time.sleep(0.3)  # noqa: ASYNC251 - blocking the engine is the point
                with trio.fail_after(10):
                    identity, payload = await peer.router.recv_multipart()
                MsgpackDecoder(EngineCoreReadyResponse).decode([payload])
                assert engine.core.num_requests == 0
                nursery.cancel_scope.cancel()
    finally:
        peer_ctx.destroy(linger=0)
        ctx.destroy(linger=0)
        shutil.rmtree(tmp, ignore_errors=True)


async def test_the_input_left_over_is_taken_off_to_the_last_message_and_no_further() -> None:
    """What the engine drops before greeting a new client: exactly what was queued."""
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        with (
            make_socket(ctx, zmq.ROUTER) as router,
            make_socket(ctx, zmq.DEALER, identity=RANK0) as dealer,
        ):
            router.bind(f"ipc://{tmp}/in")
            dealer.connect(f"ipc://{tmp}/in")
            await dealer.send_multipart([b"hello"])
            with trio.fail_after(10):
                assert (await router.recv_multipart())[0] == RANK0
                assert await drop_queued_input(dealer) == 0
                for i in range(50):
                    await router.send_multipart([RANK0, b"stale %d" % i])
                # Let libzmq's I/O thread queue them all on the DEALER, with no
                # checkpoint (the engine's tasks see such a queue after a stall).
                time.sleep(0.2)  # noqa: ASYNC251
                assert await drop_queued_input(dealer) == 50
                assert await drop_queued_input(dealer) == 0
                await router.send_multipart([RANK0, b"fresh"])
                assert await dealer.recv_multipart() == [b"fresh"]
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(tmp, ignore_errors=True)

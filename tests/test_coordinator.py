"""The data-parallel coordinator: pure state, then the real sockets in-process."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import zmq

from trio_enginecore._curve import CurveClient, CurveKeyPair, write_key_pair
from trio_enginecore._zmq import make_socket
from trio_enginecore.coordinator import (
    CoordinatorAddresses,
    CoordinatorState,
    serve_coordinator,
)
from trio_enginecore.protocol import EngineCoreOutputs, SchedulerStats
from trio_enginecore.serial import MsgpackEncoder

from .support import free_port


def stats(engine: int, waiting: int, running: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        engine_index=engine,
        scheduler_stats=SchedulerStats(num_waiting_reqs=waiting, num_running_reqs=running),
        timestamp=1.0,
    )


def test_state_folds_each_engines_counts_and_tracks_changes() -> None:
    state = CoordinatorState(3)
    assert msgspec.msgpack.decode(state.publication()) == [
        [[0, 0, 0.0], [0, 0, 0.0], [0, 0, 0.0]],
        0,
        False,
    ]
    assert not state.changed
    state.update(stats(1, 2, 5))
    assert state.changed
    counts, wave, running = msgspec.msgpack.decode(state.publication())
    assert counts == [[0, 0, 0.0], [2, 5, 0.0], [0, 0, 0.0]]
    # Counts are load, not the wave: only wave messages start and end waves.
    assert (wave, running) == (0, False)
    state.update(stats(1, 2, 5))  # the same again: nothing to publish
    assert not state.changed


def test_state_ignores_unknown_engines_and_messages_without_stats() -> None:
    state = CoordinatorState(2)
    state.publication()
    state.update(stats(7, 1, 1))
    state.update(EngineCoreOutputs(engine_index=0, timestamp=1.0))
    assert not state.changed


def test_engines_are_ready_once_the_whole_group_subscribed_and_latecomers_at_once() -> None:
    state = CoordinatorState(3)
    assert [state.engine_subscribed() for _ in range(3)] == [False, False, True]
    assert state.engine_subscribed()  # a restarted engine is told at once
    # The barrier is the group the coordinator started with, rescaled or not.
    rescaled = CoordinatorState(2)
    rescaled.scale(3)
    assert [rescaled.engine_subscribed() for _ in range(2)] == [False, True]


def test_a_new_front_end_is_sent_the_counts_at_once() -> None:
    state = CoordinatorState(2)
    state.publication()
    state.frontend_subscribed()
    assert state.changed
    assert not state.wave_changed


def test_the_group_cannot_be_scaled_below_one_engine() -> None:
    state = CoordinatorState(2)
    state.update(stats(1, 4, 5))
    state.publication()
    with pytest.raises(ValueError, match="at least one engine"):
        state.scale(0)
    assert (state.engines, state.counts, state.changed) == (2, [(0, 0, 0.0), (4, 5, 0.0)], False)


async def test_the_coordinator_relays_counts_and_runs_waves_over_real_sockets() -> None:
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    addresses = CoordinatorAddresses.in_directory(tmp)
    ctx: zmq.Context[Any] = zmq.Context()
    push = make_socket(ctx, zmq.PUSH)
    client = make_socket(ctx, zmq.XSUB)
    engines = [make_socket(ctx, zmq.XSUB) for _ in range(2)]
    encoder = MsgpackEncoder()

    async def next_publication(predicate: Callable[[list[Any]], bool]) -> list[Any]:
        while True:
            publication = msgspec.msgpack.decode((await client.recv_multipart())[0])
            if predicate(publication):
                return publication

    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    partial(
                        serve_coordinator,
                        ctx,
                        engines=2,
                        addresses=addresses,
                        min_interval_s=0.01,
                        heartbeat_s=60,
                    )
                )
                # Engines subscribe; READY comes once both have.
                engines[0].connect(addresses.engine_publish)
                await engines[0].send_multipart([b"\x01"])
                with trio.move_on_after(0.2) as early:
                    await engines[0].recv_multipart()
                assert early.cancelled_caught, "READY before every engine subscribed"
                engines[1].connect(addresses.engine_publish)
                await engines[1].send_multipart([b"\x01"])
                for engine in engines:
                    assert await engine.recv_multipart() == [b"READY"]
                # A new client is sent the state at once (no waiting for a heartbeat).
                client.connect(addresses.publish)
                await client.send_multipart([b"\x01"])
                first = await next_publication(lambda _: True)
                assert first == [[[0, 0, 0.0], [0, 0, 0.0]], 0, False]
                push.connect(addresses.stats)
                await push.send_multipart(encoder.encode(stats(0, 3, 4)))
                await push.send_multipart(encoder.encode(stats(1, 0, 2)))
                await next_publication(lambda p: p[0] == [[3, 4, 0.0], [0, 2, 0.0]])
                # Engine 1 got a request while paused: the others start its wave, and
                # front-ends hear of it at once, with no counts (vLLM's shape).
                await push.send_multipart(
                    encoder.encode(EngineCoreOutputs(engine_index=1, start_wave=0))
                )
                for engine in engines:
                    frames = await engine.recv_multipart()
                    assert frames[0] == b"\x02"
                    assert msgspec.msgpack.decode(frames[1]) == [0, 1]
                await next_publication(lambda p: p == [None, 0, True])
                # Rank 0 ends the wave (vLLM's rank 0 speaks for its group).
                done = EngineCoreOutputs(engine_index=0, wave_complete=0)
                await push.send_multipart(encoder.encode(done))
                await next_publication(lambda p: p == [None, 1, False])
                # A front-end may only rescale the group (elastic EP).
                await client.send_multipart([msgspec.msgpack.encode(("SCALE_ELASTIC_EP", 3))])
                await next_publication(lambda p: p[0] is not None and len(p[0]) == 3)
                # Garbage from a front-end or an engine is dropped; the coordinator
                # serves on. The old wake message of a front-end is not accepted.
                await client.send_multipart([b"\xc1not msgpack"])
                await client.send_multipart([msgspec.msgpack.encode((1, 0))])
                await client.send_multipart([msgspec.msgpack.encode(("SCALE_ELASTIC_EP", 0))])
                await push.send_multipart([b"\xc1"])
                await push.send_multipart(encoder.encode(stats(1, 9, 9)))
                await next_publication(lambda p: p[0][1][:2] == [9, 9])
                nursery.cancel_scope.cancel()
    finally:
        for sock in (push, client, *engines):
            sock.close()
        ctx.destroy(linger=0)


def _free_tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


async def test_the_coordinator_command_serves_over_tcp_with_curve_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    _, frontend_secret = write_key_pair(tmp_path, "frontend")
    engine_public, _ = write_key_pair(tmp_path, "engine")
    frontend = CurveKeyPair.load(frontend_secret)
    addresses = CoordinatorAddresses(_free_tcp(), _free_tcp(), _free_tcp())
    command = [
        sys.executable, "-m", "trio_enginecore", "coordinator", "--engines", "1",
        *addresses.arguments(),
        "--curve-secret-key", str(frontend_secret), "--curve-allow", str(engine_public),
    ]  # fmt: skip
    ctx: zmq.Context[Any] = zmq.Context()
    member = make_socket(ctx, zmq.XSUB)
    stranger = make_socket(ctx, zmq.XSUB)
    try:
        with trio.fail_after(20):
            process = await trio.lowlevel.open_process(command, stdin=subprocess.DEVNULL)
            try:
                # A frontend (holding the frontends' key pair) is admitted and served...
                CurveClient(frontend, frontend.public).apply(member)
                member.connect(addresses.publish)
                await member.send_multipart([b"\x01"])
                publication = msgspec.msgpack.decode((await member.recv_multipart())[0])
                assert publication == [[[0, 0, 0.0]], 0, False]
                # ...a peer with another key is not.
                CurveClient(CurveKeyPair.generate(), frontend.public).apply(stranger)
                stranger.connect(addresses.publish)
                await stranger.send_multipart([b"\x01"])
                with trio.move_on_after(1) as nothing:
                    await stranger.recv_multipart()
                assert nothing.cancelled_caught
            finally:
                process.terminate()
                assert await process.wait() == 0
            # An address another program holds: one line naming it, exit code 2.
            with socket.socket() as holder:
                # (SO_REUSEADDR: the coordinator's closed connections may linger.)
                holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                host, port = addresses.publish[len("tcp://") :].rsplit(":", 1)
                holder.bind((host, int(port)))
                holder.listen()
                taken = await trio.run_process(command, check=False, capture_stderr=True)
            assert taken.returncode == 2
            assert taken.stderr.decode() == (
                f"trio-enginecore coordinator: cannot use address {addresses.publish!r} "
                "(coordinator publish): Address already in use\n"
            )
    finally:
        member.close()
        stranger.close()
        ctx.destroy(linger=0)


def test_the_coordinator_command_refuses_half_a_curve_configuration() -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "trio_enginecore", "coordinator", "--engines", "1",
            "--stats-address", "ipc:///tmp/x1", "--engine-publish-address", "ipc:///tmp/x2",
            "--publish-address", "ipc:///tmp/x3", "--curve-secret-key", "/nonexistent",
        ],
        capture_output=True,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert b"go together" in result.stderr

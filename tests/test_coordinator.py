"""The data-parallel coordinator: pure state, then the real sockets in-process."""

from __future__ import annotations

import tempfile
from typing import Any

import msgspec
import trio
import zmq

from trio_enginecore._zmq import make_socket
from trio_enginecore.engine._coordinator import CoordinatorState, run_coordinator
from trio_enginecore.protocol import EngineCoreOutputs, SchedulerStats
from trio_enginecore.serial import MsgpackEncoder


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
    assert state.engines_running
    counts, wave, running = msgspec.msgpack.decode(state.publication())
    assert counts == [[0, 0, 0.0], [2, 5, 0.0], [0, 0, 0.0]]
    assert (wave, running) == (0, True)
    state.update(stats(1, 2, 5))  # the same again: nothing to publish
    assert not state.changed


def test_state_ignores_unknown_engines_and_messages_without_stats() -> None:
    state = CoordinatorState(2)
    state.publication()
    state.update(stats(7, 1, 1))
    state.update(EngineCoreOutputs(engine_index=0, timestamp=1.0))
    assert not state.changed


async def test_the_coordinator_republishes_engine_counts_to_subscribers() -> None:
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    ctx: zmq.Context[Any] = zmq.Context()
    push = make_socket(ctx, zmq.PUSH)
    sub = make_socket(ctx, zmq.SUB)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    lambda task_status: run_coordinator(
                        ctx,
                        engines=2,
                        stats_address=f"ipc://{tmp}/stats",
                        publish_address=f"ipc://{tmp}/pub",
                        min_interval_s=0.01,
                        heartbeat_s=0.2,
                        task_status=task_status,
                    )
                )
                sub.raw.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(f"ipc://{tmp}/pub")
                push.connect(f"ipc://{tmp}/stats")
                encoder = MsgpackEncoder()
                # A subscriber that joins late still learns the state (heartbeat).
                first = msgspec.msgpack.decode((await sub.recv_multipart())[0])
                assert first[0] == [[0, 0, 0.0], [0, 0, 0.0]]
                await push.send_multipart(encoder.encode(stats(0, 3, 4)))
                await push.send_multipart(encoder.encode(stats(1, 0, 2)))
                while True:
                    counts, _, running = msgspec.msgpack.decode((await sub.recv_multipart())[0])
                    if counts == [[3, 4, 0.0], [0, 2, 0.0]]:
                        break
                assert running is True
                nursery.cancel_scope.cancel()
    finally:
        push.close()
        sub.close()
        ctx.destroy(linger=0)

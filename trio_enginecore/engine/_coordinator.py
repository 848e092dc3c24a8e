"""The data-parallel coordinator: engines' request counts, republished to clients.

Engines PUSH their scheduler statistics (an ``EngineCoreOutputs`` whose
``scheduler_stats`` holds the waiting and running counts and the KV-cache usage) to the
coordinator's stats address; the coordinator publishes, on its XPUB publish address,
``msgpack((counts, current_wave, engines_running))`` with ``counts`` one
``[waiting, running, kv_usage]`` per engine, as vLLM's coordinator publishes to its
front-ends: when something changed, at most every ``min_interval_s``, and at least every
``heartbeat_s`` so a newly subscribed client learns the state.

Not built yet: request waves (``wave_complete`` / ``start_wave`` / ``START_DP_WAVE``).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Final

import attrs
import msgspec
import trio
import zmq

from .._zmq import make_socket
from ..errors import ProtocolError
from ..protocol import EngineCoreOutputs
from ..serial import MsgpackDecoder

__all__ = ["CoordinatorState", "run_coordinator"]

logger = logging.getLogger("trio_enginecore.coordinator")

MIN_INTERVAL_S: Final = 0.1
HEARTBEAT_S: Final = 4.0


@attrs.define
class CoordinatorState:
    """What the coordinator knows (pure logic: no I/O)."""

    engines: int
    counts: list[list[float]] = attrs.field(init=False)
    current_wave: int = 0
    engines_running: bool = False
    changed: bool = True

    def __attrs_post_init__(self) -> None:
        self.counts = [[0, 0, 0.0] for _ in range(self.engines)]

    def update(self, message: EngineCoreOutputs) -> None:
        """Fold one engine's statistics in; unknown engines and stat-less messages are
        ignored."""
        stats = message.scheduler_stats
        index = message.engine_index
        if stats is None or not 0 <= index < self.engines:
            return
        new = [stats.num_waiting_reqs, stats.num_running_reqs, stats.kv_cache_usage]
        if new != self.counts[index]:
            self.counts[index] = new
            self.changed = True
        running = any(c[0] or c[1] for c in self.counts)
        if running != self.engines_running:
            self.engines_running = running
            self.changed = True

    def publication(self) -> bytes:
        """The message clients receive, and the end of the current change."""
        self.changed = False
        return msgspec.msgpack.encode((self.counts, self.current_wave, self.engines_running))


async def run_coordinator(
    ctx: zmq.Context[Any],
    *,
    engines: int,
    stats_address: str,
    publish_address: str,
    min_interval_s: float = MIN_INTERVAL_S,
    heartbeat_s: float = HEARTBEAT_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve as the coordinator of ``engines`` engines until cancelled."""
    state = CoordinatorState(engines)
    decoder = MsgpackDecoder(EngineCoreOutputs)
    pull = make_socket(ctx, zmq.PULL)
    publish = make_socket(ctx, zmq.XPUB)
    try:
        pull.bind(stats_address)
        publish.bind(publish_address)
        task_status.started()
        last_publication = -math.inf
        while True:
            with trio.move_on_at(last_publication + heartbeat_s):
                while True:
                    wait_until = last_publication + min_interval_s
                    if state.changed and trio.current_time() >= wait_until:
                        break
                    with trio.move_on_at(wait_until if state.changed else math.inf):
                        for frames in await pull.drain():
                            try:
                                state.update(decoder.decode(frames))
                            except ProtocolError as exc:
                                logger.error("dropping an invalid engine message: %s", exc)
            publish.send_multipart_nowait([state.publication()])
            last_publication = trio.current_time()
    finally:
        pull.close()
        publish.close()

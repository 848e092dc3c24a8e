"""The data-parallel coordinator: engines' request counts and the request wave.

Three sockets, as vLLM 0.33's ``DPCoordinator`` has them:

* **stats** (PULL, bound): engines PUSH ``EngineCoreOutputs`` carrying their
  ``scheduler_stats`` (waiting and running counts, KV-cache usage), ``wave_complete``
  or ``start_wave``;
* **engine publish** (XPUB, bound): engines subscribe (XSUB,
  :data:`~trio_enginecore.protocol.COORDINATOR_SUBSCRIBE`); once all of them have, the
  coordinator sends :data:`~trio_enginecore.protocol.COORDINATOR_READY`, and later
  broadcasts ``[b"\\x02", msgpack((wave, exclude_engine_index))]`` (START_DP_WAVE) when an
  engine asks for a wave to start;
* **publish** (XPUB, bound): front-ends subscribe and receive a
  :class:`~trio_enginecore.protocol.CoordinatorPublication`, ``(counts, current_wave,
  engines_running)``, with ``counts`` one ``[waiting, running, kv_usage]`` per engine:
  when the counts changed, at most every ``min_interval_s``, at once for a new
  subscriber, and at least every ``heartbeat_s``; and at once, with ``counts`` None,
  when the wave or the running state changes. Front-ends send nothing but
  :class:`~trio_enginecore.protocol.ScaleElasticEP`: only engines start waves.

Engines that run no waves (vLLM's dense, non-MoE data parallelism: independent
``EngineCoreProc`` ranks) never send ``start_wave``, so the coordinator never sends them
START_DP_WAVE and publishes wave 0, not running, as vLLM's does for them.

Invalid messages are logged and dropped; nothing a peer sends stops the coordinator.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Final

import attrs
import msgspec
import trio
import zmq

from .._addresses import bind_address
from .._curve import CurveServer
from .._zmq import TrioSocket, make_socket
from ..errors import ProtocolError
from ..protocol import (
    COORDINATOR_READY,
    COORDINATOR_SUBSCRIBE,
    COORDINATOR_UNSUBSCRIBE,
    REPORTS_OWN_WAVES,
    SCALE_ELASTIC_EP,
    CoordinatorPublication,
    EngineCoreOutputs,
    EngineCoreRequestType,
    ScaleElasticEP,
    StartDPWave,
)
from ..serial import MsgpackDecoder

__all__ = ["CoordinatorAddresses", "CoordinatorState", "run_coordinator", "start_wave_frames"]

logger = logging.getLogger("trio_enginecore.coordinator")

MIN_INTERVAL_S: Final = 0.1
HEARTBEAT_S: Final = 4.0
_START_DP_WAVE: Final = EngineCoreRequestType.START_DP_WAVE.value
_IDLE: Final = (0, 0, 0.0)


@attrs.frozen
class CoordinatorAddresses:
    """Where a coordinator listens: the three addresses it binds.

    Attributes:
        stats: engines PUSH their counts and wave reports here.
        engine_publish: engines subscribe here for START_DP_WAVE.
        publish: clients subscribe here for the counts and the wave.
    """

    stats: str
    engine_publish: str
    publish: str

    @classmethod
    def on_host(cls, host: str) -> CoordinatorAddresses:
        """TCP addresses on ``host`` with ports chosen when bound."""
        return cls(
            stats=f"tcp://{host}:*", engine_publish=f"tcp://{host}:*", publish=f"tcp://{host}:*"
        )

    @classmethod
    def in_directory(cls, directory: str) -> CoordinatorAddresses:
        """ipc:// addresses in ``directory`` (which should be private, mode 0700)."""
        return cls(
            stats=f"ipc://{directory}/coordinator-stats",
            engine_publish=f"ipc://{directory}/coordinator-engines",
            publish=f"ipc://{directory}/coordinator-publish",
        )

    def arguments(self) -> list[str]:
        """The ``trio-enginecore coordinator`` flags for these addresses."""
        return [
            "--stats-address",
            self.stats,
            "--engine-publish-address",
            self.engine_publish,
            "--publish-address",
            self.publish,
        ]


def start_wave_frames(start: StartDPWave) -> list[bytes]:
    """The START_DP_WAVE broadcast to engines: ``[b"\\x02", msgpack((wave, exclude))]``."""
    return [_START_DP_WAVE, msgspec.msgpack.encode(start)]


@attrs.define
class CoordinatorState:
    """What the coordinator knows, and the wave rules (pure logic: no I/O).

    vLLM's rules: an engine's ``start_wave`` for a later wave, or for the current one
    while paused, starts that wave on the others; a ``wave_complete`` for the current
    wave (or a later one) ends it. vLLM's rank 0 reports the completion for every rank
    after an all-reduce; reference engines, which announce that they report their own
    (:data:`~trio_enginecore.protocol.REPORTS_OWN_WAVES`), must all report it, so the
    wave ends once rank 0 and every engine that announced itself have.
    """

    engines: int
    counts: list[tuple[int, int, float]] = attrs.field(init=False)
    """``(waiting, running, kv_cache_usage)`` of each engine, by rank."""
    current_wave: int = 0
    engines_running: bool = False
    changed: bool = True
    """The counts changed since the last publication."""
    wave_changed: bool = False
    """The wave or the running state changed since the last publication."""
    _own_reporters: set[int] = attrs.field(init=False, factory=set[int])
    _completed: dict[int, set[int]] = attrs.field(init=False, factory=dict[int, set[int]])

    def __attrs_post_init__(self) -> None:
        self.counts = [_IDLE] * self.engines

    def update(self, message: EngineCoreOutputs) -> StartDPWave | None:
        """Fold one engine's message in.

        Returns the START_DP_WAVE to broadcast to the engines, if any. Messages from
        unknown engines are ignored.
        """
        index = message.engine_index
        if not 0 <= index < self.engines:
            return None
        stats = message.scheduler_stats
        if stats is not None:
            new = (stats.num_waiting_reqs, stats.num_running_reqs, stats.kv_cache_usage)
            if new != self.counts[index]:
                self.counts[index] = new
                self.changed = True
        if message.wave_complete is not None:
            if message.wave_complete == REPORTS_OWN_WAVES:
                self._own_reporters.add(index)
            else:
                self._wave_completed(message.wave_complete, index)
        elif message.start_wave is not None:
            wave = message.start_wave
            if wave > self.current_wave or (wave == self.current_wave and not self.engines_running):
                self.current_wave = wave
                self.engines_running = True
                self.wave_changed = True
                return StartDPWave(wave, index)
        return None

    def scale(self, engines: int) -> None:
        """A front-end says the group now has ``engines`` engines (elastic EP)."""
        if engines < 1:
            raise ValueError(f"a group needs at least one engine, got {engines}")
        self.counts = (self.counts + [_IDLE] * engines)[:engines]
        self.engines = engines
        self._own_reporters = {rank for rank in self._own_reporters if rank < engines}
        self.changed = True

    def publication(self) -> bytes:
        """The counts and wave for front-ends; the end of the current changes."""
        self.changed = self.wave_changed = False
        return msgspec.msgpack.encode(
            CoordinatorPublication(self.counts, self.current_wave, self.engines_running)
        )

    def wave_publication(self) -> bytes:
        """The wave and running state alone (``counts`` None), sent at once when they
        change, as vLLM's coordinator does; the end of the wave change."""
        self.wave_changed = False
        return msgspec.msgpack.encode(
            CoordinatorPublication(None, self.current_wave, self.engines_running)
        )

    def _wave_completed(self, wave: int, engine: int) -> None:
        if wave < self.current_wave:
            return  # a wave that has ended (or been overtaken) already
        done = self._completed.setdefault(wave, set())
        done.add(engine)
        waiting_for = self._own_reporters | {0}
        if not waiting_for <= done:
            return
        self.current_wave = wave + 1
        self.engines_running = False
        self.wave_changed = True
        for old in [w for w in self._completed if w <= wave]:
            del self._completed[old]


async def run_coordinator(
    ctx: zmq.Context[Any],
    *,
    engines: int,
    addresses: CoordinatorAddresses,
    min_interval_s: float = MIN_INTERVAL_S,
    heartbeat_s: float = HEARTBEAT_S,
    curve: CurveServer | None = None,
    task_status: trio.TaskStatus[CoordinatorAddresses] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve as the coordinator of ``engines`` engines until cancelled.

    Binds ``addresses``, then reports started with the addresses actually bound (a
    ``tcp://HOST:*`` address comes back with its port). With ``curve``, every TCP socket
    is a CURVE server (a ZAP handler must be running in ``ctx``).

    Raises:
        AddressError: an address could not be bound (in use, malformed, an interface
            this host does not have), before started is reported.
    """
    state = CoordinatorState(engines)
    stats = make_socket(ctx, zmq.PULL)
    engine_publish = make_socket(ctx, zmq.XPUB)
    publish = make_socket(ctx, zmq.XPUB)
    # Every subscription must reach us (the READY barrier counts them; a new client is
    # sent the state at once), not only the first one for a topic.
    engine_publish.raw.setsockopt(zmq.XPUB_VERBOSE, 1)
    publish.raw.setsockopt(zmq.XPUB_VERBOSE, 1)
    changed = trio.Event()

    def broadcast(start: StartDPWave | None) -> None:
        if start is None:
            return
        logger.debug(
            "starting wave %d (excluding engine %s)", start.wave, start.exclude_engine_index
        )
        engine_publish.send_multipart_nowait(start_wave_frames(start))
        changed.set()

    async def engine_messages() -> None:
        decoder = MsgpackDecoder(EngineCoreOutputs)
        while True:
            for frames in await stats.drain():
                try:
                    message = decoder.decode(frames)
                except ProtocolError as exc:
                    logger.error("dropping an invalid engine message: %s", exc)
                    continue
                broadcast(state.update(message))
                if state.wave_changed:
                    logger.debug(
                        "wave %d, engines %s",
                        state.current_wave,
                        "running" if state.engines_running else "paused",
                    )
                    publish.send_multipart_nowait([state.wave_publication()])
                if state.changed:
                    changed.set()

    async def engine_subscriptions() -> None:
        subscribed = 0
        while True:
            frames = await engine_publish.recv_multipart()
            if bytes(frames[0])[:1] != COORDINATOR_SUBSCRIBE:
                continue
            subscribed += 1
            # vLLM's engines wait for READY until every engine has subscribed; one that
            # subscribes later (a restart) is told at once.
            if subscribed >= engines:
                engine_publish.send_multipart_nowait([COORDINATOR_READY])

    async def client_messages() -> None:
        decoder = MsgpackDecoder(ScaleElasticEP)
        while True:
            frames = await publish.recv_multipart()
            message = bytes(frames[0])
            if message[:1] in (COORDINATOR_SUBSCRIBE, COORDINATOR_UNSUBSCRIBE):
                if message[:1] == COORDINATOR_SUBSCRIBE:
                    state.changed = True
                    changed.set()
                continue
            try:
                scale = decoder.decode([message])
                if scale.tag != SCALE_ELASTIC_EP:
                    raise ProtocolError(f"unknown front-end message {scale.tag!r}")
                state.scale(scale.new_engine_count)
            except (ProtocolError, ValueError) as exc:
                logger.error("dropping an invalid front-end message: %s", exc)
                continue
            logger.info("the group now has %d engines", state.engines)
            changed.set()

    async def publisher() -> None:
        nonlocal changed
        last = -math.inf
        while True:
            with trio.move_on_at(last + heartbeat_s):
                await changed.wait()
                await trio.sleep_until(last + min_interval_s)
            changed = trio.Event()
            publish.send_multipart_nowait([state.publication()])
            last = trio.current_time()

    sockets: list[TrioSocket] = [stats, engine_publish, publish]
    try:
        if curve is not None:
            for sock, address in zip(
                sockets, (addresses.stats, addresses.engine_publish, addresses.publish), strict=True
            ):
                if address.startswith("tcp://"):
                    curve.apply(sock)
        bound = CoordinatorAddresses(
            stats=bind_address(stats, addresses.stats, role="coordinator stats"),
            engine_publish=bind_address(
                engine_publish, addresses.engine_publish, role="coordinator engine publish"
            ),
            publish=bind_address(publish, addresses.publish, role="coordinator publish"),
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine_messages)
            nursery.start_soon(engine_subscriptions)
            nursery.start_soon(client_messages)
            nursery.start_soon(publisher)
            task_status.started(bound)
    finally:
        for sock in sockets:
            sock.close()

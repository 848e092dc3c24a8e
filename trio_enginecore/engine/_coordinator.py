"""The data-parallel coordinator: engines' request counts and the request wave.

Three sockets, as vLLM's coordinator has them:

* **stats** (PULL, bound): engines PUSH ``EngineCoreOutputs`` carrying their
  ``scheduler_stats`` (waiting and running counts, KV-cache usage), ``wave_complete``
  or ``start_wave``;
* **engine publish** (XPUB, bound): engines subscribe (XSUB, ``b"\\x01"``); once all
  of them have, the coordinator sends ``b"READY"``, and later broadcasts
  ``[b"\\x02", msgpack((wave, exclude_engine_index))]`` (START_DP_WAVE);
* **publish** (XPUB, bound): clients subscribe and receive
  ``msgpack((counts, current_wave, engines_running))`` with ``counts`` one
  ``[waiting, running, kv_usage]`` per engine: when something changed, at most every
  ``min_interval_s``, at once for a new subscriber, and at least every ``heartbeat_s``.
  A client that sends a request while the engines are paused also sends
  ``msgpack((engine_index, wave))`` upstream on this socket, and the coordinator
  starts a wave on the other engines.

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
from ..protocol import EngineCoreOutputs, EngineCoreRequestType, StartDPWave
from ..serial import MsgpackDecoder

__all__ = ["COORDINATOR_READY", "CoordinatorAddresses", "CoordinatorState", "run_coordinator"]

logger = logging.getLogger("trio_enginecore.coordinator")

MIN_INTERVAL_S: Final = 0.1
HEARTBEAT_S: Final = 4.0
COORDINATOR_READY: Final = b"READY"
"""What the coordinator sends engines once they have all subscribed."""
_SUBSCRIBE: Final = b"\x01"
_UNSUBSCRIBE: Final = b"\x00"
_START_DP_WAVE: Final = EngineCoreRequestType.START_DP_WAVE.value


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


@attrs.define
class CoordinatorState:
    """What the coordinator knows, and the wave rules (pure logic: no I/O).

    The wave ends when every engine has reported it complete: the reference engines
    report their own completion, where vLLM's rank 0 reports for all after an
    all-reduce (see :mod:`trio_enginecore.engine._waves`).
    """

    engines: int
    counts: list[list[float]] = attrs.field(init=False)
    current_wave: int = 0
    engines_running: bool = False
    changed: bool = True
    _completed: dict[int, set[int]] = attrs.field(init=False, factory=dict[int, set[int]])

    def __attrs_post_init__(self) -> None:
        self.counts = [[0, 0, 0.0] for _ in range(self.engines)]

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
            new = [stats.num_waiting_reqs, stats.num_running_reqs, stats.kv_cache_usage]
            if new != self.counts[index]:
                self.counts[index] = new
                self.changed = True
        if message.wave_complete is not None:
            self._wave_completed(message.wave_complete, index)
        elif message.start_wave is not None:
            wave = message.start_wave
            # The engine got a request stamped with a finished wave while paused: the
            # other engines must run too.
            if wave > self.current_wave or (wave == self.current_wave and not self.engines_running):
                self._start(wave)
                return StartDPWave(wave, index)
        return None

    def client_request(self, engine_index: int, wave: int) -> StartDPWave | None:
        """A client sent a request to ``engine_index`` believing the engines paused.

        Returns the START_DP_WAVE to broadcast, if the engines are indeed paused.
        """
        if self.engines_running:
            return None
        # A client behind on waves stamped its request with a finished wave: the engine
        # that has it must be told as well.
        exclude = engine_index if wave >= self.current_wave else None
        self._start(self.current_wave)
        return StartDPWave(self.current_wave, exclude)

    def publication(self) -> bytes:
        """The message clients receive, and the end of the current change."""
        self.changed = False
        return msgspec.msgpack.encode((self.counts, self.current_wave, self.engines_running))

    def _start(self, wave: int) -> None:
        self.current_wave = wave
        self.engines_running = True
        self.changed = True

    def _wave_completed(self, wave: int, engine: int) -> None:
        if wave < self.current_wave:
            return  # a wave that has ended (or been overtaken) already
        done = self._completed.setdefault(wave, set())
        done.add(engine)
        if len(done) < self.engines:
            return
        self.current_wave = wave + 1
        self.engines_running = False
        self.changed = True
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
        engine_publish.send_multipart_nowait(
            [_START_DP_WAVE, msgspec.msgpack.encode((start.wave, start.exclude_engine_index))]
        )
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
                if state.changed:
                    changed.set()

    async def engine_subscriptions() -> None:
        subscribed = 0
        while True:
            frames = await engine_publish.recv_multipart()
            if bytes(frames[0])[:1] != _SUBSCRIBE:
                continue
            subscribed += 1
            # vLLM's engines wait for READY until every engine has subscribed; one that
            # subscribes later (a restart) is told at once.
            if subscribed >= engines:
                engine_publish.send_multipart_nowait([COORDINATOR_READY])

    async def client_messages() -> None:
        while True:
            frames = await publish.recv_multipart()
            message = bytes(frames[0])
            if message[:1] in (_SUBSCRIBE, _UNSUBSCRIBE):
                if message[:1] == _SUBSCRIBE:
                    state.changed = True
                    changed.set()
                continue
            try:
                engine_index, wave = msgspec.msgpack.decode(message)
                start = state.client_request(int(engine_index), int(wave))
            except (msgspec.DecodeError, TypeError, ValueError) as exc:
                logger.error("dropping an invalid client message: %s", exc)
                continue
            broadcast(start)

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

"""The coordinator's sockets: :func:`serve_coordinator`, a Trio task."""

from __future__ import annotations

import logging
import math
from typing import Any

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
    EngineCoreOutputs,
    ScaleElasticEP,
    StartDPWave,
)
from ..serial import MsgpackDecoder
from ._addresses import CoordinatorAddresses
from ._state import CoordinatorState, start_wave_frames

__all__ = ["serve_coordinator"]

logger = logging.getLogger("trio_enginecore.coordinator")


async def serve_coordinator(
    ctx: zmq.Context[Any],
    *,
    engines: int,
    addresses: CoordinatorAddresses,
    min_interval_s: float = 0.1,
    heartbeat_s: float = 4.0,
    curve: CurveServer | None = None,
    task_status: trio.TaskStatus[CoordinatorAddresses] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve as the coordinator of ``engines`` engines until cancelled.

    Binds ``addresses``, then reports started with the addresses actually bound (a
    ``tcp://HOST:*`` address comes back with its port):
    ``bound = await nursery.start(partial(serve_coordinator, ctx, engines=2,
    addresses=...))``. With ``curve``, every TCP socket is a CURVE server (a ZAP
    handler must be running in ``ctx``). :func:`~trio_enginecore.open_coordinator`
    does all of this for you.

    Front-ends are sent the counts when they changed, at most every
    ``min_interval_s`` seconds, and at least every ``heartbeat_s`` seconds.

    Invalid messages are logged and dropped; nothing a peer sends stops the
    coordinator.

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
        while True:
            frames = await engine_publish.recv_multipart()
            if bytes(frames[0])[:1] != COORDINATOR_SUBSCRIBE:
                continue
            if state.engine_subscribed():
                engine_publish.send_multipart_nowait([COORDINATOR_READY])

    async def client_messages() -> None:
        decoder = MsgpackDecoder(ScaleElasticEP)
        while True:
            frames = await publish.recv_multipart()
            message = bytes(frames[0])
            if message[:1] in (COORDINATOR_SUBSCRIBE, COORDINATOR_UNSUBSCRIBE):
                if message[:1] == COORDINATOR_SUBSCRIBE:
                    state.frontend_subscribed()
                    changed.set()
                continue
            try:
                scale = decoder.decode([message])
            except ProtocolError as exc:
                logger.error("dropping an invalid front-end message: %s", exc)
                continue
            state.scale(scale.new_engine_count)
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

"""The client side of the startup: the handshake, the ready messages, and what a
startup that failed tells the user.

vLLM's startup, as engines see it: each engine connects a DEALER to the client's
handshake ROUTER and says HELLO; the client answers with the addresses of its input
and output sockets (and of the coordinator); the engine loads its model, connects
there, sends its ready message on the input socket and says READY on the handshake
socket. Attached engines skip the handshake: they were given the addresses and only
send the ready message. :class:`StartupProgress` runs those exchanges and remembers
how far each engine got, so that a startup that fails or times out names, per engine,
what it is still waiting for.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import final

import msgspec
import zmq

from ..._zmq import Frames, TrioSocket
from ...config import EngineConfig
from ...coordinator import CoordinatorAddresses
from ...dialects import DialectChoice, choose_dialect, choose_group_dialects
from ...errors import EngineStartupError, ProtocolError
from ...protocol import (
    EngineCoreReadyResponse,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeHello,
    HandshakeMessage,
    HandshakeReady,
)
from ...serial import Buffer, MsgpackDecoder
from .._core._engines import EngineHandle
from ._launch import LaunchedProcesses
from ._remote import RemoteEngines

__all__ = [
    "EngineDialects",
    "ReadyDecoder",
    "StartupProgress",
    "group_hint",
    "handshake_metadata",
]

logger = logging.getLogger("trio_enginecore.client")


def handshake_metadata(
    config: EngineConfig,
    remote: RemoteEngines | None,
    coordinator: CoordinatorAddresses | None,
    input_address: str,
    output_address: str,
) -> EngineHandshakeMetadata:
    """The client's answer to every HELLO: where to connect, and the group's settings."""
    group = remote.group_parallel_config(config.data_parallel_size) if remote is not None else {}
    fields = (
        {}
        if coordinator is None
        else {
            "coordinator_input": coordinator.engine_publish,
            "coordinator_output": coordinator.stats,
            "frontend_stats_publish_address": coordinator.publish,
        }
    )
    return EngineHandshakeMetadata(
        addresses=EngineZmqAddresses(inputs=[input_address], outputs=[output_address], **fields),
        parallel_config=group,
    )


def group_hint(config: EngineConfig, remote: RemoteEngines | None) -> str | None:
    """Why a data-parallel group may not form, for a startup error (None: no group)."""
    if config.data_parallel_size <= 1:
        return None
    if remote is not None and remote.data_parallel_master_ip is None:
        return (
            " (vLLM MoE ranks started by separate launchers meet only where the client "
            "tells them: RemoteEngines(data_parallel_master_ip=...))"
        )
    return ""


def _handshake_decoder() -> MsgpackDecoder[HandshakeHello | HandshakeReady]:
    return MsgpackDecoder(HandshakeMessage)


@final
class StartupProgress:
    """How far each engine got in the startup (see the module docstring).

    Args:
        engines: every engine the client waits for.
        input_address: where ready messages arrive (for the error messages).
        handshake_address: where engines say HELLO; None for attached engines.
    """

    def __init__(
        self, engines: list[EngineHandle], input_address: str, handshake_address: str | None
    ) -> None:
        self.engines = engines
        self.input_address = input_address
        self.handshake_address = handshake_address
        self.dialects = EngineDialects()
        """Chooses the engines' dialects from their ready messages (the client's: an
        engine that restarts is given its dialect by the same one)."""
        self.hellos: set[bytes] = set()
        self.handshake_ready: set[bytes] = set()
        self.ready_messages: set[bytes] = set()

    # ------------------------------------------------------------ the exchanges

    async def handshake(self, sock: TrioSocket, metadata: Sequence[Buffer]) -> None:
        """Answer each engine's HELLO with ``metadata`` (the encoded addresses).

        Raises:
            EngineStartupError: an engine sent a message that does not decode.
        """
        decoder = _handshake_decoder()
        waiting = {engine.identity: engine for engine in self.engines}
        while waiting:
            identity, *payload = await sock.recv_multipart()
            try:
                message = decoder.decode(payload)
            except ProtocolError as exc:
                raise EngineStartupError(
                    f"invalid handshake message from {identity!r}: {exc}"
                ) from exc
            if isinstance(message, HandshakeReady):
                # A fast engine can be READY before a slower one has said HELLO.
                self._handshake_ready(bytes(identity))
                continue
            engine = waiting.pop(bytes(identity), None)
            if engine is None:
                logger.warning("ignoring a HELLO from unexpected identity %r", identity)
                continue
            self.hellos.add(engine.identity)
            logger.debug(
                "handshake: engine rank %d said HELLO; sending it the addresses", engine.rank
            )
            await sock.send_multipart([engine.identity, *metadata])

    async def wait_handshake_ready(self, sock: TrioSocket) -> None:
        """Wait for every engine's READY on the handshake socket."""
        decoder = _handshake_decoder()
        waiting = {engine.identity for engine in self.engines} - self.handshake_ready
        while waiting:
            identity, *payload = await sock.recv_multipart()
            message = decoder.decode(payload)
            if isinstance(message, HandshakeReady):
                waiting.discard(bytes(identity))
                self._handshake_ready(bytes(identity))

    def note_queued_readies(self, sock: TrioSocket) -> None:
        """Record the READYs already queued on the handshake socket (unread when the
        startup stops early), so that a startup error says how far each engine got."""
        decoder = _handshake_decoder()
        while not sock.closed:
            try:
                identity, *payload = sock.raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            with suppress(ProtocolError):
                if isinstance(decoder.decode(payload), HandshakeReady):
                    self.handshake_ready.add(bytes(identity))

    async def wait_ready(
        self,
        next_ready: Callable[[], Awaitable[tuple[Frames, int]]],
        came_on: Callable[[int, EngineHandle], None] | None = None,
    ) -> None:
        """Wait for every engine's ready message (``next_ready()``: the message pipe's
        :meth:`~._pipe.MessagePipe.next_ready`), keeping each engine's decoded
        :class:`EngineCoreReadyResponse` (an empty one is allowed); ``came_on(fd,
        engine)`` says which connection each came on.

        Raises:
            EngineStartupError: a ready message does not decode.
        """
        decoder = ReadyDecoder()
        waiting = {engine.identity: engine for engine in self.engines}
        while waiting:
            frames, fd = await next_ready()
            if len(frames) != 2:
                logger.warning("ignoring a %d-frame message on the input socket", len(frames))
                continue
            identity, payload = bytes(frames[0]), frames[1]
            engine = waiting.pop(identity, None)
            if engine is None:
                logger.warning("ignoring a ready message from unexpected identity %r", identity)
                continue
            self.ready_messages.add(identity)
            if came_on is not None:
                came_on(fd, engine)
            if len(payload):
                try:
                    decoder.decode_into(engine, payload)
                except ProtocolError as exc:
                    raise EngineStartupError(
                        f"{engine.describe()} sent an invalid ready message: {exc}"
                    ) from exc
            logger.debug("%s is ready", engine.describe())
        self.dialects.settle(self.engines)

    def _handshake_ready(self, identity: bytes) -> None:
        self.handshake_ready.add(identity)
        logger.debug("handshake: engine rank %d reported READY", int.from_bytes(identity, "little"))

    # ---------------------------------------------------------- failed startups

    async def error(
        self,
        timeout_s: float,
        processes: LaunchedProcesses,
        *,
        timed_out: bool,
        waits_for_coordinator: bool,
        group_hint: str | None,
        refusals: str | None,
    ) -> EngineStartupError:
        """The error of a startup that failed or timed out, naming each engine's stage.

        Args:
            timeout_s: the ready timeout.
            processes: the engines the client launched (how they ended).
            timed_out: it timed out (else it was stopped by an engine's death).
            waits_for_coordinator: the engines subscribe to a coordinator first.
            group_hint: why a data-parallel group may not form, or None if the
                engines form no group.
            refusals: the connections refused for lack of a CURVE key, described.
        """
        details: list[str] = []
        for engine in self.engines:
            if engine.identity in self.ready_messages and engine.alive:
                continue
            launched = processes.get(engine)
            exited = launched is not None and launched.exited
            if launched is not None and exited:
                await launched.wait_stderr(1)
            if not engine.alive or exited:
                details.append(processes.describe_exit(engine))
            else:
                stage = self._stage(
                    engine, waits_for_coordinator, group_hint, remote=launched is None
                )
                details.append(stage)
        if refusals:
            details.append(refusals)
        what = f"not ready within {timeout_s:g} s" if timed_out else "failed to start"
        return EngineStartupError(f"engine {what}: " + " | ".join(details))

    def _stage(
        self,
        engine: EngineHandle,
        waits_for_coordinator: bool,
        group_hint: str | None,
        *,
        remote: bool,
    ) -> str:
        """How far a live engine got in the startup, and what it is waiting for."""
        name = f"engine rank {engine.rank}"
        if self.handshake_address is None:  # attached: no handshake
            return (
                f"{name} never sent its ready message: no engine with its identity "
                f"connected to the input address {self.input_address} (is it running, "
                "and given this address?)"
            )
        if engine.identity not in self.hellos:
            where = "(remote) " if remote else ""
            return (
                f"{name} {where}never said HELLO at {self.handshake_address} (still "
                "starting, or it cannot reach that address)"
            )
        if engine.identity not in self.handshake_ready:
            waiting = ["loading its model and sizing its KV cache"]
            if waits_for_coordinator:
                waiting.append("for every rank of its group to subscribe to the coordinator")
            if group_hint is not None:
                waiting.append(f"for its data-parallel group to form{group_hint}")
            return f"{name} said HELLO but never READY: still " + ", or ".join(waiting)
        return (
            f"{name} said READY in the handshake but its ready message never arrived at "
            f"the input address {self.input_address} (it could not connect there)"
        )


@final
class ReadyDecoder:
    """Decodes ready messages into an engine's record: the message, and the keys it
    had (the decoded struct fills in the keys a release does not send, and the keys
    are how a release is recognised when an engine's version names none)."""

    def __init__(self) -> None:
        self._ready = MsgpackDecoder(EngineCoreReadyResponse)
        self._keys = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])

    def decode_into(self, engine: EngineHandle, payload: Buffer) -> None:
        """Set ``engine.ready`` and ``engine.ready_keys`` from ``payload``; both are
        unchanged if it does not decode.

        Raises:
            ProtocolError: it is not a ready message.
        """
        ready = self._ready.decode(payload)
        try:
            keys = frozenset(self._keys.decode(payload))
        except msgspec.DecodeError as exc:  # a map already: not expected
            raise ProtocolError(f"invalid ready message: {exc}") from exc
        engine.ready, engine.ready_keys = ready, keys


@final
class EngineDialects:
    """Gives each engine of one client the dialect of the vLLM release its ready
    message names, or, if its version names none (``"dev"``), whose keys its ready
    message has; and logs what it had to guess once per client (an untested
    release, a version that names no release), however many engines it concerns
    and however often they restart."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def settle(self, engines: Sequence[EngineHandle]) -> None:
        """Give the engines of a startup their dialects (those that sent an empty
        ready message keep the oldest).

        Raises:
            EngineStartupError: an engine's release is older than every supported
                one, its version names no release and its ready message has the
                keys of none, or the engines run different releases (the message
                names them).
        """
        ready = [engine for engine in engines if engine.ready is not None]
        announced = [(engine.describe(), _version(engine), engine.ready_keys) for engine in ready]
        if not announced:
            return
        try:
            choices = choose_group_dialects(announced)
        except ValueError as exc:
            raise EngineStartupError(f"engines refused: {exc}") from None
        self._warn(choices)
        for engine, choice in zip(ready, choices, strict=True):
            engine.dialect = choice.dialect

    def adopt(self, engine: EngineHandle) -> None:
        """Give an engine that restarted or re-attached the dialect of its (new)
        ready message; it is sent its own release's form even if that changed
        (logged)."""
        if engine.ready is None:
            return
        try:
            choice = choose_dialect(_version(engine), engine.ready_keys)
        except ValueError as exc:
            logger.error("%s came back unsupported: %s", engine.describe(), exc)
            return
        self._warn([choice])
        if choice.dialect != engine.dialect:
            logger.warning(
                "%s came back as %s (was %s): sending it that release's form",
                engine.describe(),
                choice.describe(),
                engine.dialect.name,
            )
        engine.dialect = choice.dialect

    def _warn(self, choices: Sequence[DialectChoice]) -> None:
        warnings = [
            warning
            for warning in dict.fromkeys(choice.warning() for choice in choices)
            if warning is not None and warning not in self._warned
        ]
        if warnings:
            self._warned.update(warnings)
            logger.warning("%s", "; ".join(warnings))


def _version(engine: EngineHandle) -> str:
    assert engine.ready is not None
    return engine.ready.vllm_version

"""What the engine does with one input message (pure logic: no I/O).

:class:`RequestIntake` decodes a message a client (or the coordinator) sent and applies
it to the :class:`~trio_enginecore.engine.EngineCore` at once, synchronously. It
decides:

* that nothing a client sends can kill the engine: a malformed message is logged and,
  where the protocol has a place for an error (an ADD's output, a UTILITY's reply),
  answered with one, naming the request or call when its id can be read at all;
* that a draining engine refuses new requests (each gets an error output);
* which data-parallel wave a request moves the engine to, and whether the coordinator
  must be asked to start one (:meth:`RequestIntake.take_start_wave`).
"""

from __future__ import annotations

import logging
from typing import Any, Final

import msgspec

from .._zmq import Frames
from ..errors import ProtocolError
from ..protocol import EngineCoreRequest, EngineCoreRequestType, StartDPWave, UtilityRequest
from ..serial import MsgpackDecoder
from ._core import EngineCore
from ._waves import EngineWaveState

__all__ = ["RequestIntake"]

logger = logging.getLogger("trio_enginecore.engine")


def _position(struct: type[msgspec.Struct], field: str) -> int:
    """Where ``field`` sits in the wire array of an ``array_like`` Struct."""
    return struct.__struct_fields__.index(field)


_REQUEST_ID_AT: Final = _position(EngineCoreRequest, "request_id")
_REQUEST_CLIENT_AT: Final = _position(EngineCoreRequest, "client_index")
_CALL_ID_AT: Final = _position(UtilityRequest, "call_id")
_CALL_CLIENT_AT: Final = _position(UtilityRequest, "client_index")


class RequestIntake:
    """Applies input messages to ``core`` (see the module docstring).

    Args:
        core: the core the messages are applied to.
        waves: the engine's side of the data-parallel waves.
    """

    def __init__(self, core: EngineCore, waves: EngineWaveState) -> None:
        self.core = core
        self.waves = waves
        self.draining = False
        """Refuse new requests (the engine is shutting down)."""
        self._start_wave: int | None = None
        self._request_decoder = MsgpackDecoder(EngineCoreRequest)
        self._abort_decoder = MsgpackDecoder(list[str])
        self._utility_decoder = MsgpackDecoder(UtilityRequest)
        self._wave_decoder = MsgpackDecoder(StartDPWave)
        self._generic_decoder = MsgpackDecoder()

    def take_start_wave(self) -> int | None:
        """The wave the coordinator must be asked to start, once; or None."""
        start, self._start_wave = self._start_wave, None
        return start

    def apply(self, frames: Frames) -> None:
        """Decode one message (type frame + payload) and apply it to the core."""
        if len(frames) < 2:
            logger.error("dropping a %d-frame input message: expected type + payload", len(frames))
            return
        type_frame = bytes(frames[0])
        payload = frames[1:]
        try:
            request_type = EngineCoreRequestType(type_frame)
        except ValueError:
            logger.error("dropping a message with unknown request type %r", type_frame)
            return
        if request_type is EngineCoreRequestType.ADD:
            self._add(payload)
        elif request_type is EngineCoreRequestType.ABORT:
            try:
                request_ids = self._abort_decoder.decode(payload)
            except ProtocolError as exc:
                logger.error("dropping an invalid ABORT: %s", exc)
            else:
                logger.debug("ABORT of %d request(s)", len(request_ids))
                self.core.abort_requests(request_ids)
        elif request_type is EngineCoreRequestType.UTILITY:
            self._utility(payload)
        elif request_type is EngineCoreRequestType.START_DP_WAVE:
            try:
                start = self._wave_decoder.decode(payload)
            except ProtocolError as exc:
                logger.error("dropping an invalid START_DP_WAVE: %s", exc)
            else:
                self.waves.on_start_wave(start.wave, start.exclude_engine_index)
        else:
            logger.error("dropping an engine-internal request type %s from the wire", request_type)

    def _add(self, payload: Frames) -> None:
        try:
            request = self._request_decoder.decode(payload)
        except ProtocolError as exc:
            logger.error("invalid ADD: %s", exc)
            request_id, client_index = self._salvage_ids(
                payload, id_at=_REQUEST_ID_AT, client_at=_REQUEST_CLIENT_AT
            )
            if isinstance(request_id, str) and request_id:
                self.core.reject(request_id, client_index, f"invalid request: {exc}")
            return
        if self.draining:
            self.core.reject(
                request.request_id, request.client_index, "the engine is shutting down"
            )
            return
        start = self.waves.on_request(request.current_wave)
        if start is not None:
            self._start_wave = start
        # Decoded by the typed decoder: its fields are checked already.
        self.core.add_request(request, decoded=True)

    def _utility(self, payload: Frames) -> None:
        try:
            call = self._utility_decoder.decode(payload)
        except ProtocolError as exc:
            logger.error("invalid UTILITY: %s", exc)
            call_id, client_index = self._salvage_ids(
                payload, id_at=_CALL_ID_AT, client_at=_CALL_CLIENT_AT
            )
            if isinstance(call_id, int):
                self.core.reply_failure(client_index, call_id, "?", f"invalid call: {exc}")
            return
        self.core.call_utility(call.client_index, call.call_id, call.method, call.args)

    def _salvage_ids(self, payload: Frames, *, id_at: int, client_at: int) -> tuple[Any, int]:
        """Best-effort read of an invalid message's id and client index, so its sender
        gets an error; client 0 when the index cannot be read."""
        try:
            generic = self._generic_decoder.decode(payload)
        except ProtocolError:
            return None, 0
        if not isinstance(generic, list) or len(generic) <= id_at:  # pyright: ignore[reportUnknownArgumentType]
            return None, 0
        items: list[Any] = generic  # pyright: ignore[reportUnknownVariableType]
        client = items[client_at] if len(items) > client_at else 0
        return items[id_at], client if type(client) is int else 0

"""The ZeroMQ message pipe: vLLM's data path between a client and its engines.

One ROUTER socket carries requests to every engine (addressed by its identity) and
brings their ready messages; one PULL socket brings their other messages back, fed to
the client's state by the receive task (:mod:`._receive`), which loses nothing to
cancellation. Sends are non-blocking multipart sends from the caller's task (atomic; a
ROUTER with no high-water mark never refuses one).

:class:`ZmqPipe` is a :class:`~._pipe.MessagePipe`: the engine group (:mod:`._group`)
makes it when it starts and runs the lifecycle around it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import final

import trio
import zmq

from ..._listeners import ListenerFd, bind_all
from ..._zmq import Frames, TrioSocket
from ...errors import EngineCoreError
from ...protocol import EngineCoreOutputs
from ...serial import Buffer, MsgpackDecoder, MsgpackEncoder
from .._core._engines import EngineHandle
from .._core._state import ClientState
from ._pipe import ServerSockets
from ._receive import receive_outputs

__all__ = ["ZmqPipe"]

logger = logging.getLogger("trio_enginecore.client")


@final
class ZmqPipe:
    """The client's input ROUTER and output PULL sockets (see the module docstring).

    Args:
        server_socket: makes the sockets, in the engine group's context.
    """

    def __init__(self, server_socket: ServerSockets) -> None:
        self._input = server_socket(zmq.ROUTER)
        self._output = server_socket(zmq.PULL)
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)

    @property
    def connection_socket(self) -> TrioSocket:
        """The input ROUTER: each engine connects to it once, and sends its ready
        message on that connection."""
        return self._input

    def bind(
        self, input_address: str | ListenerFd, output_address: str | ListenerFd
    ) -> tuple[str, str]:
        # Checks any listener descriptors before binding either socket (_listeners.py).
        bound_input, bound_output = bind_all(
            [
                (self._input, input_address, "client input, ROUTER"),
                (self._output, output_address, "client output, PULL"),
            ]
        )
        logger.debug(
            "bound the input ROUTER at %s and the output PULL at %s", bound_input, bound_output
        )
        return bound_input, bound_output

    def send(
        self,
        engine: EngineHandle,
        kind: bytes,
        message: object,
    ) -> None:
        frames: list[Buffer] = [engine.identity, kind, *self._encoder.encode(message)]
        try:
            self._input.send_multipart_nowait(frames)
        except trio.WouldBlock:  # pragma: no cover - a ROUTER with HWM 0 never blocks
            raise EngineCoreError("the input socket refused a message") from None

    async def next_ready(self) -> tuple[Frames, int]:
        """The next message on the input ROUTER, and the connection it came on
        (cancellation loses nothing: see ``TrioSocket.recv_multipart_with_source``)."""
        return await self._input.recv_multipart_with_source()

    async def receive(self, state: ClientState, reported_dead: Callable[[], None]) -> None:
        """The receive task on the output PULL socket (:func:`~._receive.receive_outputs`)."""
        await receive_outputs(self._output, state, self._decoder, reported_dead)

    def close(self) -> None:
        for sock in (self._input, self._output):
            sock.close(linger=0)

"""What an engine group needs from the data path its messages travel by.

The engine group (:mod:`._group`) decides everything about the engines' lifecycle:
where they are, launching them, the handshake, the coordinator, liveness, restarts.
How requests reach the engines and their messages come back is a
:class:`MessagePipe`, made by the group when it starts: ZeroMQ sockets
(:class:`~._zmq_pipe.ZmqPipe`, vLLM's own data path), or another (shared memory,
say) in a file of its own, reusing the whole lifecycle and its tests.

The control plane (the handshake, the coordinator, CURVE admission) stays ZeroMQ and
the group's: a pipe is given :data:`ServerSockets` to make the sockets engines connect
to, so that they share the group's context (and its CURVE handler).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..._listeners import ListenerFd
from ..._zmq import Frames, TrioSocket
from .._core._engines import EngineHandle
from .._core._state import ClientState

__all__ = ["MessagePipe", "PipeFactory", "ServerSockets"]

ServerSockets = Callable[[int], TrioSocket]
"""Makes a socket of a ZeroMQ type engines connect to, in the group's context (a
CURVE server when the group uses CURVE)."""


class MessagePipe(Protocol):
    """The data path between a client and its engines (see the module docstring).

    Made before anything is bound; :meth:`bind` is called once, then the other
    members, until :meth:`close`.
    """

    @property
    def connection_socket(self) -> TrioSocket | None:
        """The socket the engines' connections come in on, for the group's watch of
        them (set up before :meth:`bind`, under heartbeats); None if the pipe has no
        connections to watch."""
        ...

    def bind(
        self, input_address: str | ListenerFd, output_address: str | ListenerFd
    ) -> tuple[str, str]:
        """Bind where engines send from and receive on; the bound addresses (given to
        the engines in the handshake).

        Raises:
            AddressError: an address that cannot be bound (the error names the
                socket).
        """
        ...

    def send(self, engine: EngineHandle, kind: bytes, message: object) -> None:
        """Send one request of type ``kind`` (ADD, ABORT or UTILITY) to ``engine``:
        ``message`` is what to encode (an ``EngineCoreRequest`` in the engine's dialect,
        the request ids of an ABORT, a ``UtilityRequest``). No checkpoint; never
        blocks.

        Raises:
            EngineCoreError: the pipe refused the message (never, with ZeroMQ).
        """
        ...

    async def next_ready(self) -> tuple[Frames, int]:
        """The next message engines send on the input side (their ready messages: the
        identity frame and the payload), with the connection it came on. Only one task
        waits at a time: the startup's, then the group's input watch. Cancellation
        loses nothing.

        Raises:
            trio.ClosedResourceError: the pipe was closed.
        """
        ...

    async def receive(self, state: ClientState, reported_dead: Callable[[], None]) -> None:
        """The receive task: feed ``state`` every engine message until the pipe is
        closed with the client; ``reported_dead()`` for each ENGINE_CORE_DEAD.
        Cancellation loses no message.

        Raises:
            trio.ClosedResourceError: the pipe was closed while the client is open.
        """
        ...

    def close(self) -> None:
        """Release what the pipe holds (at once: no linger). Idempotent."""
        ...


PipeFactory = Callable[[ServerSockets], MessagePipe]
"""How an engine group makes its pipe when it starts (``ZmqPipe`` is one)."""

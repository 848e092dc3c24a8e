"""A TCP proxy between an engine and its client, to break the path between them.

:class:`FreezableProxy` forwards each connection an engine makes to the client's
address, and on demand either stops forwarding (:meth:`~FreezableProxy.freeze`: a
silent cut, nothing closes) or resets every connection it carries
(:meth:`~FreezableProxy.reset`: both ends get a TCP RST, as from a NAT or a firewall
that dropped the flow, and the engine's libzmq makes its connection again through the
proxy). Used by ``test_network_cut.py``, ``test_silent_reconnect.py`` and the vLLM
interop tests.
"""

from __future__ import annotations

import socket
import struct
from functools import partial
from typing import Final, final

import trio

__all__ = ["FreezableProxy"]

_LINGER_0: Final = struct.pack("ii", 1, 0)
"""``SO_LINGER`` on, 0 s: ``close()`` sends a RST instead of a FIN."""


@final
class FreezableProxy:
    """Forwards each TCP connection accepted on 127.0.0.1 to ``target_port``, bytes
    both ways, until :meth:`freeze`: from then on it forwards nothing, drops what
    comes, and closes nothing; new connections are accepted and held, never forwarded.
    Until then, :meth:`reset` resets the connections it carries and goes on forwarding
    new ones. An end that closes by itself is not passed on to the other (the other
    end learns only from its own heartbeats).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.frozen = trio.Event()
        self.connections = 0
        """Connections forwarded to the target so far."""
        self._live: dict[trio.CancelScope, tuple[trio.SocketStream, trio.SocketStream]] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_tcp, self._forward, 0, host="127.0.0.1")
            )
            self.port = listeners[0].socket.getsockname()[1]
            task_status.started()

    def freeze(self) -> None:
        self.frozen.set()

    def reset(self) -> int:
        """Close both ends of every connection carried now with a TCP RST; how many
        there were. The proxy keeps listening and forwarding."""
        live = list(self._live.items())
        for scope, ends in live:
            for end in ends:
                end.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
            scope.cancel()
        return len(live)

    async def _forward(self, engine_side: trio.SocketStream) -> None:
        async with engine_side:
            if self.frozen.is_set():
                await trio.sleep_forever()
            try:
                client_side = await trio.open_tcp_stream("127.0.0.1", self.target_port)
            except OSError:
                return  # nobody listening yet: the engine tries again
            async with client_side:
                with trio.CancelScope() as scope:
                    self._live[scope] = (engine_side, client_side)
                    self.connections += 1
                    try:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(self._pump, engine_side, client_side)
                            nursery.start_soon(self._pump, client_side, engine_side)
                    finally:
                        del self._live[scope]
            # Leaving the two ``async with`` closes both sockets (with a RST after
            # reset(): linger 0).

    async def _pump(self, source: trio.SocketStream, sink: trio.SocketStream) -> None:
        try:
            async for chunk in source:
                if self.frozen.is_set():
                    await trio.sleep_forever()  # what came is dropped; nothing closes
                await sink.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await trio.sleep_forever()  # a closed side is not passed on either

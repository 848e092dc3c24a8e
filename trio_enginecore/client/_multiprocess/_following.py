"""Following a data-parallel group's coordinator: the engines' loads and the wave.

The coordinator publishes, on an XPUB socket, each engine's waiting and running
counts and the group's request wave. A client subscribes with an XSUB socket and
folds every publication into its wave follower, from a task of its own. Which
coordinator: the one the client was given or launched, or (attached engines) the one
the engines name in their ready messages.
"""

from __future__ import annotations

import logging
from typing import Any, final

import trio
import zmq

from ..._addresses import connect_address
from ..._curve import CurveServer
from ..._zmq import TrioSocket, make_socket
from ...errors import EngineStartupError, ProtocolError
from ...protocol import COORDINATOR_SUBSCRIBE, CoordinatorPublication
from ...serial import MsgpackDecoder
from .._transport import ClientLink

__all__ = ["CoordinatorFollower"]

logger = logging.getLogger("trio_enginecore.client")


@final
class CoordinatorFollower:
    """A client's subscription to its coordinator (see the module docstring).

    Args:
        ctx: the client's ZeroMQ context.
        link: the client (its engines, its wave follower, whether it is closing).
        curve: the client's CURVE role, when its engines use CURVE: a coordinator
            reached over TCP then holds the frontends' key pair.
    """

    def __init__(self, ctx: zmq.Context[Any], link: ClientLink, curve: CurveServer | None) -> None:
        self._ctx = ctx
        self._link = link
        self._curve = curve
        self._sock: TrioSocket | None = None

    async def follow(self, nursery: trio.Nursery, publish_address: str) -> None:
        """Subscribe to the coordinator publishing at ``publish_address`` and follow it
        from a task in ``nursery``."""
        sock = make_socket(self._ctx, zmq.XSUB)
        try:
            if self._curve is not None and publish_address.startswith("tcp://"):
                # We prove we are a frontend with the same key, and check it is theirs.
                self._curve.as_client_of_itself().apply(sock)
            connect_address(sock, publish_address, role="coordinator publish address")
            await sock.send_multipart([COORDINATOR_SUBSCRIBE])
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        nursery.start_soon(self._follow, sock)

    async def follow_announced(self, nursery: trio.Nursery) -> None:
        """Follow the coordinator the (attached) engines named in their ready
        messages, if they named one.

        Raises:
            EngineStartupError: the engines name different coordinators.
        """
        engines = self._link.state.engines
        announced = {e.ready.dp_stats_address for e in engines if e.ready is not None}
        announced.discard(None)
        if not announced:
            await trio.lowlevel.checkpoint()
            return
        if len(announced) > 1:
            raise EngineStartupError(
                f"the engines name different coordinators: {sorted(map(str, announced))}"
            )
        (address,) = announced
        assert address is not None
        logger.debug("following the coordinator the engines named, at %s", address)
        await self.follow(nursery, address)

    def close(self) -> None:
        """Close the subscription (its task then ends)."""
        if self._sock is not None:
            self._sock.close(linger=0)

    async def _follow(self, sock: TrioSocket) -> None:
        link = self._link
        decoder = MsgpackDecoder(CoordinatorPublication)
        try:
            while True:
                for frames in await sock.drain():
                    try:
                        link.waves.fold(decoder.decode(frames), link.state.engines)
                    except ProtocolError as exc:
                        logger.error("dropping an invalid coordinator message: %s", exc)
        except trio.ClosedResourceError:
            if not link.state.closing:
                raise
        finally:
            sock.close()

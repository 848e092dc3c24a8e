"""The seam between a client and the way its messages travel.

A :class:`Transport` moves requests to engines and their messages back: to engine
processes (:class:`~trio_enginecore.client._multiprocess._group.EngineGroup`, whose data
path is a message pipe, ZeroMQ by default), to an engine running as a task (the
in-process client), or to the scripted engine of :mod:`trio_enginecore.testing`. The one
client class, :class:`~trio_enginecore.client.TrioEngineClient`, is given a transport,
as trio-websocket's connection is given its stream, and never looks behind it.

What the transport may do to its client is in the :class:`ClientLink` it is handed
when it starts: feed decoded engine messages to the client's state (one direct call
per message, the receive hot path), report an engine's death, feed the coordinator's
publications to the client's wave follower, and ping an engine through the client's
utility machinery (for its liveness calls). It is built with keywords only: several of
its callbacks have the same type, and a swap would type-check.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, final

import attrs
import trio

from ..protocol import EngineCoreRequest, UtilityRequest
from ._core._engines import EngineHandle
from ._core._router import WaveFollower

if TYPE_CHECKING:
    # Only a type here: the client hands its state over in the link.
    from ._core._state import ClientState

__all__ = ["ClientLink", "Transport"]


@final
@attrs.frozen(kw_only=True)
class ClientLink:
    """What a transport may do to the client it serves."""

    state: ClientState
    """The client's state: ``handle_outputs(message)`` for every decoded engine
    message, ``undecodable(error)`` for one that could not be decoded; ``engines`` is
    the list the transport fills (in place) with one handle per engine, by rank."""
    engine_died: Callable[[EngineHandle, str], None]
    """Report that an engine died (or stopped answering), with the reason users read."""
    waves: WaveFollower
    """The client's follower of the coordinator's publications."""
    ping: Callable[[EngineHandle], Awaitable[None]]
    """One utility round trip to an engine; raises ``EngineDeadError`` or
    ``trio.ClosedResourceError`` once that is what any call would raise."""
    engine_back: Callable[[EngineHandle], None]
    """A restarted engine is ready: put it back in service."""
    engine_given_up: Callable[[EngineHandle, str], None]
    """A restarting engine will not be restarted again, for this reason."""
    requests_lost: Callable[[EngineHandle, str], None]
    """A live engine lost the client's requests (it sent a second ready message:
    it restarted, or reconnected, on its own); the reason completes "engine rank N"."""
    engine_suspect: Callable[[EngineHandle, str], bool]
    """An engine in service may be gone or stuck, for this reason (it stays in
    service); whether this was news."""
    engine_cleared: Callable[[EngineHandle], None]
    """A suspect engine showed life."""


class Transport(Protocol):
    """How a client's messages reach its engines and come back.

    The three ``send_*`` methods never block and never checkpoint: the client owns the
    single schedule point of each public call, so a call that is cancelled sent
    nothing, and a batch is handed over whole. They are only called between a
    successful :meth:`start` and the end of :meth:`aclose`.
    """

    def send_add(self, engine: EngineHandle, request: EngineCoreRequest) -> None:
        """Deliver an ADD to ``engine``."""
        ...

    def send_abort(self, engine: EngineHandle, request_ids: list[str]) -> None:
        """Deliver an ABORT of these (wire) request ids to ``engine``."""
        ...

    def send_utility(self, engine: EngineHandle, call: UtilityRequest) -> None:
        """Deliver a UTILITY call to ``engine``."""
        ...

    async def start(self, nursery: trio.Nursery, link: ClientLink) -> None:
        """Reach the engines, fill ``link.state.engines``, start the transport's
        background tasks in ``nursery``, and return once every engine is ready.

        If it raises (or is cancelled), :meth:`aclose` is still called."""
        ...

    @property
    def restarts_engines(self) -> bool:
        """Whether it can launch a dead engine again (the ``restart`` policy): it
        launched every engine itself."""
        ...

    def engine_death_recorded(self, engine: EngineHandle) -> None:
        """The client recorded ``engine``'s death and failed its waiters (a transport
        may attribute deaths, or stop a startup, on it). If ``engine.restarting``,
        the transport restarts it and reports through ``link.engine_back`` or
        ``link.engine_given_up``."""
        ...

    async def aclose(self) -> None:
        """Stop what the transport started: engines it launched, sockets, tasks.

        Called once, shielded, after the client aborted what was in flight (those
        ABORTs are sent before this is called) and marked itself closing."""
        ...

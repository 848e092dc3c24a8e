"""The record a client keeps of each engine: who it is, where it runs, how it stands.

Plain data, no I/O: a launched engine's process (its pipes, its lifeline) is the engine
group's (:class:`~trio_enginecore.client._multiprocess._launch.LaunchedProcess`), and
only its process id is here, for the messages. Several parts of a client read a record,
and some fill in facts (the launcher its process id, the startup its ready message and
release, the receive task how many messages it sent); only the client's state
(:mod:`._state`) changes where an engine *stands*, its :attr:`EngineHandle.state`: what
notices a death, a silence or a recovery reports it there, and the state decides.

The states::

    alive ──(connection lost, or no progress for a while)──> suspect ──(it shows life)──> alive
      │                                                        │
      └───────────────(a death: exit, silence, a fatal error)──┴──> dead, or restarting
                                                   restarting ──(ready again)──> alive
                                                   restarting ──(given up)──> dead
"""

from __future__ import annotations

from typing import final

import attrs

from ...dialects import OLDEST, Dialect
from ...errors import EngineDeadError
from ...protocol import EngineCoreReadyResponse, identity_for_rank
from ._lb import EngineLoad
from ._statistics import EngineState, EngineStatus

__all__ = ["DeathNotice", "EngineHandle"]


@final
@attrs.frozen
class DeathNotice:
    """What an :class:`~trio_enginecore.errors.EngineDeadError` says, kept to raise a
    fresh error for each waiter (one exception object raised in several tasks would
    mix their tracebacks)."""

    message: str
    rank: int | None = None
    pid: int | None = None
    location: str | None = None
    retryable: bool = False

    def error(self) -> EngineDeadError:
        return EngineDeadError(
            self.message,
            rank=self.rank,
            pid=self.pid,
            location=self.location,
            retryable=self.retryable,
        )


@attrs.define(eq=False)
class EngineHandle:
    """What the client knows about one engine (see the module docstring)."""

    rank: int
    identity: bytes
    pid: int | None = None
    """The process id of an engine this client launched (set by the launcher), for
    the messages; None for an engine started elsewhere."""
    ready: EngineCoreReadyResponse | None = None
    ready_keys: frozenset[str] | None = None
    """The keys its ready message had (the decoded ``ready`` fills in the others):
    what tells its release when its version names none (``"dev"``)."""
    dialect: Dialect = OLDEST
    """The wire form this engine's vLLM release reads, from its ready message (the
    oldest supported until one says otherwise)."""
    load: EngineLoad = attrs.field(factory=EngineLoad)
    state: EngineState = "alive"
    """Where it stands; written by the client's state only."""
    death: str | None = None
    """Why it died (while ``dead`` or ``restarting``)."""
    suspicion: str | None = None
    """Why it is ``suspect``."""
    heard: int = 0
    """How many messages it has sent this client (outputs and replies): the progress
    the liveness checks look for."""
    restarts: int = 0
    """How many times the client has restarted it."""
    location: str | None = None
    """Where the engine runs, for an engine started elsewhere (its host, or the Ray
    actor and node: :attr:`RemoteEngines.locations
    <trio_enginecore.RemoteEngines.locations>`): part of how every message names the
    engine (``engine rank 1 (host-b)``)."""

    @property
    def alive(self) -> bool:
        """In service: ``alive`` or ``suspect`` (a suspect engine keeps its requests
        and its place in routing until it is declared dead)."""
        return self.state == "alive" or self.state == "suspect"

    @property
    def restarting(self) -> bool:
        """Dead, and being started again (the ``restart`` policy)."""
        return self.state == "restarting"

    @classmethod
    def for_rank(cls, rank: int) -> EngineHandle:
        """A handle for the engine of data-parallel rank ``rank`` (its DEALER identity
        as vLLM defines it)."""
        return cls(rank=rank, identity=identity_for_rank(rank))

    def forget_instance(self) -> None:
        """Forget what belonged to an engine that died (its process id, its ready
        message), before another is started for the same rank."""
        self.pid = None
        self.ready = None
        self.ready_keys = None

    def death_notice(self, message: str, *, retryable: bool) -> DeathNotice:
        """What an ``EngineDeadError`` blaming this engine says."""
        return DeathNotice(
            message,
            rank=self.rank,
            pid=self.pid,
            location=self.location,
            retryable=retryable,
        )

    def describe(self) -> str:
        pid = f", pid {self.pid}" if self.pid is not None else ""
        where = f" ({self.location})" if self.location is not None else ""
        return f"engine rank {self.rank}{pid}{where}"

    def status(self) -> EngineStatus:
        """This engine's line of ``statistics().engines``."""
        return EngineStatus(
            self.rank,
            self.state,
            self.load.in_flight,
            death=self.death,
            restarts=self.restarts,
            location=self.location,
            suspicion=self.suspicion if self.state == "suspect" else None,
            pid=self.pid,
        )

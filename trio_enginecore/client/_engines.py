"""The record a client keeps of each engine: who it is, where it runs, how it stands.

Plain data, no I/O. Several parts of a client read a record, and some fill in facts
(the launcher its process, the startup its ready message and release, the receive task
how many messages it sent); only the client's state (:mod:`._state`) changes where an
engine *stands*, its :attr:`EngineHandle.state`: what notices a death, a silence or a
recovery reports it there, and the state decides.

The states::

    alive ──(connection lost, or no progress for a while)──> suspect ──(it shows life)──> alive
      │                                                        │
      └───────────────(a death: exit, silence, a fatal error)──┴──> dead, or restarting
                                                   restarting ──(ready again)──> alive
                                                   restarting ──(given up)──> dead
"""

from __future__ import annotations

import collections
from typing import Final, final

import attrs
import trio

from ..dialects import OLDEST, Dialect
from ..errors import EngineDeadError
from ..protocol import EngineCoreReadyResponse, identity_for_rank
from ._interface import EngineState, EngineStatus
from ._lb import EngineLoad

__all__ = ["STDERR_TAIL_LINES", "DeathNotice", "EngineHandle"]

STDERR_TAIL_LINES: Final = 20


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
    process: trio.Process | None = None
    stderr_tail: collections.deque[str] = attrs.field(
        factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES)
    )
    stderr_done: trio.Event = attrs.field(factory=trio.Event)
    ready: EngineCoreReadyResponse | None = None
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
    lifeline: int | None = None
    """The write end of the engine's lifeline pipe, while the client holds it."""
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

    def forget_process(self) -> None:
        """Forget the process (and ready message) of an engine that died, before
        another is started for the same rank. The lifeline must be closed first."""
        assert self.lifeline is None, "close the lifeline of the old process first"
        self.process = None
        self.stderr_done = trio.Event()
        self.ready = None
        self.stderr_tail.clear()

    def death_notice(self, message: str, *, retryable: bool) -> DeathNotice:
        """What an ``EngineDeadError`` blaming this engine says."""
        return DeathNotice(
            message,
            rank=self.rank,
            pid=self.process.pid if self.process is not None else None,
            location=self.location,
            retryable=retryable,
        )

    def describe(self) -> str:
        pid = f", pid {self.process.pid}" if self.process is not None else ""
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
        )

    def exit_description(self, *, with_name: bool = True, with_stderr: bool = True) -> str:
        """How the engine's process ended, with its last stderr lines."""
        parts = [self.describe()] if with_name else []
        if self.process is not None and self.process.returncode is not None:
            code = self.process.returncode
            parts.append(
                f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
            )
        if with_stderr and self.stderr_tail:
            parts.append("last stderr lines:\n  " + "\n  ".join(self.stderr_tail))
        return "; ".join(parts)

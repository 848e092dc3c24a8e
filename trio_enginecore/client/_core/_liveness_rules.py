"""How a client tells a dead or hung engine from a slow one: settings and rules, no I/O.

Two questions, answered separately (the tasks asking them are in :mod:`._liveness`):

* **Is the engine still there?** Killed, ``SIGSTOP``-ped, its host or network gone.
  Answered without the engine's busy loop, so that the length of a step never matters:
  a launched engine's process exit, and for every engine ZeroMQ's own connection
  heartbeats (ZMTP 3.1 PING/PONG, which libzmq's I/O thread answers in the engine,
  vLLM's included, whatever its Python code is doing). A connection that closes, or
  whose heartbeats go unanswered, is reported by the input socket's monitor; the
  :class:`ConnectionTable` says whose it was.
* **Is it making progress?** Deadlocked, a collective that never completes, a stuck
  device: process and sockets alive, the busy loop not. While an engine has work from
  this client (requests in flight, or the client's own liveness call outstanding), a
  message from it must come within ``progress_timeout_s``; time it spends in a utility
  a caller asked for does not count (:class:`ProgressClock`).
"""

from __future__ import annotations

from typing import Final, final

import attrs

from ._settings_checks import positive_number

__all__ = [
    "DEFAULT_LIVENESS",
    "RECONNECT_GRACE_S",
    "ConnectionTable",
    "Liveness",
    "ProgressClock",
]

RECONNECT_GRACE_S: Final = 0.5
"""How long an engine whose connection closed has to show life on a new one (libzmq
reconnects 100 ms after a loss) before it is declared dead."""

_MAX_PING_INTERVAL_S: Final = 5.0
_positive: Final = positive_number("Liveness")
_positive_or_none: Final = positive_number("Liveness", optional=True)


@final
@attrs.frozen(kw_only=True)
class Liveness:
    """How a client notices that an engine died, stopped, or hung.

    One object for every kind of engine: launched, attached, joined from other hosts
    (:class:`~trio_enginecore.RemoteEngines`), placed by Ray. ``liveness=None`` turns
    every check off but a launched engine's process exit.

    Attributes:
        heartbeat_interval_s: how often the client's input socket sends each engine's
            connection a ZeroMQ heartbeat (ZMTP PING). The engine's libzmq answers it
            by itself, off its busy loop, so a step of any length does not matter.
            ``None``: no heartbeats (then a killed remote or attached engine is only
            noticed by the progress deadline).
        heartbeat_timeout_s: a connection with no traffic for this long after a
            heartbeat is closed, and its engine declared dead unless it reconnects at
            once. With the defaults a killed, stopped or cut-off engine is declared
            dead within about 2.3 s. Raise it if one message to an engine can take
            longer than this to transmit (hundreds of megabytes over a slow link).
        progress_timeout_s: while an engine has work from this client (requests in
            flight, or the client's own liveness call), it must send something (an
            output, a reply) within this time, or it is declared hung: dead, and
            killed if the client launched it. Time the engine spends in a utility
            you called does not count (bound your own calls with cancel scopes). Keep
            it well above your engines' longest step, and longest utility the client
            does not wait for; ``None`` turns the deadline off.
    """

    heartbeat_interval_s: float | None = attrs.field(default=0.3, validator=_positive_or_none)
    heartbeat_timeout_s: float = attrs.field(default=1.5, validator=_positive)
    progress_timeout_s: float | None = attrs.field(default=60.0, validator=_positive_or_none)

    @property
    def ping_interval_s(self) -> float | None:
        """How often the client asks an engine a cheap utility (``is_sleeping``), so
        that an idle engine has work to make progress on: a quarter of the progress
        timeout, at most 5 s; None without a progress deadline."""
        if self.progress_timeout_s is None:
            return None
        return min(_MAX_PING_INTERVAL_S, self.progress_timeout_s / 4)

    @property
    def heartbeat_options(self) -> dict[str, int]:
        """The ZeroMQ socket options (in milliseconds) of the client's input socket;
        empty without heartbeats. No ``HEARTBEAT_TTL``: the engines need no deadline
        of their own on the client (a client that goes away closes its sockets, and
        its launched engines stop with it)."""
        if self.heartbeat_interval_s is None:
            return {}
        return {
            "HEARTBEAT_IVL": max(1, round(self.heartbeat_interval_s * 1000)),
            "HEARTBEAT_TIMEOUT": max(1, round(self.heartbeat_timeout_s * 1000)),
        }

    @property
    def connection_loss_s(self) -> float | None:
        """The longest an engine can be gone before its connection is reported lost
        and its grace to reconnect ends: None without heartbeats."""
        if self.heartbeat_interval_s is None:
            return None
        return self.heartbeat_interval_s + self.heartbeat_timeout_s + RECONNECT_GRACE_S


DEFAULT_LIVENESS: Final = Liveness()
"""What a client checks unless told otherwise."""


@final
class _Connection:
    __slots__ = ("fd", "owner")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.owner: bytes | None = None


@final
class ConnectionTable:
    """Which engine each connection of the client's input ROUTER belongs to.

    The socket monitor reports connections by file descriptor (``accepted``,
    ``disconnected``), and says nothing of whose they are; a message received on the
    ROUTER carries both its sender's identity and the descriptor it came on (libzmq's
    ``ZMQ_SRCFD``). An engine's ready message is the first it sends on a connection, so
    it *claims* that connection for the engine. Several engines share the socket, and a
    descriptor is reused once closed: events must be applied in the monitor's order,
    and every event queued before a claimed message applied before the claim (then the
    claim binds to the connection the message came on).
    """

    def __init__(self) -> None:
        self._open: dict[int, _Connection] = {}
        self._current: dict[bytes, _Connection] = {}
        self._closed: set[int] = set()

    def accepted(self, fd: int) -> None:
        """A connection was made on descriptor ``fd``."""
        self._closed.discard(fd)
        self._open[fd] = _Connection(fd)

    def disconnected(self, fd: int) -> bytes | None:
        """The connection on ``fd`` closed: the identity of the engine whose current
        connection it was, or None (unclaimed, or an engine's former connection)."""
        self._closed.add(fd)
        connection = self._open.pop(fd, None)
        if connection is None or connection.owner is None:
            return None
        if self._current.get(connection.owner) is not connection:
            return None
        del self._current[connection.owner]
        return connection.owner

    def claim(self, fd: int, identity: bytes) -> bool:
        """A message from ``identity`` came on descriptor ``fd``: that connection is
        now the engine's current one. False if it is closed already (the engine's
        connection was lost right after the message). A descriptor never seen is a
        connection whose ``accepted`` event the monitor dropped (its queue is
        bounded): it is taken as open, not as lost."""
        if fd in self._closed:
            return False
        connection = self._open.get(fd)
        if connection is None:
            connection = self._open[fd] = _Connection(fd)
        connection.owner = identity
        self._current[identity] = connection
        return True

    def connected(self, identity: bytes) -> bool:
        """Whether the engine has a current connection."""
        return identity in self._current

    def __len__(self) -> int:
        """Open connections (claimed or not)."""
        return len(self._open)


@final
@attrs.define
class ProgressClock:
    """How long one engine has gone without progress while it had work.

    Fed, every so often, what the client knows of the engine: how many messages it has
    sent (``heard``), whether it has work from this client (``busy``), and whether it
    is in a utility a caller is waiting on (``excused``). The clock restarts whenever
    the engine sent something, had nothing to do, or was excused.
    """

    _heard: int = -1
    _since: float | None = None

    def observe(self, now: float, *, heard: int, busy: bool, excused: bool) -> float:
        """Seconds without progress, as of ``now`` (0 when it progressed). The time
        counts from the first observation that found the engine busy, unexcused and
        silent: an engine is never charged for time it may have been idle."""
        if not busy or excused:
            self._heard = heard
            self._since = None
            return 0.0
        if heard != self._heard or self._since is None:
            self._heard = heard
            self._since = now
            return 0.0
        return now - self._since

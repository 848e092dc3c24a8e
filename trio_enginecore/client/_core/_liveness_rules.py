"""How a client tells a dead or hung engine from a slow one: settings and rules, no I/O.

Two questions, answered separately (the tasks asking them are in :mod:`._liveness`):

* **Is the engine still there?** Killed, ``SIGSTOP``-ped, its host or network gone.
  Answered without the engine's busy loop, so that the length of a step never matters:
  a launched engine's process exit, and for every engine ZeroMQ's own connection
  heartbeats (ZMTP 3.1 PING/PONG, which libzmq's I/O thread answers in the engine,
  vLLM's included, whatever its Python code is doing). A connection that closes, or
  whose heartbeats go unanswered, is reported by the input socket's monitor; the
  :class:`ConnectionTable` says whose it was, and which new connections may be the
  same engine's (a TCP connection reset by the network and made again by libzmq).
* **Is it making progress?** Deadlocked, a collective that never completes, a stuck
  device: process and sockets alive, the busy loop not. While an engine has work from
  this client (requests in flight, or the client's own liveness call outstanding), a
  message from it must come within ``progress_timeout_s``; time it spends in a utility
  a caller asked for does not count (:class:`ProgressClock`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Final, final

import attrs

from ..._keywords import suggest_keywords
from ._settings_checks import positive_number

__all__ = [
    "DEFAULT_LIVENESS",
    "RECONNECT_GRACE_S",
    "ConnectionTable",
    "Liveness",
    "Peer",
    "ProgressClock",
]

RECONNECT_GRACE_S: Final = 0.5
"""How long an engine whose connection closed has to show it can be reached again, or
to make a new connection from where the lost one came (libzmq reconnects 100 ms after
a loss), before it is declared dead; one that made one has until it answers (see
:class:`ConnectionTable`)."""

_MAX_PING_INTERVAL_S: Final = 5.0
_positive: Final = positive_number("Liveness")
_positive_or_none: Final = positive_number("Liveness", optional=True)


@final
@suggest_keywords
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


Peer = Hashable
"""Where a connection comes from, as the client can tell: the peer's host for TCP, its
process for a Unix-domain socket (see ``_liveness.peer_of``)."""


@final
class _Connection:
    __slots__ = ("fd", "owner", "peer", "seq")

    def __init__(self, fd: int, peer: Peer | None, seq: int) -> None:
        self.fd = fd
        self.peer = peer
        self.seq = seq
        self.owner: bytes | None = None


@final
class _Adrift:
    """An engine in service whose connection was lost, and that has claimed no other."""

    __slots__ = ("confirmed", "peer", "since")

    def __init__(self, peer: Peer | None, since: int) -> None:
        self.peer = peer
        self.since = since
        """Connections accepted after this one (in the table's order) may be its own."""
        self.confirmed = False
        """It answered a call sent since it was last put at risk: it has a connection."""


@final
class ConnectionTable:
    """Which engine each connection of the client's input ROUTER belongs to, and which
    connections an engine that lost its own may have made since.

    The socket monitor reports connections by file descriptor (``accepted``,
    ``disconnected``), and says nothing of whose they are; a message received on the
    ROUTER carries both its sender's identity and the descriptor it came on (libzmq's
    ``ZMQ_SRCFD``). An engine's ready message is the first it sends on a connection, so
    it *claims* that connection for the engine. Several engines share the socket, and a
    descriptor is reused once closed: events must be applied in the monitor's order,
    and every event queued before a claimed message applied before the claim (then the
    claim binds to the connection the message came on).

    An engine whose connection closes is *adrift* until it claims another. libzmq
    reconnects an engine's DEALER by itself, with the same identity, and a vLLM engine
    sends nothing on the new connection: nothing says whose it is. What can be known:
    where it comes from (its :data:`Peer`), and that it was accepted after the loss
    (before it, the ROUTER still held the engine's identity and would have ignored a
    second connection carrying it). A connection that no engine claimed, from the
    adrift engine's peer, accepted after its loss, *may be its own*; an engine that
    answers a call sent after the loss has one (the ROUTER routes by identity), and if
    only one connection may be its own, that is it: it is placed there, and watched
    there as on its first. An adrift engine is *gone* when it cannot have a connection:
    none may be its own that is not needed by the adrift engines that answered (several
    engines on one host reconnecting together share their candidates).
    """

    def __init__(self) -> None:
        self._open: dict[int, _Connection] = {}
        self._current: dict[bytes, _Connection] = {}
        self._closed: dict[int, tuple[Peer | None, int]] = {}
        self._adrift: dict[bytes, _Adrift] = {}
        self._seq = 0

    def accepted(self, fd: int, peer: Peer | None = None) -> None:
        """A connection from ``peer`` (None: unknown) was made on descriptor ``fd``."""
        self._seq += 1
        self._closed.pop(fd, None)
        self._open[fd] = _Connection(fd, peer, self._seq)

    def disconnected(self, fd: int) -> list[bytes]:
        """The connection on ``fd`` closed: the identities of the engines this puts at
        risk. The engine whose current connection it was (not an engine's former
        connection), now adrift; or, for a connection nobody claimed, every adrift
        engine it may have belonged to, which must answer again."""
        connection = self._open.pop(fd, None)
        self._closed[fd] = (connection.peer if connection is not None else None, self._seq)
        if connection is None:
            return []
        owner = connection.owner
        if owner is not None:
            if self._current.get(owner) is not connection:
                return []
            del self._current[owner]
            self._adrift[owner] = _Adrift(connection.peer, self._seq)
            return [owner]
        at_risk = [
            identity
            for identity, adrift in self._adrift.items()
            if _may_be_its_own(connection, adrift)
        ]
        for identity in at_risk:
            self._adrift[identity].confirmed = False
        return at_risk

    def claim(self, fd: int, identity: bytes, peer: Peer | None = None) -> bool:
        """A message from ``identity`` came on descriptor ``fd``: that connection is
        now the engine's current one. False if it is closed already (the engine's
        connection was lost right after the message: it is adrift). A descriptor never
        seen is a connection whose ``accepted`` event the monitor dropped (its queue is
        bounded): it is taken as open, from ``peer``, not as lost."""
        closed = self._closed.get(fd)
        if closed is not None:
            self._current.pop(identity, None)
            self._adrift[identity] = _Adrift(*closed)
            return False
        connection = self._open.get(fd)
        if connection is None:
            self.accepted(fd, peer)
            connection = self._open[fd]
        self._place(identity, connection)
        return True

    def confirm(self, identity: bytes) -> None:
        """An adrift engine answered a call sent since it was last put at risk: it has
        a connection. If only one connection may be its own, that is its current one."""
        adrift = self._adrift.get(identity)
        if adrift is not None:
            adrift.confirmed = True
            self._settle()

    def forget(self, identity: bytes) -> None:
        """The engine is out of service: it is nobody's candidate any more."""
        self._adrift.pop(identity, None)

    def connected(self, identity: bytes) -> bool:
        """Whether the engine has a current connection."""
        return identity in self._current

    def candidates(self, identity: bytes) -> list[int]:
        """The descriptors of the connections that may be the adrift engine's own."""
        if identity not in self._adrift:
            return []
        return [connection.fd for connection in self._options(identity)]

    def gone(self, identity: bytes) -> bool:
        """Whether the adrift engine cannot have a connection: no connection may be its
        own, or every one that may is needed by the adrift engines that answered (it
        cannot be added to a largest matching of those engines to distinct connections
        each may own). False for an engine that is not adrift."""
        if identity not in self._adrift:
            return False
        answered = [other for other, a in self._adrift.items() if a.confirmed and other != identity]
        return _largest_matching([*answered, identity], self._options) == _largest_matching(
            answered, self._options
        )

    def __len__(self) -> int:
        """Open connections (claimed or not)."""
        return len(self._open)

    def _options(self, identity: bytes) -> list[_Connection]:
        adrift = self._adrift[identity]
        return [c for c in self._open.values() if _may_be_its_own(c, adrift)]

    def _place(self, identity: bytes, connection: _Connection) -> None:
        connection.owner = identity
        self._current[identity] = connection
        self._adrift.pop(identity, None)
        self._settle()

    def _settle(self) -> None:
        # An engine that answered, with one connection that may be its own, is placed
        # there; that connection is then nobody else's candidate, which may leave
        # another with one. An engine that answered with none (its connection came
        # from elsewhere, or from where nothing could tell) stays adrift.
        for identity, adrift in self._adrift.items():
            if adrift.confirmed:
                options = self._options(identity)
                if len(options) == 1:
                    self._place(identity, options[0])
                    return


def _may_be_its_own(connection: _Connection, adrift: _Adrift) -> bool:
    return (
        connection.owner is None
        and adrift.peer is not None
        and connection.peer == adrift.peer
        and connection.seq > adrift.since
    )


def _largest_matching(engines: list[bytes], options: Callable[[bytes], list[_Connection]]) -> int:
    """The size of a largest matching of ``engines`` to distinct connections among
    their options (augmenting paths: a handful of engines and connections)."""
    holder: dict[int, bytes] = {}
    choices = {identity: options(identity) for identity in engines}

    def augment(identity: bytes, seen: set[int]) -> bool:
        for connection in choices[identity]:
            if connection.fd in seen:
                continue
            seen.add(connection.fd)
            other = holder.get(connection.fd)
            if other is None or augment(other, seen):
                holder[connection.fd] = identity
                return True
        return False

    return sum(1 for identity in engines if augment(identity, set()))


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

"""What a client reports of itself: :class:`ClientStatistics`, one
:class:`EngineStatus` per engine, and the states an engine can be in."""

from __future__ import annotations

from typing import Literal, final

import attrs

__all__ = ["ClientStatistics", "EngineState", "EngineStatus"]


EngineState = Literal["alive", "suspect", "restarting", "dead"]
"""Where an engine stands (see :attr:`EngineStatus.state`)."""


@final
@attrs.frozen
class EngineStatus:
    """One engine, as ``statistics().engines`` shows it."""

    rank: int
    """The engine's data-parallel rank."""
    state: EngineState
    """Where it stands: ``"alive"`` (serving, or still starting), ``"suspect"``
    (serving, but its connection was lost or it has made no progress for a while:
    declared dead if that goes on, back to ``"alive"`` when it shows life),
    ``"restarting"`` (it died and is being launched again: the ``restart`` policy),
    ``"dead"`` (died, and taken out of routing; or shut down with its client)."""
    in_flight: int
    """This client's requests in flight on it."""
    death: str | None = None
    """Why it died (the message its failed requests carry), or None."""
    restarts: int = 0
    """How many times the client restarted it (the ``restart`` policy)."""
    location: str | None = None
    """Where it runs, for remote engines (``RemoteEngines.locations``; a restart
    may move it), else None."""
    suspicion: str | None = None
    """Why it is ``"suspect"``, or None."""
    pid: int | None = None
    """The process the client launched for it (for vLLM's engine cores, the
    ``vllm serve --headless`` launcher, which leads their process group; a restart
    changes it), else None."""


@final
@attrs.frozen
class ClientStatistics:
    """A snapshot of a client's state, from its ``statistics()``."""

    requests_in_flight: int
    """Requests sent and neither finished nor aborted (streams included)."""
    open_streams: int
    """Streams whose ``async with`` block has not exited."""
    pending_utility_calls: int
    """Your utility calls waiting for their reply (the client's own liveness calls
    are not counted)."""
    pending_batches: int
    """Engine messages waiting for ``get_output()``."""
    messages_received: int
    """Messages decoded from the output socket."""
    outputs_received: int
    """Per-request outputs in those messages."""
    tokens_received: int
    """New token ids in those outputs."""
    protocol_errors: int
    """Engine messages (or parts of them) dropped because they broke the protocol:
    undecodable, from an engine this client does not have, or outputs of one request
    that cannot be merged."""
    engines_alive: int
    """Engines that have neither died nor been shut down."""
    outputs_dropped: int = 0
    """Outputs dropped because no request of theirs was in flight: late outputs of an
    aborted request (normal), and outputs an engine should not have sent (for an
    unknown id, a second finish, after the finish)."""
    engines: tuple[EngineStatus, ...] = ()
    """Each engine's state, by rank."""

"""The ``restart`` failure policy: its settings, and when to try again (pure).

:class:`Restart` is what users pass as ``on_engine_failure``; :class:`RestartBudget`
decides, from the times of an engine's earlier restarts alone, how long to wait before
the next one or that there is none: no clock of its own, no I/O, so the policy is
unit-tested with made-up times.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Final, final

import attrs

from ._settings_checks import positive_number

__all__ = ["RESTART_NEEDS_LAUNCHED_ENGINES", "Restart", "RestartBudget"]

RESTART_NEEDS_LAUNCHED_ENGINES: Final = (
    "on_engine_failure='restart' restarts engines this client launches, or remote "
    "engines with a restarter (RemoteEngines(restarter=...)); these are started "
    "elsewhere (use 'route_around', or give RemoteEngines a restarter)"
)


def _at_least_one(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Restart.{attribute.name} must be an int of at least 1, got {value!r}")


_positive: Final = positive_number("Restart")


@final
@attrs.frozen(kw_only=True)
class Restart:
    """Restart engines that die or hang (``on_engine_failure=Restart(...)``, or
    ``"restart"`` for these defaults): engines this client launched, and remote ones
    whose :class:`~trio_enginecore.RemoteEngines` has a ``restarter`` (engines placed
    by Ray have one).

    The dead engine is taken out of routing as with ``"route_around"`` (its requests
    fail with ``EngineDeadError``), then started again with the same rank after a
    back-off, handshaken, and put back once ready. New requests meanwhile go to the
    other engines; with none in service they wait up to :attr:`wait_s` for one. An
    engine restarted :attr:`max_restarts` times within :attr:`window_s` is not
    restarted again: it is dead, and the client fails once no engine is left.

    Raises:
        ValueError: a setting out of range.
    """

    max_restarts: int = attrs.field(default=5, validator=_at_least_one)
    """Restarts of one engine allowed within :attr:`window_s` (a launch that fails or
    is not ready in time counts as one)."""
    window_s: float = attrs.field(default=60.0, validator=_positive)
    """The window, in seconds, over which restarts are counted."""
    backoff_s: float = attrs.field(default=0.5, validator=_positive)
    """The wait before the first restart in the window; doubled for each later one."""
    max_backoff_s: float = attrs.field(default=8.0, validator=_positive)
    """The longest wait between two restarts."""
    wait_s: float = attrs.field(default=30.0, validator=_positive)
    """How long a new request (or utility call) waits for an engine when none is in
    service, before it raises ``EngineDeadError``."""


@final
class RestartBudget:
    """When one engine may be restarted next (see the module docstring)."""

    __slots__ = ("_policy", "_times")

    def __init__(self, policy: Restart) -> None:
        self._policy = policy
        self._times: deque[float] = deque()

    @property
    def restarts(self) -> int:
        """Restarts counted in the current window."""
        return len(self._times)

    def next_delay(self, now: float) -> float | None:
        """How long to wait before restarting at ``now``; None when the budget of the
        window is spent. The restart is counted (at ``now`` plus the delay)."""
        policy = self._policy
        times = self._times
        while times and times[0] <= now - policy.window_s:
            times.popleft()
        if len(times) >= policy.max_restarts:
            return None
        delay = min(policy.backoff_s * 2.0 ** len(times), policy.max_backoff_s)
        times.append(now + delay)
        return delay

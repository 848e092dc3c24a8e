"""What one engine's death does to the client: the failure policies (pure).

A policy answers one question, :meth:`on_death`: given how many other engines are in
service (or being restarted), does this death fail the client, does the client serve on
without the engine, or is the engine restarted? :func:`resolve_policy` turns what users
pass as ``on_engine_failure`` (``"fail"``, ``"route_around"``, ``"restart"`` or a
:class:`Restart`) into a policy, once. The client's state asks the policy and carries
out the verdict; the transport restarts engines under :class:`Restart`, whose
:class:`RestartBudget` decides, from the times of an engine's earlier restarts alone,
how long to wait before the next one or that there is none: no clock of its own, no
I/O, so every policy is unit-tested with made-up numbers.

A new policy is one class here with an ``on_death`` method, and one test.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Final, Literal, TypeAlias, final

import attrs

from ..._keywords import suggest_keywords
from ._settings_checks import positive_number

__all__ = [
    "POLICY_NAMES",
    "RESTART_NEEDS_LAUNCHED_ENGINES",
    "Fail",
    "FailurePolicy",
    "Policy",
    "Restart",
    "RestartBudget",
    "RouteAround",
    "Verdict",
    "resolve_policy",
]

Verdict: TypeAlias = Literal["fail_client", "serve_on", "restart"]
"""What a death does: the client fails (every later call raises), the client serves on
with the engines left, or the dead engine is started again (the client serving on
meanwhile)."""

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
@attrs.frozen
class Fail:
    """``on_engine_failure="fail"`` (the default, vLLM's behaviour): the first engine
    death fails the client."""

    def on_death(self, *, others_in_service: int) -> Verdict:
        """Fail the client, whatever is left."""
        return "fail_client"


@final
@attrs.frozen
class RouteAround:
    """``on_engine_failure="route_around"``: the dead engine is taken out of routing,
    what depended on it fails, and the client serves on with the others; it fails
    when no engine is left."""

    def on_death(self, *, others_in_service: int) -> Verdict:
        """Serve on while another engine is in service (or being restarted)."""
        return "serve_on" if others_in_service else "fail_client"


@final
@suggest_keywords
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

    def on_death(self, *, others_in_service: int) -> Verdict:
        """Start the engine again; the client serves on meanwhile (it fails only when
        an engine is given up with no other left: see ``RestartBudget``)."""
        return "restart"


Policy: TypeAlias = Fail | RouteAround | Restart
"""A failure policy, resolved (see :func:`resolve_policy`)."""

_NAMED: Final[dict[str, Policy]] = {
    "fail": Fail(),
    "route_around": RouteAround(),
    "restart": Restart(),
}

POLICY_NAMES: Final = tuple(_NAMED)
"""The names ``on_engine_failure`` accepts, in the order messages list them."""


def resolve_policy(value: object) -> Policy:
    """The policy ``value`` names: ``"fail"``, ``"route_around"``, ``"restart"`` (the
    default :class:`Restart`), or a policy object, returned as it is.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, Fail | RouteAround | Restart):
        return value
    if isinstance(value, str) and value in _NAMED:
        return _NAMED[value]
    raise ValueError(
        f"on_engine_failure must be one of {', '.join(map(repr, _NAMED))} or a "
        f"Restart(...), got {value!r}"
    )


FailurePolicy = Literal["fail", "route_around", "restart"] | Restart
"""What a client does when one of its engines dies (see
:func:`~trio_enginecore.open_engine_client`'s ``on_engine_failure``); ``"restart"`` is
``Restart()``."""


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
        delay = self.peek_delay(now)
        if delay is not None:
            self._times.append(now + delay)
        return delay

    def peek_delay(self, now: float) -> float | None:
        """What :meth:`next_delay` would answer at ``now``, counting nothing (to
        announce a restart when the engine dies, before its turn comes)."""
        policy = self._policy
        times = self._times
        while times and times[0] <= now - policy.window_s:
            times.popleft()
        if len(times) >= policy.max_restarts:
            return None
        return min(policy.backoff_s * 2.0 ** len(times), policy.max_backoff_s)

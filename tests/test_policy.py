"""The failure policies, one verdict each (pure, synchronous).

``on_engine_failure`` is resolved once into a policy; each policy says what one
engine's death does, given how many other engines are in service (or restarting), and
the client's state carries the verdict out. The real engines' side of each policy is in
tests/test_failure_policy.py.
"""

from __future__ import annotations

import pytest

from trio_enginecore.client._core._engines import EngineHandle
from trio_enginecore.client._core._policy import (
    Fail,
    Policy,
    Restart,
    RouteAround,
    resolve_policy,
)
from trio_enginecore.client._core._state import ClientState


def test_fail_fails_the_client_whatever_is_left() -> None:
    assert Fail().on_death(others_in_service=0) == "fail_client"
    assert Fail().on_death(others_in_service=3) == "fail_client"


def test_route_around_serves_on_while_another_engine_serves() -> None:
    assert RouteAround().on_death(others_in_service=2) == "serve_on"
    assert RouteAround().on_death(others_in_service=0) == "fail_client"


def test_restart_restarts_even_the_last_engine() -> None:
    assert Restart().on_death(others_in_service=0) == "restart"
    assert Restart(max_restarts=1).on_death(others_in_service=4) == "restart"


def test_the_names_resolve_once_and_objects_pass_through() -> None:
    assert resolve_policy("fail") == Fail()
    assert resolve_policy("route_around") == RouteAround()
    assert resolve_policy("restart") == Restart()
    custom = Restart(max_restarts=2)
    assert resolve_policy(custom) is custom
    with pytest.raises(ValueError, match="on_engine_failure must be one of 'fail'"):
        resolve_policy("route-around")


def _state(policy: Policy, engines: int) -> ClientState:
    handles = [EngineHandle.for_rank(rank) for rank in range(engines)]
    return ClientState(handles, lambda engine, ids: None, policy=policy)


@pytest.mark.parametrize(
    ("policy", "states", "client_failed"),
    [
        (Fail(), ["dead", "alive"], True),
        (RouteAround(), ["dead", "alive"], False),
        (Restart(), ["restarting", "alive"], False),
    ],
)
def test_the_state_carries_out_each_policys_verdict(
    policy: Policy, states: list[str], client_failed: bool
) -> None:
    state = _state(policy, 2)
    assert state.lifecycle.engine_died(state.engines[0], "killed")
    assert [engine.state for engine in state.engines] == states
    assert (state.failure is not None) == client_failed


def test_the_last_engine_routed_around_fails_the_client_saying_none_is_left() -> None:
    state = _state(RouteAround(), 2)
    state.lifecycle.engine_died(state.engines[0], "first")
    assert state.failure is None
    state.lifecycle.engine_died(state.engines[1], "second")
    assert state.failure is not None
    assert state.failure.startswith("no engine is left: engine rank 1 died: second")


def test_a_restarting_engine_given_up_fails_the_client_only_when_none_is_left() -> None:
    state = _state(Restart(), 2)
    first, second = state.engines
    state.lifecycle.engine_died(first, "killed")
    state.lifecycle.engine_given_up(first, "not restarted again")
    assert (first.state, state.failure) == ("dead", None)  # rank 1 serves
    state.lifecycle.engine_died(second, "killed")
    assert second.state == "restarting"
    assert state.failure is None
    state.lifecycle.engine_given_up(second, "not restarted again")
    assert state.failure is not None
    assert state.failure.startswith("no engine is left")

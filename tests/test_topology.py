"""plan_topology: where a multiprocess client's sockets go and which engines it waits
for, decided before anything is bound or launched; checked with no sockets."""

from __future__ import annotations

import attrs
import pytest

from trio_enginecore._curve import CurveKeyPair, CurveServer
from trio_enginecore._listeners import ListenerFd
from trio_enginecore.client import LeastLoaded, Liveness, RemoteEngines
from trio_enginecore.client._core._liveness_rules import DEFAULT_LIVENESS, RECONNECT_GRACE_S
from trio_enginecore.client._core._router import DataParallelRole
from trio_enginecore.client._multiprocess._topology import (
    ATTRIBUTION_WINDOW_S,
    EXTERNAL_LB_NEEDS_COORDINATOR,
    CoordinatorSource,
    Topology,
    plan_topology,
)
from trio_enginecore.config import EngineConfig
from trio_enginecore.coordinator import CoordinatorAddresses

INPUT = "tcp://10.0.0.1:7001"
OUTPUT = "tcp://10.0.0.1:7002"
REMOTE = "tcp://127.0.0.1:5555"
COORDINATOR = CoordinatorAddresses.in_directory("/tmp/x")


def single() -> DataParallelRole:
    return DataParallelRole.single(EngineConfig())


def balanced(size: int = 2, coordinator: CoordinatorAddresses | None = None) -> DataParallelRole:
    return DataParallelRole.balanced(
        EngineConfig(data_parallel_size=size), LeastLoaded(), coordinator
    )


def one_rank(rank: int = 1, coordinator: CoordinatorAddresses | None = None) -> DataParallelRole:
    config = EngineConfig(data_parallel_size=2, data_parallel_rank=rank)
    return DataParallelRole.one_rank(config, coordinator)


def attach(role: DataParallelRole, liveness: Liveness | None = None) -> Topology:
    return plan_topology(role, input_address=INPUT, output_address=OUTPUT, liveness=liveness)


def joining(remote: RemoteEngines, *ranks: int) -> RemoteEngines:
    """``remote`` with ``ranks=ranks``. mypy's attrs plugin refuses every value of that
    argument (the type variable of its converter, ``optional(frozenset)``, goes
    unsolved), in the constructor and in ``attrs.evolve`` alike: hence the one ignore."""
    return attrs.evolve(remote, ranks=frozenset(ranks))


def curve() -> CurveServer:
    return CurveServer(CurveKeyPair.generate(), [])


# ----------------------------------------------------------------- launching


def test_launching_is_the_plan_without_addresses_or_remote_engines() -> None:
    assert plan_topology(single()) == Topology(
        input_address=None,
        output_address=None,
        handshake_address=None,
        handshakes=True,
        ranks=(0,),
        launched=(0,),
        private_dir=True,
        curve=None,
        local_engine_keys=False,
        coordinator=CoordinatorSource.NONE,
        liveness=None,
        attribution_window_s=ATTRIBUTION_WINDOW_S,
    )


def test_launching_launches_every_rank_and_handshakes() -> None:
    topology = plan_topology(balanced(3))
    assert (topology.ranks, topology.launched) == ((0, 1, 2), (0, 1, 2))
    assert topology.handshakes is True
    assert topology.attached is False


def test_launched_engines_sockets_are_in_the_private_directory() -> None:
    topology = plan_topology(single())
    assert topology.private_dir is True
    assert topology.addresses("/run/c") == (
        "ipc:///run/c/input",
        "ipc:///run/c/output",
        "ipc:///run/c/handshake",
    )


def test_launched_engines_are_checked_too_since_a_live_process_may_be_hung() -> None:
    """Their exits say when they die, but not when they stop or hang: the checks do."""
    liveness = Liveness(heartbeat_interval_s=1.0, progress_timeout_s=2.0)
    topology = plan_topology(single(), liveness=liveness)
    assert topology.liveness == liveness
    # Their exits still identify the sender of an ENGINE_CORE_DEAD promptly.
    assert topology.attribution_window_s == ATTRIBUTION_WINDOW_S


def test_launched_engines_without_liveness_checks_have_none() -> None:
    assert plan_topology(balanced(2), liveness=None).liveness is None


def test_the_attribution_window_of_launched_engines_is_two_seconds() -> None:
    assert ATTRIBUTION_WINDOW_S == 2.0
    assert plan_topology(balanced(2)).attribution_window_s == 2.0


# ----------------------------------------------------------------- attaching


def test_attaching_is_the_plan_with_both_addresses() -> None:
    liveness = Liveness(heartbeat_interval_s=1.5, heartbeat_timeout_s=4.0)
    assert attach(single(), liveness) == Topology(
        input_address=INPUT,
        output_address=OUTPUT,
        handshake_address=None,
        handshakes=False,
        ranks=(0,),
        launched=(),
        private_dir=False,
        curve=None,
        local_engine_keys=False,
        coordinator=CoordinatorSource.NONE,
        liveness=liveness,
        attribution_window_s=1.5 + 4.0 + RECONNECT_GRACE_S + ATTRIBUTION_WINDOW_S,
    )


def test_an_attached_client_has_no_handshake_and_keeps_its_addresses_verbatim() -> None:
    topology = attach(single())
    assert topology.attached is True
    assert topology.addresses(None) == (INPUT, OUTPUT, None)


def test_attaching_to_ipc_addresses_keeps_them_verbatim_too() -> None:
    topology = plan_topology(
        single(), input_address="ipc:///srv/in", output_address="ipc:///srv/out"
    )
    assert (topology.input_address, topology.output_address) == ("ipc:///srv/in", "ipc:///srv/out")
    assert topology.addresses(None) == ("ipc:///srv/in", "ipc:///srv/out", None)
    assert topology.private_dir is False


def test_attaching_to_listener_descriptors_keeps_them_as_given() -> None:
    inputs, outputs = ListenerFd(7), ListenerFd(8)
    topology = plan_topology(single(), input_address=inputs, output_address=outputs)
    assert topology.addresses(None) == (inputs, outputs, None)
    assert topology.launched == ()


def test_attaching_launches_nothing_and_waits_for_every_rank() -> None:
    topology = attach(balanced(3))
    assert (topology.ranks, topology.launched) == ((0, 1, 2), ())
    assert topology.private_dir is False


def test_attaching_without_liveness_has_no_checks_and_no_attribution_window() -> None:
    topology = attach(single(), liveness=None)
    assert topology.liveness is None
    assert topology.attribution_window_s is None


def test_attaching_without_heartbeats_has_no_attribution_window() -> None:
    """Nothing then tells which engine went away after its ENGINE_CORE_DEAD."""
    topology = attach(single(), liveness=Liveness(heartbeat_interval_s=None))
    assert topology.attribution_window_s is None


@pytest.mark.parametrize(
    ("input_address", "output_address"), [(INPUT, None), (None, OUTPUT)], ids=["input", "output"]
)
def test_attaching_with_only_one_address_raises_value_error(
    input_address: str | None, output_address: str | None
) -> None:
    with pytest.raises(ValueError, match="needs both input_address and output_address"):
        plan_topology(single(), input_address=input_address, output_address=output_address)


def test_attach_addresses_together_with_remote_engines_raise_value_error() -> None:
    with pytest.raises(ValueError, match="give remote= or the attach addresses, not both"):
        plan_topology(
            single(), input_address=INPUT, output_address=OUTPUT, remote=RemoteEngines(REMOTE)
        )


def test_one_attach_address_together_with_remote_engines_names_the_missing_address() -> None:
    with pytest.raises(ValueError, match="needs both input_address and output_address"):
        plan_topology(single(), input_address=INPUT, remote=RemoteEngines(REMOTE))


# ----------------------------------------------------------------- remote engines


def test_remote_engines_are_the_plan_with_a_handshake_over_tcp() -> None:
    remote = RemoteEngines(REMOTE)
    liveness = Liveness(heartbeat_interval_s=3.0, heartbeat_timeout_s=9.0)
    assert plan_topology(single(), remote=remote, liveness=liveness) == Topology(
        input_address="tcp://127.0.0.1:*",
        output_address="tcp://127.0.0.1:*",
        handshake_address=REMOTE,
        handshakes=True,
        ranks=(0,),
        launched=(),
        private_dir=False,
        curve=None,
        local_engine_keys=False,
        coordinator=CoordinatorSource.NONE,
        liveness=liveness,
        attribution_window_s=3.0 + 9.0 + RECONNECT_GRACE_S + ATTRIBUTION_WINDOW_S,
    )


def test_remote_engines_addresses_need_no_private_directory() -> None:
    topology = plan_topology(balanced(2), remote=RemoteEngines(REMOTE))
    assert topology.addresses(None) == ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", REMOTE)
    assert topology.attached is False


def test_remote_engines_are_checked_as_every_other_kind() -> None:
    """One ``Liveness`` for every kind of engine: no second set on ``RemoteEngines``."""
    topology = plan_topology(single(), remote=RemoteEngines(REMOTE), liveness=DEFAULT_LIVENESS)
    assert topology.liveness is DEFAULT_LIVENESS
    assert topology.attribution_window_s == pytest.approx(0.3 + 1.5 + 0.5 + ATTRIBUTION_WINDOW_S)
    assert not hasattr(RemoteEngines(REMOTE), "liveness_interval_s")


def test_ranks_not_named_remote_are_launched_here_over_tcp_with_no_private_directory() -> None:
    remote = joining(RemoteEngines(REMOTE), 1)
    liveness = Liveness(heartbeat_interval_s=2.0, heartbeat_timeout_s=6.0)
    topology = plan_topology(balanced(2), remote=remote, liveness=liveness)
    assert (topology.ranks, topology.launched) == ((0, 1), (0,))
    # They use TCP like the remote ones; without CURVE there are no key files to keep.
    assert topology.private_dir is False
    assert topology.handshake_address == REMOTE
    assert topology.liveness == liveness
    # Not every engine is a child process: the remote one's death shows in its connection.
    assert topology.attribution_window_s == 2.0 + 6.0 + RECONNECT_GRACE_S + ATTRIBUTION_WINDOW_S


def test_remote_ranks_naming_a_rank_the_role_does_not_have_raise_value_error() -> None:
    with pytest.raises(ValueError, match=r"names rank\(s\) \[2\], but the client's ranks are"):
        plan_topology(balanced(2), remote=joining(RemoteEngines(REMOTE), 1, 2))


def test_remote_ranks_are_checked_against_a_one_rank_roles_rank() -> None:
    with pytest.raises(ValueError, match=r"names rank\(s\) \[0\]"):
        plan_topology(one_rank(1, COORDINATOR), remote=joining(RemoteEngines(REMOTE), 0))


# ----------------------------------------------------------------- CURVE


def test_curve_remote_engines_make_every_socket_a_curve_server() -> None:
    server = curve()
    topology = plan_topology(balanced(2), remote=RemoteEngines(REMOTE, curve=server))
    assert topology.curve is server
    assert topology.local_engine_keys is False
    assert topology.private_dir is False


def test_engines_launched_beside_curve_remote_ones_get_keys_of_their_own() -> None:
    server = curve()
    topology = plan_topology(balanced(2), remote=joining(RemoteEngines(REMOTE, curve=server), 1))
    assert topology.curve is server
    assert topology.local_engine_keys is True
    assert topology.private_dir is True


def test_without_curve_no_local_engine_keys() -> None:
    topology = plan_topology(balanced(2), remote=joining(RemoteEngines(REMOTE), 1))
    assert (topology.curve, topology.local_engine_keys) == (None, False)
    launching = plan_topology(single())
    assert (launching.curve, launching.local_engine_keys) == (None, False)


# ----------------------------------------------------------------- coordinator


def test_a_client_that_is_not_data_parallel_follows_no_coordinator() -> None:
    assert plan_topology(single()).coordinator is CoordinatorSource.NONE
    assert attach(single()).coordinator is CoordinatorSource.NONE
    assert plan_topology(single(), remote=RemoteEngines(REMOTE)).coordinator is (
        CoordinatorSource.NONE
    )


def test_a_single_role_over_several_ranks_follows_no_coordinator() -> None:
    role = DataParallelRole.single(EngineConfig(data_parallel_size=2))
    assert plan_topology(role).coordinator is CoordinatorSource.NONE


@pytest.mark.parametrize(
    "role", [balanced(2, COORDINATOR), one_rank(1, COORDINATOR)], ids=["balanced", "one_rank"]
)
@pytest.mark.parametrize("shape", ["launch", "attach", "remote"])
def test_a_coordinator_given_is_followed_whatever_the_shape(
    role: DataParallelRole, shape: str
) -> None:
    if shape == "launch":
        topology = plan_topology(role)
    elif shape == "attach":
        topology = attach(role)
    else:
        topology = plan_topology(role, remote=RemoteEngines(REMOTE))
    assert topology.coordinator is CoordinatorSource.GIVEN


@pytest.mark.parametrize("role", [balanced(2), one_rank(1)], ids=["balanced", "one_rank"])
def test_attached_data_parallel_engines_announce_their_coordinator(role: DataParallelRole) -> None:
    assert attach(role).coordinator is CoordinatorSource.ANNOUNCED


def test_a_balanced_client_launching_engines_launches_its_coordinator() -> None:
    assert plan_topology(balanced(2)).coordinator is CoordinatorSource.LAUNCHED


def test_a_balanced_client_of_remote_engines_launches_its_coordinator() -> None:
    topology = plan_topology(balanced(2), remote=RemoteEngines(REMOTE))
    assert topology.coordinator is CoordinatorSource.LAUNCHED


def test_external_load_balancing_launching_without_a_coordinator_raises_value_error() -> None:
    with pytest.raises(ValueError, match="data_parallel_external_lb") as raised:
        plan_topology(one_rank(1))
    assert str(raised.value) == EXTERNAL_LB_NEEDS_COORDINATOR


def test_external_load_balancing_of_a_remote_rank_without_a_coordinator_raises_too() -> None:
    """The remote engine learns its coordinator from the handshake: there is none."""
    with pytest.raises(ValueError, match="data_parallel_external_lb") as raised:
        plan_topology(one_rank(0), remote=RemoteEngines(REMOTE))
    assert str(raised.value) == EXTERNAL_LB_NEEDS_COORDINATOR


def test_a_one_rank_client_launches_only_its_own_rank() -> None:
    topology = plan_topology(one_rank(1, COORDINATOR))
    assert (topology.ranks, topology.launched) == ((1,), (1,))
    assert topology.attribution_window_s == ATTRIBUTION_WINDOW_S

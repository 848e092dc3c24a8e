"""The router and the wave follower: where each request goes, and what the coordinator
last published. Plain objects, checked with no sockets (and an event loop only to
watch a waiter wake)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import trio
import trio.testing

from trio_enginecore.client import EngineLoad, LeastLoaded, PowerOfTwoChoices
from trio_enginecore.client._core._engines import EngineHandle
from trio_enginecore.client._core._router import DataParallelRole, Router, WaveFollower
from trio_enginecore.config import EngineConfig
from trio_enginecore.coordinator import CoordinatorAddresses
from trio_enginecore.errors import EngineDeadError, ProtocolError
from trio_enginecore.protocol import CoordinatorPublication, EngineCoreRequest


def engines(*ranks: int) -> list[EngineHandle]:
    return [EngineHandle.for_rank(rank) for rank in ranks]


def request(data_parallel_rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest.for_tokens([1, 2], data_parallel_rank=data_parallel_rank)


def loaded(handles: list[EngineHandle], *running: int) -> list[EngineHandle]:
    for handle, count in zip(handles, running, strict=True):
        handle.load = EngineLoad(running=count)
    return handles


def publication(
    counts: list[tuple[int, int, float]] | None, wave: int = 0, running: bool = False
) -> CoordinatorPublication:
    return CoordinatorPublication(counts=counts, current_wave=wave, engines_running=running)


def wakes_a_waiter(follower: WaveFollower, change: Callable[[], object]) -> bool:
    """Whether ``change()`` wakes a task waiting in ``follower.wait_changed()``."""
    woken: list[bool] = []

    async def main() -> None:
        async def wait() -> None:
            await follower.wait_changed()
            woken.append(True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            change()
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()

    trio.run(main)
    return woken == [True]


# ----------------------------------------------------------------- roles


def test_a_single_role_has_every_rank_of_the_config_and_no_balancer_or_coordinator() -> None:
    role = DataParallelRole.single(EngineConfig())
    assert role == DataParallelRole(
        ranks=range(1),
        load_balancer=None,
        coordinator=None,
        data_parallel=False,
        launches_coordinator=False,
    )


def test_a_single_role_over_a_data_parallel_config_keeps_all_its_ranks() -> None:
    assert DataParallelRole.single(EngineConfig(data_parallel_size=3)).ranks == range(3)


def test_a_one_rank_role_owns_only_its_rank_and_follows_the_coordinator_given() -> None:
    coordinator = CoordinatorAddresses.in_directory("/tmp/x")
    config = EngineConfig(data_parallel_size=4, data_parallel_rank=2)
    role = DataParallelRole.one_rank(config, coordinator)
    assert role == DataParallelRole(
        ranks=range(2, 3),
        load_balancer=None,
        coordinator=coordinator,
        data_parallel=True,
        launches_coordinator=False,
    )


def test_a_one_rank_role_may_have_no_coordinator_yet() -> None:
    config = EngineConfig(data_parallel_size=2, data_parallel_rank=1)
    role = DataParallelRole.one_rank(config, None)
    assert (role.ranks, role.coordinator, role.data_parallel) == (range(1, 2), None, True)
    assert role.launches_coordinator is False


def test_a_balanced_role_has_every_rank_the_balancer_and_launches_a_coordinator() -> None:
    balancer = LeastLoaded()
    role = DataParallelRole.balanced(EngineConfig(data_parallel_size=3), balancer, None)
    assert role == DataParallelRole(
        ranks=range(3),
        load_balancer=balancer,
        coordinator=None,
        data_parallel=True,
        launches_coordinator=True,
    )
    assert role.load_balancer is balancer


def test_a_balanced_role_keeps_the_coordinator_given() -> None:
    coordinator = CoordinatorAddresses.on_host("127.0.0.1")
    role = DataParallelRole.balanced(EngineConfig(data_parallel_size=2), LeastLoaded(), coordinator)
    assert role.coordinator is coordinator
    assert role.launches_coordinator is True


# ----------------------------------------------------------------- routing


def test_without_a_balancer_one_engine_takes_every_request() -> None:
    handles = engines(0)
    router = Router(handles, None)
    assert [router.engine_for(request()) for _ in range(3)] == [handles[0]] * 3


def test_without_a_balancer_every_request_goes_to_the_first_of_several_engines() -> None:
    handles = loaded(engines(0, 1), 50, 0)
    router = Router(handles, None)
    assert router.engine_for(request()) is handles[0]
    assert router.engine_for(request(data_parallel_rank=1)) is handles[0]
    assert [handle.load.waiting for handle in handles] == [0, 0]


def test_without_a_balancer_a_named_rank_still_goes_to_the_one_engine() -> None:
    """The one-rank client owns a single engine: the rank is not its index."""
    handles = engines(1)
    assert Router(handles, None).engine_for(request(data_parallel_rank=1)) is handles[0]


@pytest.mark.parametrize(
    "balancer",
    [LeastLoaded(), PowerOfTwoChoices(rng=random.Random(3))],
    ids=["LeastLoaded", "PowerOfTwoChoices"],
)
def test_with_a_balancer_the_least_loaded_engine_gets_the_request(
    balancer: LeastLoaded | PowerOfTwoChoices,
) -> None:
    # With two engines both policies compare the same pair.
    handles = loaded(engines(0, 1), 9, 2)
    router = Router(handles, balancer)
    assert router.engine_for(request()) is handles[1]


def test_the_least_loaded_of_several_engines_gets_the_request() -> None:
    handles = loaded(engines(0, 1, 2), 4, 7, 1)
    assert Router(handles, LeastLoaded()).engine_for(request()).rank == 2


def test_the_chosen_engine_counts_the_request_as_waiting() -> None:
    handles = loaded(engines(0, 1), 3, 0)
    Router(handles, LeastLoaded()).engine_for(request())
    assert [handle.load.waiting for handle in handles] == [0, 1]


def test_a_request_naming_its_rank_goes_to_that_engine() -> None:
    handles = loaded(engines(0, 1, 2), 0, 100, 0)
    router = Router(handles, LeastLoaded())
    assert router.engine_for(request(data_parallel_rank=1)) is handles[1]


@pytest.mark.parametrize("rank", [3, -1])
def test_a_request_naming_a_rank_out_of_range_raises_value_error(rank: int) -> None:
    handles = engines(0, 1, 2)
    router = Router(handles, LeastLoaded())
    with pytest.raises(ValueError, match=rf"data_parallel_rank {rank} is out of range"):
        router.engine_for(request(data_parallel_rank=rank))
    assert [handle.load.waiting for handle in handles] == [0, 0, 0]


def test_utilities_go_to_the_first_engine() -> None:
    handles = engines(0, 1, 2)
    assert Router(handles, LeastLoaded()).utility_engine() is handles[0]
    assert Router(engines(5), None).utility_engine().rank == 5


def test_the_router_sees_engines_added_to_its_list_in_place() -> None:
    """The client's state and the router share one list, which the transport fills."""
    shared: list[EngineHandle] = []
    router = Router(shared, LeastLoaded())
    shared[:] = loaded(engines(0, 1), 5, 0)
    assert router.engines is shared
    assert router.engine_for(request()) is shared[1]
    assert router.utility_engine() is shared[0]


def out_of_service(router: Router, engine: EngineHandle) -> None:
    engine.state = "dead"
    engine.death = "killed by signal 9"
    router.take_out(engine)


@pytest.mark.parametrize("balancer", [LeastLoaded(), PowerOfTwoChoices(rng=random.Random(3))])
def test_an_engine_taken_out_of_service_is_never_chosen(
    balancer: LeastLoaded | PowerOfTwoChoices,
) -> None:
    handles = loaded(engines(0, 1, 2), 0, 9, 9)  # rank 0 would win every time
    router = Router(handles, balancer)
    out_of_service(router, handles[0])
    chosen = {router.engine_for(request()).rank for _ in range(200)}
    assert chosen == {1, 2}


def test_a_request_naming_a_rank_out_of_service_is_refused_before_anything_is_chosen() -> None:
    handles = engines(0, 1)
    router = Router(handles, LeastLoaded())
    out_of_service(router, handles[1])
    with pytest.raises(EngineDeadError, match=r"data_parallel_rank 1 is out of service.*signal 9"):
        router.check(request(data_parallel_rank=1))
    router.check(request(data_parallel_rank=0))
    assert router.engine_for(request(data_parallel_rank=0)) is handles[0]
    assert [h.load.waiting for h in handles] == [1, 0]  # the refusal counted nothing


@pytest.mark.parametrize("rank", [-1, 2])
def test_checking_a_request_naming_a_rank_out_of_range_raises_value_error(rank: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        Router(engines(0, 1), LeastLoaded()).check(request(data_parallel_rank=rank))


def test_utilities_go_to_the_first_engine_in_service() -> None:
    handles = engines(0, 1, 2)
    router = Router(handles, LeastLoaded())
    out_of_service(router, handles[0])
    assert router.utility_engine() is handles[1]
    assert router.live == handles[1:]


# ----------------------------------------------------------------- waves


def test_a_new_follower_is_at_wave_zero_not_running() -> None:
    follower = WaveFollower(stamps=True)
    assert (follower.current_wave, follower.engines_running) == (0, False)


def test_a_data_parallel_follower_stamps_requests_with_the_current_wave() -> None:
    follower = WaveFollower(stamps=True)
    follower.fold(publication(None, wave=3, running=True), engines(0))
    stamped = request()
    follower.stamp(stamped)
    assert stamped.current_wave == 3


def test_a_follower_that_does_not_stamp_leaves_the_requests_wave_alone() -> None:
    follower = WaveFollower(stamps=False)
    follower.fold(publication(None, wave=3, running=True), engines(0))
    unstamped = request()
    unstamped.current_wave = 7
    follower.stamp(unstamped)
    assert unstamped.current_wave == 7


def test_a_publication_sets_every_engines_counts_by_rank() -> None:
    handles = engines(0, 1)
    handles[1].load.in_flight = 4
    follower = WaveFollower(stamps=True)
    follower.fold(publication([(1, 2, 0.25), (3, 4, 0.5)], wave=2, running=True), handles)
    assert [handle.load for handle in handles] == [
        EngineLoad(waiting=1, running=2, kv_usage=0.25, in_flight=0),
        EngineLoad(waiting=3, running=4, kv_usage=0.5, in_flight=4),
    ]
    assert (follower.current_wave, follower.engines_running) == (2, True)


def test_a_one_rank_client_takes_the_counts_of_its_own_rank() -> None:
    handles = engines(1)
    WaveFollower(stamps=True).fold(publication([(1, 1, 0.1), (5, 6, 0.75)]), handles)
    assert handles[0].load == EngineLoad(waiting=5, running=6, kv_usage=0.75)


def test_a_publication_without_counts_changes_only_the_wave() -> None:
    handles = loaded(engines(0), 9)
    follower = WaveFollower(stamps=True)
    follower.fold(publication(None, wave=4, running=False), handles)
    assert handles[0].load == EngineLoad(running=9)
    assert (follower.current_wave, follower.engines_running) == (4, False)


def test_a_publication_missing_a_rank_raises_and_changes_nothing() -> None:
    handles = engines(0, 1, 2)
    handles[0].load = EngineLoad(waiting=7, running=8, kv_usage=0.9, in_flight=1)
    follower = WaveFollower(stamps=True)
    follower.fold(publication(None, wave=1, running=True), handles)
    with pytest.raises(ProtocolError, match=r"counts for 2 engine\(s\), not for rank 2"):
        follower.fold(publication([(0, 0, 0.0), (1, 1, 0.1)], wave=5, running=False), handles)
    assert handles[0].load == EngineLoad(waiting=7, running=8, kv_usage=0.9, in_flight=1)
    assert [handle.load for handle in handles[1:]] == [EngineLoad(), EngineLoad()]
    assert (follower.current_wave, follower.engines_running) == (1, True)


def test_a_publication_missing_the_one_rank_a_client_owns_raises() -> None:
    handles = engines(1)
    follower = WaveFollower(stamps=True)
    with pytest.raises(ProtocolError, match=r"counts for 1 engine\(s\), not for rank 1"):
        follower.fold(publication([(3, 3, 0.3)], wave=2), handles)
    assert handles[0].load == EngineLoad()
    assert follower.current_wave == 0


def test_a_rejected_publication_wakes_no_one() -> None:
    follower = WaveFollower(stamps=True)
    handles = engines(0, 1)

    def fold_short() -> None:
        with pytest.raises(ProtocolError):
            follower.fold(publication([(0, 0, 0.0)], wave=1, running=True), handles)

    assert wakes_a_waiter(follower, fold_short) is False


@pytest.mark.parametrize(
    ("wave", "running"), [(1, False), (0, True), (2, True)], ids=["wave", "running", "both"]
)
def test_a_change_of_wave_or_running_state_wakes_a_waiter(wave: int, running: bool) -> None:
    follower = WaveFollower(stamps=True)
    handles = engines(0)
    assert wakes_a_waiter(
        follower, lambda: follower.fold(publication(None, wave, running), handles)
    )
    assert (follower.current_wave, follower.engines_running) == (wave, running)


def test_a_change_sets_the_event_behind_wait_changed() -> None:
    follower = WaveFollower(stamps=True)
    changed = follower._changed  # pyright: ignore[reportPrivateUsage]
    follower.fold(publication([(1, 0, 0.0)], wave=1), engines(0))
    assert changed.is_set()
    # A fresh event for the next change.
    assert not follower._changed.is_set()  # pyright: ignore[reportPrivateUsage]


def test_a_publication_with_the_same_wave_and_state_wakes_no_one() -> None:
    follower = WaveFollower(stamps=True)
    handles = engines(0)
    follower.fold(publication(None, wave=3, running=True), handles)
    assert (
        wakes_a_waiter(
            follower, lambda: follower.fold(publication([(2, 1, 0.0)], 3, True), handles)
        )
        is False
    )
    # The counts were still taken in.
    assert handles[0].load == EngineLoad(waiting=2, running=1)


def test_the_first_publication_at_wave_zero_not_running_wakes_no_one() -> None:
    follower = WaveFollower(stamps=True)
    handles = engines(0)
    assert (
        wakes_a_waiter(follower, lambda: follower.fold(publication(None, 0, False), handles))
        is False
    )


def test_announce_wakes_waiters() -> None:
    follower = WaveFollower(stamps=False)
    assert wakes_a_waiter(follower, follower.announce)
    assert (follower.current_wave, follower.engines_running) == (0, False)


def test_announce_wakes_every_waiter_once_and_later_waiters_wait_for_the_next() -> None:
    follower = WaveFollower(stamps=True)
    woken: list[int] = []

    async def main() -> None:
        async def wait(name: int) -> None:
            await follower.wait_changed()
            woken.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, 1)
            nursery.start_soon(wait, 2)
            await trio.testing.wait_all_tasks_blocked()
            follower.announce()
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(wait, 3)
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(woken) == [1, 2]
            follower.announce()
            await trio.testing.wait_all_tasks_blocked()

    trio.run(main)
    assert sorted(woken) == [1, 2, 3]

"""Errors a program can act on: what died, where, and whether to try again.

``EngineDeadError`` carries, as attributes and not only in its message, the rank of
the engine that died, its pid (launched engines) or location (engines started
elsewhere), and ``retryable``: True when sending the request again on this client may
succeed (another engine serves, or the dead one is restarting), False when the client
failed as a whole. ``UtilityCallError`` says "failed" once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    InprocClient,
    SyncMPClient,
    UtilityCallError,
    open_engine_client,
)
from trio_enginecore.client._core._engines import EngineHandle
from trio_enginecore.client._core._policy import Fail, RouteAround
from trio_enginecore.client._core._state import ClientState
from trio_enginecore.client._core._stream import StreamFeed

from .support import children_of_this_process

# ------------------------------------------------------------------ pure: the state


def _state(engines: int, *, route_around: bool) -> ClientState:
    state = ClientState(
        [EngineHandle.for_rank(rank) for rank in range(engines)],
        lambda engine, ids: None,
        policy=RouteAround() if route_around else Fail(),
    )
    state.engines[1 % engines].location = "host-b"
    return state


def _stream_on(state: ClientState, rank: int) -> StreamFeed:
    request = EngineCoreRequest.for_tokens([1], request_id=f"on-{rank}")
    feed = StreamFeed(request.request_id, lambda feed: None)
    state.register(request, state.engines[rank], stream=feed)
    return feed


def test_a_death_routed_around_is_retryable_and_names_the_engine() -> None:
    state = _state(2, route_around=True)
    feed = _stream_on(state, 1)
    assert state.lifecycle.engine_died(state.engines[1], "it was killed")
    assert feed.failure_notice is not None
    error = feed.failure_notice.error()
    assert (error.rank, error.pid, error.location, error.retryable) == (1, None, "host-b", True)
    assert "it was killed" in str(error)
    state.raise_if_unusable()  # the client serves on


def test_the_death_that_fails_the_client_is_not_retryable() -> None:
    state = _state(1, route_around=False)
    feed = _stream_on(state, 0)
    assert state.lifecycle.engine_died(state.engines[0], "it was killed")
    assert feed.failure_notice is not None
    assert feed.failure_notice.error().retryable is False
    with pytest.raises(EngineDeadError) as raised:
        state.raise_if_unusable()
    assert (raised.value.rank, raised.value.retryable) == (0, False)
    # Each waiter gets its own exception object: tracebacks of several tasks never mix.
    assert state.dead_error() is not state.dead_error()


def test_the_last_engine_routed_around_fails_the_client_not_retryable() -> None:
    state = _state(2, route_around=True)
    state.lifecycle.engine_died(state.engines[0], "first")
    state.lifecycle.engine_died(state.engines[1], "second")
    error = state.dead_error()
    assert (error.rank, error.location, error.retryable) == (1, "host-b", False)
    assert str(error).startswith("no engine is left")


# ------------------------------------------------------------ real engine processes


async def test_a_killed_engine_error_names_its_rank_and_pid_under_fail() -> None:
    with trio.fail_after(30):
        with pytest.raises(EngineDeadError) as block_error:
            async with open_engine_client(EngineConfig(step_time_s=0.01)) as client:
                (pid,) = client.engine_pids
                assert pid is not None
                request = EngineCoreRequest.for_tokens([1], max_tokens=100_000)
                with pytest.raises(EngineDeadError) as stream_error:
                    async with client.stream(request) as outputs:
                        async for _ in outputs:
                            os.kill(pid, signal.SIGKILL)
                with pytest.raises(EngineDeadError) as later:
                    await client.add_request(EngineCoreRequest.for_tokens([2]))
    for error in (stream_error.value, later.value, block_error.value):
        assert (error.rank, error.pid, error.location) == (0, pid, None)
        assert error.retryable is False
        assert f"pid {pid}" in str(error)
    assert children_of_this_process() == []


async def test_under_route_around_the_dead_ranks_errors_are_retryable() -> None:
    config = EngineConfig(data_parallel_size=2, step_time_s=0.01)
    with trio.fail_after(30):
        async with open_engine_client(config, on_engine_failure="route_around") as client:
            victim = client.engine_pids[1]
            assert victim is not None
            request = EngineCoreRequest.for_tokens([1], max_tokens=100_000, data_parallel_rank=1)
            with pytest.raises(EngineDeadError) as stream_error:
                async with client.stream(request) as outputs:
                    async for _ in outputs:
                        os.kill(victim, signal.SIGKILL)
            error = stream_error.value
            assert (error.rank, error.pid, error.retryable) == (1, victim, True)
            # Naming the dead rank cannot succeed: not retryable as it stands.
            with pytest.raises(EngineDeadError) as pinned:
                await client.add_request(EngineCoreRequest.for_tokens([2], data_parallel_rank=1))
            assert (pinned.value.rank, pinned.value.retryable) == (1, False)
            # Sent again without the rank, the request is served by the engine left.
            tokens: list[int] = []
            async with client.stream(EngineCoreRequest.for_tokens([1], max_tokens=3)) as out:
                async for output in out:
                    tokens += output.new_token_ids
            assert tokens == [2, 3, 4]


async def test_a_utility_failure_says_failed_once() -> None:
    with trio.fail_after(30):
        async with open_engine_client(EngineConfig()) as client:
            with pytest.raises(UtilityCallError) as raised:
                await client.call_utility("sleep", 3)
    error = raised.value
    assert str(error).count("failed") == 1, str(error)
    assert str(error).startswith("utility call 'sleep' failed on the engine: ")
    assert error.engine_message.startswith("Call to sleep method failed: ")  # verbatim


@pytest.mark.parametrize("kind", [InprocClient, SyncMPClient])
def test_a_closed_blocking_client_raises_the_librarys_error_not_trios(
    kind: type[InprocClient | SyncMPClient],
) -> None:
    client = kind(EngineConfig())
    client.close()
    calls = [
        lambda: client.add_request(EngineCoreRequest.for_tokens([1])),
        client.get_output,
        lambda: client.abort_requests(["a"]),
        lambda: client.call_utility("is_sleeping"),
        client.is_sleeping,
    ]
    for call in calls:
        with pytest.raises(EngineDeadError, match="the engine client was closed") as raised:
            call()
        assert (raised.value.rank, raised.value.retryable) == (None, False)
    client.close()  # idempotent


def test_a_blocking_clients_errors_after_a_death_name_the_engine_even_once_closed() -> None:
    client = SyncMPClient(EngineConfig(step_time_s=0.01))
    try:
        (pid,) = client.engine_pids
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        for _ in range(300):
            if client.is_dead:
                break
            threading.Event().wait(0.05)
        assert client.is_dead
    finally:
        with contextlib.suppress(EngineDeadError):
            client.close()
    # Closed after the death: every call still says which engine died, and where.
    with pytest.raises(EngineDeadError) as later:
        client.add_request(EngineCoreRequest.for_tokens([1]))
    assert (later.value.rank, later.value.pid, later.value.retryable) == (0, pid, False)
    assert children_of_this_process() == []

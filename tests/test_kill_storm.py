"""SIGKILL an engine at a random moment: every waiter fails, nothing is left behind.

Each trial launches real engines, puts streams, batch requests and utility calls in
flight, and kills an engine with SIGKILL at a moment drawn from a seeded RNG (trial
``n`` uses ``random.Random(SEED + n)``, so a failing trial can be rerun alone). Then:

* every waiter of the killed engine gets ``EngineDeadError``: its streams, the
  ``get_output()`` reader, the utility calls; with data parallelism the streams of the
  surviving engine keep streaming (the client fails as a whole only when its block
  ends), as :class:`~trio_enginecore.client.DPLBTrioMPClient` documents;
* the client's block raises exactly one ``EngineDeadError``, never an ExceptionGroup;
* no child process is left and the file descriptors are back to what they were.

Engines killed during the startup (before the client is ready) give one
``EngineStartupError`` instead, with the same cleanliness.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from typing import Any

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    EngineStartupError,
    TrioMPClient,
    open_engine_client,
)
from trio_enginecore.client._multiprocess._startup import StartupProgress

from .support import children_of_this_process, open_fds

SEED = 20_240_611
SINGLE_ENGINE_TRIALS = 30
DATA_PARALLEL_TRIALS = 10
STARTUP_TRIALS = 6
STREAMS_PER_ENGINE = 3
BATCH_PER_ENGINE = 2


def long_request(request_id: str, rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest.for_tokens(
        [7], request_id=request_id, max_tokens=1_000_000, data_parallel_rank=rank
    )


class Waiters:
    """Streams, a batch reader and a utility caller on one client, and how each ended."""

    def __init__(self, client: TrioMPClient, ranks: int) -> None:
        self.client = client
        self.ranks = ranks
        self.ended: dict[str, BaseException | None] = {}
        self.tokens: dict[str, int] = {}
        self.started = 0

    def start(self, nursery: trio.Nursery) -> None:
        for rank in range(self.ranks):
            for i in range(STREAMS_PER_ENGINE):
                nursery.start_soon(self.stream, f"stream-{rank}-{i}", rank)
        nursery.start_soon(self.batch)
        nursery.start_soon(self.utility)

    async def _record(self, name: str, work: Callable[[], Any]) -> None:
        try:
            await work()
        except (EngineDeadError, trio.Cancelled) as exc:
            self.ended[name] = exc
            if isinstance(exc, trio.Cancelled):
                raise
        else:
            self.ended[name] = None

    async def stream(self, name: str, rank: int) -> None:
        async def work() -> None:
            self.tokens[name] = 0
            async with self.client.stream(long_request(name, rank)) as outputs:
                async for output in outputs:
                    self.tokens[name] += len(output.new_token_ids)

        await self._record(name, work)

    async def batch(self) -> None:
        async def work() -> None:
            await self.client.add_requests(
                long_request(f"batch-{rank}-{i}", rank)
                for rank in range(self.ranks)
                for i in range(BATCH_PER_ENGINE)
            )
            while True:
                await self.client.get_output()

        await self._record("batch", work)

    async def utility(self) -> None:
        async def work() -> None:
            while True:
                await self.client.call_utility("is_sleeping")

        await self._record("utility", work)

    def in_flight(self) -> int:
        return self.client.statistics().requests_in_flight

    @property
    def all_in_flight(self) -> int:
        return self.ranks * (STREAMS_PER_ENGINE + BATCH_PER_ENGINE)


def assert_nothing_left(fds_before: set[str]) -> None:
    assert children_of_this_process() == []
    assert open_fds() - fds_before == set()


@pytest.mark.parametrize("trial", range(SINGLE_ENGINE_TRIALS))
async def test_an_engine_killed_at_a_random_moment_fails_every_waiter(trial: int) -> None:
    rng = random.Random(SEED + trial)
    fds_before = open_fds()
    with trio.fail_after(60), pytest.raises(EngineDeadError) as caught:
        async with open_engine_client(EngineConfig(step_time_s=0.002)) as client:
            pid = client.engine_pids[0]
            assert pid is not None
            waiters = Waiters(client, ranks=1)
            async with trio.open_nursery() as nursery:
                waiters.start(nursery)
                # Anywhere from before the first request is sent to well after all are.
                await trio.sleep(rng.uniform(0, 0.15))
                os.kill(pid, signal.SIGKILL)
            assert client.is_dead
    assert type(caught.value) is EngineDeadError
    assert "killed by signal 9" in str(caught.value)
    names = {f"stream-0-{i}" for i in range(STREAMS_PER_ENGINE)} | {"batch", "utility"}
    assert set(waiters.ended) == names
    for name, ended in waiters.ended.items():
        assert isinstance(ended, EngineDeadError), (name, ended)
    assert_nothing_left(fds_before)


@pytest.mark.parametrize("trial", range(DATA_PARALLEL_TRIALS))
async def test_a_killed_rank_fails_its_waiters_while_the_other_streams_on(trial: int) -> None:
    rng = random.Random(SEED + 1000 + trial)
    victim = rng.randrange(2)
    survivor = 1 - victim
    fds_before = open_fds()
    config = EngineConfig(data_parallel_size=2, step_time_s=0.002)
    with trio.fail_after(60), pytest.raises(EngineDeadError) as caught:
        async with open_engine_client(config) as client:
            pid = client.engine_pids[victim]
            assert pid is not None
            waiters = Waiters(client, ranks=2)
            with trio.CancelScope() as survivors:
                async with trio.open_nursery() as nursery:
                    waiters.start(nursery)
                    with trio.fail_after(10):
                        while waiters.in_flight() < waiters.all_in_flight or not all(
                            waiters.tokens.get(f"stream-{r}-{i}")
                            for r in range(2)
                            for i in range(STREAMS_PER_ENGINE)
                        ):
                            await trio.sleep(0.005)
                    await trio.sleep(rng.uniform(0, 0.1))
                    os.kill(pid, signal.SIGKILL)
                    mine = [f"stream-{victim}-{i}" for i in range(STREAMS_PER_ENGINE)]
                    with trio.fail_after(5):
                        while not all(name in waiters.ended for name in mine):
                            await trio.sleep(0.005)
                    # The survivor's streams are still streaming after the death...
                    theirs = [f"stream-{survivor}-{i}" for i in range(STREAMS_PER_ENGINE)]
                    counts = {name: waiters.tokens[name] for name in theirs}
                    with trio.fail_after(5):
                        while not all(waiters.tokens[n] > counts[n] for n in theirs):
                            await trio.sleep(0.005)
                    # ...until we leave them.
                    survivors.cancel()
            assert client.is_dead
    assert type(caught.value) is EngineDeadError
    assert f"engine rank {victim}" in str(caught.value)
    for name in [*mine, "batch", "utility"]:
        assert isinstance(waiters.ended[name], EngineDeadError), (name, waiters.ended[name])
    for name in theirs:
        assert isinstance(waiters.ended[name], trio.Cancelled), (name, waiters.ended[name])
    assert_nothing_left(fds_before)


@pytest.mark.parametrize("trial", range(STARTUP_TRIALS))
async def test_an_engine_killed_during_startup_gives_one_startup_error(
    trial: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed before the client sent it the addresses: still importing, or having
    said HELLO. It can never become ready, whatever the moment."""
    rng = random.Random(SEED + 2000 + trial)
    delay = rng.uniform(0, 2.0)
    handshake = StartupProgress.handshake
    killed: list[float] = []

    async def kill_then_handshake(progress: StartupProgress, *args: Any) -> None:
        await trio.sleep(delay)
        (engine,) = progress.engines
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        killed.append(delay)
        await handshake(progress, *args)

    monkeypatch.setattr(StartupProgress, "handshake", kill_then_handshake)
    fds_before = open_fds()
    with trio.fail_after(60), pytest.raises(EngineStartupError) as caught:
        async with open_engine_client(EngineConfig(), ready_timeout_s=30):
            pytest.fail("the engine was killed before it could be ready")
    assert killed == [delay]
    assert type(caught.value) is EngineStartupError
    assert "killed by signal 9" in str(caught.value)
    assert_nothing_left(fds_before)

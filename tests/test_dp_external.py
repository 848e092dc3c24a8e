"""External load balancing: clients each owning one rank, sharing a coordinator."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from functools import partial

import trio

from trio_enginecore import (
    CoordinatorAddresses,
    EngineConfig,
    EngineCoreRequest,
    open_coordinator,
    open_engine_client,
)
from trio_enginecore.client import DPTrioMPClient

from .support import children_of_this_process, expected


def rank_config(rank: int, size: int = 2) -> EngineConfig:
    return EngineConfig(
        data_parallel_size=size,
        data_parallel_rank=rank,
        data_parallel_external_lb=True,
        step_time_s=0.01,
    )


@asynccontextmanager
async def open_group(
    coordinator: CoordinatorAddresses, size: int = 2
) -> AsyncGenerator[list[DPTrioMPClient], None]:
    """One client per rank, opened together: each rank's engine waits for the
    coordinator's READY, which comes once every engine of the group subscribed."""
    clients: dict[int, DPTrioMPClient] = {}
    ready = trio.Event()
    done = trio.Event()

    async def hold(rank: int) -> None:
        async with open_engine_client(rank_config(rank, size), coordinator=coordinator) as client:
            assert isinstance(client, DPTrioMPClient)
            clients[rank] = client
            if len(clients) == size:
                ready.set()
            await done.wait()

    async with trio.open_nursery() as nursery:
        for rank in range(size):
            nursery.start_soon(hold, rank)
        await ready.wait()
        try:
            yield [clients[rank] for rank in range(size)]
        finally:
            done.set()


async def generate(client: DPTrioMPClient, rid: str, prompt: list[int], tokens: int) -> None:
    got: list[int] = []
    async with client.stream(
        EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=tokens)
    ) as outputs:
        async for output in outputs:
            got += output.new_token_ids
    assert got == expected(prompt, tokens)


async def test_each_client_launches_and_uses_only_its_own_rank() -> None:
    with trio.fail_after(60):
        async with open_coordinator(2) as coordinator, open_group(coordinator) as clients:
            for rank, client in enumerate(clients):
                assert len(client.engine_pids) == 1
                assert client.engines[0] is not None
                await generate(client, f"r{rank}", [rank + 1], 5)
                counts = await client.get_request_counts_per_engine()
                assert counts == [(0, 0)]
    assert children_of_this_process() == []


async def test_two_clients_sharing_a_coordinator_both_see_the_waves() -> None:
    seen: list[list[tuple[int, bool]]] = [[], []]

    async def watch(
        client: DPTrioMPClient,
        log: list[tuple[int, bool]],
        until: int,
        *,
        task_status: trio.TaskStatus[None],
    ) -> None:
        task_status.started()  # we park in wait_wave_change() before the caller resumes
        while (state := await client.wait_wave_change()) != (until, False):
            log.append(state)
        log.append(state)

    with trio.fail_after(60):
        async with open_coordinator(2) as coordinator, open_group(coordinator) as clients:
            assert [(c.current_wave, c.engines_running) for c in clients] == [(0, False)] * 2
            # Wave 0: started by client 0's request, while client 1 only watches.
            async with trio.open_nursery() as nursery:
                for client, log in zip(clients, seen, strict=True):
                    await nursery.start(partial(watch, client, log, 1))
                await generate(clients[0], "a", [1], 20)
            # Wave 1: started by client 1 this time, stamped with the wave it learnt.
            async with trio.open_nursery() as nursery:
                for client, log in zip(clients, seen, strict=True):
                    await nursery.start(partial(watch, client, log, 2))
                await generate(clients[1], "b", [2], 20)
    for log in seen:
        assert log == [(0, True), (1, False), (1, True), (2, False)], seen

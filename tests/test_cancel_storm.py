"""A cancel storm: thousands of requests, half of them cut at random, through every API.

Each request is served one way, picked at random (the seed makes every run the same
storm): a stream read to the end, a stream under a cancel scope cancelled at a random
moment, a stream left by ``break``, a stream aborted with ``abort_requests`` by another
task, a stream whose every ``receive()`` runs under a tiny timeout and is retried, a
batch request read through ``get_output()`` calls under tiny timeouts, and a batch
request aborted at a random moment. Utility calls under tiny timeouts run throughout.

Afterwards: every uncut request got exactly its tokens, every cut one a prefix of them
and nothing after its abort returned, and nothing is left: no request in flight, no
open stream, no pending call, and the engine holds (0, 0).
"""

from __future__ import annotations

import random
from typing import Final

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    FinishReason,
    TrioMPClient,
    open_engine_client,
)

from .support import expected

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REQUESTS: Final = 3000
CONCURRENCY: Final = 200
MODES: Final = (
    "stream",
    "stream-cancelled",
    "stream-break",
    "stream-aborted",
    "stream-receive-timeouts",
    "batch",
    "batch-aborted",
)
CUT: Final = {"stream-cancelled", "stream-break", "stream-aborted", "batch-aborted"}


class Storm:
    def __init__(self, client: TrioMPClient, seed: int) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.plans: dict[str, tuple[str, list[int], int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, FinishReason | None] = {}
        self.aborted_batch: set[str] = set()
        self.after_abort: list[str] = []
        self.batch_open: set[str] = set()
        self.batch_changed = trio.Event()
        self.utility_timeouts = 0
        self.receive_timeouts = 0

    def plan(self, i: int) -> str:
        rid = f"r{i}"
        mode = self.rng.choice(MODES)
        prompt = [1 + (i * 7919) % 30_000]
        self.plans[rid] = (mode, prompt, self.rng.randint(1, 40))
        self.tokens[rid] = []
        self.finish[rid] = None
        return rid

    def request(self, rid: str) -> EngineCoreRequest:
        _, prompt, max_tokens = self.plans[rid]
        return EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=max_tokens)

    async def run_one(self, rid: str, limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            mode = self.plans[rid][0]
            if mode.startswith("batch"):
                await self.batch(rid, aborted=mode == "batch-aborted")
            else:
                await self.stream(rid, mode)

    async def stream(self, rid: str, mode: str) -> None:
        client, rng = self.client, self.rng
        if mode == "stream-cancelled":
            with trio.move_on_after(rng.uniform(0, 0.02)):
                await self.read_stream(rid)
        elif mode == "stream-break":
            stop_after = rng.randint(0, 3)
            async with client.stream(self.request(rid)) as outputs:
                async for output in outputs:
                    self.record(rid, output.new_token_ids, output.finish_reason)
                    if stop_after == 0:
                        break
                    stop_after -= 1
        elif mode == "stream-aborted":
            async with trio.open_nursery() as nursery, client.stream(self.request(rid)) as outputs:

                async def abort_later() -> None:
                    await trio.sleep(rng.uniform(0, 0.01))
                    await client.abort_requests([rid])

                nursery.start_soon(abort_later)
                async for output in outputs:
                    self.record(rid, output.new_token_ids, output.finish_reason)
        elif mode == "stream-receive-timeouts":
            async with client.stream(self.request(rid)) as outputs:
                while self.finish[rid] is None:
                    with trio.move_on_after(rng.uniform(0, 0.002)) as scope:
                        output = await outputs.receive()
                        self.record(rid, output.new_token_ids, output.finish_reason)
                    self.receive_timeouts += scope.cancelled_caught
        else:
            await self.read_stream(rid)

    async def read_stream(self, rid: str) -> None:
        async with self.client.stream(self.request(rid)) as outputs:
            async for output in outputs:
                self.record(rid, output.new_token_ids, output.finish_reason)

    def record(self, rid: str, tokens: list[int], finish: FinishReason | None) -> None:
        assert self.finish[rid] is None, f"{rid}: an output after the finished one"
        self.tokens[rid] += tokens
        self.finish[rid] = finish

    async def batch(self, rid: str, *, aborted: bool) -> None:
        self.batch_open.add(rid)
        await self.client.add_request(self.request(rid))
        if aborted:
            await trio.sleep(self.rng.uniform(0, 0.01))
            await self.client.abort_requests([rid])
            self.aborted_batch.add(rid)
            self.batch_open.discard(rid)
            self.batch_changed.set()
            return
        while rid in self.batch_open:
            await self.batch_changed.wait()

    async def read_batches(self, done: trio.Event) -> None:
        """The one get_output() reader, every call under a tiny timeout."""
        rng = self.rng
        while not done.is_set():
            with trio.move_on_after(rng.uniform(0, 0.003)) as scope:
                message = await self.client.get_output()
                for output in message.outputs:
                    rid = output.request_id
                    if rid in self.aborted_batch:
                        self.after_abort.append(rid)
                        continue
                    self.record(rid, output.new_token_ids, output.finish_reason)
                    if output.finish_reason is not None:
                        self.batch_open.discard(rid)
                self.batch_changed.set()
                self.batch_changed = trio.Event()
            self.receive_timeouts += scope.cancelled_caught

    async def poke_utilities(self, done: trio.Event) -> None:
        rng = self.rng
        while not done.is_set():
            with trio.move_on_after(rng.uniform(0, 0.002)) as scope:
                assert await self.client.is_sleeping() is False
            self.utility_timeouts += scope.cancelled_caught
            await trio.sleep(0.001)


async def test_a_storm_of_random_cancellations_loses_nothing_and_leaves_nothing() -> None:
    with trio.fail_after(150):
        async with open_engine_client(EngineConfig(step_time_s=0.001)) as client:
            storm = Storm(client, seed=20261201)
            ids = [storm.plan(i) for i in range(REQUESTS)]
            limiter = trio.CapacityLimiter(CONCURRENCY)
            done = trio.Event()
            async with trio.open_nursery() as background:
                background.start_soon(storm.read_batches, done)
                background.start_soon(storm.poke_utilities, done)
                async with trio.open_nursery() as nursery:
                    for rid in ids:
                        nursery.start_soon(storm.run_one, rid, limiter)
                done.set()
            stats = client.statistics()
            assert (stats.requests_in_flight, stats.open_streams) == (0, 0)
            assert stats.pending_utility_calls == 0
            assert await client.get_request_counts() == (0, 0)

    modes = {mode for mode, _, _ in storm.plans.values()}
    assert modes == set(MODES)
    cut = 0
    for rid, (mode, prompt, max_tokens) in storm.plans.items():
        want = expected(prompt, max_tokens)
        got = storm.tokens[rid]
        if mode in CUT:
            assert got == want[: len(got)], f"{rid} ({mode}): not a prefix"
            cut += len(got) < len(want)
        else:
            assert got == want, f"{rid} ({mode})"
            assert storm.finish[rid] is FinishReason.LENGTH, rid
    assert storm.after_abort == []
    # The storm did what it says: many requests cut, many calls timed out and retried.
    assert cut > REQUESTS // 4
    assert storm.receive_timeouts > 100
    assert storm.utility_timeouts > 10

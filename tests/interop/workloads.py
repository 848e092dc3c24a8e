"""The workloads every interop test of our client against vLLM's engines runs.

vLLM's engines run the fake executor's counter model (``vllm_side/fake_executor.py``),
so every token is known in advance (``tests.support.expected``). The executor also
tells, through vLLM's ``collective_rpc`` utility, which requests vLLM's scheduler
finished: the proof that an abort reached the engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trio_enginecore import AsyncEngineCoreClient, EngineCoreRequest, FinishReason

from ..support import expected

Result = tuple[list[int], FinishReason | None]


async def generate(client: AsyncEngineCoreClient, request: EngineCoreRequest) -> Result:
    """Stream ``request`` to its end: its tokens and its finish reason."""
    tokens: list[int] = []
    finish = None
    async with client.stream(request) as outputs:
        async for output in outputs:
            tokens += output.new_token_ids
            finish = output.finish_reason
    return tokens, finish


async def exact_streams(client: AsyncEngineCoreClient, count: int = 64) -> set[str]:
    """``count`` concurrent streams, tokens exact: half end on ``max_tokens``
    (LENGTH), half on a stop token id (STOP). Returns their request ids."""
    results: dict[str, Any] = {}
    wanted: dict[str, Result] = {}

    async def one(i: int) -> None:
        prompt = [1000 + 50 * i, 1001 + 50 * i]
        if i % 2:
            request = EngineCoreRequest.for_tokens(
                prompt, request_id=f"length-{i}", max_tokens=16 + i
            )
            wanted[request.request_id] = (expected(prompt, 16 + i), FinishReason.LENGTH)
        else:
            stop = prompt[-1] + 3 + i % 11
            request = EngineCoreRequest.for_tokens(
                prompt, request_id=f"stop-{i}", max_tokens=100, stop_token_ids=[stop]
            )
            wanted[request.request_id] = (expected(prompt, stop - prompt[-1]), FinishReason.STOP)
        results[request.request_id] = await generate(client, request)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    assert results == wanted
    return set(wanted)


async def cancel_half_midway(
    client: AsyncEngineCoreClient,
    finished_ids: Callable[[], Awaitable[set[str]]],
    pairs: int = 32,
) -> set[str]:
    """``pairs`` streams cancelled after 5 tokens beside ``pairs`` kept ones, on engines
    stepping slowly (the caller sets the step delay). Waits until ``finished_ids()``
    (what vLLM's schedulers finished) is exactly the cancelled ids, while every kept
    stream still runs; then checks the kept ones' tokens. Returns the cancelled ids."""
    cancelled = {f"cancel-{i}" for i in range(pairs)}
    kept: dict[str, Result] = {}
    all_cancelled = trio.Event()
    cancels_left = len(cancelled)

    async def cancel_midway(request_id: str, prompt: list[int]) -> None:
        nonlocal cancels_left
        request = EngineCoreRequest.for_tokens(prompt, request_id=request_id, max_tokens=1000)
        received = 0
        async with client.stream(request) as outputs:
            async for output in outputs:
                assert output.finish_reason is None
                received += len(output.new_token_ids)
                if received >= 5:
                    break  # leaving the block aborts the request
        cancels_left -= 1
        if not cancels_left:
            all_cancelled.set()

    async def keep(request_id: str, prompt: list[int]) -> None:
        request = EngineCoreRequest.for_tokens(prompt, request_id=request_id, max_tokens=300)
        kept[request_id] = await generate(client, request)

    finished: set[str] = set()
    async with trio.open_nursery() as nursery:
        for i in range(pairs):
            nursery.start_soon(cancel_midway, f"cancel-{i}", [5000 + i])
            nursery.start_soon(keep, f"keep-{i}", [9000 + i])
        with trio.fail_after(30):
            await all_cancelled.wait()
            # The aborts reach the executor in the scheduler's next step.
            while finished != cancelled:
                finished = await finished_ids()
                assert len(kept) == 0, "the kept requests finished too early"
                await trio.sleep(0.05)
    assert kept == {
        f"keep-{i}": (expected([9000 + i], 300), FinishReason.LENGTH) for i in range(pairs)
    }
    assert client.statistics().requests_in_flight == 0
    return cancelled

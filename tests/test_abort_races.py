"""Aborts are final, and an aborted request's id is free at once.

* After ``abort_requests()`` returns, ``get_output()`` never returns an output of the
  aborted requests, even when the abort runs while ``get_output()`` is about to return.
* An id used again right after its request was aborted gets only the new request's
  outputs, on the batch API and on streams, although the engine may still produce
  outputs for the old request until it reads the ABORT.
* A failure in a client's background task reaches the ``async with`` block as one
  ``EngineCoreError``, never as the ``Cancelled`` it caused.
"""

from __future__ import annotations

import random

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreError,
    EngineCoreRequest,
    FinishReason,
    TrioMPClient,
    open_engine_client,
)
from trio_enginecore.client._core._state import ClientState
from trio_enginecore.testing import FakeEngine, open_fake_engine_client

from .support import expected


async def test_get_output_never_returns_outputs_of_a_request_after_its_abort_returned() -> None:
    rng = random.Random(7)
    violations: list[str] = []
    aborts = 0
    with trio.fail_after(60):
        async with open_engine_client(EngineConfig(max_num_seqs=64)) as client:
            for trial in range(40):
                ids = [f"t{trial}-{i}" for i in range(32)]
                await client.add_requests(
                    EngineCoreRequest.for_tokens([i + 1], request_id=rid, max_tokens=100_000)
                    for i, rid in enumerate(ids)
                )
                aborted: set[str] = set()

                async def read(done: trio.Event, aborted: set[str] = aborted) -> None:
                    while not done.is_set():
                        with trio.move_on_after(0.05):
                            message = await client.get_output()
                            violations.extend(
                                o.request_id for o in message.outputs if o.request_id in aborted
                            )
                            # Fall behind a little: the next call finds messages
                            # waiting and takes one at once, the racy moment.
                            await trio.sleep(0.0005)

                done = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read, done)
                    order = list(ids)
                    rng.shuffle(order)
                    for rid in order:
                        # Give the reader a turn, then abort while it may be holding a
                        # message it has taken but not yet returned.
                        for _ in range(1 + rng.randrange(3)):
                            await trio.lowlevel.checkpoint()
                        await client.abort_requests([rid])
                        aborted.add(rid)
                        aborts += 1
                    done.set()
                assert client.statistics().requests_in_flight == 0
            assert await client.get_request_counts() == (0, 0)
    assert aborts == 40 * 32
    assert violations == []


async def reused_by_streams(client: TrioMPClient, rid: str, old: int, new: int) -> list[int]:
    """Stream ``rid`` a little, leave (aborting it), stream ``rid`` again to the end."""
    async with client.stream(
        EngineCoreRequest.for_tokens([old], request_id=rid, max_tokens=100_000)
    ) as outputs:
        await outputs.receive()
    tokens: list[int] = []
    async with client.stream(
        EngineCoreRequest.for_tokens([new], request_id=rid, max_tokens=12)
    ) as outputs:
        async for output in outputs:
            assert output.request_id == rid
            tokens += output.new_token_ids
    return tokens


async def test_a_stream_reusing_an_aborted_id_gets_only_its_own_tokens() -> None:
    results: dict[str, list[int]] = {}
    with trio.fail_after(60):
        async with open_engine_client(EngineConfig(step_time_s=0.001)) as client:

            async def one(i: int) -> None:
                results[f"s{i}"] = await reused_by_streams(client, f"s{i}", 10_000 + i, i)

            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(one, i)
            assert client.statistics().requests_in_flight == 0
            assert await client.get_request_counts() == (0, 0)
    assert results == {f"s{i}": expected([i], 12) for i in range(200)}


async def test_a_batch_request_reusing_an_aborted_id_gets_only_its_own_tokens() -> None:
    n = 200
    with trio.fail_after(60):
        async with open_engine_client(EngineConfig(step_time_s=0.001)) as client:
            await client.add_requests(
                EngineCoreRequest.for_tokens([10_000 + i], request_id=f"b{i}", max_tokens=100_000)
                for i in range(n)
            )
            await client.get_output()  # the engine is producing for them now
            ids = [f"b{i}" for i in range(n)]
            await client.abort_requests(ids)
            await client.add_requests(
                EngineCoreRequest.for_tokens([i], request_id=f"b{i}", max_tokens=12)
                for i in range(n)
            )
            tokens: dict[str, list[int]] = {rid: [] for rid in ids}
            finished: set[str] = set()
            while len(finished) < n:
                for output in (await client.get_output()).outputs:
                    assert output.request_id not in finished
                    tokens[output.request_id] += output.new_token_ids
                    if output.finish_reason is not None:
                        assert output.finish_reason is FinishReason.LENGTH
                        finished.add(output.request_id)
            assert client.statistics().requests_in_flight == 0
    assert tokens == {f"b{i}": expected([i], 12) for i in range(n)}


async def test_an_id_can_be_aborted_and_reused_again_and_again() -> None:
    with trio.fail_after(30):
        async with open_engine_client(EngineConfig(step_time_s=0.001)) as client:
            for round_ in range(20):
                request = EngineCoreRequest.for_tokens(
                    [round_], request_id="same", max_tokens=10_000
                )
                await client.add_request(request)
                assert request.request_id == "same"  # the caller's object is left alone
                await client.get_output()
                await client.abort_requests(["same"])
            assert await reused_by_streams(client, "same", 500, 7) == expected([7], 12)
            assert await client.get_request_counts() == (0, 0)


async def test_the_fake_engine_reports_reused_ids_as_the_caller_gave_them() -> None:
    engine = FakeEngine(step_time_s=0.01)
    engine.script("r", [[1], [2], [3]])
    async with open_fake_engine_client(engine) as client:
        with trio.move_on_after(0.015):
            async with client.stream(EngineCoreRequest.for_tokens([0], request_id="r")) as out:
                async for _ in out:
                    pass
        tokens = []
        async with client.stream(EngineCoreRequest.for_tokens([0], request_id="r")) as outputs:
            async for output in outputs:
                assert output.request_id == "r"
                tokens += output.new_token_ids
    assert tokens == [1, 2, 3]
    assert engine.aborted == ["r"]
    assert [r.external_req_id or r.request_id for r in engine.requests] == ["r", "r"]


async def test_a_background_failure_reaches_the_block_instead_of_a_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FakeEngine(step_time_s=0.01)
    broken = RuntimeError("a bug in the receive path")
    raised: BaseException | None = None
    try:
        async with open_fake_engine_client(engine) as client:

            def handle(state: object, message: object) -> None:
                raise broken

            monkeypatch.setattr(ClientState, "handle_outputs", handle)
            async with client.stream(EngineCoreRequest.for_tokens([1])) as outputs:
                async for _ in outputs:
                    pass
    except BaseException as exc:  # a Cancelled must be seen, not passed through
        raised = exc
    assert type(raised) is EngineCoreError, repr(raised)
    assert "a bug in the receive path" in str(raised)
    assert raised.__cause__ is broken

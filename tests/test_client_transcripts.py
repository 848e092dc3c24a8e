"""The client's behaviour at the wire, pinned by scripted transcripts.

Each test is one transcript: a real client attached over ipc:// (in a temp dir) to
engine peers that are raw ZeroMQ sockets in the test's own Trio run
(:class:`~tests.hostile.HostileEngine`, :class:`~tests.hostile.ServingEngine`) and,
for data parallelism, to a scripted coordinator (an XPUB,
:class:`~tests.hostile.ScriptedCoordinator`). The peers send exactly the frames the
test scripts and record exactly the frames the client sends. Nothing runs in another
process, and nothing waits for time to pass except where the promise is about time
(the ready timeout, the liveness checks): every other step is sequenced by a peer
reading a frame, a utility round trip (``fence``) or ``trio.testing``.

The promises:

* an engine whose ready message is undecodable fails the startup at once with
  ``EngineStartupError`` naming it; one whose ready message never comes in the expected
  shape (``[identity, payload]`` from its identity) fails it at the ready timeout, naming
  it; either way nothing the client opened stays open;
* an undecodable output message is dropped and counted in ``protocol_errors``; every
  good output of every request is delivered exactly, and the client keeps serving;
* with two attached engines, one that sends ``ENGINE_CORE_DEAD`` and goes silent is
  declared dead by the progress deadline: its requests fail with ``EngineDeadError``, the
  client is dead (every later call raises), the other engine's streams stream on, and
  the block ends with one ``EngineDeadError`` (DPLBTrioMPClient's failure policy);
* the coordinator's counts steer the next requests to the less loaded engine; its wave
  publications set ``current_wave`` / ``engines_running``, wake ``wait_wave_change()``
  and stamp the next requests; a malformed publication is dropped whole;
* a utility reply for a call id nobody is waiting for is ignored, and a failure reply
  raises ``UtilityCallError`` with the engine's message in the caller; nothing else
  changes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
import zmq

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    EngineStartupError,
    Liveness,
    UtilityCallError,
    open_engine_client,
)
from trio_enginecore.client import DPLBTrioMPClient
from trio_enginecore.engine import EngineCore
from trio_enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    UtilityOutput,
    UtilityResult,
)
from trio_enginecore.serial import Buffer, MsgpackEncoder

from .hostile import (
    AttachedPeers,
    HostileEngine,
    ScriptedCoordinator,
    attached_to_serving_engines,
    delivered_until_finished,
    fence_all,
    finished,
    output,
    streamed_tokens,
)
from .support import open_fds

PROGRESS_TIMEOUT_S = 0.5
"""The progress deadline of the tests that hang an engine (a short one: no speed claim,
the bounds around it are generous)."""
TIMEOUT_S = 10
"""Bound on every test; each takes well under 2 s."""

COORDINATOR_FRAMES = Path(__file__).parent / "data" / "vllm-0.33.0-coordinator" / "frames.json"


def request(request_id: str, *, rank: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest.for_tokens(
        [1], request_id=request_id, max_tokens=8, data_parallel_rank=rank
    )


def served_exactly(tokens: list[int]) -> list[tuple[list[int], bool]]:
    """What get_output() delivers of a request sent ``tokens`` one per message, the
    last one finished."""
    return [([token], i == len(tokens) - 1) for i, token in enumerate(tokens)]


def dplb(peers: AttachedPeers) -> DPLBTrioMPClient:
    client = peers.client
    assert isinstance(client, DPLBTrioMPClient)
    return client


def ready_payload(rank: int = 0) -> bytes:
    """The one-frame ready message a well-behaved engine of ``rank`` sends."""
    config = EngineConfig(data_parallel_rank=rank, data_parallel_size=rank + 1)
    (frame,) = MsgpackEncoder().encode(EngineCore(config).ready_response())
    return bytes(frame)


@cache
def vllm_coordinator_frames(name: str) -> list[bytes]:
    """Frames vLLM 0.33.0's own coordinator sent (tests/data/vllm-0.33.0-coordinator)."""
    cases = json.loads(COORDINATOR_FRAMES.read_text())["cases"]
    case = next(case for case in cases if case["name"] == name)
    return [bytes.fromhex(frame) for frame in case["frames"]]


async def published(
    client: DPLBTrioMPClient, coordinator: ScriptedCoordinator, frames: Sequence[Buffer]
) -> tuple[int, bool]:
    """Publish ``frames`` and return the ``(wave, running)`` the client announces next.

    The publications reach the client in order, so once this returns the client has
    folded every one published before the one that changed its wave state.
    """
    announced: list[tuple[int, bool]] = []

    async def wait() -> None:
        announced.append(await client.wait_wave_change())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()  # the waiter waits
        await coordinator.publish_frames(frames)
    return announced[0]


def encoded(*publication: Any) -> list[bytes]:
    """A coordinator message holding ``publication`` as msgpack, well-formed or not."""
    return [msgspec.msgpack.encode(publication)]


def new_adds(engine: HostileEngine, before: set[str]) -> list[str]:
    return [request_id for request_id in engine.added if request_id not in before]


# ------------------------------------------------------------------ ready messages


@asynccontextmanager
async def attach_addresses() -> AsyncGenerator[tuple[zmq.Context[Any], str, str], None]:
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        yield ctx, f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    finally:
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)


def _truncated_ready() -> list[Buffer]:
    payload = ready_payload()
    return [payload[: len(payload) // 2]]


def _a_field_of_the_wrong_type() -> list[Buffer]:
    fields = msgspec.msgpack.decode(ready_payload())
    fields["max_model_len"] = "very long"
    return [msgspec.msgpack.encode(fields)]


UNDECODABLE_READY: dict[str, Callable[[], list[Buffer]]] = {
    "not-msgpack": lambda: [b"\xc1"],
    "truncated": _truncated_ready,
    "an-array-not-a-map": lambda: [msgspec.msgpack.encode([1, 2, 3])],
    "a-string": lambda: [msgspec.msgpack.encode("READY")],
    "required-fields-missing": lambda: [msgspec.msgpack.encode({"max_model_len": 2048})],
    "a-field-of-the-wrong-type": _a_field_of_the_wrong_type,
}

ENGINES = [
    pytest.param(1, 0, id="one-engine"),
    pytest.param(2, 1, id="rank-1-of-two"),
]


async def failed_startup(
    *,
    size: int = 1,
    ranks: Sequence[int] | None = None,
    bad: Mapping[int, list[Buffer]] | None = None,
    ready_timeout_s: float,
) -> tuple[EngineStartupError, float]:
    """Start a client (``EngineConfig(data_parallel_size=size)``) attached to a
    :class:`~tests.hostile.HostileEngine` of each of ``ranks`` (by default 0 to
    size - 1): the engine of a rank in ``bad`` sends those frames, every other one a
    well-formed ready message. The startup must fail: the ``EngineStartupError`` and
    how long it took; nothing the client opened may stay open."""
    bad = bad or {}
    fds_before = open_fds()
    with trio.fail_after(TIMEOUT_S):
        async with attach_addresses() as (ctx, input_address, output_address):
            engines = [
                HostileEngine(ctx, input_address, output_address, rank=rank)
                for rank in (range(size) if ranks is None else ranks)
            ]
            try:
                for engine in engines:
                    if engine.rank in bad:
                        await engine.dealer.send_multipart(bad[engine.rank])
                    else:
                        await engine.send_ready()
                started_at = trio.current_time()
                with pytest.raises(EngineStartupError) as failed:
                    async with open_engine_client(
                        EngineConfig(data_parallel_size=size),
                        input_address=input_address,
                        output_address=output_address,
                        ready_timeout_s=ready_timeout_s,
                        liveness=None,
                    ):
                        pytest.fail("the client must not start")
                took = trio.current_time() - started_at
            finally:
                for engine in engines:
                    engine.close()
    assert open_fds() - fds_before == set()
    return failed.value, took


@pytest.mark.parametrize(("size", "bad_rank"), ENGINES)
@pytest.mark.parametrize("frames", UNDECODABLE_READY.values(), ids=UNDECODABLE_READY.keys())
async def test_an_undecodable_ready_message_fails_the_startup_at_once_naming_the_engine(
    frames: Callable[[], list[Buffer]], size: int, bad_rank: int
) -> None:
    ready_timeout_s = TIMEOUT_S  # the error must come long before it
    failed, took = await failed_startup(
        size=size, bad={bad_rank: frames()}, ready_timeout_s=ready_timeout_s
    )
    assert took < ready_timeout_s / 2
    assert f"engine rank {bad_rank} sent an invalid ready message" in str(failed)
    assert type(failed) is EngineStartupError


WRONG_SHAPE_READY: dict[str, Callable[[], list[Buffer]]] = {
    # The DEALER adds nothing: [payload, extra] reaches the client as 3 frames.
    "a-second-frame-after-the-payload": lambda: [ready_payload(), b""],
    "the-payload-in-three-frames": lambda: [b"\x80", b"", b""],
}


@pytest.mark.parametrize(("size", "bad_rank"), ENGINES)
@pytest.mark.parametrize("frames", WRONG_SHAPE_READY.values(), ids=WRONG_SHAPE_READY.keys())
async def test_a_ready_message_of_the_wrong_shape_is_ignored_and_the_startup_times_out_naming_the_engine(  # noqa: E501
    frames: Callable[[], list[Buffer]], size: int, bad_rank: int
) -> None:
    ready_timeout_s = 0.3  # the time that must pass
    failed, waited = await failed_startup(
        size=size, bad={bad_rank: frames()}, ready_timeout_s=ready_timeout_s
    )
    assert ready_timeout_s <= waited < ready_timeout_s + 2
    message = str(failed)
    assert message.startswith("engine not ready within 0.3 s: ")
    assert f"engine rank {bad_rank} never sent its ready message" in message
    for rank in range(size):
        if rank != bad_rank:
            assert f"engine rank {rank}" not in message  # it was ready


async def test_a_ready_message_from_an_identity_of_no_engine_is_ignored() -> None:
    failed, _ = await failed_startup(ranks=[7], ready_timeout_s=0.3)
    assert "engine rank 0 never sent its ready message" in str(failed)
    assert "rank 7" not in str(failed)


# ------------------------------------------------------------ undecodable outputs


def _truncated_outputs() -> list[Buffer]:
    payload = bytes(MsgpackEncoder().encode(EngineCoreOutputs(outputs=[output("b1", 9)]))[0])
    return [payload[: len(payload) // 2]]


GARBAGE: list[Callable[[], list[Buffer]]] = [
    lambda: [b"\xc1"],
    _truncated_outputs,
    lambda: [ENGINE_CORE_DEAD, b""],  # not the one-frame marker: a message to decode
    lambda: [msgspec.msgpack.encode([0, [["b1", "9"]]])],  # tokens of the wrong type
    lambda: [b""],
]


async def test_undecodable_messages_among_good_ones_cost_no_output_and_are_counted() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_serving_engines(1) as peers:
            (engine,) = peers.engines
            client = peers.client
            await client.add_request(request("b1"))
            await client.add_request(request("b2"))
            async with client.stream(request("s1")) as s1:
                await engine.expect_adds("b1", "b2", "s1")
                await engine.send(output("b1", 1), output("s1", 1))
                await engine.send_frames(GARBAGE[0]())
                await engine.send(output("b2", 1), output("s1", 2))
                await engine.send_frames(GARBAGE[1]())
                await engine.send_frames(GARBAGE[2]())
                await engine.send(finished("b1", 2), output("b2", 2))
                await engine.send_frames(GARBAGE[3]())
                await engine.send(finished("b2", 3), output("s1", 3))
                await engine.send_frames(GARBAGE[4]())
                await engine.send(finished("s1", 4))
                assert await delivered_until_finished(client, "b1", "b2") == {
                    "b1": served_exactly([1, 2]),
                    "b2": served_exactly([1, 2, 3]),
                }
                assert await streamed_tokens(s1) == [1, 2, 3, 4]
            stats = client.statistics()
            assert stats.protocol_errors == len(GARBAGE)
            assert stats.outputs_dropped == 0
            assert stats.requests_in_flight == 0
            # It keeps serving.
            async with client.stream(request("after")) as after:
                await engine.expect_adds("after")
                await engine.send(finished("after", 7))
                assert await streamed_tokens(after) == [7]
            await fence_all(client, engine)
            assert not client.is_dead
            assert client.statistics().pending_batches == 0
            assert client.statistics().protocol_errors == len(GARBAGE)


async def test_undecodable_messages_from_one_of_two_engines_leave_both_serving_exactly() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_serving_engines(2) as peers:
            e0, e1 = peers.engines
            client = peers.client
            await client.add_request(request("on-0", rank=0))
            await client.add_request(request("on-1", rank=1))
            async with (
                client.stream(request("s0", rank=0)) as s0,
                client.stream(request("s1", rank=1)) as s1,
            ):
                await e0.expect_adds("on-0", "s0")
                await e1.expect_adds("on-1", "s1")
                for token in (1, 2):
                    await e0.send(output("on-0", token), output("s0", token))
                    for garbage in GARBAGE:
                        await e1.send_frames(garbage())
                    await e1.send(output("on-1", token), output("s1", token))
                await e0.send(finished("on-0", 3), finished("s0", 3))
                await e1.send_frames(GARBAGE[0]())
                await e1.send(finished("on-1", 3), finished("s1", 3))
                assert await delivered_until_finished(client, "on-0", "on-1") == {
                    "on-0": served_exactly([1, 2, 3]),
                    "on-1": served_exactly([1, 2, 3]),
                }
                assert await streamed_tokens(s0) == [1, 2, 3]
                assert await streamed_tokens(s1) == [1, 2, 3]
            await fence_all(client, e0, e1)
            stats = client.statistics()
            assert stats.protocol_errors == 2 * len(GARBAGE) + 1
            assert stats.engines_alive == 2
            assert stats.requests_in_flight == 0
            assert stats.pending_batches == 0
            assert not client.is_dead


# ------------------------------------------------ one of two engines dies silently


async def test_an_engine_that_sends_engine_core_dead_and_goes_silent_fails_its_requests_and_the_client() -> (  # noqa: E501
    None
):
    liveness = Liveness(progress_timeout_s=PROGRESS_TIMEOUT_S)
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(EngineDeadError) as block_failed:
            async with attached_to_serving_engines(2, liveness=liveness) as peers:
                e0, e1 = peers.engines
                client = peers.client
                # Both answer the liveness checks.
                await e0.expect_answered("is_sleeping", 1)
                await e1.expect_answered("is_sleeping", 1)
                await client.add_request(request("batch-on-1", rank=1))
                async with (
                    client.stream(request("s0", rank=0)) as s0,
                    client.stream(request("s1", rank=1)) as s1,
                ):
                    await e0.expect_adds("s0")
                    await e1.expect_adds("s1", "batch-on-1")
                    await e0.send(output("s0", 1))
                    await e1.send(output("s1", 1))
                    assert (await s0.receive()).new_token_ids == [1]
                    assert (await s1.receive()).new_token_ids == [1]

                    # Engine 1's last frame is ENGINE_CORE_DEAD; it then reads on but
                    # answers nothing: no output, no reply to the client's own call.
                    e1.stop_answering()
                    await e1.send_engine_core_dead()
                    silent_at = trio.current_time()
                    with pytest.raises(EngineDeadError) as s1_failed:
                        await s1.receive()
                    died_after = trio.current_time() - silent_at
                    assert died_after < PROGRESS_TIMEOUT_S + 1.0
                    assert "engine rank 1" in str(s1_failed.value)
                    assert "no progress for" in str(s1_failed.value)
                    assert e1.ignored  # it read the calls and answered none
                    # The client as a whole is dead: every later call raises.
                    assert client.is_dead
                    stats = client.statistics()
                    assert stats.engines_alive == 1
                    assert stats.requests_in_flight == 1  # s0: engine 1's are gone
                    assert stats.pending_utility_calls == 0
                    with pytest.raises(EngineDeadError):
                        await client.get_output()  # batch-on-1 failed, nothing pending
                    with pytest.raises(EngineDeadError):
                        await client.add_request(request("late", rank=0))
                    with pytest.raises(EngineDeadError):
                        await client.call_utility("get_weight_version")
                    assert "late" not in e0.added
                    # Engine 0's stream streams on to its end.
                    await e0.send(output("s0", 2))
                    await e0.send(finished("s0", 3))
                    assert await streamed_tokens(s0) == [2, 3]
    assert type(block_failed.value) is EngineDeadError  # one error, not a group
    assert "engine rank 1" in str(block_failed.value)
    assert "engine rank 0" not in str(block_failed.value)


async def test_an_idle_engine_that_stops_answering_is_hung_after_the_progress_timeout() -> None:
    """No request in flight: the client's own call, every quarter of the deadline, is
    the work an idle engine must answer."""
    liveness = Liveness(progress_timeout_s=PROGRESS_TIMEOUT_S)
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(EngineDeadError, match="no progress for") as block_failed:
            async with attached_to_serving_engines(1, liveness=liveness) as peers:
                (engine,) = peers.engines
                await engine.expect_answered("is_sleeping", 2)
                engine.stop_answering()
                silent_at = trio.current_time()
                await peers.client.wait_failed()
                assert trio.current_time() - silent_at < 2 * PROGRESS_TIMEOUT_S + 1.0
    assert "with 0 request(s) pending" in str(block_failed.value)
    assert "no reply to the client's liveness call" in str(block_failed.value)


async def test_an_engine_silent_in_a_utility_you_wait_on_is_hung_only_once_you_stop_waiting() -> (
    None
):
    """Time an engine spends in a utility a caller is waiting on is not counted: a LoRA
    load, a weight update, a ``collective_rpc`` can take a while. The caller bounds
    its own call; from then on the engine has ``progress_timeout_s`` to say
    anything."""
    liveness = Liveness(progress_timeout_s=PROGRESS_TIMEOUT_S)
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(EngineDeadError, match="no progress for") as block_failed:
            async with attached_to_serving_engines(1, liveness=liveness) as peers:
                (engine,) = peers.engines
                client = peers.client
                await engine.expect_answered("is_sleeping", 1)
                async with client.stream(request("s")) as stream:
                    await engine.expect_adds("s")
                    engine.stop_answering()
                    with trio.move_on_after(4 * PROGRESS_TIMEOUT_S) as waited:
                        await client.call_utility("load_weights")
                    assert waited.cancelled_caught
                    # Four deadlines long, and in service all along.
                    assert not client.is_dead
                    gave_up = trio.current_time()
                    with pytest.raises(EngineDeadError):
                        await stream.receive()
                    assert trio.current_time() - gave_up < PROGRESS_TIMEOUT_S + 1.0
    assert "with 1 request(s) pending" in str(block_failed.value)


# ------------------------------------------------------------ coordinator publications


async def test_published_counts_send_the_next_requests_to_the_less_loaded_engine() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_serving_engines(2, coordinator=True) as peers:
            e0, e1 = peers.engines
            client = dplb(peers)
            # Equal loads: one request each.
            await client.add_request(request("first"))
            await client.add_request(request("second"))
            await fence_all(client, e0, e1)
            assert (len(e0.added), len(e1.added)) == (1, 1)

            # Engine 0 reports 100 requests, engine 1 none.
            before = set(e0.added) | set(e1.added)
            counts = [(50, 50, 0.0), (0, 0, 0.0)]
            assert await published(client, peers.coordinator, encoded(counts, 1, False)) == (
                1,
                False,
            )
            await client.add_requests(request(f"to-1-{i}") for i in range(5))
            await fence_all(client, e0, e1)
            assert new_adds(e0, before) == []
            assert new_adds(e1, before) == [f"to-1-{i}" for i in range(5)]

            # Now engine 1 does.
            before = set(e0.added) | set(e1.added)
            counts = [(0, 0, 0.0), (50, 50, 0.0)]
            assert await published(client, peers.coordinator, encoded(counts, 2, False)) == (
                2,
                False,
            )
            for i in range(5):
                await client.add_request(request(f"to-0-{i}"))
            await fence_all(client, e0, e1)
            assert new_adds(e0, before) == [f"to-0-{i}" for i in range(5)]
            assert new_adds(e1, before) == []


async def test_vllm_coordinator_publications_set_the_wave_and_stamp_the_next_requests() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_serving_engines(2, coordinator=True) as peers:
            e0, e1 = peers.engines
            client = dplb(peers)
            coordinator = peers.coordinator
            assert (client.current_wave, client.engines_running) == (0, False)

            # vLLM's own frames: engine 1 has 1 waiting and 2 running (wave 0, paused),
            # then wave 0 starts.
            await coordinator.publish_frames(vllm_coordinator_frames("publication_counts"))
            started = vllm_coordinator_frames("publication_wave_started")
            assert await published(client, coordinator, started) == (0, True)
            assert (client.current_wave, client.engines_running) == (0, True)
            # Engine 1's 3 requests weigh: the next 3 go to engine 0, in wave 0.
            for i in range(3):
                await client.add_request(request(f"w0-{i}"))
            await fence_all(client, e0, e1)
            assert list(e0.added) == ["w0-0", "w0-1", "w0-2"]
            assert e1.added == {}
            assert [r.current_wave for r in e0.added.values()] == [0, 0, 0]

            # Wave 0 completes: wave 1, paused. The counts stay as they were.
            complete = vllm_coordinator_frames("publication_wave_complete")
            assert await published(client, coordinator, complete) == (1, False)
            assert (client.current_wave, client.engines_running) == (1, False)
            await client.add_request(request("w1", rank=1))
            await e1.expect_adds("w1")
            assert e1.added["w1"].current_wave == 1

            # The same state again is no change: the waiter wakes for the next one.
            await coordinator.publish(None, 1, False)
            assert await published(client, coordinator, encoded(None, 7, True)) == (7, True)
            async with client.stream(request("w7", rank=0)) as w7:
                await e0.expect_adds("w7")
                assert e0.added["w7"].current_wave == 7
                await e0.send(finished("w7", 1))
                assert await streamed_tokens(w7) == [1]
            await client.add_requests([request("w7-a", rank=0), request("w7-b", rank=1)])
            await fence_all(client, e0, e1)
            assert e0.added["w7-a"].current_wave == e1.added["w7-b"].current_wave == 7


MALFORMED_PUBLICATIONS: dict[str, list[bytes]] = {
    "not-msgpack": [b"\xc1"],
    "a-string": encoded("wave 9"),
    "two-fields": encoded(None, 9),
    "a-wave-that-is-no-int": encoded(None, "9", True),
    "counts-of-the-wrong-shape": encoded([[100, 100], [0, 0]], 9, True),
    "counts-for-fewer-engines-than-the-client-has": encoded([[100, 100, 0.0]], 9, True),
}


@pytest.mark.parametrize(
    "malformed", MALFORMED_PUBLICATIONS.values(), ids=MALFORMED_PUBLICATIONS.keys()
)
async def test_a_malformed_publication_is_dropped_whole_and_the_next_good_one_applies(
    malformed: list[bytes],
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_serving_engines(2, coordinator=True) as peers:
            e0, e1 = peers.engines
            client = dplb(peers)
            coordinator = peers.coordinator
            await coordinator.publish_frames(malformed)
            # Had the malformed one applied, the first change seen would be wave 9.
            assert await published(client, coordinator, encoded(None, 2, True)) == (2, True)
            assert (client.current_wave, client.engines_running) == (2, True)
            # Nor did it change the loads: equal engines get one request each.
            await client.add_request(request("a"))
            await client.add_request(request("b"))
            await fence_all(client, e0, e1)
            assert (len(e0.added), len(e1.added)) == (1, 1)
            assert [r.current_wave for r in (*e0.added.values(), *e1.added.values())] == [2, 2]
            # The subscription keeps working: counts apply after it.
            before = set(e0.added) | set(e1.added)
            counts = [(0, 0, 0.0), (50, 50, 0.0)]
            assert await published(client, coordinator, encoded(counts, 3, True)) == (3, True)
            await client.add_requests([request("c"), request("d")])
            await fence_all(client, e0, e1)
            assert new_adds(e0, before) == ["c", "d"]


# ------------------------------------------------------------------ utility replies


FAILURE = "Call to get_weight_version method failed: no weights loaded"


async def test_a_utility_failure_reply_raises_utility_call_error_and_changes_nothing_else() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_serving_engines(1) as peers:
            (engine,) = peers.engines
            client = peers.client
            failures: list[UtilityCallError] = []

            async def call() -> None:
                try:
                    await client.call_utility("get_weight_version")
                except UtilityCallError as exc:
                    failures.append(exc)

            async with client.stream(request("keep")) as keep:
                await engine.expect_adds("keep")
                await engine.send(output("keep", 1))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(call)
                    asked = await engine.expect_utility()
                    assert asked.method == "get_weight_version"
                    # Replies for calls nobody is waiting for, a success and a failure.
                    for unknown in (asked.call_id ^ 1, asked.call_id ^ 2):
                        await engine.send(
                            utility_output=UtilityOutput(unknown, None, UtilityResult("w0"))
                        )
                        await engine.send(utility_output=UtilityOutput(unknown, "not yours"))
                    await engine.send(utility_output=UtilityOutput(asked.call_id, FAILURE))
                (failure,) = failures
                assert failure.method == "get_weight_version"
                assert failure.engine_message == FAILURE
                assert str(failure) == (
                    "utility call 'get_weight_version' failed on the engine: no weights loaded"
                )
                # Nothing else changed: the stream goes on, the engine serves on.
                await engine.send(finished("keep", 2))
                assert await streamed_tokens(keep) == [1, 2]
            stats = client.statistics()
            assert stats.pending_utility_calls == 0
            assert stats.protocol_errors == 0
            assert stats.outputs_dropped == 0
            assert stats.requests_in_flight == 0
            assert stats.engines_alive == 1
            assert not client.is_dead
            results: list[object] = []

            async def call_again() -> None:
                results.append(await client.call_utility("get_weight_version"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call_again)
                await engine.reply(await engine.expect_utility(), "w1")
            assert results == ["w1"]


async def test_with_two_engines_a_utility_failure_reply_names_the_engine_that_failed() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_serving_engines(2) as peers:
            e0, e1 = peers.engines
            client = peers.client
            failures: list[UtilityCallError] = []

            async def call() -> None:
                try:
                    await client.call_utility_all("get_weight_version")
                except UtilityCallError as exc:
                    failures.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                asked_0 = await e0.expect_utility()
                asked_1 = await e1.expect_utility()
                await e1.send(utility_output=UtilityOutput(asked_1.call_id, FAILURE))
                await e0.reply(asked_0, "w1")
            (failure,) = failures
            assert failure.method == "get_weight_version"
            assert "failed on engine 1: no weights loaded" in str(failure)
            assert (failure.engine_message, failure.rank) == (FAILURE, 1)
            assert not client.is_dead
            assert client.statistics().pending_utility_calls == 0
            assert client.statistics().engines_alive == 2
            assert await client.call_utility_all("is_sleeping") == [False, False]

"""A real client against an engine that breaks the protocol (tests/hostile.py).

The engine here is the test: it speaks the startup protocol to a real ``TrioMPClient``
over ipc:// and then sends inconsistent or malicious messages. Whatever it sends, the
client must keep serving every other request exactly, and nothing may leak out of it as
an ExceptionGroup or a bare ``trio.Cancelled``. The contract:

* an output of a request not in flight (an unknown id, a second finish, an output
  after the finish, a late output of an aborted request) is dropped and counted in
  ``statistics().outputs_dropped``: never delivered, never an exception;
* a message whose ``engine_index`` is not one of the client's engines is dropped whole,
  logged, and counted in ``statistics().protocol_errors``;
* outputs of one stream that cannot be merged fail that stream with ``ProtocolError``
  (and abort its request on the engine), counted in ``protocol_errors``;
* an undecodable message is dropped and counted in ``protocol_errors``;
* a failure inside the client's receive task ends the ``async with`` block with one
  ``EngineCoreError`` chained from it;
* the batch buffer never holds more than ``max_pending_outputs`` messages plus one per
  engine.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec
import pytest
import trio

from trio_enginecore import (
    EngineCoreError,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    ProtocolError,
    TrioMPClient,
)
from trio_enginecore.client._core._state import ClientState
from trio_enginecore.protocol import ENGINE_CORE_DEAD, UtilityOutput, UtilityResult
from trio_enginecore.serial import Buffer, MsgpackEncoder

from .hostile import (
    HostileEngine,
    attached_to_hostile_engine,
    delivered_until_finished,
    fence,
    finished,
    logprobs,
    output,
    streamed_tokens,
)

TIMEOUT_S = 30

"""What ``get_output()`` delivered: per request id, each output's tokens and whether it
was the finished one."""


def request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest.for_tokens([1], request_id=request_id, max_tokens=8)


async def nothing_else_is_pending(engine: HostileEngine, client: TrioMPClient) -> None:
    """Once the client handled everything sent so far, nothing waits for get_output()
    and no request is left in flight."""
    await fence(engine, client)
    stats = client.statistics()
    assert stats.pending_batches == 0
    assert stats.requests_in_flight == 0


async def wait_until(condition: Callable[[], bool]) -> None:
    while not condition():
        await trio.sleep(0.001)


# ------------------------------------------------- outputs of requests not in flight
#
# Each scenario provokes stray outputs next to a request served normally, checks what
# the caller sees, and returns how many outputs the client must have dropped.

Scenario = Callable[[HostileEngine, TrioMPClient], Awaitable[int]]


async def unknown_request_id(engine: HostileEngine, client: TrioMPClient) -> int:
    """Outputs for an id the client never sent are not delivered."""
    await client.add_request(request("keep"))
    await engine.expect_adds("keep")
    await engine.send(output("never-sent", 9), output("keep", 1))
    await engine.send(finished("never-sent", 9), finished("keep", 2))
    assert await delivered_until_finished(client, "keep") == {"keep": [([1], False), ([2], True)]}
    await nothing_else_is_pending(engine, client)
    return 2


async def unknown_request_id_while_streaming(engine: HostileEngine, client: TrioMPClient) -> int:
    """An output for an unknown id goes neither to an open stream nor to get_output()."""
    async with client.stream(request("keep")) as keep:
        await engine.expect_adds("keep")
        await engine.send(output("never-sent", 9), output("keep", 1))
        await engine.send(finished("keep", 2))
        assert await streamed_tokens(keep) == [1, 2]
    await nothing_else_is_pending(engine, client)
    return 1


async def finished_twice_in_one_message(engine: HostileEngine, client: TrioMPClient) -> int:
    """The same finished output twice in one message is delivered once."""
    await client.add_request(request("twice"))
    await client.add_request(request("keep"))
    await engine.expect_adds("twice", "keep")
    await engine.send(finished("twice", 1), finished("twice", 1), output("keep", 1))
    await engine.send(finished("keep", 2))
    assert await delivered_until_finished(client, "twice", "keep") == {
        "twice": [([1], True)],
        "keep": [([1], False), ([2], True)],
    }
    await nothing_else_is_pending(engine, client)
    return 1


async def finished_twice_while_streaming(engine: HostileEngine, client: TrioMPClient) -> int:
    """A stream ends after its first finished output; a second one is not delivered."""
    async with client.stream(request("twice")) as twice:
        await engine.expect_adds("twice")
        await engine.send(finished("twice", 1), finished("twice", 2))
        assert await streamed_tokens(twice) == [1]
    await nothing_else_is_pending(engine, client)
    return 1


async def output_after_finish_in_the_same_message(
    engine: HostileEngine, client: TrioMPClient
) -> int:
    """An output following the finished one in the same message is not delivered."""
    await client.add_request(request("done"))
    await client.add_request(request("keep"))
    await engine.expect_adds("done", "keep")
    await engine.send(finished("done", 1), output("done", 2), output("keep", 1))
    await engine.send(finished("keep", 2))
    assert await delivered_until_finished(client, "done", "keep") == {
        "done": [([1], True)],
        "keep": [([1], False), ([2], True)],
    }
    await nothing_else_is_pending(engine, client)
    return 1


async def outputs_after_finish_in_later_messages(
    engine: HostileEngine, client: TrioMPClient
) -> int:
    """Outputs sent after a request's finished output are not delivered."""
    await client.add_request(request("done"))
    await client.add_request(request("keep"))
    await engine.expect_adds("done", "keep")
    await engine.send(finished("done", 1))
    await engine.send(output("done", 2), output("keep", 1))
    await engine.send(finished("done", 3), finished("keep", 2))
    assert await delivered_until_finished(client, "done", "keep") == {
        "done": [([1], True)],
        "keep": [([1], False), ([2], True)],
    }
    await nothing_else_is_pending(engine, client)
    return 2


async def output_after_finish_while_streaming(engine: HostileEngine, client: TrioMPClient) -> int:
    """An output after a stream's finished output reaches neither it nor get_output()."""
    async with client.stream(request("done")) as done:
        await engine.expect_adds("done")
        await engine.send(finished("done", 1))
        await engine.send(output("done", 2))
        assert await streamed_tokens(done) == [1]
    await nothing_else_is_pending(engine, client)
    return 1


async def late_outputs_after_abort(engine: HostileEngine, client: TrioMPClient) -> int:
    """Outputs the engine produced before it read an ABORT are not delivered."""
    await client.add_request(request("aborted"))
    await client.add_request(request("keep"))
    await engine.expect_adds("aborted", "keep")
    await client.abort_requests(["aborted"])
    await engine.expect_abort("aborted")
    await engine.send(output("aborted", 1), output("keep", 1))
    await engine.send(finished("aborted", 2), finished("keep", 2))
    assert await delivered_until_finished(client, "keep") == {"keep": [([1], False), ([2], True)]}
    await nothing_else_is_pending(engine, client)
    return 2


async def late_output_after_a_stream_was_left(engine: HostileEngine, client: TrioMPClient) -> int:
    """Leaving a stream aborts its request; a late output of it goes nowhere."""
    await client.add_request(request("keep"))
    async with client.stream(request("left")) as left:
        await engine.expect_adds("keep", "left")
        await engine.send(output("left", 1))
        assert (await left.receive()).new_token_ids == [1]
    await engine.expect_abort("left")
    await engine.send(output("left", 2), output("keep", 1))
    await engine.send(finished("keep", 2))
    assert await delivered_until_finished(client, "keep") == {"keep": [([1], False), ([2], True)]}
    await nothing_else_is_pending(engine, client)
    return 1


async def a_hundred_thousand_strays_in_one_message(
    engine: HostileEngine, client: TrioMPClient
) -> int:
    """A message with 100,000 outputs of unknown requests: each one is dropped."""
    await client.add_request(request("keep"))
    await engine.expect_adds("keep")
    strays = [output(f"stray-{i}", i) for i in range(100_000)]
    await engine.send(*strays[:50_000], output("keep", 1), *strays[50_000:])
    await engine.send(finished("keep", 2))
    assert await delivered_until_finished(client, "keep") == {"keep": [([1], False), ([2], True)]}
    await nothing_else_is_pending(engine, client)
    return 100_000


STRAY_SCENARIOS = [
    pytest.param(unknown_request_id, id="unknown-id"),
    pytest.param(unknown_request_id_while_streaming, id="unknown-id-while-streaming"),
    pytest.param(finished_twice_in_one_message, id="finished-twice-in-one-message"),
    pytest.param(finished_twice_while_streaming, id="finished-twice-while-streaming"),
    pytest.param(output_after_finish_in_the_same_message, id="after-finish-in-the-same-message"),
    pytest.param(outputs_after_finish_in_later_messages, id="after-finish-later"),
    pytest.param(output_after_finish_while_streaming, id="after-finish-while-streaming"),
    pytest.param(late_outputs_after_abort, id="late-after-abort"),
    pytest.param(late_output_after_a_stream_was_left, id="late-after-leaving-a-stream"),
    pytest.param(a_hundred_thousand_strays_in_one_message, id="100000-strays-in-one-message"),
]


@pytest.mark.parametrize("scenario", STRAY_SCENARIOS)
async def test_outputs_of_requests_not_in_flight_are_never_delivered(scenario: Scenario) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_hostile_engine() as (engine, client):
            await scenario(engine, client)
            assert client.statistics().protocol_errors == 0


@pytest.mark.parametrize("scenario", STRAY_SCENARIOS)
async def test_outputs_of_requests_not_in_flight_are_counted_as_dropped(
    scenario: Scenario,
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_hostile_engine() as (engine, client):
            dropped = await scenario(engine, client)
            assert client.statistics().outputs_dropped == dropped


# -------------------------------------------------------- outputs that cannot merge


async def test_a_stream_whose_outputs_cannot_be_merged_fails_alone() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_hostile_engine() as (engine, client):
            async with client.stream(request("bad")) as bad, client.stream(request("keep")) as keep:
                await engine.expect_adds("bad", "keep")
                # Each array decodes fine, but nobody reads "bad" yet, so its two outputs
                # are merged: a row of 2 candidates cannot be followed by one of 3.
                await engine.send(output("bad", 1, new_logprobs=logprobs(1, 2)), output("keep", 1))
                await engine.send(
                    output("bad", 2, new_logprobs=logprobs(1, 3)), finished("keep", 2)
                )
                assert await streamed_tokens(keep) == [1, 2]
                before_the_error: list[int] = []
                with pytest.raises(ProtocolError):
                    async for out in bad:
                        before_the_error += out.new_token_ids
                assert before_the_error in ([], [1])  # what came before may be delivered
                await engine.expect_abort("bad")
                assert client.statistics().protocol_errors == 1
            async with client.stream(request("after")) as after:
                await engine.expect_adds("after")
                await engine.send(finished("after", 3))
                assert await streamed_tokens(after) == [3]


# ------------------------------------------------------------- unknown engine_index


async def test_messages_from_an_engine_the_client_does_not_have_are_dropped_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_hostile_engine() as (engine, client):
            await client.add_request(request("keep"))
            await engine.expect_adds("keep")
            await engine.send(output("keep", 666), engine_index=7)
            await engine.send(output("keep", 1))
            await engine.send(finished("keep", 667), engine_index=1)
            await engine.send(finished("keep", 2))
            assert await delivered_until_finished(client, "keep") == {
                "keep": [([1], False), ([2], True)]
            }
            await nothing_else_is_pending(engine, client)
            assert client.statistics().protocol_errors == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("7" in line for line in warnings), warnings


async def test_the_batch_buffer_stays_bounded_when_every_message_claims_a_new_engine() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_hostile_engine(max_pending_outputs=64) as (engine, client):
            await client.add_request(request("a"))
            await engine.expect_adds("a")
            for index in range(1, 5_001):
                await engine.send(output("a", index), engine_index=index)
            await fence(engine, client)
            assert client.statistics().pending_batches <= 64 + 1


# ---------------------------------------------------------------- floods and waves


async def test_a_backlog_nobody_reads_is_held_within_the_documented_bounds() -> None:
    # docs/guide/backpressure.md: a stream holds one merged output; the batch buffer
    # holds at most max_pending_outputs messages, folding the rest, and a reader that
    # fell behind gets one engine's whole backlog in one call.
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_hostile_engine(max_pending_outputs=8) as (engine, client):
            await client.add_request(request("batch"))
            async with client.stream(request("streamed")) as streamed:
                await engine.expect_adds("batch", "streamed")
                for i in range(5_000):
                    await engine.send(output("batch", i), output("streamed", i))
                await fence(engine, client)
                assert client.statistics().pending_batches <= 8 + 1
                assert (await streamed.receive()).new_token_ids == list(range(5_000))
                backlog = await client.get_output()
                assert [out.new_token_ids for out in backlog.outputs] == [[i] for i in range(5_000)]
                assert client.statistics().pending_batches == 0


async def test_wave_notifications_for_waves_that_never_existed_leave_nothing_behind() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_hostile_engine() as (engine, client):
            await client.add_request(request("keep"))
            await engine.expect_adds("keep")
            await engine.send(wave_complete=99)
            await engine.send(start_wave=12_345)
            await engine.send(output("keep", 1), wave_complete=-5, start_wave=2**40)
            await engine.send(finished("keep", 2), wave_complete=0)
            assert await delivered_until_finished(client, "keep") == {
                "keep": [([1], False), ([2], True)]
            }
            await nothing_else_is_pending(engine, client)


# -------------------------------------------------------------------- utility replies


async def test_utility_replies_nobody_asked_for_are_ignored() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_hostile_engine() as (engine, client):
            unasked = [
                UtilityOutput(424_242, None, UtilityResult("surprise")),
                UtilityOutput(7, "?"),
            ]
            for reply in unasked:
                await engine.send(utility_output=reply)
            results: list[object] = []

            async def call() -> None:
                results.append(await client.call_utility("get_weight_version"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                asked = await engine.expect_utility()
                await engine.reply(asked, "for another call", call_id=asked.call_id ^ 1)
                await engine.reply(asked, "w1")
            assert results == ["w1"]
            assert client.statistics().pending_utility_calls == 0


# ---------------------------------------------------------------- undecodable frames


def _aux_frames_left_out() -> list[Buffer]:
    message = EngineCoreOutputs(outputs=[output("keep", 1, new_logprobs=logprobs(100, 4))])
    frames = MsgpackEncoder().encode(message)
    assert len(frames) > 1  # the arrays travel in aux frames
    return frames[:1]


def _truncated() -> list[Buffer]:
    payload = bytes(MsgpackEncoder().encode(EngineCoreOutputs(outputs=[output("keep", 1)]))[0])
    return [payload[: len(payload) // 2]]


UNDECODABLE: dict[str, Callable[[], list[Buffer]]] = {
    "not-msgpack": lambda: [b"\xc1"],
    # ZeroMQ cannot carry a message of no frames: the nearest is one empty frame.
    "one-empty-frame": lambda: [b""],
    "truncated": _truncated,
    "a-string": lambda: [msgspec.msgpack.encode("hello")],
    "a-field-of-the-wrong-type": lambda: [msgspec.msgpack.encode([0, [["keep", "1"]]])],
    "pickled": lambda: [msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\x80\x04N."))],
    "aux-frames-left-out": _aux_frames_left_out,
    "dead-marker-with-a-second-frame": lambda: [ENGINE_CORE_DEAD, b""],
}


@pytest.mark.parametrize("frames", UNDECODABLE.values(), ids=UNDECODABLE.keys())
async def test_undecodable_messages_are_dropped_and_counted(
    frames: Callable[[], list[Buffer]],
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with attached_to_hostile_engine() as (engine, client):
            await client.add_request(request("keep"))
            await engine.expect_adds("keep")
            await engine.send(output("keep", 1))
            await engine.send_frames(frames())
            await engine.send(finished("keep", 2))
            assert await delivered_until_finished(client, "keep") == {
                "keep": [([1], False), ([2], True)]
            }
            await nothing_else_is_pending(engine, client)
            assert client.statistics().protocol_errors == 1


# ------------------------------------------------------------------- engine death


async def test_outputs_sent_after_engine_core_dead_are_never_delivered() -> None:
    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(EngineDeadError) as died:
            async with attached_to_hostile_engine() as (engine, client):
                await client.add_request(request("batch"))
                async with client.stream(request("streamed")) as streamed:
                    await engine.expect_adds("batch", "streamed")
                    await engine.send_engine_core_dead()
                    await engine.send(output("batch", 1), output("streamed", 1), output("x", 1))
                    # The one message after the marker has been handled (and dropped).
                    await wait_until(lambda: client.statistics().messages_received == 1)
                    with pytest.raises(EngineDeadError):
                        await streamed.receive()
                with pytest.raises(EngineDeadError):
                    await client.get_output()
                assert client.statistics().requests_in_flight == 0
    assert type(died.value) is EngineDeadError  # one error, not a group


# ------------------------------------------------------ a failure inside the client


async def test_a_failure_in_the_receive_task_ends_the_block_with_one_engine_core_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_method(self: ClientState, message: EngineCoreOutputs) -> None:
        raise RuntimeError("a bug in the client")

    with trio.fail_after(TIMEOUT_S):
        with pytest.raises(EngineCoreError) as failure:
            async with attached_to_hostile_engine() as (engine, client):
                # Stands in for any bug: the receive task hands each message to this.
                monkeypatch.setattr(ClientState, "handle_outputs", broken_method)
                await client.add_request(request("a"))
                await engine.expect_adds("a")
                await engine.send(output("a", 1))
                await client.get_output()
    assert isinstance(failure.value.__cause__, RuntimeError)
    assert "a bug in the client" in str(failure.value)

"""RequestStream: the per-request channel between the receive task and one reader."""

from __future__ import annotations

import gc

import pytest
import trio
import trio.testing

from trio_enginecore.client import RequestStream
from trio_enginecore.client._core._stream import StreamFeed, open_request_stream
from trio_enginecore.errors import EngineDeadError
from trio_enginecore.protocol import EngineCoreOutput, FinishReason


def out(*tokens: int, finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput("req-1", list(tokens), finish_reason=finish)


_FEEDS: dict[RequestStream, StreamFeed] = {}
_STREAMS: dict[StreamFeed, RequestStream] = {}


class Closes:
    """An ``on_close`` callback that records the streams whose reading half closed."""

    def __init__(self) -> None:
        self.calls: list[RequestStream] = []

    def __call__(self, feed: StreamFeed) -> None:
        self.calls.append(_STREAMS[feed])


def make_stream() -> tuple[RequestStream, Closes]:
    closes = Closes()
    feed, stream = open_request_stream("req-1", on_close=closes)
    _FEEDS[stream] = feed
    _STREAMS[feed] = stream
    return stream, closes


def feed_of(stream: RequestStream) -> StreamFeed:
    """The feeding half of a stream made by :func:`make_stream`."""
    return _FEEDS[stream]


# ------------------------------------------------------------ merging and ending


async def test_pushes_before_a_receive_are_merged_into_one_output() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1, 2))
    feed_of(stream).push(out(3))
    feed_of(stream).push(out())
    feed_of(stream).push(out(4, 5))
    got = await stream.receive()
    assert got.request_id == "req-1"
    assert got.new_token_ids == [1, 2, 3, 4, 5]
    assert got.finish_reason is None
    assert not stream.finished


async def test_async_for_ends_after_the_finished_output() -> None:
    stream, closes = make_stream()
    feed_of(stream).push(out(1))
    feed_of(stream).push(out(2, finish=FinishReason.STOP))
    feed_of(stream).push(out(3))  # after the finish: ignored
    feed_of(stream).push(out(4, finish=FinishReason.LENGTH))  # ignored as well
    received = [o async for o in stream]
    assert len(received) == 1
    assert received[0].new_token_ids == [1, 2]
    assert received[0].finish_reason is FinishReason.STOP
    with pytest.raises(trio.EndOfChannel):
        await stream.receive()
    with pytest.raises(trio.EndOfChannel):  # and stays ended
        await stream.receive()
    assert stream.tokens_received == 2
    assert closes.calls == []  # ending is not closing


async def test_async_for_with_a_live_producer() -> None:
    stream, _ = make_stream()
    received: list[EngineCoreOutput] = []

    async def reader() -> None:
        received.extend([o async for o in stream])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        for step in range(5):
            await trio.testing.wait_all_tasks_blocked()
            feed_of(stream).push(out(step))
        await trio.testing.wait_all_tasks_blocked()
        feed_of(stream).push(out(10))
        feed_of(stream).push(
            out(11, finish=FinishReason.STOP)
        )  # merged with 10 (no wake in between)
        feed_of(stream).push(out(12))
    assert [o.new_token_ids for o in received] == [[0], [1], [2], [3], [4], [10, 11]]
    assert [o.finish_reason for o in received] == [None] * 5 + [FinishReason.STOP]


async def test_a_finished_output_without_tokens_ends_the_stream() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1))
    assert (await stream.receive()).new_token_ids == [1]
    feed_of(stream).push(out(finish=FinishReason.LENGTH))
    last = await stream.receive()
    assert last.new_token_ids == []
    assert last.finish_reason is FinishReason.LENGTH
    with pytest.raises(trio.EndOfChannel):
        await stream.receive()


# ------------------------------------------------------------ waiting


async def test_receive_waits_until_a_push_arrives() -> None:
    stream, _ = make_stream()
    received: list[EngineCoreOutput] = []

    async def reader() -> None:
        received.append(await stream.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert received == []  # blocked: nothing to deliver yet
        feed_of(stream).push(out(7, 8))
        await trio.testing.wait_all_tasks_blocked()
        assert [o.new_token_ids for o in received] == [[7, 8]]


async def test_receive_waits_with_autojump_clock(autojump_clock: trio.testing.MockClock) -> None:
    stream, _ = make_stream()

    async def push_later() -> None:
        await trio.sleep(5)
        feed_of(stream).push(out(1, finish=FinishReason.STOP))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(push_later)
        start = trio.current_time()
        got = await stream.receive()
        assert trio.current_time() - start == pytest.approx(5)
    assert got.finished


# ------------------------------------------------------------ checkpoints and cancellation


async def test_receive_is_a_checkpoint_even_with_an_output_pending() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1))
    with trio.testing.assert_checkpoints():
        got = await stream.receive()
    assert got.new_token_ids == [1]

    # The finished output too. (Like trio's memory channels, raising EndOfChannel is
    # only a cancel point, so it is not asserted here.)
    feed_of(stream).push(out(2, finish=FinishReason.STOP))
    with trio.testing.assert_checkpoints():
        await stream.receive()


async def test_a_receive_cancelled_while_waiting_leaves_the_stream_unchanged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream, _ = make_stream()
    with trio.move_on_after(1) as scope:
        await stream.receive()
    assert scope.cancelled_caught
    # Not left "busy", and the next push goes to the next receive.
    feed_of(stream).push(out(1, 2))
    feed_of(stream).push(out(3))
    got = await stream.receive()
    assert got.new_token_ids == [1, 2, 3]
    assert stream.tokens_received == 3


async def test_a_reader_task_cancelled_while_waiting_loses_nothing() -> None:
    stream, _ = make_stream()
    outcome: list[object] = []

    async def reader(scope: trio.CancelScope) -> None:
        with scope:
            outcome.append(await stream.receive())
        outcome.append("cancelled" if scope.cancelled_caught else "done")

    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, scope)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
    assert outcome == ["cancelled"]

    feed_of(stream).push(out(5))
    assert (await stream.receive()).new_token_ids == [5]


async def test_a_push_and_a_cancel_in_the_same_tick_deliver_exactly_once() -> None:
    stream, _ = make_stream()
    received: list[EngineCoreOutput] = []

    async def reader(scope: trio.CancelScope) -> None:
        with scope:
            received.append(await stream.receive())

    scope = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, scope)
        await trio.testing.wait_all_tasks_blocked()
        feed_of(stream).push(out(1))
        scope.cancel()  # before the reader ran again

    # Either the reader got the output, or it is still pending: never both, never none.
    if not received:
        received.append(await stream.receive())
    assert [o.new_token_ids for o in received] == [[1]]
    feed_of(stream).push(out(2, finish=FinishReason.STOP))
    assert (await stream.receive()).new_token_ids == [2]


async def test_a_receive_in_a_cancelled_scope_does_not_consume_the_pending_output() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1, 2, finish=FinishReason.STOP))
    reached = False
    with trio.CancelScope() as scope:
        scope.cancel()
        await stream.receive()
        reached = True
    assert scope.cancelled_caught
    assert not reached
    got = await stream.receive()
    assert got.new_token_ids == [1, 2]
    assert got.finished


async def test_a_receive_in_a_cancelled_scope_on_an_empty_stream_raises_cancelled() -> None:
    stream, _ = make_stream()
    with trio.CancelScope() as scope:
        scope.cancel()
        await stream.receive()
    assert scope.cancelled_caught
    feed_of(stream).push(out(9))
    assert (await stream.receive()).new_token_ids == [9]


# ------------------------------------------------------------ engine death and aborts


async def test_fail_wakes_a_waiting_reader_with_engine_dead_error() -> None:
    stream, _ = make_stream()
    errors: list[EngineDeadError] = []

    async def reader() -> None:
        try:
            await stream.receive()
        except EngineDeadError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        feed_of(stream).fail("engine 0 exited with code -9")
    assert len(errors) == 1
    assert "engine 0 exited with code -9" in str(errors[0])
    # Every later receive says so again; the first reason wins.
    feed_of(stream).fail("a second reason")
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        await stream.receive()
    assert not stream.finished


async def test_fail_still_delivers_the_tokens_that_arrived_before() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1))
    feed_of(stream).push(out(2))
    feed_of(stream).fail("boom")
    assert (await stream.receive()).new_token_ids == [1, 2]
    with pytest.raises(EngineDeadError, match="boom"):
        await stream.receive()


async def test_fail_after_the_finished_output_has_no_effect() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1, finish=FinishReason.STOP))
    assert (await stream.receive()).finished
    feed_of(stream).fail("too late")
    with pytest.raises(trio.EndOfChannel):
        await stream.receive()


async def test_fail_after_the_finish_arrived_but_before_it_was_read_has_no_effect() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1, finish=FinishReason.STOP))
    feed_of(stream).fail("too late")
    received = [o async for o in stream]
    assert [o.new_token_ids for o in received] == [[1]]


async def test_abort_locally_ends_the_stream_with_an_abort_output() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1, 2))
    feed_of(stream).push(out(3))
    feed_of(stream).abort_locally()
    assert stream.finished
    received = [o async for o in stream]
    assert len(received) == 1
    assert received[0].new_token_ids == [1, 2, 3]
    assert received[0].finish_reason is FinishReason.ABORT
    assert received[0].request_id == "req-1"


async def test_abort_locally_wakes_a_waiting_reader() -> None:
    stream, _ = make_stream()
    received: list[EngineCoreOutput] = []

    async def reader() -> None:
        received.extend([o async for o in stream])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        feed_of(stream).abort_locally()
    assert [(o.new_token_ids, o.finish_reason) for o in received] == [([], FinishReason.ABORT)]


async def test_abort_locally_after_the_finish_changes_nothing() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1, finish=FinishReason.STOP))
    feed_of(stream).abort_locally()
    got = await stream.receive()
    assert got.finish_reason is FinishReason.STOP
    assert got.new_token_ids == [1]
    feed_of(stream).abort_locally()
    with pytest.raises(trio.EndOfChannel):
        await stream.receive()


# ------------------------------------------------------------ misuse and closing


async def test_two_concurrent_receivers_raise_busy_resource_error() -> None:
    stream, _ = make_stream()
    received: list[EngineCoreOutput] = []

    async def first() -> None:
        received.append(await stream.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await stream.receive()
        # The first receiver is unaffected by the failed second one.
        feed_of(stream).push(out(4))
    assert [o.new_token_ids for o in received] == [[4]]


async def test_receive_after_aclose_raises_closed_resource_error() -> None:
    stream, closes = make_stream()
    feed_of(stream).push(out(1))  # pending outputs are dropped by closing
    await stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive()
    assert closes.calls == [stream]


async def test_on_close_is_called_exactly_once() -> None:
    stream, closes = make_stream()
    await stream.aclose()
    await stream.aclose()
    feed_of(stream).close()
    assert closes.calls == [stream]

    other, other_closes = make_stream()
    async with other:
        pass
    feed_of(other).close()
    assert other_closes.calls == [other]


async def test_aclose_wakes_a_waiting_reader_with_closed_resource_error() -> None:
    stream, closes = make_stream()
    errors: list[BaseException] = []

    async def reader() -> None:
        try:
            await stream.receive()
        except trio.ClosedResourceError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        await stream.aclose()
    assert len(errors) == 1
    assert len(closes.calls) == 1


async def test_aclose_closes_even_in_a_cancelled_scope() -> None:
    stream, closes = make_stream()
    with trio.CancelScope() as scope:
        scope.cancel()
        await stream.aclose()
    assert closes.calls == [stream]
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive()


async def test_close_wins_over_a_finished_or_failed_stream() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1, finish=FinishReason.STOP))
    assert (await stream.receive()).finished
    await stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive()

    failed, _ = make_stream()
    feed_of(failed).fail("boom")
    await failed.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await failed.receive()


async def test_pushes_after_close_are_not_delivered() -> None:
    stream, _ = make_stream()
    await stream.aclose()
    feed_of(stream).push(out(1))
    feed_of(stream).abort_locally()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive()
    assert stream.tokens_received == 0


async def test_a_receive_on_an_ended_stream_in_a_cancelled_scope_raises_cancelled() -> None:
    stream, _ = make_stream()
    feed_of(stream).push(out(1, finish=FinishReason.STOP))
    await stream.receive()
    with trio.CancelScope() as scope:
        scope.cancel()
        await stream.receive()
    assert scope.cancelled_caught


async def test_a_push_racing_a_close_is_not_delivered_to_the_woken_reader() -> None:
    stream, _ = make_stream()
    errors: list[BaseException] = []

    async def reader() -> None:
        try:
            await stream.receive()
        except trio.ClosedResourceError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        feed_of(stream).close()
        feed_of(stream).push(out(1))  # in the same tick, before the reader runs
    assert len(errors) == 1


# ------------------------------------------------------------ properties


async def test_finished_and_tokens_received() -> None:
    stream, _ = make_stream()
    assert stream.request_id == "req-1"
    assert not stream.finished
    assert stream.tokens_received == 0
    feed_of(stream).push(out(1, 2, 3))
    assert stream.tokens_received == 3
    await stream.receive()
    feed_of(stream).push(out())
    feed_of(stream).push(out(4))
    assert stream.tokens_received == 4
    assert not stream.finished
    feed_of(stream).push(out(5, 6, finish=FinishReason.LENGTH))
    assert stream.finished  # as soon as it arrived, before it is read
    assert stream.tokens_received == 6
    feed_of(stream).push(out(7, 8))  # ignored after the finish
    assert stream.tokens_received == 6
    got = await stream.receive()
    assert got.new_token_ids == [4, 5, 6]
    assert stream.finished


async def test_finished_after_an_abort() -> None:
    stream, _ = make_stream()
    feed_of(stream).abort_locally()
    assert stream.finished
    assert stream.tokens_received == 0


async def test_the_stream_is_a_trio_receive_channel() -> None:
    stream, _ = make_stream()
    assert isinstance(stream, trio.abc.ReceiveChannel)
    feed_of(stream).push(out(1, finish=FinishReason.STOP))
    async with stream:
        assert [o.new_token_ids async for o in stream] == [[1]]


async def test_a_stream_block_is_entered_once_and_lets_go_of_the_request() -> None:
    from trio_enginecore import EngineCoreRequest
    from trio_enginecore.testing import open_fake_engine_client

    async with open_fake_engine_client() as client:
        request = EngineCoreRequest.for_tokens([1], request_id="once", max_tokens=2)
        block = client.stream(request)
        async with block as outputs:
            # Sent: the block holds the request no more (an open stream costs less).
            assert all(referent is not request for referent in gc.get_referents(block))
            tokens = [t async for o in outputs for t in o.new_token_ids]
        assert len(tokens) == 2
        with pytest.raises(RuntimeError, match="entered only once"):
            async with block:
                pass  # pragma: no cover

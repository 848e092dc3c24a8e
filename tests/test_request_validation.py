"""Requests are easy to build and every mistake gets a clear error.

* ``EngineCoreRequest.for_tokens`` builds a request with keywords and defaults, and
  encodes exactly as the positional constructor does.
* ``add_request``, ``add_requests`` and ``stream`` check the request before anything is
  sent: a wrong type raises ``TypeError`` naming the field, a reused id in flight raises
  ``ValueError``; nothing is registered, and the client serves the next request exactly.
* A request the engine rejects makes its stream raise ``RequestFailedError`` with the
  engine's message, after the outputs that came before; the batch API keeps vLLM's
  shape (the output carries ``finish_reason=ERROR`` and ``error``).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    FinishReason,
    InprocClient,
    RequestFailedError,
    SamplingParams,
    SyncMPClient,
    TrioMPClient,
    open_engine_client,
)
from trio_enginecore._request_checks import check_request, check_requests
from trio_enginecore.client._core._stream import open_request_stream
from trio_enginecore.protocol import EngineCoreOutput, LoRARequest, RequestError
from trio_enginecore.serial import MsgpackEncoder
from trio_enginecore.testing import FakeEngine, open_fake_engine_client

from .support import expected

MAX_MODEL_LEN = 64

# ------------------------------------------------------------- the keyword constructor


def test_for_tokens_fills_every_other_field_with_its_default() -> None:
    request = EngineCoreRequest.for_tokens([1, 2, 3], request_id="r", arrival_time=5.0)
    assert request == EngineCoreRequest(
        "r", [1, 2, 3], None, SamplingParams(), None, 5.0, None, None, None
    )


def test_for_tokens_encodes_exactly_like_the_positional_constructor() -> None:
    keyword = EngineCoreRequest.for_tokens(
        [7, 8],
        request_id="same",
        arrival_time=1.5,
        max_tokens=8,
        temperature=0.5,
        seed=3,
        stop_token_ids=[2],
        priority=4,
        data_parallel_rank=1,
        cache_salt="salt",
        lora_request=LoRARequest("adapter", 1),
    )
    positional = EngineCoreRequest(
        "same",
        [7, 8],
        None,
        SamplingParams(max_tokens=8, temperature=0.5, seed=3, stop_token_ids=[2]),
        None,
        1.5,
        LoRARequest("adapter", 1),
        "salt",
        1,
        priority=4,
    )
    encoder = MsgpackEncoder()
    assert [bytes(f) for f in encoder.encode(keyword)] == [
        bytes(f) for f in encoder.encode(positional)
    ]


def test_for_tokens_generates_a_new_unique_id_and_stamps_the_arrival_time() -> None:
    ids = {EngineCoreRequest.for_tokens([1]).request_id for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", i) for i in ids)
    import time

    before = time.time()
    request = EngineCoreRequest.for_tokens([1])
    assert before <= request.arrival_time <= time.time()


def test_for_tokens_takes_the_whole_sampling_params_or_keywords_but_not_both() -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert EngineCoreRequest.for_tokens([1], sampling_params=params).sampling_params is params
    assert EngineCoreRequest.for_tokens([1], max_tokens=3, ignore_eos=True).sampling_params == (
        params
    )
    with pytest.raises(TypeError, match="either sampling_params or sampling keywords"):
        EngineCoreRequest.for_tokens([1], sampling_params=params, max_tokens=3)


def test_for_tokens_accepts_any_iterable_and_numpy_arrays_of_token_ids() -> None:
    assert EngineCoreRequest.for_tokens(range(3)).prompt_token_ids == [0, 1, 2]
    from_numpy = EngineCoreRequest.for_tokens(np.array([5, 6], dtype=np.int32))
    assert from_numpy.prompt_token_ids == [5, 6]
    assert all(type(t) is int for t in from_numpy.prompt_token_ids or [])
    check_request(from_numpy)


def test_for_tokens_refuses_a_text_prompt_and_bad_sampling_values() -> None:
    with pytest.raises(TypeError, match="tokenize the prompt first"):
        EngineCoreRequest.for_tokens("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        EngineCoreRequest.for_tokens([1], max_tokens=0)


# ------------------------------------------------------------------- the check itself


def _good(**changes: Any) -> EngineCoreRequest:
    request = EngineCoreRequest.for_tokens([1, 2, 3], request_id="ok", max_tokens=4)
    return msgspec.structs.replace(request, **changes)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"request_id": 123}, TypeError, r"request_id must be a str, got int 123"),
        ({"request_id": b"id"}, TypeError, r"request_id must be a str, got bytes"),
        ({"request_id": ""}, ValueError, r"request_id must not be empty"),
        ({"prompt_token_ids": ["1", "2"]}, TypeError, r"must hold ints, but item 0 is str '1'"),
        ({"prompt_token_ids": [1, 2.0]}, TypeError, r"item 1 is float 2.0"),
        ({"prompt_token_ids": [1, True]}, TypeError, r"item 1 is bool True"),
        ({"prompt_token_ids": [1, np.int64(2)]}, TypeError, r"item 1 is int64"),
        ({"prompt_token_ids": np.array([1, 2])}, TypeError, r"list of int.*\.tolist\(\)"),
        ({"prompt_token_ids": (1, 2)}, TypeError, r"prompt_token_ids must be a list of int"),
        ({"prompt_token_ids": [3, -1]}, ValueError, r"prompt_token_ids\[1\] is -1"),
        ({"prompt_token_ids": [*range(500), "x"]}, TypeError, r"item 500 is str 'x'"),
        ({"prompt_token_ids": [*range(500), -3]}, ValueError, r"prompt_token_ids\[500\] is -3"),
        ({"prompt_token_ids": [*range(500), False]}, TypeError, r"item 500 is bool False"),
        # vLLM 0.34 packs prompts as int32: every client refuses larger ids, any release.
        ({"prompt_token_ids": [1, 2**31]}, ValueError, r"\[1\] is 2147483648: .* fit in int32"),
        ({"prompt_token_ids": [*range(500), 2**40]}, ValueError, r"\[500\] is .* int32"),
        ({"prompt_token_ids": None}, ValueError, r"needs prompt_token_ids"),
        ({"sampling_params": {"max_tokens": 4}}, TypeError, r"sampling_params must be a"),
        ({"sampling_params": None}, ValueError, r"needs sampling_params .* or pooling_params"),
        ({"arrival_time": "now"}, TypeError, r"arrival_time must be a float"),
        ({"priority": "high"}, TypeError, r"priority must be an int, got str"),
        ({"priority": True}, TypeError, r"priority must be an int, got bool"),
        ({"data_parallel_rank": "0"}, TypeError, r"data_parallel_rank must be an int or None"),
        ({"lora_request": "adapter"}, TypeError, r"lora_request must be a LoRARequest"),
        ({"cache_salt": 5}, TypeError, r"cache_salt must be a str or None"),
        ({"trace_headers": [("a", "b")]}, TypeError, r"trace_headers must be a dict"),
        ({"resumable": 1}, TypeError, r"resumable must be a bool"),
    ],
)
def test_a_wrongly_typed_field_is_named(
    changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        check_request(_good(**changes))


def test_a_request_that_is_not_an_engine_core_request_is_refused() -> None:
    with pytest.raises(TypeError, match="expected an EngineCoreRequest, got dict"):
        check_request({"request_id": "x"})


def test_good_requests_pass_including_an_empty_prompt_left_to_the_engine() -> None:
    check_request(_good())
    check_request(_good(prompt_token_ids=[]))
    check_request(_good(arrival_time=0))
    check_request(_good(prompt_token_ids=list(range(5000))))


def test_a_batch_names_the_id_used_twice_or_already_in_flight() -> None:
    a, b = _good(request_id="a"), _good(request_id="b")
    check_requests([a, b], set())
    with pytest.raises(ValueError, match="'a' appears twice"):
        check_requests([a, b, _good(request_id="a")], set())
    with pytest.raises(ValueError, match="'b' is already in flight"):
        check_requests([a, b], {"b"})


# -------------------------------------------------- the real client, a real engine


@asynccontextmanager
async def engine_client(**config: Any) -> AsyncIterator[TrioMPClient]:
    config.setdefault("max_model_len", MAX_MODEL_LEN)
    async with open_engine_client(EngineConfig(**config)) as client:
        yield client


async def assert_serves_exactly(client: TrioMPClient, prompt: list[int], n: int = 6) -> None:
    """A new request, streamed from start to finish, gets exactly the counter's tokens."""
    tokens: list[int] = []
    async with client.stream(EngineCoreRequest.for_tokens(prompt, max_tokens=n)) as outputs:
        async for output in outputs:
            tokens += output.new_token_ids
            last = output
    assert tokens == expected(prompt, n)
    assert last.finish_reason is FinishReason.LENGTH
    assert client.statistics().requests_in_flight == 0
    assert await client.get_request_counts() == (0, 0)


async def assert_nothing_registered(client: TrioMPClient) -> None:
    stats = client.statistics()
    assert (stats.requests_in_flight, stats.open_streams) == (0, 0)
    assert await client.get_request_counts() == (0, 0)


BAD_REQUESTS: dict[str, tuple[Callable[[], EngineCoreRequest], type[Exception], str]] = {
    "int request id": (lambda: _good(request_id=123), TypeError, "request_id must be a str"),
    "string token ids": (
        lambda: _good(prompt_token_ids=["1", "2"]),
        TypeError,
        "prompt_token_ids must hold ints",
    ),
    "token id beyond int32": (
        lambda: _good(prompt_token_ids=[1, 2**31]),
        ValueError,
        "must fit in int32",
    ),
    "sampling params as a dict": (
        lambda: _good(sampling_params={"max_tokens": 4}),
        TypeError,
        "sampling_params must be a SamplingParams",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_a_bad_request_raises_at_once_and_the_client_serves_on(case: str) -> None:
    build, error, message = BAD_REQUESTS[case]
    with trio.fail_after(30):
        async with engine_client() as client:
            with pytest.raises(error, match=message):
                async with client.stream(build()):
                    pytest.fail("the block must not be entered")
            await assert_nothing_registered(client)
            with pytest.raises(error, match=message):
                await client.add_request(build())
            await assert_nothing_registered(client)
            with pytest.raises(error, match=message):
                await client.add_requests([_good(request_id="fine"), build()])
            await assert_nothing_registered(client)  # not even the good one was sent
            await assert_serves_exactly(client, [11, 12])


async def test_an_id_in_flight_cannot_be_reused_and_the_first_request_is_untouched() -> None:
    with trio.fail_after(30):
        async with engine_client(step_time_s=0.002) as client:
            first = EngineCoreRequest.for_tokens([40], request_id="dup", max_tokens=30)
            tokens: list[int] = []
            async with client.stream(first) as outputs:
                tokens += (await outputs.receive()).new_token_ids
                with pytest.raises(ValueError, match="'dup' is already in flight"):
                    async with client.stream(_good(request_id="dup")):
                        pytest.fail("the block must not be entered")
                with pytest.raises(ValueError, match="'dup' is already in flight"):
                    await client.add_request(_good(request_id="dup"))
                with pytest.raises(ValueError, match="'dup' is already in flight"):
                    await client.add_requests([_good(request_id="dup")])
                assert client.statistics().requests_in_flight == 1
                async for output in outputs:
                    tokens += output.new_token_ids
            assert tokens == expected([40], 30)
            await assert_serves_exactly(client, [13])


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt must contain at least one token"),
        (list(range(MAX_MODEL_LEN)), f"the prompt has {MAX_MODEL_LEN} tokens"),
        ([1, 10**6], "prompt token ids must be in"),
    ],
    ids=["empty prompt", "prompt too long", "token out of the vocabulary"],
)
async def test_a_request_the_engine_rejects_raises_from_its_stream(
    prompt: list[int], message: str
) -> None:
    with trio.fail_after(30):
        async with engine_client() as client:
            request = EngineCoreRequest.for_tokens(prompt, request_id="rejected", max_tokens=4)
            received: list[EngineCoreOutput] = []
            with pytest.raises(RequestFailedError) as caught:
                async with client.stream(request) as outputs:
                    received += [output async for output in outputs]
            assert received == []
            error = caught.value
            assert (error.request_id, error.code) == ("rejected", "invalid_request")
            assert message in error.engine_message
            assert message in str(error)
            assert "'rejected'" in str(error)
            await assert_serves_exactly(client, [21, 22])


async def test_the_batch_api_keeps_vllms_shape_for_a_rejected_request() -> None:
    with trio.fail_after(30):
        async with engine_client() as client:
            await client.add_request(EngineCoreRequest.for_tokens([], request_id="e"))
            (output,) = (await client.get_output()).outputs
            assert output.finish_reason is FinishReason.ERROR
            assert output.error is not None
            assert "at least one token" in output.error.message
            await assert_nothing_registered(client)


@pytest.mark.parametrize("kind", [InprocClient, SyncMPClient])
def test_the_blocking_clients_check_requests_too(kind: type[InprocClient | SyncMPClient]) -> None:
    with kind(EngineConfig(step_time_s=0.01)) as client:
        with pytest.raises(TypeError, match="request_id must be a str"):
            client.add_request(_good(request_id=7))
        with pytest.raises(ValueError, match="must fit in int32"):
            client.add_request(_good(prompt_token_ids=[2**31]))
        assert client.statistics().requests_in_flight == 0
        client.add_request(EngineCoreRequest.for_tokens([1], request_id="x", max_tokens=10_000))
        with pytest.raises(ValueError, match="'x' is already in flight"):
            client.add_request(_good(request_id="x"))
        assert client.statistics().requests_in_flight == 1  # "x", once
        client.abort_requests(["x"])
        client.add_request(EngineCoreRequest.for_tokens([3], request_id="ok", max_tokens=2))
        tokens: list[int] = []
        finished = False
        while not finished:
            for output in client.get_output().outputs:
                if output.request_id == "ok":
                    tokens += output.new_token_ids
                    finished = output.finished
        assert tokens == expected([3], 2)


# ------------------------------------------- a failure after some tokens, the stream's part


async def test_tokens_before_an_error_are_delivered_then_the_error_is_raised() -> None:
    engine = FakeEngine()
    engine.script("r", [[1, 2], [3]], error="the model hit a NaN")
    async with open_fake_engine_client(engine) as client:
        received: list[int] = []
        with pytest.raises(RequestFailedError, match="the model hit a NaN"):
            async with client.stream(_good(request_id="r")) as outputs:
                async for output in outputs:
                    assert output.finish_reason is None
                    received += output.new_token_ids
        assert received == [1, 2, 3]
        assert engine.aborted == []  # a finished request is not aborted on the way out


async def test_a_slow_reader_gets_the_merged_tokens_first_and_the_error_stays() -> None:
    feed, stream = open_request_stream("slow", on_close=lambda _: None)
    feed.push(EngineCoreOutput("slow", [1, 2]))
    feed.push(
        EngineCoreOutput(
            "slow",
            [3],
            finish_reason=FinishReason.ERROR,
            error=RequestError("internal", "gone wrong", retryable=True),
        )
    )
    merged = await stream.receive()
    assert merged.new_token_ids == [1, 2, 3]
    assert (merged.finish_reason, merged.error) == (None, None)
    for _ in range(2):  # it keeps raising: the error is not mistaken for a normal end
        with pytest.raises(RequestFailedError) as caught:
            await stream.receive()
        assert (caught.value.code, caught.value.retryable) == ("internal", True)


async def test_an_error_without_a_message_still_raises() -> None:
    feed, stream = open_request_stream("bare", on_close=lambda _: None)
    feed.push(EngineCoreOutput("bare", [], finish_reason=FinishReason.ERROR))
    with pytest.raises(RequestFailedError, match=r"\(unknown\): the engine gave no reason"):
        await stream.receive()

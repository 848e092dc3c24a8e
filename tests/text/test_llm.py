"""The text layer's Trio face against real engine processes (and the shipped fake
engine where a test must count what the engine received).

Timing rules: engines run on this machine's two cores; no test asserts a duration.
"""

from __future__ import annotations

import math
import random
import threading

import pytest
import trio

from trio_enginecore import EngineConfig, FinishReason, RequestOutputKind, SamplingParams
from trio_enginecore.errors import InvalidInputError
from trio_enginecore.testing import FakeEngine, open_fake_engine_client
from trio_enginecore.text import (
    AsyncLLM,
    Logprob,
    RequestOutput,
    SyncLLM,
    builtin_tokenizer,
    open_llm,
)

DELTA = RequestOutputKind.DELTA
pytestmark = pytest.mark.slow


async def settled_counts(llm: AsyncLLM) -> tuple[int, int]:
    """The engine's (waiting, running) counts once aborts in flight have landed."""
    counts = (-1, -1)
    for _ in range(200):
        counts = await llm.client.get_request_counts()  # type: ignore[attr-defined]
        if counts == (0, 0):
            break
        await trio.sleep(0.01)
    return counts


async def test_with_no_arguments_it_writes_english_text() -> None:
    async with open_llm() as llm:
        output = await llm.complete("The river", max_tokens=120, seed=3, temperature=0.5)
    completion = output.outputs[0]
    assert output.finished
    assert output.prompt == "The river"
    assert completion.finish_reason in ("length", "stop")
    words = completion.text.split()
    assert len(words) >= 3
    assert all(ch.isascii() for ch in completion.text)


async def test_the_same_seed_writes_the_same_text_and_deltas_add_up() -> None:
    async with open_llm() as llm:
        whole = await llm.complete("Tea is", max_tokens=60, seed=5)
        async with llm.generate("Tea is", max_tokens=60, seed=5, output_kind=DELTA) as outputs:
            pieces = [output.outputs[0].text async for output in outputs]
    assert "".join(pieces) == whole.outputs[0].text


async def test_leaving_early_aborts_the_request_on_the_engine() -> None:
    async with open_llm(EngineConfig(model="ngram", step_time_s=0.005)) as llm:
        received = 0
        with trio.move_on_after(0.2):
            async with llm.generate("The", max_tokens=3000, ignore_eos=True) as outputs:
                async for output in outputs:
                    received = len(output.outputs[0].token_ids)
        assert received > 0
        assert await settled_counts(llm) == (0, 0)
        stats = llm.client.statistics()
        assert (stats.requests_in_flight, stats.open_streams) == (0, 0)


async def test_n_sequences_stream_by_index_and_leaving_aborts_them_all() -> None:
    async with open_llm(EngineConfig(model="ngram", step_time_s=0.002)) as llm:
        final = await llm.complete("A good test", max_tokens=30, n=3, seed=2)
        assert sorted(c.index for c in final.outputs) == [0, 1, 2]
        assert len({c.text for c in final.outputs}) > 1  # seeds seed + i differ
        seen: set[int] = set()
        async with llm.generate("The", max_tokens=3000, n=4, ignore_eos=True) as outputs:
            async for output in outputs:
                seen.update(c.index for c in output.outputs)
                if seen == {0, 1, 2, 3}:
                    break
        assert await settled_counts(llm) == (0, 0)


async def test_a_slow_reader_gets_fewer_bigger_outputs_and_the_same_text() -> None:
    async with open_llm(EngineConfig(model="ngram", step_time_s=0.001)) as llm:
        fast = await llm.complete("The scheduler", max_tokens=200, ignore_eos=True, seed=4)
        reads = 0
        text = ""
        async with llm.generate(
            "The scheduler", max_tokens=200, ignore_eos=True, seed=4, output_kind=DELTA
        ) as outputs:
            async for output in outputs:
                reads += 1
                text += output.outputs[0].text
                await trio.sleep(0.05)
    assert text == fast.outputs[0].text
    assert reads < 100  # merged while the reader slept, nothing lost


async def test_bad_input_is_refused_before_sending_and_harms_no_one() -> None:
    async with open_llm(EngineConfig(model="ngram", step_time_s=0.002)) as llm:
        async with llm.generate("The", max_tokens=80, seed=1, output_kind=DELTA) as outputs:
            text = ""
            bad_calls = [
                lambda: llm.generate(""),
                lambda: llm.generate("x" * 5000),
                lambda: llm.generate([1, 2, 999]),
                lambda: llm.generate("hi", stop=[3]),  # type: ignore[list-item]
                lambda: llm.generate("hi", n=0),
                lambda: llm.generate("hi", min_tokens=-1),
            ]
            params = []
            async for output in outputs:
                text += output.outputs[0].text
                if bad_calls:
                    with pytest.raises(InvalidInputError) as caught:
                        bad_calls.pop()()
                    params.append(caught.value.param)
                    assert llm.client.statistics().requests_in_flight == 1
        assert sorted(params) == ["min_tokens", "n", "prompt", "prompt", "prompt", "stop"]
        assert len(text) > 0
        clean = await llm.complete("The", max_tokens=80, seed=1)
        assert clean.outputs[0].text == text


async def test_a_stop_string_aborts_the_engine_request_exactly_once() -> None:
    engine = FakeEngine()
    text = b"one, two, three, four, five"
    engine.script("r", [[b] for b in text])
    async with open_fake_engine_client(engine) as client:
        llm = AsyncLLM(client, builtin_tokenizer(), max_model_len=1024)
        got: list[RequestOutput] = []
        async with llm.generate("count:", request_id="r", stop=[", three"]) as outputs:
            got = [output async for output in outputs]
            await trio.sleep(0.1)  # the engine would go on: it was told to stop
    assert got[-1].outputs[0].text == "one, two"
    assert (got[-1].outputs[0].finish_reason, got[-1].outputs[0].stop_reason) == (
        "stop",
        ", three",
    )
    assert engine.aborted == ["r"]


async def test_the_engines_own_finish_needs_no_abort() -> None:
    engine = FakeEngine()
    engine.script("r", [[104], [105], [256]], finish_reason=FinishReason.STOP)
    async with open_fake_engine_client(engine) as client:
        llm = AsyncLLM(client, builtin_tokenizer(), max_model_len=1024)
        output = await llm.complete("x", request_id="r")
    assert output.outputs[0].text == "hi"
    assert output.outputs[0].token_ids == [104, 105, 256]
    assert engine.aborted == []


async def test_a_storm_of_cancellations_leaves_nothing_behind() -> None:
    rng = random.Random(7)
    async with open_llm(EngineConfig(model="ngram", step_time_s=0.002)) as llm:

        async def one(i: int) -> None:
            with trio.move_on_after(rng.random() * 0.3):
                n = rng.choice([1, 1, 2])
                params = SamplingParams(
                    max_tokens=rng.randint(1, 400),
                    n=n,
                    stop=rng.choice([None, [" the"], ["."]]),
                    output_kind=rng.choice(list(RequestOutputKind)),
                )
                async with llm.generate("The river", params) as outputs:
                    async for _ in outputs:
                        if rng.random() < 0.02:
                            break
                        await trio.sleep(rng.random() * 0.01)

        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(one, i)
        assert await settled_counts(llm) == (0, 0)
        stats = llm.client.statistics()
        assert (stats.requests_in_flight, stats.open_streams) == (0, 0)


def test_the_blocking_face_serves_several_threads() -> None:
    results: dict[int, str] = {}
    with SyncLLM() as llm:

        def work(i: int) -> None:
            results[i] = llm.complete("The river", max_tokens=40, seed=i).outputs[0].text

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with llm.generate("Tea", max_tokens=20, seed=0, output_kind=DELTA) as outputs:
            streamed = "".join(o.outputs[0].text for o in outputs)
        assert streamed == llm.complete("Tea", max_tokens=20, seed=0).outputs[0].text
        with pytest.raises(InvalidInputError):
            llm.generate("hi", n=0)
    assert len(results) == 4
    assert all(results.values())


async def test_text_over_a_data_parallel_group_pins_ranks_and_balances() -> None:
    config = EngineConfig(model="ngram", data_parallel_size=2, step_time_s=0.002)
    async with open_llm(config) as llm:
        pinned = [
            await llm.complete("The river", max_tokens=30, seed=6, data_parallel_rank=rank)
            for rank in (0, 1)
        ]
        # The same seed on either rank: the same text (the ranks run the same model).
        assert pinned[0].outputs[0].text == pinned[1].outputs[0].text
        spread = await llm.complete("Tea is", max_tokens=20, n=4, seed=1)
        assert sorted(c.index for c in spread.outputs) == [0, 1, 2, 3]
        stats = llm.client.statistics()
        assert [engine.in_flight for engine in stats.engines] == [0, 0]


# ---------------------------------------------------------- logprobs from the engine


def assert_position(position: dict[int, Logprob], chosen: int, num_logprobs: int) -> None:
    """One position's map as vLLM builds it: the chosen token first, then the top
    ``num_logprobs`` by rank (the chosen one among them appears once, with its top-k
    rank), logprobs <= 0 and in rank order, each token's own text."""
    tokenizer = builtin_tokenizer()
    assert next(iter(position)) == chosen
    rank = position[chosen].rank
    assert rank is not None
    assert len(position) == num_logprobs + (1 if rank > num_logprobs else 0)
    by_rank = sorted(position.values(), key=lambda entry: entry.rank or 0)
    assert [entry.rank for entry in by_rank[:num_logprobs]] == list(range(1, num_logprobs + 1))
    values = [entry.logprob for entry in by_rank]
    assert values == sorted(values, reverse=True)
    assert all(value <= 0.0 for value in values)
    assert all(entry.decoded_token == tokenizer.decode([i]) for i, entry in position.items())


async def test_complete_gives_the_engines_logprobs_per_position() -> None:
    async with open_llm() as llm:
        output = await llm.complete("The river", max_tokens=12, logprobs=2, seed=1)
        unasked = await llm.complete("The river", max_tokens=12, seed=1)
    completion = output.outputs[0]
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids) == 12
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert_position(position, token, 2)
    chosen = [
        position[token].logprob
        for token, position in zip(completion.token_ids, completion.logprobs, strict=True)
    ]
    assert completion.cumulative_logprob is not None
    assert math.isclose(completion.cumulative_logprob, sum(chosen), rel_tol=1e-6)
    # Logprobs change nothing about the text; a request without them gets none.
    assert unasked.outputs[0].token_ids == completion.token_ids
    assert unasked.outputs[0].logprobs is None
    assert unasked.outputs[0].cumulative_logprob is None
    assert unasked.prompt_logprobs is None


async def test_the_whole_vocabulary_adds_up_to_one_at_each_position() -> None:
    async with open_llm(EngineConfig(model="ngram", max_logprobs=-1)) as llm:
        output = await llm.complete("Tea is", max_tokens=6, logprobs=-1, seed=2)
    positions = output.outputs[0].logprobs
    assert positions is not None
    assert len(positions) == 6
    for token, position in zip(output.outputs[0].token_ids, positions, strict=True):
        assert len(position) == 257
        assert next(iter(position)) == token
        assert math.isclose(sum(math.exp(e.logprob) for e in position.values()), 1.0, rel_tol=1e-4)
        assert sorted(e.rank or 0 for e in position.values()) == list(range(1, 258))


async def test_prompt_logprobs_score_each_prompt_token_after_the_first() -> None:
    tokenizer = builtin_tokenizer()
    prompt_ids = tokenizer.encode("The river ran")
    async with open_llm() as llm:
        output = await llm.complete("The river ran", max_tokens=2, prompt_logprobs=2, seed=1)
        later = await llm.complete(
            "The river ran",
            SamplingParams(max_tokens=2, prompt_logprobs=1, prompt_logprob_start=4, seed=1),
        )
    scored = output.prompt_logprobs
    assert scored is not None
    assert len(scored) == len(prompt_ids)
    assert scored[0] is None
    for token, position in zip(prompt_ids[1:], scored[1:], strict=True):
        assert position is not None
        assert_position(position, token, 2)
    assert output.outputs[0].logprobs is None  # the prompt's only
    assert later.prompt_logprobs is not None
    assert later.prompt_logprobs[:5] == [None] * 5
    assert [next(iter(p)) for p in later.prompt_logprobs[5:] if p] == prompt_ids[5:]


async def test_logprob_token_ids_give_those_tokens_after_the_chosen_one() -> None:
    wanted = list(b"aeiou")
    params = SamplingParams(max_tokens=4, logprob_token_ids=wanted, seed=3)
    async with open_llm() as llm:
        output = await llm.complete("The garden", params)
    completion = output.outputs[0]
    assert completion.logprobs is not None
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert list(position) == [token, *(i for i in wanted if i != token)]
        assert all(entry.logprob <= 0.0 for entry in position.values())

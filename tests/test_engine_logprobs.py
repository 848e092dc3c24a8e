"""The reference engine sends logprobs as vLLM's engine does.

* ``SamplingParams.logprobs = k``: each output carries one row per new token, the
  sampled token first with its logprob, then the ``k`` most likely tokens by rank
  (``-1``: the whole vocabulary), and the sampled token's rank; ``logprob_token_ids``
  puts those ids in place of the top ``k``.
* ``prompt_logprobs = k``: a request's first output carries one row per prompt
  position after the first (from ``prompt_logprob_start`` on), the prompt token first;
  ``prompt_logprob_token_ids`` has those ids scored, row by row.
* Values are the model's raw logprobs (before temperature and truncation). A rank is
  1 + the more likely tokens + the equally likely ones of smaller id. The counter
  model's are fixed: 0.0 for its token, ``-d`` for the id ``d`` steps further on.
* More than ``max_logprobs`` (20 by default, as vLLM's) fails that request with
  vLLM's message; a request asking for none gets none, and costs nothing.

Pure tests drive :class:`EngineCore` directly; the last ones run engine processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import trio
from hypothesis import given, settings, strategies as st

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    RequestFailedError,
    SamplingParams,
    open_engine_client,
)
from trio_enginecore.dialects import DIALECTS
from trio_enginecore.engine import CounterModel, EngineCore, Model, NgramModel, SamplingState
from trio_enginecore.engine._models import rank_of, top_ids
from trio_enginecore.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    Tensor,
)
from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder, outputs_for

VOCAB = 32000
PROMPT = list(b"The river")

# ------------------------------------------------------------------------ helpers


def request(
    rid: str, prompt: Sequence[int] = (5, 9, 10), *, max_tokens: int = 3, **sampling: Any
) -> EngineCoreRequest:
    return EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=max_tokens, **sampling)


def with_params(rid: str, prompt: Sequence[int], **params: Any) -> EngineCoreRequest:
    """A request with SamplingParams fields ``for_tokens`` has no keyword for."""
    return EngineCoreRequest(
        rid, list(prompt), None, SamplingParams(**params), None, 0.0, None, None, None
    )


def run(engine: EngineCore, *requests: EngineCoreRequest) -> dict[str, list[EngineCoreOutput]]:
    """Every output of each request, stepping until the engine is idle."""
    for one in requests:
        engine.add_request(one)
    received: dict[str, list[EngineCoreOutput]] = {}
    while engine.can_step:
        for batch in engine.step().values():
            for output in batch.outputs:
                received.setdefault(output.request_id, []).append(output)
    return received


def rows(lists: LogprobsLists) -> tuple[list[int], list[float], int]:
    """The one row of a single step's sample logprobs: ids, logprobs, rank."""
    assert lists.logprob_token_ids.shape[0] == lists.logprobs.shape[0] == 1
    return (
        lists.logprob_token_ids[0].tolist(),
        lists.logprobs[0].tolist(),
        int(lists.sampled_token_ranks[0]),
    )


def counter_engine(**config: Any) -> EngineCore:
    return EngineCore(EngineConfig(**config))


def ngram_engine(**config: Any) -> EngineCore:
    return EngineCore(EngineConfig(model="ngram", **config))


# -------------------------------------------------------- the counter model's values


def test_the_counter_is_certain_of_its_token_and_ranks_the_next_ids_after_it() -> None:
    outputs = run(counter_engine(), request("r", (5, 9, 10), max_tokens=3, logprobs=2))["r"]
    assert [o.new_token_ids for o in outputs] == [[11], [12], [13]]
    for token, output in zip((11, 12, 13), outputs, strict=True):
        assert output.new_logprobs is not None
        assert rows(output.new_logprobs) == ([token, token, token + 1], [0.0, 0.0, -1.0], 1)
        # 0.0, not -0.0: the value a client prints.
        assert math.copysign(1.0, output.new_logprobs.logprobs[0, 0]) == 1.0


def test_the_counters_logprobs_wrap_around_the_vocabulary() -> None:
    outputs = run(counter_engine(vocab_size=10), request("r", (8,), max_tokens=1, logprobs=3))
    lists = outputs["r"][0].new_logprobs
    assert lists is not None
    assert rows(lists) == ([9, 9, 0, 1], [0.0, 0.0, -1.0, -2.0], 1)


def test_the_counters_prompt_logprobs_score_each_prompt_token_by_its_distance() -> None:
    # After 5 the counter expects 6: 9 is 3 steps further (logprob -3, rank 4); after
    # 9 it expects 10, and gets it (0.0, rank 1).
    first = run(counter_engine(), request("r", (5, 9, 10), max_tokens=2, prompt_logprobs=2))["r"]
    tensors = first[0].new_prompt_logprobs_tensors
    assert tensors is not None
    assert tensors.logprob_token_ids.array.tolist() == [[9, 6, 7], [10, 10, 11]]
    assert tensors.logprobs.array.tolist() == [[-3.0, 0.0, -1.0], [0.0, 0.0, -1.0]]
    assert tensors.selected_token_ranks.array.tolist() == [4, 1]
    assert first[1].new_prompt_logprobs_tensors is None  # the first output only
    assert all(o.new_logprobs is None for o in first)  # asked for the prompt's only


def test_logprob_token_ids_take_the_place_of_the_top_k() -> None:
    asked = with_params("r", [5], max_tokens=1, logprob_token_ids=[7, 6, VOCAB - 1])
    lists = run(counter_engine(), asked)["r"][0].new_logprobs
    assert lists is not None
    # The counter produces 6; 7 is one id further, VOCAB - 1 is VOCAB - 7 further.
    assert rows(lists) == ([6, 7, 6, VOCAB - 1], [0.0, -1.0, 0.0, -(VOCAB - 7.0)], 1)


def test_the_wire_types_are_vllms() -> None:
    first = run(
        counter_engine(), request("r", (1, 2), max_tokens=1, logprobs=1, prompt_logprobs=1)
    )["r"][0]
    lists, tensors = first.new_logprobs, first.new_prompt_logprobs_tensors
    assert lists is not None
    assert tensors is not None
    assert [a.dtype.str for a in lists[:3]] == ["<i4", "<f4", "<i8"]
    assert (lists.logprob_token_ids.shape, lists.sampled_token_ranks.shape) == ((1, 2), (1,))
    assert lists.cu_num_generated_tokens is None
    kinds = [t.dtype for t in tensors[:3]]
    assert kinds == ["int32", "float32", "int64"]
    assert tensors.cu_num_generated_tokens is None
    assert tensors.cu_num_generated_tokens_tensor is None


def test_prompt_logprob_token_ids_score_those_ids_row_by_row() -> None:
    table = np.array([[9, 6, -1], [10, 3, 11], [1, 2, 3]], dtype=np.int64)
    asked = with_params("r", [5, 9, 10], max_tokens=2, prompt_logprob_token_ids=table)
    outputs = run(counter_engine(), asked)["r"]
    scores = outputs[0].prompt_token_id_logprobs
    assert scores is not None
    assert scores.dtype == "float32"
    # Row 0 follows [5] (the counter expects 6), row 1 follows [5, 9] (expects 10);
    # -1 pads, and row 2 would score the token after the prompt: -inf.
    inf = -math.inf
    assert scores.array.tolist() == [
        [-3.0, 0.0, inf],
        [0.0, -(VOCAB - 7.0), -1.0],
        [inf, inf, inf],
    ]
    assert outputs[1].prompt_token_id_logprobs is None
    assert all(o.new_logprobs is None and o.new_prompt_logprobs_tensors is None for o in outputs)
    later = with_params(
        "r", [5, 9, 10], max_tokens=1, prompt_logprob_token_ids=table[:1], prompt_logprob_start=1
    )
    scores = run(counter_engine(), later)["r"][0].prompt_token_id_logprobs
    assert scores is not None
    assert scores.array.tolist() == [[-(VOCAB - 1.0), -(VOCAB - 4.0), inf]]


# ------------------------------------------------------------- the n-gram model's values


def test_ngram_logprobs_are_the_models_raw_distribution_whatever_the_sampling() -> None:
    model = NgramModel()
    with np.errstate(divide="ignore"):
        expected = np.log(model.distribution(PROMPT))
    for sampling in ({}, {"temperature": 0.3, "top_k": 3}, {"top_p": 0.5, "min_p": 0.2}):
        engine = ngram_engine(max_logprobs=-1)
        first = run(engine, request("r", PROMPT, max_tokens=1, logprobs=-1, seed=1, **sampling))
        lists = first["r"][0].new_logprobs
        assert lists is not None
        ids, values, _ = rows(lists)
        seen = dict(zip(ids[1:], values[1:], strict=True))
        assert sorted(seen) == list(range(model.vocab_size))
        likely = [i for i in seen if expected[i] > -50]
        assert likely
        assert all(math.isclose(seen[i], expected[i], abs_tol=1e-5) for i in likely)
        # A byte never seen after this context: floored, finite, not -inf.
        assert min(seen.values()) == pytest.approx(math.log(1e-300), abs=1e-3)


def test_the_whole_vocabulary_is_a_distribution_ranked_best_first() -> None:
    engine = ngram_engine(max_logprobs=-1)
    outputs = run(engine, request("r", PROMPT, max_tokens=8, logprobs=-1, temperature=1.0, seed=4))
    for output in outputs["r"]:
        assert output.new_logprobs is not None
        ids, values, rank = rows(output.new_logprobs)
        assert len(ids) == 1 + 257
        assert math.isclose(sum(math.exp(v) for v in values[1:]), 1.0, rel_tol=1e-4)
        assert all(v <= 0.0 for v in values)
        assert values[1:] == sorted(values[1:], reverse=True)
        # The sampled token is at its rank in the ranking.
        assert ids[rank] == ids[0]
        assert values[rank] == values[0]


def test_greedy_tokens_have_rank_one_and_the_top_k_follow_by_rank() -> None:
    outputs = run(ngram_engine(), request("r", PROMPT, max_tokens=10, logprobs=5, temperature=0))
    for output in outputs["r"]:
        assert output.new_logprobs is not None
        ids, values, rank = rows(output.new_logprobs)
        assert rank == 1
        assert ids[1] == ids[0] == output.new_token_ids[0]
        assert len(ids) == 6
        assert len(set(ids[1:])) == 5
        assert values[1:] == sorted(values[1:], reverse=True)


def test_ngram_prompt_logprobs_from_prompt_logprob_start() -> None:
    model = NgramModel()
    asked = with_params("r", PROMPT, max_tokens=1, prompt_logprobs=3, prompt_logprob_start=5)
    tensors = run(ngram_engine(), asked)["r"][0].new_prompt_logprobs_tensors
    assert tensors is not None
    ids = tensors.logprob_token_ids.array
    # Rows 5.. score tokens 6..: the prompt token first, then the top 3.
    assert ids[:, 0].tolist() == PROMPT[6:]
    assert ids.shape == (len(PROMPT) - 6, 4)
    for row, end in enumerate(range(5, len(PROMPT) - 1)):
        raw = model.logprobs(PROMPT[: end + 1])
        assert ids[row, 1:].tolist() == top_ids(raw, 3).tolist()
        assert tensors.selected_token_ranks.array[row] == rank_of(raw, PROMPT[end + 1])
        assert np.allclose(tensors.logprobs.array[row], raw[ids[row]], atol=1e-5)


def test_a_prompt_with_nothing_to_score_gets_no_prompt_logprobs() -> None:
    one = run(counter_engine(), request("one", (4,), max_tokens=1, prompt_logprobs=2))
    assert one["one"][0].new_prompt_logprobs_tensors is None
    late = with_params("late", [1, 2, 3], max_tokens=1, prompt_logprobs=2, prompt_logprob_start=2)
    assert run(counter_engine(), late)["late"][0].new_prompt_logprobs_tensors is None


# ----------------------------------------------------------- ranks, ties and top ids


def test_ties_are_broken_by_token_id() -> None:
    row = np.log(np.array([0.1, 0.3, 0.1, 0.3, 0.2]))
    assert top_ids(row, 5).tolist() == [1, 3, 4, 0, 2]
    assert top_ids(row, 3).tolist() == [1, 3, 4]
    assert top_ids(row, 4).tolist() == [1, 3, 4, 0]
    assert [rank_of(row, t) for t in range(5)] == [4, 1, 5, 2, 3]
    assert top_ids(row, 0).tolist() == []


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(-4, 0), min_size=1, max_size=40),
    k=st.integers(0, 45),
)
def test_top_ids_are_the_first_k_of_the_full_ranking(values: list[int], k: int) -> None:
    row = np.array(values, dtype=np.float64)
    ranking = sorted(range(len(values)), key=lambda i: (-values[i], i))
    assert top_ids(row, k).tolist() == ranking[:k]
    assert [rank_of(row, t) for t in range(len(values))] == [
        ranking.index(t) + 1 for t in range(len(values))
    ]


@settings(max_examples=100, deadline=None)
@given(
    context=st.lists(st.integers(0, 99), min_size=1, max_size=5),
    token=st.integers(0, 99),
    top=st.integers(0, 100),
    ids=st.none() | st.lists(st.integers(0, 99), max_size=6),
)
def test_the_counters_closed_form_is_its_distribution_scored(
    context: list[int], token: int, top: int, ids: list[int] | None
) -> None:
    model = CounterModel(vocab_size=100)
    fast = model.score(context, token, top=top, ids=ids)
    slow = Model.score(model, context, token, top=top, ids=ids)
    assert (fast.logprob, fast.rank) == (slow.logprob, slow.rank)
    assert fast.ids.tolist() == slow.ids.tolist()
    assert fast.logprobs.tolist() == slow.logprobs.tolist()


# ---------------------------------------------------------- limits and refusals


REFUSALS: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    ({}, {"logprobs": 21}, "sample logprobs of 21, which is greater than max allowed: 20"),
    ({}, {"logprobs": -1}, f"Requested sample logprobs of {VOCAB}, which is greater than"),
    ({"max_logprobs": 2}, {"prompt_logprobs": 3}, "Requested prompt logprobs of 3, which is"),
    ({"max_logprobs": 0}, {"logprobs": 1}, "greater than max allowed: 0"),
    ({}, {"logprob_token_ids": list(range(129))}, "of length 129, which is greater than max"),
    ({}, {"logprob_token_ids": [1, VOCAB]}, f"token_id(s) [{VOCAB}] in logprob_token_ids"),
    ({}, {"logprobs": 1, "logprob_token_ids": [1, 2]}, "logprobs must equal len(logprob_"),
    ({}, {"prompt_logprob_start": 1}, "prompt_logprob_start requires prompt_logprobs"),
    ({}, {"prompt_logprob_token_ids": np.array([1, 2])}, "must be a non-empty integer array"),
    ({}, {"prompt_logprob_token_ids": np.zeros((1, 21), int)}, "21 token ids per row in"),
    ({}, {"prompt_logprob_token_ids": np.array([[-2]])}, "contain out-of-vocab token ids"),
    ({}, {"prompt_logprob_token_ids": np.array([[VOCAB]])}, "contain out-of-vocab token ids"),
    ({"max_model_len": 8}, {"prompt_logprob_token_ids": np.zeros((8, 1), int)}, "has 8 rows"),
    ({}, {"prompt_logprobs": 1, "prompt_logprob_start": -1}, "must be non-negative"),
]


@pytest.mark.parametrize(("config", "params", "message"), REFUSALS)
def test_asking_for_too_much_fails_that_request_with_vllms_message(
    config: dict[str, Any], params: dict[str, Any], message: str
) -> None:
    outputs = run(
        counter_engine(**config),
        with_params("bad", [1, 2], max_tokens=2, **params),
        request("good", (1, 2), max_tokens=2),
    )
    (failed,) = outputs["bad"]
    assert failed.finish_reason is FinishReason.ERROR
    assert failed.error is not None
    assert message in failed.error.message
    assert [o.new_token_ids for o in outputs["good"]] == [[3], [4]]


def test_max_logprobs_minus_one_allows_the_whole_vocabulary() -> None:
    lists = run(counter_engine(max_logprobs=-1), request("r", (1,), max_tokens=1, logprobs=-1))
    first = lists["r"][0].new_logprobs
    assert first is not None
    assert first.logprob_token_ids.shape == (1, VOCAB + 1)
    assert first.logprob_token_ids[0, 1:].tolist() == [(2 + d) % VOCAB for d in range(VOCAB)]


class Silent(Model):
    """A model that computes no logprobs."""

    name = "silent"
    vocab_size = 10
    eos_token_id = None

    def next_tokens(self, batch: Sequence[SamplingState]) -> list[int]:
        return [1] * len(batch)


def test_a_model_without_logprobs_refuses_requests_for_them_and_serves_the_rest() -> None:
    engine = EngineCore(EngineConfig(), model=Silent())
    outputs = run(
        engine,
        request("asks", (1,), max_tokens=1, prompt_logprobs=0),
        request("plain", (1,), max_tokens=1),
    )
    (refused,) = outputs["asks"]
    assert refused.error is not None
    assert refused.error.message == "the silent model computes no logprobs"
    assert outputs["plain"][0].new_token_ids == [1]


# ------------------------------------------------------------------ nothing asked


class Watched(CounterModel):
    """The counter model, counting the positions it is asked to score."""

    def __init__(self) -> None:
        super().__init__()
        self.scored = 0

    def score(self, *args: Any, **kwargs: Any) -> Any:
        self.scored += 1
        return super().score(*args, **kwargs)


def test_a_request_without_logprobs_gets_none_and_costs_none() -> None:
    model = Watched()
    engine = EngineCore(EngineConfig(), model=model)
    outputs = run(engine, *[request(f"plain{i}", max_tokens=5) for i in range(4)])
    assert model.scored == 0
    assert all(
        o.new_logprobs is None and o.new_prompt_logprobs_tensors is None
        for output in outputs.values()
        for o in output
    )
    # Mixed with one that asks, only that one is scored.
    outputs = run(engine, request("plain", max_tokens=5), request("asks", max_tokens=5, logprobs=1))
    assert model.scored == 5
    assert all(o.new_logprobs is None for o in outputs["plain"])
    assert all(o.new_logprobs is not None for o in outputs["asks"])


def test_aborted_and_finished_requests_stop_being_scored() -> None:
    model = Watched()
    engine = EngineCore(EngineConfig(), model=model)
    engine.add_request(request("a", max_tokens=100, logprobs=1))
    engine.add_request(request("b", max_tokens=2, logprobs=1))
    engine.step()
    engine.step()  # b finishes
    assert model.scored == 4
    engine.abort_requests(["a"])
    engine.add_request(request("c", max_tokens=3))
    run(engine)
    assert model.scored == 4


# ------------------------------------------------------------------ on the wire


@pytest.mark.parametrize("dialect", DIALECTS, ids=[d.name for d in DIALECTS])
def test_logprobs_round_trip_in_each_releases_form(dialect: Any) -> None:
    first = run(
        ngram_engine(), request("r", PROMPT, max_tokens=1, logprobs=3, prompt_logprobs=2, seed=1)
    )["r"][0]
    message = EngineCoreOutputs(outputs=[first], timestamp=1.0)
    frames = MsgpackEncoder().encode(outputs_for(dialect, message))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames).outputs[0]
    assert decoded.new_logprobs is not None
    assert first.new_logprobs is not None
    for got, sent in zip(decoded.new_logprobs[:3], first.new_logprobs[:3], strict=True):
        assert got.dtype == sent.dtype
        assert np.array_equal(got, sent)
    assert decoded.new_prompt_logprobs_tensors == first.new_prompt_logprobs_tensors


def test_prompt_logprobs_in_the_five_field_form_vllm_sends_decode() -> None:
    # vLLM 0.33 and 0.34 send LogprobsTensors with cu_num_generated_tokens_tensor last.
    tensors = LogprobsTensors(
        Tensor.from_numpy(np.array([[3, 3]], np.int32)),
        Tensor.from_numpy(np.array([[-0.5, -0.5]], np.float32)),
        Tensor.from_numpy(np.array([1], np.int64)),
    )
    encoded = MsgpackEncoder().encode(
        EngineCoreOutputs(
            outputs=[EngineCoreOutput("r", [1], new_prompt_logprobs_tensors=tensors)],
            timestamp=1.0,
        )
    )
    generic = msgspec.msgpack.decode(encoded[0])
    assert len(generic[1][0][3]) == 5
    assert generic[1][0][3][3:] == [None, None]
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(encoded)
    assert decoded.outputs[0].new_prompt_logprobs_tensors == tensors


# -------------------------------------------------------------- engine processes


@pytest.mark.parametrize("version", [d.tested_version for d in DIALECTS])
async def test_a_launched_engine_streams_logprobs_in_its_releases_form(version: str) -> None:
    with trio.fail_after(60):
        async with open_engine_client(EngineConfig(vllm_version=version)) as client:
            asked = request("r", (5, 9, 10), max_tokens=3, logprobs=2, prompt_logprobs=1)
            async with client.stream(asked) as outputs:
                received = [output async for output in outputs]
            plain = request("plain", (5,), max_tokens=2)
            async with client.stream(plain) as outputs:
                unasked = [output async for output in outputs]
    tokens = [t for o in received for t in o.new_token_ids]
    assert tokens == [11, 12, 13]
    sample = [o.new_logprobs for o in received]
    assert all(s is not None for s in sample)
    ids = np.concatenate([s.logprob_token_ids for s in sample if s is not None])
    assert ids.tolist() == [[t, t, t + 1] for t in tokens]
    tensors = received[0].new_prompt_logprobs_tensors
    assert tensors is not None
    assert tensors.logprob_token_ids.array.tolist() == [[9, 6], [10, 10]]
    assert tensors.selected_token_ranks.array.tolist() == [4, 1]
    assert all(o.new_logprobs is None and o.new_prompt_logprobs_tensors is None for o in unasked)


async def test_too_many_logprobs_fail_the_stream_with_vllms_message() -> None:
    with trio.fail_after(60):
        async with open_engine_client(EngineConfig()) as client:
            with pytest.raises(RequestFailedError, match="greater than max allowed: 20"):
                async with client.stream(request("r", logprobs=21)) as outputs:
                    async for _ in outputs:
                        pass
            async with client.stream(request("after", (1,), max_tokens=2)) as outputs:
                assert [o.new_token_ids async for o in outputs] in ([[2], [3]], [[2, 3]])

"""The built-in models: the predictable counter model and the small n-gram model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from trio_enginecore.config import EngineConfig
from trio_enginecore.engine import CounterModel, EngineCore, NgramModel, make_model
from trio_enginecore.protocol import EngineCoreRequest, FinishReason

EOS = 256


class Seq:
    """A minimal ``SamplingState`` for driving a model directly."""

    def __init__(self, token_ids: Sequence[int], temperature: float = 0.0) -> None:
        self.token_ids = list(token_ids)
        self.temperature = temperature
        self.top_k = 0
        self.top_p = 1.0
        self.min_p = 0.0
        self.rng = np.random.default_rng(0)

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]


# ----------------------------------------------------------------- counter model


def test_counter_next_tokens_for_a_small_batch() -> None:
    model = CounterModel(vocab_size=100)
    batch = [Seq([5]), Seq([1, 2, 98]), Seq([99]), Seq([0])]
    assert model.next_tokens(batch) == [6, 99, 0, 1]
    assert model.next_tokens([]) == []


@pytest.mark.parametrize("size", [31, 32, 33, 500])
def test_counter_next_tokens_for_batches_around_and_above_the_vectorised_threshold(
    size: int,
) -> None:
    model = CounterModel(vocab_size=1000)
    lasts = [(i * 37) % 1000 for i in range(size)]
    tokens = model.next_tokens([Seq([7, last]) for last in lasts])
    assert tokens == [(last + 1) % 1000 for last in lasts]
    assert 0 in tokens  # 999 wrapped around
    assert all(type(t) is int for t in tokens)  # plain ints, ready for msgpack


def test_counter_expected_tokens_continues_from_the_last_prompt_token() -> None:
    assert CounterModel.expected_tokens([9, 3], 4) == [4, 5, 6, 7]
    assert CounterModel.expected_tokens([31998], 3) == [31999, 0, 1]
    assert CounterModel.expected_tokens([8], 4, vocab_size=10) == [9, 0, 1, 2]
    assert CounterModel.expected_tokens([8], 0) == []


def test_counter_model_has_no_eos_and_no_tokenizer() -> None:
    model = CounterModel()
    assert (model.name, model.vocab_size, model.eos_token_id) == ("counter", 32000, None)
    assert model.detokenize([1, 22, 333]) == "1 22 333"
    with pytest.raises(NotImplementedError, match="counter"):
        model.tokenize("hello")


def test_make_model_builds_the_configured_model_and_vocabulary() -> None:
    counter = make_model(EngineConfig(vocab_size=10))
    assert isinstance(counter, CounterModel)
    assert counter.vocab_size == 10
    ngram = make_model(EngineConfig(model="ngram"))
    assert isinstance(ngram, NgramModel)
    assert (ngram.vocab_size, ngram.eos_token_id) == (257, EOS)
    assert make_model(EngineConfig(model="ngram", vocab_size=300)).vocab_size == 300


def test_the_ngram_model_needs_room_for_bytes_and_eos() -> None:
    with pytest.raises(ValueError, match="at least 257"):
        NgramModel(vocab_size=256)


# ------------------------------------------------------------------- ngram model

PROMPT = "The scheduler "


def generate(
    *,
    prompt: str = PROMPT,
    max_tokens: int = 100,
    engine: EngineCore | None = None,
    **sampling: Any,
) -> tuple[list[int], FinishReason | None]:
    """Step a fresh ngram engine until the request ends; its tokens and finish reason."""
    engine = engine or EngineCore(EngineConfig(model="ngram"))
    engine.add_request(
        EngineCoreRequest.for_tokens(
            engine.model.tokenize(prompt), request_id="gen", max_tokens=max_tokens, **sampling
        )
    )
    tokens: list[int] = []
    for _ in range(max_tokens):
        for message in engine.step().values():
            for output in message.outputs:
                if output.request_id != "gen":
                    continue
                tokens += output.new_token_ids
                if output.finished:
                    return tokens, output.finish_reason
    raise AssertionError("the request did not finish within max_tokens steps")


def text(tokens: Sequence[int]) -> str:
    return NgramModel().detokenize(tokens)


def test_greedy_generation_follows_the_most_likely_token_every_time() -> None:
    model = NgramModel()
    history = model.tokenize(PROMPT)
    expected: list[int] = []
    for _ in range(60):
        token = int(np.argmax(model.distribution(history)))
        expected.append(token)
        history.append(token)
        if token == EOS:
            break
    tokens, _ = generate(temperature=0.0, max_tokens=60)
    assert tokens == expected
    assert generate(temperature=0.0, max_tokens=60)[0] == tokens


def test_the_same_seed_writes_the_same_text_in_fresh_engines() -> None:
    first, _ = generate(seed=1234, temperature=1.0)
    second, _ = generate(seed=1234, temperature=1.0)
    assert first == second
    assert len(first) >= 10


@pytest.mark.parametrize("seed", [-7, -(2**63)])
def test_negative_seeds_are_reproducible_too(seed: int) -> None:
    first, _ = generate(seed=seed)
    assert generate(seed=seed)[0] == first
    assert first != generate(seed=seed + 1)[0]


def test_a_seeded_request_is_unaffected_by_other_requests_in_the_batch() -> None:
    alone, _ = generate(seed=99)
    engine = EngineCore(EngineConfig(model="ngram"))
    for i in range(3):
        engine.add_request(
            EngineCoreRequest.for_tokens(
                engine.model.tokenize("A nursery"), request_id=f"other{i}", max_tokens=200
            )
        )
    engine.step()  # the unseeded requests draw from the engine's generator first
    assert generate(seed=99, engine=engine)[0] == alone


def test_different_seeds_write_different_text() -> None:
    texts = {text(generate(seed=seed, temperature=1.0)[0]) for seed in range(5)}
    assert len(texts) == 5


def test_top_k_one_top_p_tiny_and_min_p_one_all_equal_greedy() -> None:
    greedy, _ = generate(temperature=0.0)
    assert generate(seed=5, temperature=1.0, top_k=1)[0] == greedy
    assert generate(seed=6, temperature=1.0, top_p=1e-6)[0] == greedy
    assert generate(seed=7, temperature=1.0, min_p=1.0)[0] == greedy
    assert generate(seed=7, temperature=1.0)[0] != greedy


def test_the_distribution_is_a_probability_distribution() -> None:
    model = NgramModel()
    contexts = [
        [],
        model.tokenize("The"),
        model.tokenize("the scheduler runs"),
        model.tokenize("zqxj"),  # contexts never seen in the corpus
        [*model.tokenize("end."), EOS],
    ]
    for context in contexts:
        probs = model.distribution(context)
        assert probs.shape == (257,)
        assert np.all(probs >= 0.0)
        assert probs.sum() == pytest.approx(1.0, abs=1e-12)


def test_generations_end_with_eos_and_finish_with_stop() -> None:
    ends = [generate(seed=seed, max_tokens=2000) for seed in range(5)]
    stopped = [tokens for tokens, reason in ends if reason is FinishReason.STOP]
    assert stopped
    for tokens in stopped:
        assert tokens[-1] == EOS
        assert EOS not in tokens[:-1]


def test_ignore_eos_keeps_generating_to_max_tokens() -> None:
    tokens, reason = generate(seed=4, max_tokens=300, ignore_eos=True)
    assert reason is FinishReason.LENGTH
    assert len(tokens) == 300


def test_tokenize_and_detokenize_round_trip() -> None:
    model = NgramModel()
    ascii_text = "Every task that starts inside it finishes. 123 !?"
    assert model.tokenize(ascii_text) == list(ascii_text.encode())
    assert model.detokenize(model.tokenize(ascii_text)) == ascii_text
    utf8 = "naïve café — ok"
    assert model.detokenize(model.tokenize(utf8)) == utf8
    assert model.detokenize([*model.tokenize("Hi"), EOS]) == "Hi"
    every_ascii = bytes(range(128)).decode("ascii")
    assert model.detokenize(model.tokenize(every_ascii)) == every_ascii


def test_generated_text_is_readable() -> None:
    tokens, _ = generate(seed=3, max_tokens=2000)
    written = text(tokens)
    assert len(written) >= 20
    readable = sum(ch.isprintable() or ch == "\n" for ch in written)
    assert readable / len(written) >= 0.95
    assert sum(ch.isalpha() for ch in written) / len(written) >= 0.5
    assert " " in written

"""A text request is checked, tokenized and completed before anything is sent; each
mistake names its field (pure: no engine)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from trio_enginecore.errors import InvalidInputError, ModelDirectoryError
from trio_enginecore.protocol import SamplingParams
from trio_enginecore.text import Tokenizer, builtin_tokenizer
from trio_enginecore.text._inputs import prepare_request, sampling_params_from

BYTES = builtin_tokenizer()


def prepare(prompt: Any, max_model_len: int = 64, **sampling: Any) -> Any:
    params = sampling_params_from(None, sampling)
    return prepare_request(prompt, params, tokenizer=BYTES, max_model_len=max_model_len)


@pytest.mark.parametrize(
    ("prompt", "sampling", "param", "words"),
    [
        ("", {}, "prompt", "cannot be empty"),
        ([], {}, "prompt", "cannot be empty"),
        ("x" * 64, {}, "prompt", "maximum length of 64"),
        ([1, 2, 257], {}, "prompt", "token id 257 is out of vocabulary"),
        ([1, -1], {}, "prompt", "token id -1"),
        ([1, "2"], {}, "prompt", "token 1 must be an int"),
        ([1, 2.0], {}, "prompt", "token 1 must be an int"),
        (b"bytes", {}, "prompt", "not bytes"),
        (7, {}, "prompt", "got int"),
        ({"text": "x"}, {}, "prompt", "needs 'prompt' or 'prompt_token_ids'"),
        ("hi", {"stop": 5}, "stop", "got int"),
        ("hi", {"stop": ["ok", 3]}, "stop", "item 1 must be a string"),
        ("hi", {"stop": [""]}, "stop", "cannot be empty"),
        ("hi", {"n": 0}, "n", "at least 1"),
        ("hi", {"min_tokens": -1}, "min_tokens", ">= 0"),
        ("hi", {"seed": "1"}, "seed", "int"),
        ("hi", {"max_token": 5}, "max_token", "did you mean 'max_tokens'"),
        ("hi", {"temperature": 9.0}, "temperature", r"\[0, 2\]"),
        ("hi", {"max_tokens": None, "min_tokens": 70}, "min_tokens", "at most max_tokens=62"),
    ],
)
def test_a_wrong_request_raises_naming_the_field(
    prompt: Any, sampling: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(InvalidInputError, match=words) as caught:
        prepare(prompt, **sampling)
    assert caught.value.param == param


def test_parameters_and_keywords_together_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="not both") as caught:
        sampling_params_from(SamplingParams(), {"max_tokens": 3})
    assert caught.value.param == "sampling_params"


def test_eos_ids_go_where_vllms_frontend_puts_them(tricky: Tokenizer) -> None:
    params = SamplingParams(stop_token_ids=[7])
    _, [request] = prepare_request("hi", params, tokenizer=tricky, max_model_len=100)
    sent = request.sampling_params
    assert sent is not None
    # </s> is the EOS; generation_config.json adds <|im_end|> (3) as a stop token.
    assert sent.eos_token_id == 1
    assert sorted(sent.stop_token_ids or []) == [3, 7]
    assert sent.all_stop_token_ids == {1, 3, 7}
    # The caller's parameters are not changed.
    assert params.stop_token_ids == [7]
    assert params.all_stop_token_ids == {7}
    assert params.eos_token_id is None


def test_ignore_eos_tells_the_engine_no_eos(tricky: Tokenizer) -> None:
    _, [request] = prepare_request(
        "hi", SamplingParams(ignore_eos=True), tokenizer=tricky, max_model_len=100
    )
    sent = request.sampling_params
    assert sent is not None
    assert sent.eos_token_id is None
    assert sent.stop_token_ids == []
    assert sent.all_stop_token_ids == {1, 3}


def test_max_tokens_unset_means_up_to_the_models_length() -> None:
    _, [request] = prepare("abcd", max_model_len=64, max_tokens=None)
    assert request.sampling_params.max_tokens == 60


def test_n_fans_out_with_vllms_ids_and_seeds() -> None:
    params = SamplingParams(n=3, seed=10)
    state, requests = prepare_request(
        "hi", params, tokenizer=BYTES, max_model_len=64, request_id="q"
    )
    assert [r.request_id for r in requests] == ["0_q", "1_q", "2_q"]
    assert [r.sampling_params.seed for r in requests] == [10, 11, 12]
    assert all(r.sampling_params.n == 1 and r.external_req_id == "q" for r in requests)
    assert state.request_id == "q"


def test_prompts_may_be_text_or_token_ids_in_vllms_forms() -> None:
    for prompt in ("hi", {"prompt": "hi"}, [104, 105], {"prompt_token_ids": [104, 105]}):
        state, [request] = prepare(prompt)
        assert request.prompt_token_ids == [104, 105]
        assert state.prompt == ("hi" if "hi" in str(prompt) else None)
    _, [request] = prepare(np.array([104, 105], dtype=np.int32))
    assert request.prompt_token_ids == [104, 105]


def test_the_wire_form_of_a_text_request_is_a_valid_engine_request() -> None:
    from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder

    _, [request] = prepare("hi", stop=["x"], max_tokens=5)
    decoded = MsgpackDecoder(type(request)).decode(MsgpackEncoder().encode(request)[0])
    assert decoded.sampling_params.stop == ["x"]
    assert msgspec.structs.asdict(decoded)["prompt_token_ids"] == [104, 105]


# ------------------------------------ token ids the engine's sampler would index with


@pytest.mark.parametrize(
    ("sampling", "param", "message"),
    [
        (
            {"logit_bias": {5: 1.0, 257: 2.0, -1: 0.5}},
            "logit_bias",
            "token_id(s) [257, -1] in logit_bias contain out-of-vocab token ids. "
            "Vocabulary size: 257 (parameter=logit_bias, value=[257, -1])",
        ),
        (
            {"stop_token_ids": [3, 400]},
            "stop_token_ids",
            "token_id(s) [400] in stop_token_ids contain out-of-vocab token ids. "
            "Vocabulary size: 257 (parameter=stop_token_ids, value=[400])",
        ),
        (
            {"allowed_token_ids": [1, 257, 9999]},
            "allowed_token_ids",
            "allowed_token_ids contains out-of-vocab token id! "
            "(parameter=allowed_token_ids, value=[257, 9999])",
        ),
        (
            {"allowed_token_ids": []},
            "allowed_token_ids",
            "allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])",
        ),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_in_vllms_words(
    sampling: dict[str, Any], param: str, message: str
) -> None:
    # An engine's sampler indexes its logits with them: one such id would fail the
    # engine's step, and every request on it. vLLM's frontend refuses them first.
    with pytest.raises(InvalidInputError) as caught:
        prepare("hi", **sampling)
    assert caught.value.param == param
    assert str(caught.value) == message


def test_every_id_inside_the_vocabulary_is_accepted() -> None:
    _, [request] = prepare(
        "hi", logit_bias={0: -1.0, 256: 1.0}, stop_token_ids=[256], allowed_token_ids=[0, 256]
    )
    assert request.sampling_params.logit_bias == {0: -1.0, 256: 1.0}


def test_the_bound_is_the_models_vocabulary_when_its_config_gives_one(tmp_path: Any) -> None:
    import json
    import shutil

    from trio_enginecore.text import load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(BYTES.directory, model)
    # Models round their vocabulary up past the tokenizer's (ids nobody writes).
    (model / "config.json").write_text(json.dumps({"vocab_size": 320}))
    padded = load_tokenizer(model)
    assert (padded.vocab_size, padded.model_vocab_size) == (257, 320)
    params = SamplingParams(logit_bias={300: 1.0}, max_tokens=2)
    prepare_request("hi", params, tokenizer=padded, max_model_len=64)
    with pytest.raises(InvalidInputError, match="Vocabulary size: 320"):
        prepare_request(
            "hi", SamplingParams(logit_bias={320: 1.0}), tokenizer=padded, max_model_len=64
        )
    # A multimodal model's text part says it; a config without one leaves the
    # tokenizer's; a wrong one names the file.
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 300}}))
    assert load_tokenizer(model).model_vocab_size == 300
    (model / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    assert load_tokenizer(model).model_vocab_size == 257
    (model / "config.json").write_text(json.dumps({"vocab_size": "many"}))
    with pytest.raises(ModelDirectoryError, match=r"config\.json: 'vocab_size' must be"):
        load_tokenizer(model)


# ----------------------------------------------------------------------- bad words


def test_bad_words_become_the_token_sequences_vllms_frontend_sends(tricky: Tokenizer) -> None:
    from trio_enginecore.text._inputs import bad_words_token_ids

    words = ["hello", "  world", "é"]
    params = SamplingParams(bad_words=words, n=2)
    _, requests = prepare_request("hi", params, tokenizer=tricky, max_model_len=100)
    expected = bad_words_token_ids(words, tricky)
    for request in requests:
        assert request.sampling_params.bad_words_token_ids == expected
    # Each word as it starts a text, and (where it tokenizes apart) after a space.
    bare = [tricky.encode(w.lstrip(), add_special_tokens=False) for w in words]
    assert [s for s in expected if s in bare] == bare
    for word in words:
        spaced = tricky.encode(" " + word.lstrip(), add_special_tokens=False)
        first = tricky.encode(word.lstrip(), add_special_tokens=False)
        assert (spaced in expected) == (spaced[0] != first[0] and len(spaced) == len(first))
    assert params.bad_words_token_ids is None  # the caller's object is not changed


def test_bad_words_that_give_no_token_or_too_many_are_refused_in_vllms_words() -> None:
    with pytest.raises(InvalidInputError) as caught:
        prepare("hi", bad_words=["   "])
    assert str(caught.value) == (
        "bad_words entries must tokenize to at least one token. "
        "(parameter=bad_words, value=['   '])"
    )
    many = [chr(0x4E00 + i) for i in range(129)]
    with pytest.raises(InvalidInputError, match=r"^Too many bad words after tokenization: 129\. "):
        prepare("hi", bad_words=many)
    _, [request] = prepare("hi", bad_words=many[:128])
    assert len(request.sampling_params.bad_words_token_ids) == 128


def test_bad_words_without_a_tokenizer_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="need a tokenizer") as caught:
        prepare_request([1, 2], SamplingParams(bad_words=["x"]), tokenizer=None, max_model_len=9)
    assert caught.value.param == "bad_words"

"""A text request is checked, tokenized and completed before anything is sent; each
mistake names its field (pure: no engine)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from trio_enginecore.errors import InvalidInputError
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

"""OpenAI request bodies read and mapped as vLLM 0.34's server reads them
(``trio_enginecore.server._openai_requests``; pure: bytes in, requests or errors out).

What a body becomes: a checked request, the engine's ``SamplingParams`` (vLLM's
``to_sampling_params`` and ``get_max_tokens``), or an :class:`ApiError` with the status
and the field vLLM names. Whatever the body, nothing but an ``ApiError`` comes out.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from trio_enginecore.protocol import RequestOutputKind, SamplingParams
from trio_enginecore.server._openai_requests import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    RequestLimits,
    max_tokens_for,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)

CHAT = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return parse_completion(json.dumps({"prompt": "x", **fields}).encode())


def chat(**fields: Any) -> ChatRequest:
    return parse_chat(json.dumps({"messages": CHAT, **fields}).encode())


def refused(parse: Any, body: Any) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as raised:
        request = parse(raw)
        request.sampling_params(16)
    return raised.value


# ------------------------------------------------------------------ mapping


def test_a_bare_completion_gets_vllms_defaults() -> None:
    request = completion()
    assert (request.max_tokens, request.n, request.stream, request.echo) == (16, 1, False, False)
    params = request.sampling_params(16)
    assert isinstance(params, SamplingParams)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert (params.n, params.max_tokens, params.min_tokens, params.seed) == (1, 16, 0, None)
    assert (params.logprobs, params.prompt_logprobs) == (None, None)
    assert not params.stop
    assert params.skip_special_tokens is True
    assert params.spaces_between_special_tokens is True
    assert params.output_kind == RequestOutputKind.FINAL_ONLY


def test_a_stream_asks_the_engine_for_deltas() -> None:
    assert completion(stream=True).sampling_params(4).output_kind == RequestOutputKind.DELTA
    assert chat(stream=True).sampling_params(4).output_kind == RequestOutputKind.DELTA
    assert chat().sampling_params(4).output_kind == RequestOutputKind.FINAL_ONLY


def test_the_fields_a_request_gives_reach_the_engine() -> None:
    params = completion(
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=7,
        n=2,
        stop=["a", "b"],
        stop_token_ids=[3],
        ignore_eos=True,
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"5": 1.5},
        allowed_token_ids=[1, 2],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    ).sampling_params(10)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 5, 0.1)
    assert (params.seed, params.n, params.max_tokens, params.min_tokens) == (7, 2, 10, 2)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == (["a", "b"], [3], True)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5,
        -0.5,
        1.2,
    )
    assert params.logit_bias == {5: 1.5}  # token ids as JSON keys become ints
    assert params.allowed_token_ids == [1, 2]
    assert params.include_stop_str_in_output is True
    assert params.skip_special_tokens is False


def test_echo_with_max_tokens_0_runs_one_step_for_the_prompt_alone() -> None:
    assert completion(echo=True, max_tokens=0).sampling_params(0).max_tokens == 1


def test_echo_asks_for_the_prompts_logprobs_as_the_completions() -> None:
    params = completion(echo=True, logprobs=2).sampling_params(4)
    assert (params.logprobs, params.prompt_logprobs) == (2, 2)
    assert completion(logprobs=2).sampling_params(4).prompt_logprobs is None


def test_chat_logprobs_are_top_logprobs_when_logprobs_is_true() -> None:
    assert chat(logprobs=True, top_logprobs=3).sampling_params(4).logprobs == 3
    assert chat(logprobs=True).sampling_params(4).logprobs == 0
    assert chat().sampling_params(4).logprobs is None
    assert refused(parse_chat, {"messages": CHAT, "top_logprobs": 3}).param == "top_logprobs"


def test_a_chats_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_completion_tokens=3, max_tokens=9).requested_max_tokens == 3
    assert chat(max_tokens=9).requested_max_tokens == 9
    assert chat().requested_max_tokens is None


@pytest.mark.parametrize(
    ("max_model_len", "requested", "prompt_tokens", "expected"),
    [
        (100, 10, 20, 10),  # asked for less than is left
        (100, 90, 20, 80),  # cut to what is left
        (100, None, 20, 80),  # nothing asked: all that is left
        (100, 10, 100, 0),  # a full prompt leaves nothing
        (None, 10, 20, 10),  # no known length: what is asked
    ],
)
def test_max_tokens_is_the_least_of_what_is_asked_and_what_the_model_has_left(
    max_model_len: int | None, requested: int | None, prompt_tokens: int, expected: int
) -> None:
    assert max_tokens_for(max_model_len, requested, prompt_tokens) == expected


def test_a_prompt_longer_than_the_model_is_refused_naming_input_tokens() -> None:
    with pytest.raises(ApiError) as raised:
        max_tokens_for(100, 1, 101)
    assert (raised.value.status, raised.value.param) == (400, "input_tokens")
    assert "100" in raised.value.message
    assert max_tokens_for(100, 1, 101, truncate_prompt_tokens=50) == 1


def test_response_format_becomes_structured_outputs() -> None:
    json_object = completion(response_format={"type": "json_object"}).sampling_params(4)
    assert json_object.structured_outputs is not None
    assert json_object.structured_outputs.json_object is True
    schema = {"type": "object"}
    with_schema = completion(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    ).sampling_params(4)
    assert with_schema.structured_outputs is not None
    assert with_schema.structured_outputs.json == schema
    assert (
        completion(response_format={"type": "text"}).sampling_params(4).structured_outputs is None
    )
    yaml = refused(parse_completion, {"prompt": "x", "response_format": {"type": "yaml"}})
    assert yaml.param == "response_format"


# ------------------------------------------------------------------ prompts


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("Hi", ["Hi"]),
        ([72, 105], [[72, 105]]),
        (["Hi", "there"], ["Hi", "there"]),
        ([[72], [105, 33]], [[72], [105, 33]]),
    ],
    ids=["text", "token_ids", "texts", "lists_of_token_ids"],
)
def test_a_prompt_is_a_text_token_ids_or_a_batch_of_them(prompt: Any, prompts: list[Any]) -> None:
    assert completion(prompt=prompt).prompts() == prompts


@pytest.mark.parametrize(
    "prompt",
    ["", [], [72, "i"], [72, -1], [True], [[72], "i"], {"text": "Hi"}, None, 3],
    ids=[
        "empty",
        "empty_list",
        "mixed",
        "negative",
        "bool",
        "mixed_batch",
        "object",
        "null",
        "int",
    ],
)
def test_a_prompt_of_another_shape_is_refused_naming_prompt(prompt: Any) -> None:
    with pytest.raises(ApiError) as raised:
        completion(prompt=prompt).prompts()
    assert (raised.value.status, raised.value.param) == (400, "prompt")


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "x",', None),
        (b"[]", None),
        (b'"x"', None),
        (b"", None),
        (b'{"prompt": "\xff"}', None),
        (b'{"prompt": "x", "temperature": "0.5"}', "temperature"),  # strict: no "0.5"
        (b'{"prompt": "x", "n": true}', "n"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
        (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
        (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),
        (b'{"prompt": "x", "temperature": 5}', "temperature"),  # as vLLM 0.34 names it
        (b'{"prompt": "x", "top_p": 2}', "top_p"),  # as vLLM 0.34 names it
        (b'{"prompt": "x", "n": 0}', None),  # vLLM 0.34 names nothing
        (b'{"prompt": "x", "stream": true, "prompt_logprobs": 1}', "prompt_logprobs"),
        (b'{"prompt": "x", "use_beam_search": true}', "use_beam_search"),
        (b'{"prompt": "x", "cache_salt": ""}', "cache_salt"),
        (b'{"prompt": "x", "suffix": "y"}', "suffix"),
        (
            b'{"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}',
            "structured_outputs",
        ),
    ],
)
def test_a_bad_completion_is_a_400_naming_the_field_vllm_names(
    body: bytes, param: str | None
) -> None:
    error = refused(parse_completion, body)
    assert (error.status, error.param) == (400, param), error.message
    assert json.loads(error.body()) == {
        "error": {"message": error.message, "type": "BadRequestError", "param": param, "code": 400}
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 2}, "messages"),
        ({"messages": "Hi"}, "messages"),
        ({"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        ({"messages": CHAT, "continue_final_message": True}, None),  # with the default prompt
    ],
)
def test_a_bad_chat_is_a_400_naming_the_field(body: dict[str, Any], param: str | None) -> None:
    error = refused(parse_chat, body)
    assert (error.status, error.param) == (400, param), error.message


def test_unknown_fields_are_ignored_as_vllm_ignores_them() -> None:
    assert completion(frobnicate=True, logit_bias=None).sampling_params(4).max_tokens == 4


def test_stream_options_say_whether_usage_comes_last_and_on_every_chunk() -> None:
    last = completion(stream=True, stream_options={"include_usage": True})
    assert (last.include_usage, last.continuous_usage) == (True, False)
    every = completion(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    assert (every.include_usage, every.continuous_usage) == (True, True)
    alone = completion(stream=True, stream_options={"continuous_usage_stats": True})
    assert (alone.include_usage, alone.continuous_usage) == (False, False)


def test_tokenize_takes_a_prompt_or_messages_and_detokenize_token_ids() -> None:
    assert parse_tokenize(b'{"prompt": "Hi"}').prompt == "Hi"
    assert parse_tokenize(json.dumps({"messages": CHAT}).encode()).messages == CHAT
    for body in (b"{}", json.dumps({"prompt": "Hi", "messages": CHAT}).encode()):
        with pytest.raises(ApiError):
            parse_tokenize(body)
    assert parse_detokenize(b'{"tokens": [72, 105]}').tokens == [72, 105]
    with pytest.raises(ApiError) as raised:
        parse_detokenize(b'{"tokens": [72, -1]}')
    assert raised.value.param == "tokens"


def test_api_errors_are_named_by_status() -> None:
    assert ApiError("x", status=404).error_type == "NotFoundError"
    assert ApiError("x", status=503).error_type == "ServiceUnavailableError"
    assert ApiError("x", status=500).error_type == "InternalServerError"
    assert ApiError("x").error_type == "BadRequestError"


# ------------------------------------------------------------------ any body at all

_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
_FIELDS = sorted(
    {
        *CompletionRequest.__struct_fields__,
        *ChatRequest.__struct_fields__,
    }
)


def _outcome(parse: Any, body: bytes, max_tokens: int) -> ApiError | None:
    """The error a body gets, all the way to its sampling parameters; None if none."""
    try:
        request = parse(body)
        request.sampling_params(max_tokens)
        if isinstance(request, CompletionRequest):
            request.prompts()
    except ApiError as error:
        return error
    return None


@settings(max_examples=200, deadline=None)
@given(
    fields=st.dictionaries(st.sampled_from(_FIELDS), _value, max_size=6),
    max_tokens=st.integers(0, 50),
)
def test_any_body_is_a_request_or_an_api_error(fields: dict[str, Any], max_tokens: int) -> None:
    # json.dumps writes NaN and Infinity, which are no JSON: refused like any bad JSON.
    body = json.dumps(fields).encode()
    for parse in (parse_completion, parse_chat):
        error = _outcome(parse, body, max_tokens)
        if error is not None:
            assert 400 <= error.status < 500
            assert json.loads(error.body())["error"]["code"] == error.status


def test_logit_bias_keys_become_token_ids_and_biases_stay_within_100() -> None:
    params = completion(logit_bias={"5": 250, " 7": -1e9, "9": 0.5}).sampling_params(16)
    assert params.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}
    error = refused(parse_completion, {"prompt": "x", "logit_bias": {"5": 1, "a": 2, "": 3}})
    assert (error.status, error.param) == (400, "logit_bias")
    assert str(error) == (
        "logit_bias contains key(s) that cannot be converted to integer token IDs: "
        "['a', ''] (parameter=logit_bias, value=['a', ''])"
    )


# ---------------------------------------------------------------- vLLM's limits


def test_n_prompts_and_stop_strings_have_vllms_limits() -> None:
    error = refused(parse_completion, {"prompt": "x", "n": 16385})
    assert (error.status, error.param) == (400, None)
    assert str(error) == (
        "n must be at most 16384, got 16385. To increase this limit, set the "
        "VLLM_MAX_N_SEQUENCES environment variable."
    )
    assert completion(n=16384).sampling_params(16).n == 16384
    error = refused(parse_completion, {"prompt": ["x"] * 1025})
    assert error.param == "prompt"
    assert str(error).startswith("prompt list length 1025 exceeds the maximum allowed count")
    # A list of token ids is one prompt, however long.
    assert completion(prompt=[65] * 2000).prompts() == [[65] * 2000]
    assert len(completion(prompt=["x"] * 1024).prompts()) == 1024
    for body in ({"prompt": "x", "stop": list("abcde")}, {"messages": CHAT, "stop": list("abcde")}):
        parse = parse_completion if "prompt" in body else parse_chat
        error = refused(parse, body)
        assert (error.status, error.param) == (400, "stop")
        assert "at most 4 stop strings, got 5" in str(error)
    assert completion(stop=list("abcd")).sampling_params(16).stop == list("abcd")


def test_the_limits_follow_vllms_variables() -> None:
    limits = RequestLimits.from_environment(
        {
            "VLLM_MAX_N_SEQUENCES": "2",
            "VLLM_MAX_COMPLETION_PROMPTS": "3",
            "VLLM_MAX_STOP_STRINGS": "9",
        }
    )
    assert limits == RequestLimits(max_n_sequences=2, max_completion_prompts=3, max_stop_strings=9)
    assert RequestLimits.from_environment({}) == RequestLimits()
    body = json.dumps({"prompt": ["a", "b", "c", "d"], "n": 2, "stop": list("abcdefg")})
    with pytest.raises(ApiError, match=r"prompt list length 4 exceeds .* count of 3"):
        parse_completion(body.encode(), limits)
    request = parse_completion(json.dumps({"prompt": "x", "n": 3}).encode(), limits)
    with pytest.raises(ApiError, match="n must be at most 2, got 3"):
        request.sampling_params(16, limits)
    for wrong in ("many", "0", "-3"):
        with pytest.raises(ValueError, match="VLLM_MAX_STOP_STRINGS must be"):
            RequestLimits.from_environment({"VLLM_MAX_STOP_STRINGS": wrong})

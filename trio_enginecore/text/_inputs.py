"""From a text request to the engine requests that serve it (pure: no I/O, no Trio).

Everything here runs before anything is sent, so a request that is wrong in any way
raises :class:`~trio_enginecore.errors.InvalidInputError` naming the field, and
nothing reaches an engine.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, NotRequired, TypedDict, cast

import msgspec
import numpy as np
import numpy.typing as npt

from ..errors import InvalidInputError
from ..protocol import (
    EngineCoreRequest,
    LoRARequest,
    RequestOutputKind,
    SamplingKeywords,
    SamplingParams,
)
from ._processor import TextRequestState, child_request_id, child_sampling_params

if TYPE_CHECKING:
    from ._tokenizer import Tokenizer

__all__ = [
    "PromptInput",
    "TextPrompt",
    "TokensPrompt",
    "final_only",
    "prepare_request",
    "sampling_params_from",
]


class TextPrompt(TypedDict):
    """A prompt given as text (vLLM's ``TextPrompt``)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids (vLLM's ``TokensPrompt``), with the text they were
    made from if the caller tokenized it (``prompt``: outputs then report it)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptInput = str | TextPrompt | TokensPrompt | Sequence[int]
"""A prompt: text (a ``str`` or ``{"prompt": ...}``) or token ids (a list of ints or
``{"prompt_token_ids": [...]}``)."""

_FIELD: Final = re.compile(r"SamplingParams[.:]\s*(?:the\s+)?([a-z_]+)")


def _as_invalid(exc: Exception) -> InvalidInputError:
    # SamplingParams names the field in its message ("SamplingParams: n must be ...",
    # "SamplingParams.seed must be ..."): keep that name as the error's param.
    message = str(exc)
    match = _FIELD.search(message)
    param = match.group(1) if match else "sampling_params"
    reason = _FIELD.sub(lambda m: m.group(1), message, count=1)
    return InvalidInputError(param, reason.removeprefix(f"{param}: "))


def sampling_params_from(
    params: SamplingParams | None, keywords: Mapping[str, Any]
) -> SamplingParams:
    """The request's parameters: ``params``, or built from ``keywords``; checked.

    Raises:
        InvalidInputError: a field is wrong (named), or both forms were given.
    """
    if params is not None and keywords:
        raise InvalidInputError(
            "sampling_params",
            f"give either sampling_params or keywords, not both (got {', '.join(keywords)})",
        )
    given = cast(object, params)  # checked whatever the annotation says
    if given is not None and not isinstance(given, SamplingParams):
        raise InvalidInputError(
            "sampling_params", f"must be a SamplingParams, got {type(params).__name__}"
        )
    unknown = set(keywords) - set(SamplingKeywords.__annotations__)
    if unknown:
        raise InvalidInputError(
            sorted(unknown)[0], f"is not a sampling parameter ({_suggest(sorted(unknown)[0])})"
        )
    _check_stop(keywords.get("stop") if params is None else params.stop)
    try:
        if params is None:
            return SamplingParams(**keywords)
        params.check()
    except (TypeError, ValueError) as exc:
        raise _as_invalid(exc) from None
    return params


def final_only(params: SamplingParams) -> SamplingParams:
    """A copy of ``params`` asking for one output at the end (``complete()``)."""
    return msgspec.structs.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _suggest(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(SamplingKeywords.__annotations__), n=1)
    return f"did you mean {close[0]!r}?" if close else "see SamplingKeywords"


def _check_stop(stop: object) -> None:
    if stop is None or isinstance(stop, str):
        if stop == "":
            raise InvalidInputError("stop", "a stop string cannot be empty")
        return
    if not isinstance(stop, list | tuple):
        raise InvalidInputError(
            "stop", f"must be a string or a list of strings, got {type(stop).__name__}"
        )
    items: Sequence[object] = cast("Sequence[object]", stop)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidInputError(
                "stop", f"item {i} must be a string, got {type(item).__name__} {item!r}"
            )
        if not item:
            raise InvalidInputError("stop", f"item {i} is empty: a stop string cannot be empty")


def _prompt_parts(prompt: object, tokenizer: Tokenizer | None) -> tuple[str | None, list[int]]:
    # ``object``: a caller's prompt is checked here whatever its annotated type says.
    if isinstance(prompt, Mapping):
        mapping = cast("Mapping[str, object]", prompt)
        if "prompt_token_ids" in mapping:
            _, token_ids = _prompt_parts(mapping["prompt_token_ids"], tokenizer)
            # The text the ids were made from, when the caller tokenized it (as an
            # OpenAI server does, to bound max_tokens): outputs report it.
            given = mapping.get("prompt")
            return (given if isinstance(given, str) else None), token_ids
        if "prompt" in mapping:
            text = mapping["prompt"]
            if not isinstance(text, str):
                raise InvalidInputError("prompt", f"must be a string, got {type(text).__name__}")
            return _prompt_parts(text, tokenizer)
        raise InvalidInputError("prompt", "a prompt mapping needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidInputError("prompt", "a text prompt needs a tokenizer; give token ids")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, bytes | bytearray):
        raise InvalidInputError("prompt", "must be text (str) or token ids, not bytes")
    if isinstance(prompt, np.ndarray):
        array = cast("npt.NDArray[Any]", prompt)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise InvalidInputError("prompt", "a numpy prompt must be a 1-d integer array")
        listed: list[int] = array.tolist()
        return None, listed
    if not isinstance(prompt, Sequence):
        raise InvalidInputError(
            "prompt", f"must be text or a list of token ids, got {type(prompt).__name__}"
        )
    ids: list[int] = []
    for i, token_id in enumerate(cast("Sequence[object]", prompt)):
        if type(token_id) is int:
            ids.append(token_id)
        elif isinstance(token_id, np.integer):
            ids.append(int(cast("np.integer[Any]", token_id)))  # type: ignore[redundant-cast]
        else:
            raise InvalidInputError(
                "prompt", f"token {i} must be an int, got {type(token_id).__name__} {token_id!r}"
            )
    return None, ids


def prepare_request(
    prompt: PromptInput,
    params: SamplingParams,
    *,
    tokenizer: Tokenizer | None,
    max_model_len: int | None,
    request_id: str | None = None,
    arrival_time: float | None = None,
    priority: int = 0,
    data_parallel_rank: int | None = None,
    lora_request: LoRARequest | None = None,
    cache_salt: str | None = None,
) -> tuple[TextRequestState, list[EngineCoreRequest]]:
    """Tokenize and check a text request; return its state and its engine requests.

    The parameters are completed as vLLM's frontend completes them: ``max_tokens``
    unset means up to ``max_model_len``; the model's EOS id and the extra EOS ids of
    ``generation_config.json`` go into ``_eos_token_id``, ``_all_stop_token_ids`` and
    ``stop_token_ids`` (unless ``ignore_eos``). ``params`` is not changed. With
    ``n > 1`` there is one engine request per sequence (``"<i>_<request id>"``).

    Raises:
        InvalidInputError: the prompt is empty, too long for ``max_model_len``, or has
            a token id outside the vocabulary; or ``params`` does not fit it.
    """
    given_id = cast(object, request_id)
    if given_id is not None and (not isinstance(given_id, str) or not given_id):
        raise InvalidInputError("request_id", "must be a non-empty string")
    if tokenizer is not None:
        _check_token_ids(params, tokenizer.model_vocab_size)
    text, prompt_ids = _prompt_parts(prompt, tokenizer)
    if not prompt_ids:
        raise InvalidInputError("prompt", "the prompt cannot be empty")
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    low, high = min(prompt_ids), max(prompt_ids)
    if low < 0:
        raise InvalidInputError("prompt", f"token id {low} is out of vocabulary")
    if vocab is not None and high >= vocab:
        raise InvalidInputError(
            "prompt", f"token id {high} is out of vocabulary (the tokenizer has {vocab} tokens)"
        )
    if max_model_len is not None and len(prompt_ids) >= max_model_len:
        raise InvalidInputError(
            "prompt",
            f"the prompt has {len(prompt_ids)} tokens; with at least 1 output token it "
            f"does not fit the model's maximum length of {max_model_len}",
        )
    if (not params.detokenize or tokenizer is None) and params.stop:
        raise InvalidInputError("stop", "stop strings need detokenize=True and a tokenizer")
    # A copy, with its own lists and set: the caller's object is never changed.
    params = msgspec.structs.replace(
        params,
        stop=list(params.stop or ()),
        stop_token_ids=list(params.stop_token_ids or ()),
        _all_stop_token_ids=set(params.all_stop_token_ids),
    )
    if params.max_tokens is None:
        if max_model_len is None:
            raise InvalidInputError(
                "max_tokens", "must be set when the engine's max_model_len is unknown"
            )
        params.max_tokens = max_model_len - len(prompt_ids)
        if params.min_tokens > params.max_tokens:
            raise InvalidInputError(
                "min_tokens",
                f"must be at most max_tokens={params.max_tokens}, got {params.min_tokens}",
            )
    if tokenizer is not None:
        _apply_eos(params, tokenizer)
        if params.bad_words:
            params._bad_words_token_ids = bad_words_token_ids(params.bad_words, tokenizer)  # pyright: ignore[reportPrivateUsage]
    elif params.bad_words and params.bad_words_token_ids is None:
        raise InvalidInputError("bad_words", "bad words need a tokenizer to become token ids")
    external = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
    arrival = time.time() if arrival_time is None else arrival_time
    state = TextRequestState(external, text, prompt_ids, params, tokenizer)
    requests = [
        EngineCoreRequest(
            request_id=engine_id,
            prompt_token_ids=list(prompt_ids),
            mm_features=None,
            sampling_params=params if params.n == 1 else child_sampling_params(params, i),
            pooling_params=None,
            arrival_time=arrival,
            lora_request=lora_request,
            cache_salt=cache_salt,
            data_parallel_rank=data_parallel_rank,
            priority=priority,
            external_req_id=external,
        )
        for i, engine_id in enumerate(
            [external]
            if params.n == 1
            else [child_request_id(i, external) for i in range(params.n)]
        )
    ]
    return state, requests


MAX_BAD_WORDS: Final = 128
"""The most token sequences a request's ``bad_words`` may become (vLLM's
``VLLM_MAX_NUM_BAD_WORDS`` default): the engine keeps that many per request."""


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    # vLLM's frontend checks these before anything reaches its engine, whose sampler
    # indexes the logits with them: an id past the vocabulary would fail the engine's
    # step (every request on it), not this request. Same order, same words.
    indexed: tuple[tuple[str, Iterable[int] | None], ...] = (
        ("logit_bias", params.logit_bias),
        ("stop_token_ids", params.stop_token_ids),
    )
    for param, ids in indexed:
        outside = [t for t in ids or () if t < 0 or t >= vocab_size]
        if outside:
            raise _vllm_refusal(
                f"token_id(s) {outside} in {param} contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab_size}",
                param,
                outside,
            )
    allowed = params.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise _vllm_refusal("allowed_token_ids is not None and empty!", "allowed_token_ids", [])
        outside = [t for t in allowed if t < 0 or t >= vocab_size]
        if outside:
            raise _vllm_refusal(
                "allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids", outside
            )


def _vllm_refusal(message: str, param: str, value: object) -> InvalidInputError:
    return InvalidInputError(param, message, value=value, vllm_wording=True)


def bad_words_token_ids(bad_words: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """The token sequences the engine must not produce for ``bad_words``, as vLLM's
    frontend makes them (``SamplingParams.update_from_tokenizer``): each word with its
    leading spaces stripped, then again after one space where that gives a different
    first token and as many tokens (a word's form inside a sentence).

    Raises:
        InvalidInputError: a word gives no token, or they give more than
            :data:`MAX_BAD_WORDS` sequences (vLLM's words).
    """
    sequences: list[list[int]] = []
    for word in bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise _vllm_refusal(
                "bad_words entries must tokenize to at least one token.",
                "bad_words",
                list(bad_words),
            )
        sequences.append(bare)
        _check_bad_word_count(sequences, bad_words)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
            _check_bad_word_count(sequences, bad_words)
    return sequences


def _check_bad_word_count(sequences: list[list[int]], bad_words: Sequence[str]) -> None:
    if len(sequences) > MAX_BAD_WORDS:
        raise _vllm_refusal(
            f"Too many bad words after tokenization: {len(sequences)}. "
            f"The max number is {MAX_BAD_WORDS}.",
            "bad_words",
            list(bad_words),
        )


def _apply_eos(params: SamplingParams, tokenizer: Tokenizer) -> None:
    # vLLM's SamplingParams.update_from_generation_config, with the tokenizer's EOS:
    # the engine stops on EOS only through these private, wire-carried fields.
    eos = tokenizer.eos_token_id
    if not params.ignore_eos:
        params._eos_token_id = eos  # pyright: ignore[reportPrivateUsage]
    if eos is not None:
        params._all_stop_token_ids.add(eos)  # pyright: ignore[reportPrivateUsage]
    extra = set(tokenizer.generation_eos_token_ids)
    if eos is not None:
        extra.discard(eos)
    if extra:
        params._all_stop_token_ids.update(extra)  # pyright: ignore[reportPrivateUsage]
        if not params.ignore_eos:
            extra.update(params.stop_token_ids or ())
            params.stop_token_ids = list(extra)

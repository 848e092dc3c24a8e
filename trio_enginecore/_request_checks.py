"""Checking a request before anything is sent (pure, synchronous).

msgspec encodes whatever a :class:`~trio_enginecore.protocol.EngineCoreRequest` holds:
a request id that is an ``int`` goes out happily and the engine, whose decoder is
typed, can only drop the message, so the caller would wait forever. The clients call
:func:`check_request` first, and a mistake becomes a ``TypeError`` or ``ValueError``
naming the field, raised before anything is registered or sent.

:class:`SamplingParams`, :class:`PoolingParams` and :class:`LoRARequest` check their
fields when they are built, but a field can be set afterwards, so they are checked
again here,
field by field (:mod:`trio_enginecore._field_checks`) and, for sampling, value by
value. Values the client cannot judge (a token id beyond the model's vocabulary, a
prompt longer than the engine allows) are the engine's to reject; a stream then raises
:class:`~trio_enginecore.errors.RequestFailedError`.

The reference engine runs the same check on every request it is given, so an engine
in the caller's process, which decodes nothing, rejects a bad request as that
request's error too.
"""

from __future__ import annotations

import operator
from collections.abc import Container
from typing import Annotated, Final

import msgspec

from .protocol import (
    EngineCoreRequest,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    Tensor,
    field_check,
)

__all__ = ["check_request", "check_requests"]

# Optional fields: None, or an instance of these types.
_OPTIONAL: Final[tuple[tuple[str, type | tuple[type, ...], str], ...]] = (
    ("mm_features", list, "a list"),
    ("pooling_params", PoolingParams, "a PoolingParams"),
    ("lora_request", LoRARequest, "a LoRARequest"),
    ("cache_salt", str, "a str"),
    ("data_parallel_rank", int, "an int"),
    ("prompt_embeds", Tensor, "a Tensor"),
    ("prompt_is_token_ids", list, "a list of bool"),
    ("trace_headers", dict, "a dict of str to str"),
    ("external_req_id", str, "a str"),
    ("reasoning_ended", bool, "a bool"),
    ("reasoning_parser_kwargs", dict, "a dict"),
    ("session_id", str, "a str"),
)
_optional_values: Final = operator.attrgetter(*(name for name, _, _ in _OPTIONAL))
_INTS: Final = ("priority", "client_index", "current_wave")
_FLAGS: Final = ("resumable", "abort_immediately")
# vLLM 0.34 sends prompts as int32 arrays; no vocabulary comes near the limit, so
# every client refuses larger ids whatever the engine's release.
_MAX_TOKEN_ID: Final = 2**31 - 1
_TOKEN_IDS: Final = list[Annotated[int, msgspec.Meta(ge=0, le=_MAX_TOKEN_ID)]]
# Below this many tokens one pass over the types in Python wins; above, msgspec's C.
_SHORT_PROMPT: Final = 64


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


def check_request(request: object) -> None:
    """Raise ``TypeError``/``ValueError`` naming the field if ``request`` cannot be sent.

    Checks the type of every field a caller sets (the request id, the prompt's token
    ids, the sampling or pooling parameters, ...). It does not check what only the
    engine knows (vocabulary size, maximum length). About 1.5 µs for a short prompt:
    the common case (optional fields all None) is decided by a few C-level calls.
    """
    if not isinstance(request, EngineCoreRequest):
        raise TypeError(f"expected an EngineCoreRequest, got {_kind(request)}")
    request_id = request.request_id
    if type(request_id) is not str:
        raise TypeError(f"EngineCoreRequest.request_id must be a str, got {_kind(request_id)}")
    if not request_id:
        raise ValueError("EngineCoreRequest.request_id must not be empty")
    _check_prompt(request)
    sampling = request.sampling_params
    if sampling is not None and type(sampling) is not SamplingParams:
        raise TypeError(
            f"EngineCoreRequest.sampling_params must be a SamplingParams or None, got "
            f"{_kind(sampling)}"
        )
    if sampling is None and request.pooling_params is None:
        raise ValueError(
            "EngineCoreRequest needs sampling_params (generation) or pooling_params (pooling)"
        )
    if sampling is not None:
        sampling.check()
    arrival = request.arrival_time
    if type(arrival) is not float and type(arrival) is not int:
        raise TypeError(
            f"EngineCoreRequest.arrival_time must be a float (time.time()), got {_kind(arrival)}"
        )
    # `type(v) is int` everywhere: bool is an int to Python, not to a reader of
    # "priority=True".
    if not (
        type(request.priority) is int
        and type(request.client_index) is int
        and type(request.current_wave) is int
    ):
        for name in _INTS:
            value = getattr(request, name)
            if type(value) is not int:
                raise TypeError(f"EngineCoreRequest.{name} must be an int, got {_kind(value)}")
    optional: tuple[object, ...] = _optional_values(request)
    if optional.count(None) != len(optional):
        for (name, types, what), value in zip(_OPTIONAL, optional, strict=True):
            if value is not None and _wrong_type(value, types):
                raise TypeError(
                    f"EngineCoreRequest.{name} must be {what} or None, got {_kind(value)}"
                )
        if request.pooling_params is not None:
            field_check(PoolingParams).check(request.pooling_params)
        if request.lora_request is not None:
            field_check(LoRARequest).check(request.lora_request)
    flags: tuple[object, object] = (request.resumable, request.abort_immediately)
    if type(flags[0]) is not bool or type(flags[1]) is not bool:
        for name in _FLAGS:
            value = getattr(request, name)
            if type(value) is not bool:
                raise TypeError(f"EngineCoreRequest.{name} must be a bool, got {_kind(value)}")


def _wrong_type(value: object, types: type | tuple[type, ...]) -> bool:
    return not isinstance(value, types) or (types is int and type(value) is not int)


def _check_prompt(request: EngineCoreRequest) -> None:
    tokens = request.prompt_token_ids
    if tokens is None:
        if request.prompt_embeds is None:
            raise ValueError(
                "EngineCoreRequest needs prompt_token_ids (or prompt_embeds), got neither"
            )
        return
    if type(tokens) is not list:
        raise TypeError(
            f"EngineCoreRequest.prompt_token_ids must be a list of int, got {_kind(tokens)}"
            + (" (use .tolist())" if hasattr(tokens, "tolist") else "")
        )
    if not tokens:
        return  # the engine rejects an empty prompt, with its own message
    if len(tokens) <= _SHORT_PROMPT:
        if set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) <= _MAX_TOKEN_ID:
            return
    else:
        try:
            msgspec.convert(tokens, _TOKEN_IDS)
        except msgspec.ValidationError:
            pass
        else:
            return
    # Something is wrong: the slow search only runs to name the culprit.
    for index, token in enumerate(tokens):
        if type(token) is not int:
            raise TypeError(
                f"EngineCoreRequest.prompt_token_ids must hold ints, but item {index} is "
                f"{_kind(token)}"
            )
        if token < 0:
            raise ValueError(
                f"EngineCoreRequest.prompt_token_ids[{index}] is {token}: token ids are >= 0"
            )
        if token > _MAX_TOKEN_ID:
            raise ValueError(
                f"EngineCoreRequest.prompt_token_ids[{index}] is {token}: token ids must fit "
                f"in int32 (at most {_MAX_TOKEN_ID})"
            )


def check_requests(requests: list[EngineCoreRequest], in_flight: Container[str]) -> None:
    """:func:`check_request` for each, plus: no id twice, none already in flight.

    ``in_flight`` holds the ids of the client's requests in flight.
    """
    seen: set[str] = set()
    for request in requests:
        check_request(request)
        request_id = request.request_id
        if request_id in seen:
            raise ValueError(f"request id {request_id!r} appears twice in this batch")
        seen.add(request_id)
        if request_id in in_flight:
            raise ValueError(f"request {request_id!r} is already in flight on this client")

"""Checking a request before anything is sent (pure, synchronous).

msgspec encodes whatever a :class:`~trio_enginecore.protocol.EngineCoreRequest` holds:
a request id that is an ``int`` goes out happily and the engine, whose decoder is
typed, can only drop the message, so the caller would wait forever. The clients call
:func:`check_request` first, and a mistake becomes a ``TypeError`` or ``ValueError``
naming the field, raised before anything is registered or sent.

The check is shallow where depth is already guaranteed: :class:`SamplingParams`
validates its own fields when it is built (and again when an engine decodes it), so
only its type is checked here. Values the client cannot judge (a token id beyond the
model's vocabulary, a prompt longer than the engine allows) are the engine's to reject;
a stream then raises :class:`~trio_enginecore.errors.RequestFailedError`.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Final

from ..protocol import EngineCoreRequest, LoRARequest, PoolingParams, SamplingParams, Tensor

__all__ = ["check_request", "check_requests"]

# Optional fields: None, or an instance of these types.
_OPTIONAL: Final[tuple[tuple[str, type | tuple[type, ...], str], ...]] = (
    ("mm_features", list, "a list"),
    ("pooling_params", PoolingParams, "a PoolingParams"),
    ("lora_request", LoRARequest, "a LoRARequest"),
    ("cache_salt", str, "a str"),
    ("prompt_embeds", Tensor, "a Tensor"),
    ("prompt_is_token_ids", list, "a list of bool"),
    ("trace_headers", dict, "a dict of str to str"),
    ("external_req_id", str, "a str"),
    ("reasoning_ended", bool, "a bool"),
    ("reasoning_parser_kwargs", dict, "a dict"),
    ("session_id", str, "a str"),
)
_FLAGS: Final = ("resumable", "abort_immediately")


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


def _is_int(value: object) -> bool:
    # bool is an int to Python, not to a reader of "priority=True".
    return type(value) is int


def check_request(request: object) -> None:
    """Raise ``TypeError``/``ValueError`` naming the field if ``request`` cannot be sent.

    Checks the type of every field a caller sets (the request id, the prompt's token
    ids, the sampling or pooling parameters, ...). It does not check what only the
    engine knows (vocabulary size, maximum length).
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
    arrival = request.arrival_time
    if type(arrival) is not float and not _is_int(arrival):
        raise TypeError(
            f"EngineCoreRequest.arrival_time must be a float (time.time()), got {_kind(arrival)}"
        )
    for name in ("priority", "client_index", "current_wave"):
        if not _is_int(getattr(request, name)):
            raise TypeError(
                f"EngineCoreRequest.{name} must be an int, got {_kind(getattr(request, name))}"
            )
    rank = request.data_parallel_rank
    if rank is not None and not _is_int(rank):
        raise TypeError(
            f"EngineCoreRequest.data_parallel_rank must be an int or None, got {_kind(rank)}"
        )
    for name, types, what in _OPTIONAL:
        value = getattr(request, name)
        if value is not None and not isinstance(value, types):
            raise TypeError(f"EngineCoreRequest.{name} must be {what} or None, got {_kind(value)}")
    for name in _FLAGS:
        if type(getattr(request, name)) is not bool:
            raise TypeError(
                f"EngineCoreRequest.{name} must be a bool, got {_kind(getattr(request, name))}"
            )


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
    # One pass in C over the types; the slow search only runs to name the culprit.
    if set(map(type, tokens)) != {int}:
        index, token = next((i, t) for i, t in enumerate(tokens) if type(t) is not int)
        raise TypeError(
            f"EngineCoreRequest.prompt_token_ids must hold ints, but item {index} is {_kind(token)}"
        )
    if min(tokens) < 0:
        index = tokens.index(min(tokens))
        raise ValueError(
            f"EngineCoreRequest.prompt_token_ids[{index}] is {tokens[index]}: token ids are >= 0"
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

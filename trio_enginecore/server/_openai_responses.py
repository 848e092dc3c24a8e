"""OpenAI response bodies and Server-Sent Events, byte for byte as vLLM 0.34 writes them
(pure).

vLLM serialises a whole response with ``json.dumps(model_dump(), ensure_ascii=False,
separators=(",", ":"))`` (Starlette's ``JSONResponse``) and each streamed chunk with
pydantic's ``model_dump_json(exclude_unset=True)``: compact JSON, non-ASCII text as
UTF-8, the fields in its models' order, the fields a chunk's constructor set written
even when null. The interop suite holds these functions to the bytes vLLM's own
server answers the same requests with (``tests/interop/test_openai_server_differential.py``).

Streaming is where the server spends its time, so a stream's constant parts are
encoded once (:class:`CompletionFrames`, :class:`ChatFrames`): a chunk of new text is
then a join of five byte strings and one JSON string.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final, final

import msgspec

from ..text._logprobs import Logprob
from ..text._outputs import CompletionOutput, RequestOutput

__all__ = [
    "DONE",
    "ChatFrames",
    "CompletionFrames",
    "chat_logprobs",
    "chat_response",
    "completion_logprobs",
    "completion_response",
    "encode_json",
    "error_event",
    "usage",
]

DONE: Final = b"data: [DONE]\n\n"
"""The last event of every stream."""

_encoder = msgspec.json.Encoder()


def encode_json(payload: object) -> bytes:
    """A whole response's body as Starlette's ``JSONResponse`` writes it:
    ``json.dumps(payload, ensure_ascii=False, separators=(",", ":"))`` (floats as Python
    writes them: ``1e-05``; a streamed chunk's are pydantic's, ``0.00001``)."""
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` as ``model_dump`` gives it (``prompt_tokens_details``
    left out when null, as its ``exclude_if`` says)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "completion_tokens_details": None,
    }


def _usage_without_nulls(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def _split_template(frame: bytes, index_probe: bytes, text_probe: bytes) -> tuple[bytes, ...]:
    prefix, rest = frame.split(index_probe, 1)
    infix, suffix = rest.split(text_probe, 1)
    return prefix, infix, suffix


_INDEX_PROBE: Final = 987654321
_TEXT_PROBE: Final = "\x00probe\x00"


class _StreamFrames:
    """What the events of one streamed response share: its identity (``id``,
    ``object``, ``created``, ``model``, ``system_fingerprint``), the chunk of new text
    as a template encoded once, and the usage chunk."""

    __slots__ = (
        "_head",
        "_infix",
        "_suffix",
        "created",
        "model",
        "request_id",
        "system_fingerprint",
    )

    OBJECT: ClassVar[str]
    """The chunks' ``object``."""

    def __init__(
        self, request_id: str, created: int, model: str, system_fingerprint: str | None = None
    ) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.system_fingerprint = system_fingerprint
        # A text chunk with values no real one has, cut where the two go.
        self._head, self._infix, self._suffix = _split_template(
            self._text_chunk_probe(), str(_INDEX_PROBE).encode(), _encoder.encode(_TEXT_PROBE)
        )

    def _text_chunk_probe(self) -> bytes:
        """A chunk of the text ``_TEXT_PROBE`` for choice ``_INDEX_PROBE``, not its last."""
        raise NotImplementedError

    def _payload(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": self.OBJECT,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice_chunk(
        self, choice: dict[str, Any], usage_so_far: dict[str, Any] | None, *, fingerprinted: bool
    ) -> bytes:
        payload = self._payload([choice])
        if usage_so_far is not None:
            payload["usage"] = usage_so_far
        if fingerprinted and self.system_fingerprint is not None:
            payload["system_fingerprint"] = self.system_fingerprint
        payload["kv_transfer_params"] = None
        return _event(payload)

    def delta(self, index: int, text: str) -> bytes:
        """A chunk of new text of choice ``index``, not its last."""
        return b"".join(
            (self._head, str(index).encode(), self._infix, _encoder.encode(text), self._suffix)
        )

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last chunk with ``include_usage``: no choices, the usage (nulls left out)."""
        payload = self._payload([])
        payload["usage"] = _usage_without_nulls(prompt_tokens, completion_tokens)
        if self.system_fingerprint is not None:
            payload["system_fingerprint"] = self.system_fingerprint
        return _event(payload)


# ------------------------------------------------------------------ logprobs

_FLOOR: Final = -9999.0  # what OpenAI writes for -inf (JSON has no infinities)

Decode = Callable[[int], str]
"""A token's text, for positions whose logprobs carry none (``tokenizer.decode``)."""


def _token_text(logprob: Logprob, token_id: int, decode: Decode) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else decode(token_id)


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[dict[int, Logprob] | None],
    num_logprobs: int | None,
    text_offset: int,
    decode: Decode,
) -> tuple[dict[str, Any], int]:
    """``/v1/completions``' ``logprobs`` of some positions (vLLM's
    ``_create_completion_logprobs``): the chosen tokens, their logprobs, the first
    ``num_logprobs + 1`` candidates of each (all with -1), and where each token's text
    starts, from ``text_offset``; and the offset after the last token."""
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    limit = None if num_logprobs is None or num_logprobs == -1 else max(num_logprobs + 1, 0)
    last_length = 0
    for i, token_id in enumerate(token_ids):
        step = positions[i] if i < len(positions) else None
        if step is None:
            token = decode(token_id)
            token_logprobs.append(None)
            tops.append(None)
        else:
            chosen = step[token_id]
            token = _token_text(chosen, token_id, decode)
            token_logprobs.append(max(chosen.logprob, _FLOOR))
            tops.append(
                {
                    _token_text(candidate, candidate_id, decode): max(candidate.logprob, _FLOOR)
                    for candidate_id, candidate in itertools.islice(step.items(), limit)
                }
            )
        tokens.append(token)
        offsets.append(text_offset if not offsets else offsets[-1] + last_length)
        last_length = len(token)
    following = offsets[-1] + last_length if offsets else text_offset
    return (
        {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": tokens,
            "top_logprobs": tops,
        },
        following,
    )


def chat_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[dict[int, Logprob] | None],
    top_logprobs: int | None,
    decode: Decode,
) -> dict[str, Any]:
    """``/v1/chat/completions``' ``logprobs`` of some positions (vLLM's
    ``_create_chat_logprobs``): each chosen token with its logprob and UTF-8 bytes, and
    its first ``top_logprobs`` candidates (all with -1)."""
    limit = None if top_logprobs == -1 else (top_logprobs or 0)
    content: list[dict[str, Any]] = []
    for i, token_id in enumerate(token_ids):
        step = positions[i] if i < len(positions) else None
        chosen = None if step is None else step.get(token_id)
        if step is None or chosen is None:
            token = decode(token_id)
            content.append(
                {
                    "token": token,
                    "logprob": _FLOOR,
                    "bytes": list(token.encode("utf-8", errors="replace")),
                    "top_logprobs": [],
                }
            )
            continue
        decoded = chosen.decoded_token
        top: list[dict[str, Any]] = []
        for candidate_id, candidate in itertools.islice(step.items(), limit):
            text = _token_text(candidate, candidate_id, decode)
            top.append(
                {
                    "token": text,
                    "logprob": max(candidate.logprob, _FLOOR),
                    "bytes": list(text.encode("utf-8", errors="replace")),
                }
            )
        content.append(
            {
                "token": _token_text(chosen, token_id, decode),
                "logprob": max(chosen.logprob, _FLOOR),
                "bytes": None
                if decoded is None
                else list(decoded.encode("utf-8", errors="replace")),
                "top_logprobs": top,
            }
        )
    return {"content": content}


# ------------------------------------------------------------------ completions


def completion_response(
    request_id: str,
    created: int,
    model: str,
    choices: Sequence[tuple[int, CompletionOutput, list[int] | None, dict[str, Any] | None]],
    prompt_tokens: int,
    *,
    system_fingerprint: str | None = None,
) -> bytes:
    """A whole ``/v1/completions`` response (``CompletionResponse.model_dump()``).

    ``choices``: per choice, its index, its final output, the prompt's token ids when
    they are to be returned (``return_token_ids``), and its logprobs
    (:func:`completion_logprobs`) when asked for."""
    completion_tokens = 0
    body_choices: list[dict[str, Any]] = []
    for index, output, prompt_token_ids, logprobs in choices:
        completion_tokens += len(output.token_ids)
        body_choices.append(
            {
                "index": index,
                "text": output.text,
                "logprobs": logprobs,
                "finish_reason": output.finish_reason,
                "stop_reason": output.stop_reason,
                "token_ids": output.token_ids if prompt_token_ids is not None else None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_token_ids,
                "routed_experts": None,
                "weight_versions": None,
            }
        )
    return encode_json(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": body_choices,
            "service_tier": None,
            "system_fingerprint": system_fingerprint,
            "usage": usage(prompt_tokens, completion_tokens),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


@final
class CompletionFrames(_StreamFrames):
    """The events of one streamed ``/v1/completions`` response."""

    __slots__ = ()
    OBJECT = "text_completion"

    def _text_chunk_probe(self) -> bytes:
        return self.chunk(_INDEX_PROBE, _TEXT_PROBE, None, None)

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        *,
        usage_so_far: dict[str, Any] | None = None,
        token_ids: list[int] | None = None,
        prompt_token_ids: list[int] | None = None,
        logprobs: dict[str, Any] | None = None,
        fingerprinted: bool = False,
    ) -> bytes:
        """Any chunk of choice ``index``: the last one (with its finish reason), one with
        the usage so far (``continuous_usage_stats``), token ids (``return_token_ids``)
        or logprobs. ``fingerprinted``: with the ``system_fingerprint`` (vLLM stamps it
        on a choice's last chunk when no usage chunk follows)."""
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "prompt_token_ids": prompt_token_ids,
            "token_ids": token_ids,
            "weight_versions": None,
        }
        return self._choice_chunk(choice, usage_so_far, fingerprinted=fingerprinted)


# ------------------------------------------------------------------ chat


def chat_response(
    request_id: str,
    created: int,
    model: str,
    choices: Sequence[tuple[int, CompletionOutput, dict[str, Any] | None]],
    prompt_tokens: int,
    *,
    role: str = "assistant",
    system_fingerprint: str | None = None,
    token_ids: bool = False,
    prompt_token_ids: list[int] | None = None,
) -> bytes:
    """A whole ``/v1/chat/completions`` response (``ChatCompletionResponse.model_dump()``):
    ``choices`` are each choice's index, final output and logprobs (:func:`chat_logprobs`)."""
    completion_tokens = 0
    body_choices: list[dict[str, Any]] = []
    for index, output, logprobs in choices:
        completion_tokens += len(output.token_ids)
        body_choices.append(
            {
                "index": index,
                "message": {
                    "role": role,
                    "content": output.text,
                    "refusal": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": logprobs,
                "finish_reason": output.finish_reason,
                "stop_reason": output.stop_reason,
                "token_ids": output.token_ids if token_ids else None,
                "routed_experts": None,
                "weight_versions": None,
            }
        )
    return encode_json(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": body_choices,
            "service_tier": None,
            "system_fingerprint": system_fingerprint,
            "usage": usage(prompt_tokens, completion_tokens),
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_token_ids,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


@final
class ChatFrames(_StreamFrames):
    """The events of one streamed ``/v1/chat/completions`` response."""

    __slots__ = ()
    OBJECT = "chat.completion.chunk"

    def _text_chunk_probe(self) -> bytes:
        return self.chunk(_INDEX_PROBE, _TEXT_PROBE, None, None)

    def role(
        self,
        index: int,
        role: str = "assistant",
        *,
        usage_so_far: dict[str, Any] | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> bytes:
        """The first chunk of choice ``index``: its role and empty content."""
        payload = self._payload(
            [
                {
                    "index": index,
                    "delta": {"role": role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        if usage_so_far is not None:
            payload["usage"] = usage_so_far
        payload["prompt_token_ids"] = prompt_token_ids
        payload["prompt_text"] = None
        return _event(payload)

    def chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        *,
        usage_so_far: dict[str, Any] | None = None,
        token_ids: list[int] | None = None,
        logprobs: dict[str, Any] | None = None,
        fingerprinted: bool = False,
    ) -> bytes:
        """Any content chunk of choice ``index``: the last one (``finish_reason`` set;
        ``text`` None for an empty delta), or one with the usage so far, token ids or
        logprobs; ``fingerprinted`` as :meth:`CompletionFrames.chunk`."""
        choice: dict[str, Any] = {
            "index": index,
            "delta": {} if text is None else {"content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        # vLLM's last chunk of a choice carries two fields more, in its model's order.
        final = finish_reason is not None
        if final:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = token_ids
        if final:
            choice["weight_versions"] = None
        return self._choice_chunk(choice, usage_so_far, fingerprinted=fingerprinted)


def error_event(message: str, status: int, error_type: str) -> bytes:
    """An error in the middle of a stream, as vLLM sends it (``data: {"error": ...}``)."""
    error = {"message": message, "type": error_type, "param": None, "code": status}
    return _event({"error": error})


def output_of(output: RequestOutput, index: int) -> CompletionOutput | None:
    """The sequence ``index`` of ``output``, if it carries it."""
    for completion in output.outputs:
        if completion.index == index:
            return completion
    return None

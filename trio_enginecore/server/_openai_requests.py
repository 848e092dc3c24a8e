"""OpenAI request bodies, read and checked as vLLM 0.34's server reads them (pure).

:func:`parse_completion`, :func:`parse_chat` and friends turn a request body into a
checked request, or raise :class:`ApiError` (an OpenAI-style error with vLLM's status
and, where vLLM names one, the field at fault). Fields vLLM accepts are accepted here,
with vLLM's defaults (``vllm/entrypoints/openai/completion/protocol.py``,
``chat_completion/protocol.py``); unknown fields are ignored, as vLLM ignores them.
Types are read strictly (a JSON string is no number): pydantic's lax mode, which vLLM
uses, would take ``"2"`` for ``2``; no OpenAI client sends that.

:meth:`CompletionRequest.sampling_params` and :meth:`ChatRequest.sampling_params` map
a request to the engine's :class:`~trio_enginecore.protocol.SamplingParams` as
vLLM's ``to_sampling_params`` does, with ``max_tokens`` from :func:`max_tokens_for`
(vLLM's ``get_max_tokens``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final, TypeVar, cast, final

import attrs
import msgspec

from ..errors import InvalidInputError
from ..protocol import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "RequestLimits",
    "StreamOptions",
    "TokenizeRequest",
    "max_tokens_for",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_tokenize",
]

_T = TypeVar("_T")

_CACHE_SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1


_LIMIT_VARIABLES: Final = {
    "max_n_sequences": "VLLM_MAX_N_SEQUENCES",
    "max_completion_prompts": "VLLM_MAX_COMPLETION_PROMPTS",
    "max_stop_strings": "VLLM_MAX_STOP_STRINGS",
}


@attrs.frozen(kw_only=True)
class RequestLimits:
    """How much one request may ask for: vLLM's limits, with its defaults.

    vLLM reads them from its environment variables (``VLLM_MAX_N_SEQUENCES``, ...);
    :meth:`from_environment` reads the same ones, so a deployment that raised them for
    ``vllm serve`` gets the same limits here. Each bounds what a single request can
    make the server and its engines hold.
    """

    max_n_sequences: int = attrs.field(default=16384, validator=attrs.validators.ge(1))
    """The largest ``n`` (``VLLM_MAX_N_SEQUENCES``)."""
    max_completion_prompts: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    """The most prompts of one ``/v1/completions`` request
    (``VLLM_MAX_COMPLETION_PROMPTS``)."""
    max_stop_strings: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    """The most stop strings of one request, OpenAI's limit (``VLLM_MAX_STOP_STRINGS``)."""

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> RequestLimits:
        """The limits vLLM's variables in ``environ`` set (the defaults where unset).

        Raises:
            ValueError: a variable that is not a positive integer (named).
        """
        values: dict[str, int] = {}
        for field, variable in _LIMIT_VARIABLES.items():
            text = environ.get(variable)
            if text is None:
                continue
            try:
                values[field] = int(text)
            except ValueError:
                raise ValueError(f"{variable} must be an integer, not {text!r}") from None
            if values[field] < 1:
                raise ValueError(f"{variable} must be at least 1, not {text!r}")
        return cls(**values)


DEFAULT_LIMITS: Final = RequestLimits()


@final
class ApiError(Exception):
    """An error the server answers with an OpenAI-style body:
    ``{"error": {"message", "type", "param", "code"}}`` (vLLM's ``ErrorResponse``)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.error_type = error_type or _ERROR_TYPES.get(self.status, "BadRequestError")

    def body(self) -> bytes:
        """The error's JSON body, as vLLM's ``ErrorResponse.model_dump()`` encodes it."""
        return json.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.error_type,
                    "param": self.param,
                    "code": self.status,
                }
            },
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()

    @classmethod
    def invalid(cls, message: str, param: str, value: object = None) -> ApiError:
        """A 400 as vLLM's ``VLLMValidationError`` words it: the message, then
        ``(parameter=..., value=...)``."""
        extras = f"parameter={param}" + ("" if value is None else f", value={value}")
        return cls(f"{message} ({extras})", param=param)

    @classmethod
    def from_invalid_input(cls, error: InvalidInputError) -> ApiError:
        """The 400 of a request the text layer refused (the field it names)."""
        return cls(str(error), param=error.param)


_ERROR_TYPES: Final = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    """``stream_options``: a last chunk with the usage, and usage on every chunk."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _ResponseFormat(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    json_schema: dict[str, Any] | None = None


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """The fields completions and chat completions share, in vLLM's names."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    add_special_tokens: bool | None = None
    response_format: _ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    return_token_ids: bool | None = None
    vllm_xargs: dict[str, Any] | None = None

    def _check_common(self, limits: RequestLimits) -> None:
        if isinstance(self.stop, list) and len(self.stop) > limits.max_stop_strings:
            raise ApiError(
                f"stop: at most {limits.max_stop_strings} stop strings, got {len(self.stop)} "
                "(the limit is VLLM_MAX_STOP_STRINGS)",
                param="stop",
            )
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ApiError("seed must be a 64-bit integer", param="seed")
        if not _INT64_MIN <= self.priority <= _INT64_MAX:
            raise ApiError("priority must be a 64-bit integer", param="priority")
        if self.stream_options is not None and not self.stream:
            raise ApiError.invalid(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if self.use_beam_search:
            raise ApiError("beam search is not supported by this server", param="use_beam_search")
        salt = self.cache_salt
        if salt is not None and not salt:
            raise ApiError.invalid(
                "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
            )
        if salt is not None and (len(salt) > 128 or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt)):
            # vLLM's rule, for the cache backends it reaches (separators, path parts).
            raise ApiError.invalid(
                "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                "'@', '/', '\\\\', or NUL.",
                "cache_salt",
            )
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ApiError(
                "truncate_prompt_tokens must be -1 or a non-negative integer",
                param="truncate_prompt_tokens",
            )
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None:
            # vLLM's order: a stream that asks for some, then a negative count.
            if self.stream and (prompt_logprobs > 0 or prompt_logprobs == -1):
                raise ApiError.invalid(
                    "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
                )
            if prompt_logprobs < -1:
                raise ApiError.invalid(
                    "`prompt_logprobs` must be a positive value or -1.",
                    "prompt_logprobs",
                    prompt_logprobs,
                )
        if self.structured_outputs is not None:
            kinds = [k for k in ("json", "regex", "choice") if self.structured_outputs.get(k)]
            if len(kinds) > 1:
                raise ApiError.invalid(
                    "You can only use one kind of constraints for structured "
                    "outputs ('json', 'regex' or 'choice').",
                    "structured_outputs",
                )

    @property
    def include_usage(self) -> bool:
        """Whether a last chunk carries the usage (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries the usage so far (with ``include_usage``)."""
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)

    def _structured(self) -> StructuredOutputsParams | None:
        fields: dict[str, Any] = dict(self.structured_outputs or {})
        response_format = self.response_format
        if response_format is not None:
            if response_format.type == "json_object":
                fields["json_object"] = True
            elif response_format.type == "json_schema":
                schema = (response_format.json_schema or {}).get("schema")
                fields["json"] = schema if schema is not None else {}
            elif response_format.type != "text":
                raise ApiError(
                    f"response_format type {response_format.type!r} is not supported "
                    "(use 'text', 'json_object' or 'json_schema')",
                    param="response_format",
                )
        if not fields:
            return None
        try:
            return msgspec.convert(fields, StructuredOutputsParams)
        except (msgspec.ValidationError, ValueError, TypeError) as exc:
            raise ApiError(str(exc), param="structured_outputs") from None

    def _sampling_params(
        self,
        max_tokens: int,
        limits: RequestLimits,
        *,
        logprobs: int | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams:
        if self.n is not None and self.n > limits.max_n_sequences:
            raise ApiError(
                f"n must be at most {limits.max_n_sequences}, got {self.n}. To increase "
                "this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
            )
        try:
            return SamplingParams(
                n=1 if self.n is None else self.n,
                presence_penalty=_or(self.presence_penalty, 0.0),
                frequency_penalty=_or(self.frequency_penalty, 0.0),
                repetition_penalty=_or(self.repetition_penalty, 1.0),
                temperature=_or(self.temperature, 1.0),
                top_p=_or(self.top_p, 1.0),
                top_k=_or(self.top_k, 0),
                min_p=_or(self.min_p, 0.0),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=_or(self.skip_special_tokens, True),
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                output_kind=(
                    RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
                ),
                structured_outputs=self._structured(),
                logit_bias=_logit_bias(self.logit_bias),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words or None,
                extra_args=self.vllm_xargs or None,
            )
        except ApiError:
            raise
        except (TypeError, ValueError) as exc:
            # As vLLM's SamplingParams checks word it: a sentence; the fields vLLM
            # names as the parameter (with its value), named; the others not (the
            # message names them).
            reason = _reason(exc)
            reason = reason if reason.endswith(".") else reason + "."
            field = _param_of(exc) or reason.split(" ", 1)[0]
            if field in _NAMED_BY_VLLM:
                raise ApiError.invalid(reason, field, getattr(self, field, None)) from None
            raise ApiError(reason) from None


def _logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    """The biases by token id, each within [-100, 100], as vLLM's
    ``SamplingParams.from_optional`` makes them (the ids are checked against the
    vocabulary by the text layer)."""
    if not given:
        return None
    biases: dict[int, float] = {}
    unreadable: list[str] = []
    for key, bias in given.items():
        try:
            token = int(key)
        except ValueError:
            unreadable.append(key)
            continue
        biases[token] = min(100.0, max(-100.0, bias))
    if unreadable:
        raise ApiError.invalid(
            "logit_bias contains key(s) that cannot be converted to integer token IDs: "
            f"{unreadable!r}",
            "logit_bias",
            unreadable,
        )
    return biases


# The SamplingParams checks whose error vLLM 0.34 gives a ``parameter``
# (``vllm/sampling_params.py``'s ``VLLMValidationError(..., parameter=...)``).
_NAMED_BY_VLLM: Final = frozenset(
    {"temperature", "top_p", "max_tokens", "stream_interval", "logprobs", "prompt_logprobs"}
)


@final
class CompletionRequest(_SamplingFields, kw_only=True):
    """A ``POST /v1/completions`` body."""

    prompt: Any = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    stream_interval: int | None = None
    return_tokens_as_token_ids: bool | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one text or token list per completion (vLLM takes a batch).

        Raises:
            ApiError: no prompt, or one of the wrong shape.
        """
        prompt = self.prompt
        if prompt is None or prompt == "":
            raise ApiError.invalid(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt:
            items = cast("list[object]", prompt)
            if all(_is_token(t) for t in items):
                return [cast("list[int]", list(items))]
            if all(isinstance(p, str) for p in items):
                return cast("list[str | list[int]]", list(items))
            lists = [cast("list[object]", p) for p in items if isinstance(p, list)]
            if len(lists) == len(items) and all(all(_is_token(t) for t in p) for p in lists):
                return [cast("list[int]", list(p)) for p in lists]
        raise ApiError(
            "prompt must be a string, a list of strings, a list of token ids "
            "(non-negative integers) or a list of such lists",
            param="prompt",
        )

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """vLLM's request-level checks (those of its model validators)."""
        given: object = self.prompt
        prompt = cast("list[object]", given) if isinstance(given, list) else None
        if (
            prompt is not None
            and len(prompt) > limits.max_completion_prompts
            and not all(_is_token(t) for t in prompt)
        ):
            raise ApiError.invalid(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                f"{limits.max_completion_prompts}. To increase this limit, set the "
                "VLLM_MAX_COMPLETION_PROMPTS environment variable.",
                "prompt",
            )
        self._check_common(limits)
        if self.suffix:
            raise ApiError(
                "suffix is not supported: the served model does not implement fill-in-the-middle",
                param="suffix",
            )
        if self.logprobs is not None and self.logprobs < -1:
            raise ApiError.invalid(
                "`logprobs` must be a positive value or -1.", "logprobs", self.logprobs
            )
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ApiError.invalid(
                f"max_tokens must be at least 1, got {self.max_tokens}.",
                "max_tokens",
                self.max_tokens,
            )

    def sampling_params(
        self, max_tokens: int, limits: RequestLimits = DEFAULT_LIMITS
    ) -> SamplingParams:
        """The engine's parameters, as vLLM's ``CompletionRequest.to_sampling_params``.

        Raises:
            ApiError: a parameter out of range (the field named).
        """
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        echo_only = bool(self.echo) and self.max_tokens == 0
        return self._sampling_params(
            1 if echo_only else max_tokens,
            limits,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
        )


@final
class ChatRequest(_SamplingFields, kw_only=True):
    """A ``POST /v1/chat/completions`` body."""

    messages: Any = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = "none"
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """vLLM's request-level checks (those of its model validators)."""
        self._check_common(limits)
        if not isinstance(self.messages, list):
            raise ApiError("messages must be a list of messages", param="messages")
        if self.top_logprobs is not None and self.top_logprobs < -1:
            raise ApiError.invalid(
                "`top_logprobs` must be a positive value or -1.", "top_logprobs", self.top_logprobs
            )
        if self.top_logprobs and not self.logprobs:
            raise ApiError.invalid(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        if self.stream and self.prompt_logprobs is not None:
            raise ApiError.invalid(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        if self.tool_choice not in ("none", None) and self.tool_choice != "auto":
            raise ApiError(
                "tool_choice other than 'none' or 'auto' is not supported by this server",
                param="tool_choice",
            )
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ApiError.invalid(f"{name} must be at least 1, got {value}.", name, value)

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def sampling_params(
        self, max_tokens: int, limits: RequestLimits = DEFAULT_LIMITS
    ) -> SamplingParams:
        """The engine's parameters, as vLLM's ``ChatCompletionRequest.to_sampling_params``.

        Raises:
            ApiError: a parameter out of range (the field named).
        """
        logprobs = self.top_logprobs if self.logprobs else None
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = logprobs
        return self._sampling_params(
            max_tokens, limits, logprobs=logprobs, prompt_logprobs=prompt_logprobs
        )


@final
class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """A ``POST /tokenize`` body: a completion's ``prompt`` or a chat's ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    tools: list[Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@final
class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """A ``POST /detokenize`` body."""

    tokens: list[int]
    model: str | None = None


def max_tokens_for(
    max_model_len: int | None,
    requested: int | None,
    prompt_tokens: int,
    *,
    truncate_prompt_tokens: int | None = None,
) -> int:
    """How many tokens a request may generate: the least of what is asked and what is
    left of the model's length (vLLM's ``get_max_tokens``).

    Raises:
        ApiError: the prompt alone is longer than the model's length.
    """
    if max_model_len is None:
        if requested is None:
            raise ApiError("max_tokens must be given: the model's length is not known")
        return requested
    if truncate_prompt_tokens is not None:
        limit = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        prompt_tokens = min(prompt_tokens, limit)
    if prompt_tokens > max_model_len:
        raise ApiError.invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt contains {prompt_tokens} input tokens, which exceeds this "
            "limit even without any output tokens. Please reduce the length of the "
            "input prompt.",
            "input_tokens",
            prompt_tokens,
        )
    left = max_model_len - prompt_tokens
    return left if requested is None else min(left, requested)


# ------------------------------------------------------------------ decoding

_JSON = msgspec.json.Decoder()


def too_deep() -> ApiError:
    """The 400 of arrays or objects nested about a thousand deep: what Python cannot
    decode, or walk (a chat's messages, a template's ``tojson``), within its recursion
    limit."""
    return ApiError("The request body is nested too deeply")


def decode_json_object(body: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object.

    Raises:
        ApiError: not JSON, or not an object.
    """
    try:
        value: object = _JSON.decode(body)
    except msgspec.DecodeError as exc:
        raise ApiError(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise too_deep() from None
    if not isinstance(value, dict):
        raise ApiError(f"The request body must be a JSON object, not {_json_type(value)}")
    return cast("dict[str, Any]", value)  # JSON objects have str keys


def _convert(body: bytes, kind: type[_T]) -> _T:
    fields = decode_json_object(body)
    try:
        return msgspec.convert(fields, kind)
    except msgspec.ValidationError as exc:
        raise ApiError(_reason(exc), param=_param_of(exc)) from None


def parse_completion(body: bytes, limits: RequestLimits = DEFAULT_LIMITS) -> CompletionRequest:
    """A checked ``/v1/completions`` request.

    Raises:
        ApiError: malformed JSON, a field of the wrong type, a request vLLM refuses.
    """
    request = _convert(body, CompletionRequest)
    request.check(limits)
    return request


def parse_chat(body: bytes, limits: RequestLimits = DEFAULT_LIMITS) -> ChatRequest:
    """A checked ``/v1/chat/completions`` request.

    Raises:
        ApiError: as :func:`parse_completion`.
    """
    fields = decode_json_object(body)
    if "messages" not in fields:
        raise ApiError("Field required: messages", param="messages")
    try:
        request = msgspec.convert(fields, ChatRequest)
    except msgspec.ValidationError as exc:
        raise ApiError(_reason(exc), param=_param_of(exc)) from None
    request.check(limits)
    return request


def parse_tokenize(body: bytes) -> TokenizeRequest:
    """A checked ``/tokenize`` request (a ``prompt`` or ``messages``, not both).

    Raises:
        ApiError: as :func:`parse_completion`.
    """
    request = _convert(body, TokenizeRequest)
    if (request.prompt is None) == (request.messages is None):
        raise ApiError("give either prompt or messages", param="prompt")
    return request


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    """A checked ``/detokenize`` request.

    Raises:
        ApiError: as :func:`parse_completion`; a negative token id.
    """
    request = _convert(body, DetokenizeRequest)
    if any(token < 0 for token in request.tokens):
        raise ApiError("token ids must be non-negative", param="tokens")
    return request


# ------------------------------------------------------------------ helpers


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _is_token(value: object) -> bool:
    return type(value) is int and value >= 0


def _json_type(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return "a number"


def _reason(exc: Exception) -> str:
    message = str(exc)
    if isinstance(exc, InvalidInputError):
        return message
    # msgspec: "Expected `int`, got `str` - at `$.n`"; SamplingParams: "SamplingParams: ..."
    return message.removeprefix("SamplingParams: ").removeprefix("SamplingParams.")


def _param_of(exc: Exception) -> str | None:
    message = str(exc)
    marker = message.rfind("- at `$.")
    if marker >= 0:
        path = message[marker + len("- at `$.") :].rstrip("`")
        return path.split(".")[0].split("[")[0] or None
    if message.startswith("SamplingParams"):
        head = message.removeprefix("SamplingParams").lstrip(":. ")
        name = head.split(" ", 1)[0].rstrip(":")
        return name if name.isidentifier() else None
    return None

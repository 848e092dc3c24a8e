"""The OpenAI-compatible routes, over the text layer: :class:`OpenAIApp`.

One handler (``await app(request)``) for :func:`~._http.serve_http`. Generation
routes take a slot (``max_concurrent_requests``; none left: 503 at once, nothing
queued), tokenize and check the request here (a wrong request is a 400 before
anything is sent), and stream from :meth:`AsyncLLM.generate`. A streamed response's
body is an async generator that the HTTP server iterates from the connection's task:
when the client goes away, the generator meets ``trio.Cancelled`` at its next
checkpoint and leaving the ``generate`` block aborts the request on the engine.

What differs from vLLM's server, and why: API-key failures answer an OpenAI-style
body (vLLM's is ``{"error": "Unauthorized"}``), so that every error of a route has one
shape (an unknown path or method is answered as vLLM's FastAPI answers it:
``{"detail": "Not Found"}``, ``{"detail": "Method Not Allowed"}``);
chat templates render, and prompts are encoded, in the request's task (vLLM uses a
worker thread: a template is sandboxed Jinja, milliseconds at most), but in a worker
thread from 32 KiB on, so that a long prompt does not hold the event loop; a
request's ``chat_template`` is honoured only with ``trust_request_chat_template``, as
in vLLM.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, Final, cast, final

import attrs
import trio

from .._keywords import suggest_keywords
from ..errors import EngineDeadError, InvalidInputError, RequestFailedError
from ..protocol import EngineCoreOutputs, SamplingParams
from ..text import AsyncLLM, CompletionOutput, GenerationStream, RequestOutput
from ..text._processor import child_request_id
from ._chat_template import ChatTemplates, template_tools
from ._http_messages import Request, Response
from ._metrics import VllmMetrics
from ._openai_requests import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    RequestLimits,
    max_tokens_for,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
    too_deep,
)
from ._openai_responses import (
    DONE,
    ChatFrames,
    CompletionFrames,
    chat_logprobs,
    chat_response,
    completion_logprobs,
    completion_response,
    encode_json,
    error_event,
)

__all__ = ["OpenAIApp", "ServerSettings"]

logger = logging.getLogger("trio_enginecore.server")

_JSON: Final = ("content-type", "application/json")
_SSE: Final = ("content-type", "text/event-stream; charset=utf-8")
_GUARDED_PREFIX: Final = "/v1"


@suggest_keywords
@final
@attrs.frozen(kw_only=True)
class ServerSettings:
    """What the OpenAI server serves, and how (the ``api-server`` command's options)."""

    served_model_names: tuple[str, ...] = attrs.field(
        converter=tuple, validator=attrs.validators.min_len(1)
    )
    """The names clients give as ``model``; the first is the one responses name."""
    model_root: str = ""
    """Where the model comes from (``/v1/models``' ``root``): its directory."""
    api_key: str | None = None
    """Requests to ``/v1/...`` need ``Authorization: Bearer <api_key>``."""
    max_concurrent_requests: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.gt(0)),  # pyright: ignore[reportUnknownArgumentType]
    )
    """Generation requests served at once; past it, 503 (nothing queued)."""
    chat_template: str | None = None
    """The chat template (a name of the model's, or a template's text) instead of the
    model's own."""
    trust_request_chat_template: bool = False
    """Whether a request may bring its own ``chat_template``."""
    response_role: str = "assistant"
    """The role of chat answers (with ``add_generation_prompt``)."""
    max_logprobs: int = attrs.field(default=20, validator=attrs.validators.ge(-1))
    """The most sample or prompt logprobs a request may ask for (vLLM's
    ``--max-logprobs``, checked by vLLM's frontend, not its engine core); -1 for the
    whole vocabulary."""
    limits: RequestLimits = attrs.field(factory=RequestLimits)
    """How much one request may ask for (``n``, prompts, stop strings): vLLM's limits,
    by default with vLLM's defaults; the ``api-server`` command reads vLLM's variables
    (``VLLM_MAX_N_SEQUENCES``, ...) as ``vllm serve`` does."""


class _Slots:
    """Generation requests in flight, against ``max_concurrent_requests``."""

    __slots__ = ("limit", "taken")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.taken = 0

    def take(self) -> Callable[[], None]:
        if self.limit is not None and self.taken >= self.limit:
            raise ApiError(
                f"the server is serving its maximum of {self.limit} concurrent requests; "
                "retry later",
                status=503,
            )
        self.taken += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.taken -= 1

        return release


@final
class _Body(trio.abc.AsyncResource):
    """A streamed body that releases its slot however it ends: iterated to the end,
    closed, or never started (closing an async generator that never ran runs none of
    its ``finally``)."""

    __slots__ = ("_chunks", "_release")

    def __init__(self, chunks: AsyncGenerator[bytes], release: Callable[[], None]) -> None:
        self._chunks = chunks
        self._release = release

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except BaseException:
            self._release()
            raise

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            self._release()


@attrs.define
class _Prepared:
    """One prompt of a generation request, tokenized and checked."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    request_id: str


@final
class OpenAIApp:
    """vLLM's OpenAI routes over an :class:`~trio_enginecore.text.AsyncLLM`:
    ``response = await app(request)``.

    Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET
    /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST
    /detokenize``. Errors are OpenAI-style JSON bodies with vLLM's statuses; an engine
    death fails the requests it held with 503 while the others are served.

    Args:
        llm: the text layer (its client serves every request).
        settings: the names, key, limits and chat template.
        metrics: the Prometheus metrics to keep (``GET /metrics``); made here by
            default, from the engines' ready messages.
    """

    def __init__(
        self,
        llm: AsyncLLM,
        settings: ServerSettings,
        *,
        metrics: VllmMetrics | None = None,
    ) -> None:
        self.llm = llm
        self.settings = settings
        self.model_name = settings.served_model_names[0]
        self._names = frozenset(settings.served_model_names)
        self.max_model_len = llm.max_model_len
        engines = [e for e in getattr(llm.client, "engines", ()) if e is not None]
        self._ranks = len(getattr(llm.client, "engines", ())) or 1
        """The data-parallel ranks a request may name (``X-data-parallel-rank``)."""
        if metrics is None:
            metrics = VllmMetrics(
                model_name=self.model_name,
                max_model_len=self.max_model_len or 0,
                engine_indexes=[e.data_parallel_rank for e in engines] or [0],
            )
            for engine in engines:
                info = getattr(engine, "cache_config_info", None)
                if isinstance(info, dict) and info:
                    try:
                        metrics.set_cache_config_info(engine.data_parallel_rank, info)  # pyright: ignore[reportUnknownArgumentType]
                    except ValueError:
                        rank = engine.data_parallel_rank
                        logger.warning("engine %d: its cache_config_info is not kept", rank)
        self.metrics = metrics
        self._stop_observing: Callable[[], None] | None = None
        observe = getattr(llm.client, "observe_outputs", None)
        if observe is not None:
            self._stop_observing = observe(self._record)
        self._templates = ChatTemplates.from_tokenizer(llm.tokenizer)
        # The longest token's text: no prompt of more characters than this many per
        # token of the model's length can fit (vLLM's max_chars_per_token).
        vocab: dict[str, int] = llm.tokenizer.backend.get_vocab(with_added_tokens=True)
        self._max_chars_per_token = max(map(len, vocab), default=1)
        self._slots = _Slots(settings.max_concurrent_requests)
        self._api_key_hash = (
            None if settings.api_key is None else hashlib.sha256(settings.api_key.encode()).digest()
        )
        self.system_fingerprint = system_fingerprint(engines, settings)
        self._routes: dict[str, tuple[str, Callable[[Request], Awaitable[Response]]]] = {
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
        }

    def close(self) -> None:
        """Stop recording the engines' messages (the client lives on)."""
        if self._stop_observing is not None:
            self._stop_observing()
            self._stop_observing = None

    def _record(self, message: EngineCoreOutputs) -> None:
        self.metrics.record_engine_outputs(message)

    @property
    def requests_in_flight(self) -> int:
        """Generation requests being served (slots taken)."""
        return self._slots.taken

    # ------------------------------------------------------------ dispatch

    async def __call__(self, request: Request) -> Response:
        """Answer one request (the handler :func:`~trio_enginecore.server.serve_http`
        calls). A request for a stream is answered with a body that streams."""
        path = request.path
        route = self._routes.get(path)
        if route is None:
            return _json(404, {"detail": "Not Found"})
        method, handler = route
        if request.method != method and not (request.method == "HEAD" and method == "GET"):
            return _json(405, {"detail": "Method Not Allowed"}, [("allow", method)])
        guarded = self._api_key_hash is not None and path.startswith(_GUARDED_PREFIX)
        if guarded and not self._authorized(request):
            error = ApiError(
                "Unauthorized: give the server's API key as 'Authorization: Bearer <key>'",
                status=401,
                error_type="Unauthorized",
            )
            return _error(error, [("www-authenticate", "Bearer")])
        if method == "POST" and not _is_json(request):
            return _error(_NOT_JSON)
        try:
            return await handler(request)
        except ApiError as error:
            return _error(error)
        except InvalidInputError as error:
            return _error(ApiError.from_invalid_input(error))
        except EngineDeadError as error:
            return _error(_engine_dead(error))
        except RequestFailedError as error:
            return _error(_request_failed(error))
        except RecursionError:
            # Only a request nested deeper than Python walks gets here (the body
            # decoded, then its messages prepared or rendered): the client's mistake.
            return _error(too_deep())

    def _authorized(self, request: Request) -> bool:
        header = request.headers.get("authorization")
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        assert self._api_key_hash is not None
        return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._api_key_hash)

    def _check_model(self, model: str | None) -> None:
        if model and model not in self._names:
            raise ApiError(
                f"The model `{model}` does not exist. "
                f"Valid aliases: {', '.join(self.settings.served_model_names)}.",
                status=404,
                param="model",
                error_type="NotFoundError",
            )

    def _request_id(self, request: Request, given: str | None) -> str:
        header = request.headers.get("x-request-id")
        return header or given or uuid.uuid4().hex

    # ------------------------------------------------------------ simple routes

    async def _health(self, request: Request) -> Response:
        await trio.lowlevel.checkpoint()
        client = self.llm.client
        failure = getattr(client, "failure", None)
        if failure is not None:
            return _error(ApiError(f"the engine is dead: {failure}", status=503))
        engines = client.statistics().engines
        if engines and not any(e.state in ("alive", "suspect") for e in engines):
            # route_around with every engine dead (or restarting): nothing can serve.
            states = ", ".join(f"rank {e.rank} {e.state}" for e in engines)
            return _error(ApiError(f"no engine is in service ({states})", status=503))
        return Response(200)

    async def _models(self, request: Request) -> Response:
        await trio.lowlevel.checkpoint()
        created = int(time.time())
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": self.settings.model_root or name,
                "parent": None,
                "max_model_len": self.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.settings.served_model_names
        ]
        return _json(200, {"object": "list", "data": cards})

    async def _metrics(self, request: Request) -> Response:
        await trio.lowlevel.checkpoint()
        body, content_type = self.metrics.render_for(request.headers.get("accept"))
        return Response(200, [("content-type", content_type)], body)

    async def _tokenize(self, request: Request) -> Response:
        await trio.lowlevel.checkpoint()
        body = parse_tokenize(request.body)
        self._check_model(body.model)
        tokenizer = self.llm.tokenizer
        if body.messages is not None:
            template = self._template(body.chat_template, tools=bool(body.tools))
            prompt = await self._render(
                template,
                request,
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tools=template_tools(body.tools) if body.tools else None,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            add_special = bool(body.add_special_tokens)
        else:
            assert body.prompt is not None
            prompt = body.prompt
            add_special = body.add_special_tokens is not False
        self._check_text_length(prompt)
        tokens = await self._encode(prompt, add_special_tokens=add_special)
        token_strs = (
            [tokenizer.id_to_token(t) or "" for t in tokens] if body.return_token_strs else None
        )
        return _json(
            200,
            {
                "count": len(tokens),
                "max_model_len": self.max_model_len,
                "tokens": tokens,
                "token_strs": token_strs,
            },
        )

    async def _detokenize(self, request: Request) -> Response:
        await trio.lowlevel.checkpoint()
        body = parse_detokenize(request.body)
        self._check_model(body.model)
        vocab = self.llm.tokenizer.vocab_size
        if any(token >= vocab for token in body.tokens):
            raise ApiError(
                f"token ids must be below the vocabulary's size, {vocab}", param="tokens"
            )
        return _json(200, {"prompt": self.llm.tokenizer.decode(body.tokens)})

    def _template(self, chat_template: str | None, *, tools: bool) -> Any:
        if chat_template is not None and not self.settings.trust_request_chat_template:
            raise ApiError(
                "Chat template is passed with request, but --trust-request-chat-template "
                "is not set. Refused request with untrusted chat template.",
                param="chat_template",
            )
        return self._templates.select(chat_template or self.settings.chat_template, tools=tools)

    # ------------------------------------------------------------ generation

    async def _prepare(
        self,
        prompt: str | list[int],
        body: CompletionRequest | ChatRequest,
        requested_max_tokens: int | None,
        request_id: str,
        *,
        add_special_tokens: bool,
    ) -> _Prepared:
        tokenizer = self.llm.tokenizer
        if isinstance(prompt, str):
            self._check_text_length(prompt)
            text: str | None = prompt
            token_ids = await self._encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text, token_ids = None, prompt
        truncate = body.truncate_prompt_tokens
        if truncate is not None and self.max_model_len is not None:
            keep = self.max_model_len if truncate == -1 else truncate
            if len(token_ids) > keep:
                token_ids = token_ids[len(token_ids) - keep :] if keep else []
                text = None
        max_tokens = max_tokens_for(
            self.max_model_len,
            requested_max_tokens,
            len(token_ids),
        )
        params = body.sampling_params(max_tokens, self.settings.limits)
        self._check_logprobs(params)
        if text is None and token_ids:
            text = tokenizer.decode(token_ids)
        return _Prepared(text, token_ids, params, request_id)

    def _check_logprobs(self, params: SamplingParams) -> None:
        """Refuse more logprobs than ``max_logprobs``, as vLLM's frontend does (its
        engine core would compute them)."""
        limit = self.settings.max_logprobs
        vocab = self.llm.tokenizer.vocab_size
        if limit == -1:
            limit = vocab
        for asked, what, param in (
            (params.logprobs, "sample logprobs", "logprobs"),
            (params.prompt_logprobs, "prompt logprobs", "prompt_logprobs"),
        ):
            count = vocab if asked == -1 else asked
            if count and count > limit:
                raise ApiError.invalid(
                    f"Requested {what} of {count}, which is greater than max allowed: {limit}",
                    param,
                    count,
                )

    def _decode_one(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([token_id])

    @staticmethod
    def _echo_positions(
        body: CompletionRequest,
        prepared: _Prepared,
        output: CompletionOutput,
        prompt_logprobs: list[Any] | None,
    ) -> tuple[list[int], list[Any]]:
        """The token ids and logprob positions a choice reports: with ``echo``, the
        prompt's first (and only those with ``max_tokens=0``)."""
        token_ids, positions = output.token_ids, list(output.logprobs or [])
        if not body.echo:
            return token_ids, positions
        prompt_positions = list(prompt_logprobs or [None] * len(prepared.token_ids))
        if body.max_tokens == 0:
            return list(prepared.token_ids), prompt_positions
        return prepared.token_ids + token_ids, prompt_positions + positions

    async def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The ids of ``text``. A long one is encoded in a worker thread with the GIL
        released: in the request's task it would hold the event loop, and every
        stream, for as long (about 0.7 s per MB of text with the built-in tokenizer)."""
        tokenizer = self.llm.tokenizer
        if len(text) < _LONG_TEXT:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        encode = functools.partial(
            tokenizer.encode_without_gil, text, add_special_tokens=add_special_tokens
        )
        return await trio.to_thread.run_sync(encode)

    async def _render(self, template: Any, request: Request, **fields: Any) -> str:
        """A chat template rendered; for a large request, in a worker thread (Jinja
        keeps the GIL, but hands it back to the loop every few milliseconds)."""
        if len(request.body) < _LONG_TEXT:
            prompt: str = template.render(**fields)
            return prompt
        rendered: str = await trio.to_thread.run_sync(functools.partial(template.render, **fields))
        return rendered

    def _check_text_length(self, text: str) -> None:
        """Refuse a prompt too long to fit before tokenizing it (vLLM's check: a huge
        body would otherwise hold the event loop while it is tokenized)."""
        if self.max_model_len is None:
            return
        limit = self.max_model_len * self._max_chars_per_token
        if len(text) > limit:
            raise ApiError.invalid(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt contains {len(text)} characters (more than {limit} "
                f"characters, which is the upper bound for {self.max_model_len} input "
                "tokens). Please reduce the length of the input prompt.",
                "input_text",
                len(text),
            )

    def _generate(
        self, prepared: _Prepared, request: Request, body: CompletionRequest | ChatRequest
    ) -> Any:
        prompt: dict[str, Any] = {"prompt_token_ids": prepared.token_ids}
        if prepared.text is not None:
            prompt["prompt"] = prepared.text
        rank = request.headers.get("x-data-parallel-rank")
        try:
            data_parallel_rank = int(rank) if rank is not None else None
        except ValueError:
            raise ApiError(f"X-data-parallel-rank must be an integer, got {rank!r}") from None
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < self._ranks:
            # vLLM's frontend refuses it so, after the request's own checks.
            raise ApiError(
                f"data_parallel_rank {data_parallel_rank} is out of range [0, {self._ranks})."
            )
        return self.llm.generate(
            prompt,  # type: ignore[arg-type]  # a TokensPrompt with its text
            prepared.params,
            request_id=prepared.request_id,
            priority=body.priority,
            data_parallel_rank=data_parallel_rank,
            cache_salt=body.cache_salt,
        )

    def _engine_ids(self, prepared: _Prepared) -> list[str]:
        n = prepared.params.n
        if n == 1:
            return [prepared.request_id]
        return [child_request_id(i, prepared.request_id) for i in range(n)]

    async def _completions(self, request: Request) -> Response:
        await trio.lowlevel.checkpoint()
        body = parse_completion(request.body, self.settings.limits)
        self._check_model(body.model)
        prompts = body.prompts()
        base_id = f"cmpl-{self._request_id(request, body.request_id)}"
        add_special = body.add_special_tokens is not False
        prepared = [
            await self._prepare(
                prompt,
                body,
                body.max_tokens,
                f"{base_id}-{i}",
                add_special_tokens=add_special,
            )
            for i, prompt in enumerate(prompts)
        ]
        blocks = [self._generate(p, request, body) for p in prepared]
        release = self._slots.take()
        created = int(time.time())
        if body.stream:
            chunks = self._completion_events(body, base_id, created, prepared, blocks)
            return Response(200, [_SSE], _Body(chunks, release))
        try:
            finals = await self._run_all(prepared, blocks)
        finally:
            release()
        n = prepared[0].params.n
        choices: list[tuple[int, CompletionOutput, list[int] | None, dict[str, Any] | None]] = []
        prompt_tokens = 0
        for p_index, (one, last) in enumerate(zip(prepared, finals, strict=True)):
            prompt_tokens += len(one.token_ids)
            for output in sorted(last.outputs, key=lambda o: o.index):
                logprobs = None
                if body.logprobs is not None:
                    token_ids, positions = self._echo_positions(
                        body, one, output, last.prompt_logprobs
                    )
                    logprobs, _ = completion_logprobs(
                        token_ids, positions, body.logprobs, 0, self._decode_one
                    )
                if body.echo:
                    output = _echoed(output, one, body.max_tokens == 0)
                returned = one.token_ids if body.return_token_ids else None
                choices.append((output.index + p_index * n, output, returned, logprobs))
        return Response(
            200,
            [_JSON],
            completion_response(
                base_id,
                created,
                self.model_name,
                choices,
                prompt_tokens,
                system_fingerprint=self.system_fingerprint,
            ),
        )

    async def _run_all(self, prepared: list[_Prepared], blocks: list[Any]) -> list[RequestOutput]:
        """Each prompt's final output: every prompt's requests sent first (the engine
        batches them), then read one prompt after another."""
        all_engine_ids = [self._engine_ids(one) for one in prepared]
        lasts: list[RequestOutput | None] = [None] * len(prepared)
        for one, engine_ids in zip(prepared, all_engine_ids, strict=True):
            self.metrics.add_request(
                engine_ids, prompt_tokens=len(one.token_ids), max_tokens=one.params.max_tokens
            )
        try:
            async with AsyncExitStack() as stack:
                streams = [await stack.enter_async_context(block) for block in blocks]
                for i, outputs in enumerate(streams):
                    async for output in outputs:
                        lasts[i] = output
        finally:
            for engine_ids, last in zip(all_engine_ids, lasts, strict=True):
                self._finish_metrics(engine_ids, last)
        finals: list[RequestOutput] = []
        for last in lasts:
            assert last is not None, "a finished request always has a final output"
            _raise_if_error(last)
            finals.append(last)
        return finals

    async def _run_one(self, prepared: _Prepared, block: Any) -> RequestOutput:
        (final,) = await self._run_all([prepared], [block])
        return final

    def _finish_metrics(self, engine_ids: list[str], last: RequestOutput | None) -> None:
        finished: dict[int, tuple[str, int]] = {}
        if last is not None:
            for output in last.outputs:
                if output.finish_reason is not None:
                    finished[output.index] = (output.finish_reason, len(output.token_ids))
        self._finish_streamed(engine_ids, finished)

    async def _completion_events(
        self,
        body: CompletionRequest,
        request_id: str,
        created: int,
        prepared: list[_Prepared],
        blocks: list[AbstractAsyncContextManager[GenerationStream]],
    ) -> AsyncGenerator[bytes]:
        frames = CompletionFrames(request_id, created, self.model_name, self.system_fingerprint)
        n = prepared[0].params.n
        plain = not body.echo and body.logprobs is None and not body.return_token_ids
        continuous = body.continuous_usage
        prompt_tokens = 0
        completion_tokens = 0
        all_engine_ids = [self._engine_ids(one) for one in prepared]
        all_finished: list[dict[int, tuple[str, int]]] = [{} for _ in prepared]
        for one, engine_ids in zip(prepared, all_engine_ids, strict=True):
            self.metrics.add_request(
                engine_ids, prompt_tokens=len(one.token_ids), max_tokens=one.params.max_tokens
            )
        try:
            async with AsyncExitStack() as stack:
                # Every prompt's requests are sent first (the engine batches them), then
                # read one prompt after another (the others' outputs wait, merged).
                streams = [await stack.enter_async_context(block) for block in blocks]
                for p_index, (one, outputs) in enumerate(zip(prepared, streams, strict=True)):
                    engine_ids = all_engine_ids[p_index]
                    finished = all_finished[p_index]
                    prompt_tokens += len(one.token_ids)
                    generated = [0] * n
                    echoed = [False] * n
                    offsets = [0] * n
                    async for output in outputs:
                        for completion in output.outputs:
                            i = completion.index
                            reason = completion.finish_reason
                            if reason == "error":
                                raise _GenerationError
                            text = completion.text
                            token_ids: list[int] = completion.token_ids
                            positions: list[Any] | None = None  # logprobs: made when asked
                            prompt_ids = None
                            if body.echo and not echoed[i]:
                                echoed[i] = True
                                text = (one.text or "") + ("" if body.max_tokens == 0 else text)
                                token_ids, positions = self._echo_positions(
                                    body, one, completion, output.prompt_logprobs
                                )
                                prompt_ids = one.token_ids
                            elif not text and not token_ids and not generated[i] and reason is None:
                                continue
                            if body.return_token_ids and not echoed[i]:
                                echoed[i] = True
                                prompt_ids = one.token_ids
                            new = len(completion.token_ids)
                            generated[i] += new
                            completion_tokens += new
                            choice = i + p_index * n
                            if reason is not None:
                                # Counted now: outputs the engine sends after a
                                # stop string are not this request's.
                                finished[i] = (reason, generated[i])
                                if reason != "abort":
                                    self.metrics.finish_request(
                                        engine_ids[i], reason, generated=generated[i]
                                    )
                            if plain and not continuous and reason is None:
                                yield frames.delta(choice, text)
                                continue
                            usage_so_far = None
                            if continuous:
                                usage_so_far = {
                                    "prompt_tokens": len(one.token_ids),
                                    "total_tokens": len(one.token_ids) + generated[i],
                                    "completion_tokens": generated[i],
                                }
                            logprobs = None
                            if body.logprobs is not None:
                                if positions is None:
                                    positions = list(completion.logprobs or [])
                                logprobs, offsets[i] = completion_logprobs(
                                    token_ids,
                                    positions,
                                    body.logprobs,
                                    offsets[i],
                                    self._decode_one,
                                )
                            yield frames.chunk(
                                choice,
                                text,
                                reason,
                                completion.stop_reason,
                                usage_so_far=usage_so_far,
                                token_ids=token_ids if body.return_token_ids else None,
                                prompt_token_ids=prompt_ids,
                                logprobs=logprobs,
                                fingerprinted=reason is not None and not body.include_usage,
                            )
            if body.include_usage:
                yield frames.usage(prompt_tokens, completion_tokens)
        except (_GenerationError, EngineDeadError, RequestFailedError) as error:
            yield _failure_event(error)
        finally:
            for engine_ids, finished in zip(all_engine_ids, all_finished, strict=True):
                self._finish_streamed(engine_ids, finished)
        yield DONE

    def _finish_streamed(self, engine_ids: list[str], finished: dict[int, tuple[str, int]]) -> None:
        """The metrics of a request's engine requests at its end: each finished one
        counted (with the tokens its output has), the others (aborted: the client
        left, or a failure) forgotten, as vLLM does. Finishing twice is harmless."""
        for index, engine_id in enumerate(engine_ids):
            done = finished.get(index)
            if done is None or done[0] == "abort":
                self.metrics.forget_request(engine_id)
            else:
                self.metrics.finish_request(engine_id, done[0], generated=done[1])

    async def _chat(self, request: Request) -> Response:
        await trio.lowlevel.checkpoint()
        body = parse_chat(request.body, self.settings.limits)
        self._check_model(body.model)
        template = self._template(body.chat_template, tools=bool(body.tools))
        messages: list[Any] = body.messages
        prompt = await self._render(
            template,
            request,
            messages=messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=template_tools(body.tools) if body.tools else None,
            documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        request_id = f"chatcmpl-{self._request_id(request, body.request_id)}"
        prepared = await self._prepare(
            prompt,
            body,
            body.requested_max_tokens,
            request_id,
            add_special_tokens=bool(body.add_special_tokens),
        )
        role = self.settings.response_role
        last_role = _last_field(messages, "role")
        if not body.add_generation_prompt and isinstance(last_role, str):
            role = last_role
        echo_text = ""
        if body.echo and last_role == role:
            content = _last_field(messages, "content")
            echo_text = content if isinstance(content, str) else ""
        block = self._generate(prepared, request, body)
        release = self._slots.take()
        created = int(time.time())
        if body.stream:
            chunks = self._chat_events(body, prepared, block, created, role, echo_text)
            return Response(200, [_SSE], _Body(chunks, release))
        try:
            final = await self._run_one(prepared, block)
        finally:
            release()
        choices: list[tuple[int, CompletionOutput, dict[str, Any] | None]] = []
        for output in sorted(final.outputs, key=lambda o: o.index):
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(
                    output.token_ids,
                    list(output.logprobs or []),
                    body.top_logprobs,
                    self._decode_one,
                )
            if echo_text:
                output = CompletionOutput(
                    output.index,
                    echo_text + output.text,
                    output.token_ids,
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                )
            choices.append((output.index, output, logprobs))
        return Response(
            200,
            [_JSON],
            chat_response(
                request_id,
                created,
                self.model_name,
                choices,
                len(prepared.token_ids),
                role=role,
                system_fingerprint=self.system_fingerprint,
                token_ids=bool(body.return_token_ids),
                prompt_token_ids=prepared.token_ids if body.return_token_ids else None,
            ),
        )

    async def _chat_events(
        self,
        body: ChatRequest,
        prepared: _Prepared,
        block: AbstractAsyncContextManager[GenerationStream],
        created: int,
        role: str,
        echo_text: str,
    ) -> AsyncGenerator[bytes]:
        frames = ChatFrames(prepared.request_id, created, self.model_name, self.system_fingerprint)
        n = prepared.params.n
        prompt_tokens = len(prepared.token_ids)
        continuous = body.continuous_usage
        plain = not body.logprobs and not body.return_token_ids and not continuous
        generated = [0] * n
        sent_finish = [False] * n
        finished: dict[int, tuple[str, int]] = {}
        engine_ids = self._engine_ids(prepared)
        self.metrics.add_request(
            engine_ids, prompt_tokens=prompt_tokens, max_tokens=prepared.params.max_tokens
        )
        first = True
        try:
            try:
                async with block as outputs:
                    async for output in outputs:
                        if first:
                            first = False
                            for i in range(n):
                                yield frames.role(
                                    i,
                                    role,
                                    usage_so_far=_usage(prompt_tokens, 0) if continuous else None,
                                    prompt_token_ids=(
                                        prepared.token_ids if body.return_token_ids else None
                                    ),
                                )
                            if echo_text:
                                for i in range(n):
                                    yield frames.chunk(
                                        i,
                                        echo_text,
                                        None,
                                        None,
                                        usage_so_far=(
                                            _usage(prompt_tokens, 0) if continuous else None
                                        ),
                                    )
                        for completion in output.outputs:
                            i = completion.index
                            if sent_finish[i]:
                                continue
                            reason = completion.finish_reason
                            if reason == "error":
                                raise _GenerationError
                            text = completion.text
                            if (
                                not text
                                and not completion.token_ids
                                and not generated[i]
                                and reason is None
                            ):
                                continue
                            empty = not text and not completion.token_ids and not generated[i]
                            generated[i] += len(completion.token_ids)
                            if reason is None and plain:
                                yield frames.delta(i, text)
                                continue
                            if reason is not None:
                                sent_finish[i] = True
                                finished[i] = (reason, generated[i])
                                if reason != "abort":
                                    self.metrics.finish_request(
                                        engine_ids[i], reason, generated=generated[i]
                                    )
                            logprobs = None
                            if body.logprobs:
                                logprobs = chat_logprobs(
                                    completion.token_ids,
                                    list(completion.logprobs or []),
                                    body.top_logprobs,
                                    self._decode_one,
                                )
                            yield frames.chunk(
                                i,
                                None if empty else text,
                                reason,
                                completion.stop_reason,
                                usage_so_far=(
                                    _usage(prompt_tokens, generated[i]) if continuous else None
                                ),
                                token_ids=completion.token_ids if body.return_token_ids else None,
                                logprobs=logprobs,
                                fingerprinted=reason is not None and not body.include_usage,
                            )
            finally:
                self._finish_streamed(engine_ids, finished)
            if body.include_usage:
                yield frames.usage(prompt_tokens, sum(generated))
        except (_GenerationError, EngineDeadError, RequestFailedError) as error:
            yield _failure_event(error)
        yield DONE


class _GenerationError(Exception):
    """An engine request finished with ``finish_reason="error"``."""


def _raise_if_error(output: RequestOutput) -> None:
    if any(o.finish_reason == "error" for o in output.outputs):
        raise ApiError("Internal server error", status=500, error_type="InternalServerError")


def _echoed(output: CompletionOutput, prepared: _Prepared, prompt_only: bool) -> CompletionOutput:
    text = (prepared.text or "") + ("" if prompt_only else output.text)
    return CompletionOutput(
        output.index,
        text,
        output.token_ids,
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
    )


def system_fingerprint(engines: Sequence[Any], settings: ServerSettings) -> str:
    """``system_fingerprint`` as vLLM's default (``--fingerprint-mode full``) writes it:
    ``vllm-<version>[-tp<N>][-pp<N>][-dp<N>][-ep]-<hash8>``, from the first engine's
    ready message (its release, its parallelism, the first 8 characters of its
    ``config_hash``, which vLLM 0.34 engines send; else a hash of what is served)."""
    if not engines:
        digest = hashlib.sha256(repr(settings.served_model_names).encode()).hexdigest()
        return f"trio-enginecore-{digest[:8]}"
    first = engines[0]
    parts = [f"vllm-{first.vllm_version}"]
    for name, size in (
        ("tp", first.tensor_parallel_size),
        ("pp", first.pipeline_parallel_size),
        ("dp", first.data_parallel_size),
    ):
        if size > 1:
            parts.append(f"{name}{size}")
    if first.enable_expert_parallel:
        parts.append("ep")
    config_hash = first.config_hash
    if not config_hash:
        seen = (settings.model_root, first.max_model_len, first.dtype, first.vllm_version)
        config_hash = hashlib.sha256(repr(seen).encode()).hexdigest()
    parts.append(config_hash[:8])
    return "-".join(parts)


def _last_field(messages: list[Any], key: str) -> object:
    """A field of the last message, if it is an object that has it."""
    if not messages or not isinstance(messages[-1], dict):
        return None
    last = cast("dict[str, object]", messages[-1])
    return last.get(key)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _failure_event(error: Exception) -> bytes:
    """The error event a stream ends with (before ``data: [DONE]``) when its request
    failed after the response began, as vLLM sends it."""
    if isinstance(error, EngineDeadError):
        failure = _engine_dead(error)
    elif isinstance(error, RequestFailedError):
        failure = _request_failed(error)
    else:  # a choice finished with finish_reason "error"
        failure = ApiError("Internal server error", status=500, error_type="InternalServerError")
    return error_event(failure.message, failure.status, failure.error_type)


def _request_failed(error: RequestFailedError) -> ApiError:
    """An engine's refusal of a request: a 400 with the engine's words when the request
    was at fault (vLLM's frontend refuses those before they reach an engine), else 500."""
    if error.code == "invalid_request":
        return ApiError(error.engine_message or str(error))
    return ApiError(str(error), status=500, error_type="InternalServerError")


def _engine_dead(error: EngineDeadError) -> ApiError:
    return ApiError(
        f"the engine serving this request died: {error}",
        status=503,
        error_type="ServiceUnavailableError",
    )


_LONG_TEXT: Final = 32 * 1024
"""Texts (and request bodies) of this many characters or more are encoded (rendered)
in a worker thread: about 50 ms of the built-in tokenizer's time, much less for the
usual BPE vocabularies; a thread's round trip costs about 0.1 ms."""

_NOT_JSON: Final = ApiError(
    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
)
"""What a POST whose body is not declared JSON gets, in vLLM's words. vLLM refuses
them too (``validate_json_request``); a browser may send a cross-site form or
``text/plain`` POST without asking first, never an ``application/json`` one, so this
also keeps web pages a user visits from driving the server."""


def _is_json(request: Request) -> bool:
    # As vLLM reads it: the media type before any parameter, nothing stripped.
    content_type = request.headers.get("content-type", "").lower()
    return content_type.split(";", 1)[0] == "application/json"


def _json(status: int, payload: object, headers: Sequence[tuple[str, str]] = ()) -> Response:
    return Response(status, [_JSON, *headers], encode_json(payload))


def _error(error: ApiError, headers: Sequence[tuple[str, str]] = ()) -> Response:
    return Response(error.status, [_JSON, *headers], error.body())

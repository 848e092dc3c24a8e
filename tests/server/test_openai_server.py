"""The OpenAI-compatible server as users run it: ``python -m trio_enginecore api-server``.

Real processes on loopback ports (``openai_server.Fleet`` starts every server the
selected tests need at once), the built-in reference engine as each server's child
process, and clients nobody here wrote: the official ``openai`` package (its sync
client from a worker thread, its asyncio client under ``asyncio.run`` in one), curl,
httpx, and h11 on a bare socket where a test needs every byte or to leave mid-stream.
What is checked:

* completions and chat completions, whole and streamed, say the same thing: the
  greedy (``temperature=0``) text is one text however it is asked for; ``n``, ``stop``,
  ``max_tokens``, ``max_completion_tokens``, ``echo`` and ``include_usage`` do what
  vLLM does; streams are Server-Sent Events ending with ``data: [DONE]``;
* ``/v1/models``, ``/health``, ``/tokenize``, ``/detokenize``, and ``/metrics`` with
  vLLM's metric names, whose counters move by exactly what a request did;
* bad requests (and fuzzed ones) get OpenAI-style errors naming the field vLLM names,
  and never hurt the server; ``--api-key`` guards the ``/v1`` routes;
* a client that leaves has its engine request aborted: the engine stops working (its
  CPU time stops growing; the reference engine sends no scheduler statistics, so
  ``vllm:num_requests_running`` cannot say it), also in a storm of streams;
  ``--max-concurrent-requests`` answers 503 at once and frees its slots;
* SIGTERM/SIGINT drain and exit 0 with no engine left; a second signal stops at once,
  also one that comes while the engines stop; an engine killed under
  ``--data-parallel-size 2`` fails the streams it held and the other serves on.

One default server (no options) serves most tests; tests that need options, or that
stop or break a server, have their own.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import h11
import httpx
import openai
import pytest
import trio
from hypothesis import HealthCheck, given, settings, strategies as st
from openai import Omit, omit
from openai.types.chat import ChatCompletionMessageParam

import trio_enginecore.text

from .openai_server import (
    MODEL,
    ApiServer,
    Fleet,
    SseStream,
    alive,
    assert_openai_error,
    children,
    cpu_ticks,
    post_json,
    sample,
    samples,
    sse_chunks,
    sse_stream,
    start,
)

T = TypeVar("T")

PROMPT = "The cat"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
LONG = 100_000
"""A ``max_tokens`` no test waits for: on a server with ``--max-model-len 1000000``
such a stream runs for a minute unless it is aborted."""
BIG_MODEL = ("--max-model-len", "1000000")


# ------------------------------------------------------------------ servers

SERVERS: dict[str, tuple[str, ...]] = {
    "default_server": (),
    "long_server": BIG_MODEL,
    "small_server": (
        "--max-model-len",
        "64",
        "--trust-request-chat-template",
        "--max-logprobs",
        "3",
    ),
    "key_server": ("--api-key", "sekret"),
    "limited_server": (*BIG_MODEL, "--max-concurrent-requests", "2"),
    "draining_server": (*BIG_MODEL, "--shutdown-timeout-s", "2"),
    "patient_server": (*BIG_MODEL, "--shutdown-timeout-s", "60"),
    "two_engine_server": (
        *BIG_MODEL,
        "--data-parallel-size",
        "2",
        "--on-engine-failure",
        "route_around",
    ),
}
"""The servers the tests use, by fixture name: their options."""
SHARED = frozenset({"default_server", "long_server", "small_server"})
"""The servers the module's tests share; each of the others serves one test."""


@pytest.fixture(scope="module")
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    """Every server the selected tests of this module use, started together."""
    needed: Counter[str] = Counter()
    for item in request.session.items:
        if isinstance(item, pytest.Function) and item.module is request.module:
            needed.update(name for name in item.fixturenames if name in SERVERS)
    fleet = Fleet(tmp_path_factory.mktemp("servers"))
    try:
        for name, count in needed.items():
            for _ in range(1 if name in SHARED else count):
                fleet.start(name, *SERVERS[name])
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def default_server(fleet: Fleet) -> Iterator[ApiServer]:
    """``api-server`` with no options: the reference engine's ngram model. It stops
    with exit code 0 and logs no traceback, whatever the tests sent it."""
    server = fleet.take("default_server")
    try:
        yield server
    finally:
        code = server.stop()
    assert code == 0, server.tail()
    assert "Traceback" not in server.log(), server.tail(80)


def _server_fixture(name: str, doc: str) -> Any:
    """The fixture giving the server ``name`` of :data:`SERVERS`: shared by the module's
    tests (:data:`SHARED`) or one test's, stopped after its last user."""

    @pytest.fixture(name=name, scope="module" if name in SHARED else "function")
    def server(fleet: Fleet) -> Iterator[ApiServer]:
        taken = fleet.take(name)
        try:
            yield taken
        finally:
            taken.stop()

    server.__doc__ = doc
    return server


long_server = _server_fixture(
    "long_server", "Streams can run for a minute (``--max-model-len 1000000``)."
)
small_server = _server_fixture(
    "small_server",
    "``--max-model-len 64``; requests may bring their own chat template; at most 3 logprobs.",
)
key_server = _server_fixture("key_server", "``--api-key sekret``.")
limited_server = _server_fixture("limited_server", "Two requests at a time, then 503.")
draining_server = _server_fixture(
    "draining_server", "Requests in flight at a signal have 2 s to finish."
)
patient_server = _server_fixture(
    "patient_server", "Requests in flight at a signal have a minute to finish."
)
two_engine_server = _server_fixture(
    "two_engine_server", "Two engines; a dead one is routed around."
)


# ------------------------------------------------------------------ clients


def openai_client(server: ApiServer, api_key: str = "EMPTY") -> openai.OpenAI:
    """The official client; no retries (a 503 must be seen, not retried)."""
    return openai.OpenAI(base_url=server.api, api_key=api_key, max_retries=0, timeout=60)


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking client call in a worker thread."""
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs))


async def under_asyncio(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run an asyncio client in a worker thread, under ``asyncio.run``."""
    return await trio.to_thread.run_sync(asyncio.run, fn())


@asynccontextmanager
async def http(server: ApiServer, **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60, **kwargs) as client:
        yield client


async def completion(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    """A non-streamed completion that must succeed."""
    response = await client.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def greedy_text(client: httpx.AsyncClient, max_tokens: int, prompt: str = PROMPT) -> str:
    answer = await completion(
        client, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == max_tokens
    text: str = choice["text"]
    return text


async def metrics(client: httpx.AsyncClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return samples(response.text)


async def token_count(client: httpx.AsyncClient, **body: Any) -> int:
    response = await client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    count: int = response.json()["count"]
    return count


async def wait_engine_busy(pid: int, ticks: int = 3, timeout_s: float = 20.0) -> None:
    """Wait until engine ``pid`` has used ``ticks`` more clock ticks of CPU time."""
    start = cpu_ticks(pid)
    with trio.move_on_after(timeout_s) as waited:
        while cpu_ticks(pid) - start < ticks:
            await trio.sleep(0.02)
    assert not waited.cancelled_caught, f"engine {pid} did no work for {timeout_s} s"


async def wait_engine_idle(pid: int, window_s: float = 0.5, timeout_s: float = 10.0) -> None:
    """Wait until engine ``pid`` uses at most one clock tick of CPU time in ``window_s``:
    it generates for no request (a generating engine uses all the CPU it gets)."""
    with trio.move_on_after(timeout_s) as waited:
        while True:
            before = cpu_ticks(pid)
            await trio.sleep(window_s)
            if cpu_ticks(pid) - before <= 1:
                break
    assert not waited.cancelled_caught, f"engine {pid} still works after {timeout_s} s"


def long_stream(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": True,
        **fields,
    }


# ------------------------------------------------------------------ completions


async def test_a_greedy_completion_is_one_text_streamed_or_not_from_sync_and_async_clients(
    default_server: ApiServer,
) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "seed": 7,
        "extra_body": {"ignore_eos": True},
    }

    def sync_client() -> tuple[list[Any], list[Any]]:
        with openai_client(default_server) as client:
            wholes = [client.completions.create(**request) for _ in range(2)]
            with client.completions.create(**request, stream=True) as stream:
                chunks = list(stream)
        return wholes, chunks

    async def async_client() -> tuple[Any, list[Any]]:
        async with openai.AsyncOpenAI(
            base_url=default_server.api, api_key="EMPTY", max_retries=0
        ) as client:
            whole = await client.completions.create(**request)
            stream = await client.completions.create(**request, stream=True)
            async with stream:
                chunks = [chunk async for chunk in stream]
        return whole, chunks

    (first, second), sync_chunks = await in_thread(sync_client)
    async_whole, async_chunks = await under_asyncio(async_client)

    text = first.choices[0].text
    assert len(text) > 0
    for whole in (first, second, async_whole):
        assert whole.object == "text_completion"
        assert whole.model == MODEL
        assert whole.id.startswith("cmpl-")
        assert [(c.index, c.text, c.finish_reason) for c in whole.choices] == [(0, text, "length")]
        assert whole.usage is not None
        assert whole.usage.completion_tokens == 12
    for chunks in (sync_chunks, async_chunks):
        assert len({chunk.id for chunk in chunks}) == 1
        assert "".join(c.choices[0].text for c in chunks) == text
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        assert all(c.usage is None for c in chunks)


async def test_n_2_gives_two_choices_with_indexes_0_and_1(default_server: ApiServer) -> None:
    async with http(default_server) as client:
        text = await greedy_text(client, 6)
        whole = await completion(
            client, prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True, n=2
        )
        assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
            (0, text, "length"),
            (1, text, "length"),
        ]
        assert whole["usage"]["completion_tokens"] == 12
        response = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "n": 2,
                "stream": True,
            },
        )
    chunks = sse_chunks(response.content)
    assert all(len(c["choices"]) == 1 for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(ch["text"] for ch in mine) == text
        assert [ch["finish_reason"] for ch in mine][-1] == "length"
        assert all(ch["finish_reason"] is None for ch in mine[:-1])
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}


async def test_a_stop_string_ends_the_text_before_it_with_finish_reason_stop(
    default_server: ApiServer,
) -> None:
    async with http(default_server) as client:
        reference = await greedy_text(client, 20)
    # A stop string the greedy text meets after some text of its own.
    stop = next(
        reference[k : k + 3] for k in range(1, 17) if reference.index(reference[k : k + 3]) > 0
    )
    expected = reference[: reference.index(stop)]
    request: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 20,
        "temperature": 0,
        "stop": [stop],
        "extra_body": {"ignore_eos": True},
    }

    def ask() -> tuple[Any, list[Any]]:
        with openai_client(default_server) as client:
            whole = client.completions.create(**request)
            with client.completions.create(**request, stream=True) as stream:
                return whole, list(stream)

    whole, chunks = await in_thread(ask)
    choice = whole.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop
    assert "".join(c.choices[0].text for c in chunks) == expected
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop"
    assert last.model_extra["stop_reason"] == stop


async def test_max_tokens_ends_a_completion_with_finish_reason_length_after_that_many_tokens(
    default_server: ApiServer,
) -> None:
    async with http(default_server) as client:
        answer = await completion(client, prompt=PROMPT, max_tokens=7, ignore_eos=True, seed=3)
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["stop_reason"] is None
        prompt_tokens = await token_count(client, prompt=PROMPT)
        assert answer["usage"] == {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + 7,
            "completion_tokens": 7,
            "completion_tokens_details": None,
        }
        # The text is those 7 tokens (the ngram model writes whole characters).
        assert await token_count(client, prompt=choice["text"], add_special_tokens=False) == 7


async def test_include_usage_adds_a_last_chunk_with_no_choices_and_the_usage(
    default_server: ApiServer,
) -> None:
    def ask() -> list[Any]:
        with (
            openai_client(default_server) as client,
            client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ) as stream,
        ):
            return list(stream)

    chunks = await in_thread(ask)
    async with http(default_server) as client:
        prompt_tokens = await token_count(client, prompt=PROMPT)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        prompt_tokens,
        5,
        prompt_tokens + 5,
    )
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


async def test_a_stream_is_server_sent_events_that_end_with_data_done(
    default_server: ApiServer,
) -> None:
    async with http(default_server) as client:
        text = await greedy_text(client, 8)
        response = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["transfer-encoding"] == "chunked"
    assert response.content.endswith(b"\n\ndata: [DONE]\n\n")
    assert response.content.count(b"[DONE]") == 1
    chunks = sse_chunks(response.content)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


async def test_curl_reads_the_same_stream(default_server: ApiServer) -> None:
    async with http(default_server) as client:
        text = await greedy_text(client, 8)
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    done = await trio.run_process(
        [
            "curl",
            "-sS",
            "-N",
            "--fail-with-body",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
            f"{default_server.url}/v1/completions",
        ],
        capture_stdout=True,
    )
    assert done.stdout.endswith(b"data: [DONE]\n\n")
    chunks = sse_chunks(done.stdout)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


async def test_echo_puts_the_prompt_before_the_completion(default_server: ApiServer) -> None:
    async with http(default_server) as client:
        text = await greedy_text(client, 5)
        echoed = await completion(
            client, prompt=PROMPT, max_tokens=5, temperature=0, ignore_eos=True, echo=True
        )
        assert echoed["choices"][0]["text"] == PROMPT + text
        assert echoed["usage"]["completion_tokens"] == 5
        prompt_only = await completion(client, prompt=PROMPT, max_tokens=0, echo=True)
        assert prompt_only["choices"][0]["text"] == PROMPT
        response = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
                "echo": True,
                "stream": True,
            },
        )
    chunks = sse_chunks(response.content)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + text


# ------------------------------------------------------------------ chat completions


async def test_a_streamed_chat_starts_each_choice_with_the_assistant_role_and_says_the_same(
    default_server: ApiServer,
) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": CHAT,
        "max_completion_tokens": 10,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }

    def ask() -> tuple[Any, list[Any]]:
        with openai_client(default_server) as client:
            whole = client.chat.completions.create(**request)
            with client.chat.completions.create(**request, stream=True) as stream:
                return whole, list(stream)

    whole, chunks = await in_thread(ask)
    async with http(default_server) as client:
        prompt_tokens = await token_count(client, messages=CHAT)
    assert whole.object == "chat.completion"
    assert whole.id.startswith("chatcmpl-")
    [choice] = whole.choices
    assert (choice.index, choice.message.role, choice.finish_reason) == (0, "assistant", "length")
    content = choice.message.content
    assert content
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 10)

    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first = chunks[0].choices[0]
    assert (first.index, first.delta.role, first.delta.content) == (0, "assistant", "")
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_a_chat_with_n_2_and_include_usage(default_server: ApiServer) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": CHAT,
        "max_completion_tokens": 4,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }

    def ask() -> tuple[Any, list[Any]]:
        with openai_client(default_server) as client:
            whole = client.chat.completions.create(**request)
            with client.chat.completions.create(
                **request, n=2, stream=True, stream_options={"include_usage": True}
            ) as stream:
                return whole, list(stream)

    whole, chunks = await in_thread(ask)
    content = whole.choices[0].message.content
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + 8
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert (mine[0].delta.role, mine[0].delta.content) == ("assistant", "")
        assert "".join(ch.delta.content or "" for ch in mine) == content
        assert mine[-1].finish_reason == "length"
    assert all(len(c.choices) == 1 and c.usage is None for c in chunks[:-1])


async def test_max_completion_tokens_bounds_a_chat_before_max_tokens(
    default_server: ApiServer,
) -> None:
    def ask(max_completion_tokens: int | Omit = omit, max_tokens: int | Omit = omit) -> int:
        with openai_client(default_server) as client:
            answer = client.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_completion_tokens=max_completion_tokens,
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True},
            )
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage is not None
        return answer.usage.completion_tokens

    assert await in_thread(ask, max_completion_tokens=3, max_tokens=9) == 3
    assert await in_thread(ask, max_tokens=6) == 6
    assert await in_thread(ask, max_completion_tokens=5) == 5


@pytest.mark.parametrize(
    ("template", "said"),
    [
        ("{{ raise_exception('no chats today') }}", "no chats today"),
        ("{% for message in messages %}{{ message['content'] }}", None),  # unclosed
        ("{{ (messages | length) / 0 }}", None),  # fails as it renders
        ("{{ messages[0]['content'].nope() }}", None),
    ],
    ids=["raises", "syntax_error", "division_by_zero", "calls_undefined"],
)
async def test_a_chat_whose_template_fails_is_a_400(
    small_server: ApiServer, template: str, said: str | None
) -> None:
    def ask() -> openai.BadRequestError:
        with openai_client(small_server) as client, pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_completion_tokens=2,
                extra_body={"chat_template": template},
            )
        return raised.value

    error = await in_thread(ask)
    assert error.status_code == 400
    assert_openai_error({"error": error.body}, 400)
    if said is not None:
        assert said in error.message
    async with http(small_server) as client:
        await completion(client, prompt="Hi", max_tokens=2)


# ------------------------------------------------------------------ the other routes


async def test_models_lists_the_served_model(default_server: ApiServer) -> None:
    def ask() -> list[Any]:
        with openai_client(default_server) as client:
            return list(client.models.list())

    [model] = await in_thread(ask)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "vllm")
    assert model.model_extra["root"] == MODEL
    assert model.model_extra["max_model_len"] == 4096


async def test_health_answers_200(default_server: ApiServer) -> None:
    async with http(default_server) as client:
        response = await client.get("/health")
        assert (response.status_code, response.content) == (200, b"")
        assert (await client.head("/health")).status_code == 200


async def test_tokenize_and_detokenize_round_trip(default_server: ApiServer) -> None:
    text = "Naïve café ☕, said the cat."
    async with http(default_server) as client:
        tokenized = await client.post("/tokenize", json={"model": MODEL, "prompt": text})
        assert tokenized.status_code == 200
        body = tokenized.json()
        assert body["count"] == len(body["tokens"]) > 0
        assert body["max_model_len"] == 4096
        assert all(isinstance(t, int) for t in body["tokens"])
        detokenized = await client.post(
            "/detokenize", json={"model": MODEL, "tokens": body["tokens"]}
        )
        assert detokenized.status_code == 200
        assert detokenized.json() == {"prompt": text}
        beyond = await client.post("/detokenize", json={"tokens": [1, 257]})
        assert_openai_error(beyond.json(), 400, param="tokens")


async def test_long_prompts_and_chats_tokenize_as_short_ones(long_server: ApiServer) -> None:
    # Past 32 KiB, texts are encoded (and chats rendered) in a worker thread, the GIL
    # released, so that the other streams go on meanwhile: same ids as in the task.
    from trio_enginecore.text import builtin_tokenizer

    tokenizer = builtin_tokenizer()
    text = "Naïve café ☕, said the cat. " * 2000
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    async with http(long_server) as client:
        tokenized = await client.post("/tokenize", json={"model": MODEL, "prompt": text})
        assert tokenized.json()["tokens"] == tokenizer.encode(text)
        chat = await client.post("/tokenize", json={"model": MODEL, "messages": messages})
        short_chat = await client.post(
            "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.json()["count"] > len(tokenizer.encode(text)) > 32 * 1024
        assert short_chat.json()["count"] > 0
        answer = await completion(client, prompt=text, max_tokens=2, ignore_eos=True)
        assert answer["usage"]["prompt_tokens"] == len(tokenizer.encode(text))
        answer = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}
        )
        assert answer.json()["usage"]["prompt_tokens"] == chat.json()["count"]


VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
}


async def test_metrics_have_vllms_names_types_and_labels(default_server: ApiServer) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async with http(default_server) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert {name: families[name].type for name in VLLM_FAMILIES if name in families} == (
        VLLM_FAMILIES
    )
    reasons = {
        s.labels["finished_reason"]
        for s in families["vllm:request_success"].samples
        if s.name == "vllm:request_success_total"
    }
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    for name in VLLM_FAMILIES:
        for s in families[name].samples:
            assert (s.labels["model_name"], s.labels["engine"]) == (MODEL, "0"), s


async def test_metrics_count_exactly_what_a_request_generated(default_server: ApiServer) -> None:
    async with http(default_server) as client:
        prompt_tokens = await token_count(client, prompt=PROMPT)
        before = await metrics(client)
        await completion(client, prompt=PROMPT, max_tokens=9, ignore_eos=True)
        after = await metrics(client)

        def moved(name: str, **labels: str) -> float:
            return sample(after, name, **labels) - sample(before, name, **labels)

        assert moved("vllm:generation_tokens_total") == 9
        assert moved("vllm:prompt_tokens_total") == prompt_tokens
        assert moved("vllm:request_success_total", finished_reason="length") == 1
        for reason in ("stop", "abort", "error"):
            assert moved("vllm:request_success_total", finished_reason=reason) == 0
        assert moved("vllm:time_to_first_token_seconds_count") == 1
        assert moved("vllm:e2e_request_latency_seconds_count") == 1
        assert moved("vllm:inter_token_latency_seconds_count") == 8  # between 9 tokens
        assert moved("vllm:request_generation_tokens_sum") == 9
        assert moved("vllm:request_prompt_tokens_sum") == prompt_tokens
        assert moved("vllm:request_params_max_tokens_sum") == 9
        # The engine's own timings and its scheduler's statistics (on, as in vllm serve).
        for name in (
            "vllm:request_queue_time_seconds_count",
            "vllm:request_prefill_time_seconds_count",
            "vllm:request_decode_time_seconds_count",
            "vllm:request_inference_time_seconds_count",
        ):
            assert moved(name) == 1, name

        # A streamed request that meets a stop string: its tokens count, as generated.
        reference = await greedy_text(client, 12)
        before = await metrics(client)
        response = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 12,
                "temperature": 0,
                "stop": reference[6:9],
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        after = await metrics(client)
    chunks = sse_chunks(response.content)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    generated = chunks[-1]["usage"]["completion_tokens"]
    assert 0 < generated < 12
    assert moved("vllm:generation_tokens_total") == generated
    assert moved("vllm:request_success_total", finished_reason="stop") == 1
    assert moved("vllm:request_success_total", finished_reason="length") == 0


# ------------------------------------------------------------------ bad requests


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


@dataclass(frozen=True)
class Bad:
    """A bad request and the error it gets."""

    name: str
    body: bytes
    status: int
    param: str | None
    path: str = "/v1/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"


def RANK(rank: str) -> dict[str, str]:  # noqa: N802 - reads as a header in the table
    return {"x-data-parallel-rank": rank}


JSON_HEADERS = {"content-type": "application/json"}

BAD_REQUESTS = [
    Bad("malformed_json", b'{"prompt": "x",', 400, None),
    Bad("json_array", b'[{"prompt": "x"}]', 400, None),
    Bad("json_string", b'"x"', 400, None),
    Bad("empty_body", b"", 400, None),
    Bad("non_utf8_bytes", b'{"prompt": "\xff\xfe"}', 400, None),
    Bad("temperature_not_a_number", _json(prompt="x", temperature="hot"), 400, "temperature"),
    Bad("temperature_out_of_range", _json(prompt="x", temperature=5), 400, "temperature"),
    Bad("top_p_out_of_range", _json(prompt="x", top_p=2), 400, "top_p"),
    Bad("n_0", _json(prompt="x", n=0), 400, None),  # vLLM 0.34 names no parameter
    Bad("max_tokens_negative", _json(prompt="x", max_tokens=-1), 400, "max_tokens"),
    Bad(
        "chat_max_tokens_negative",
        _json(messages=CHAT, max_tokens=-1),
        400,
        "max_tokens",
        path=CHATS,
    ),
    Bad(
        "stream_options_without_stream",
        _json(prompt="x", stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    Bad(
        "chat_stream_options_without_stream",
        _json(messages=CHAT, stream_options={"include_usage": True}),
        400,
        "stream_options",
        path=CHATS,
    ),
    Bad("unknown_model", _json(model="nope", prompt="x"), 404, "model"),
    Bad("chat_unknown_model", _json(model="nope", messages=CHAT), 404, "model", path=CHATS),
    Bad("missing_prompt", _json(max_tokens=3), 400, "prompt"),
    Bad("missing_messages", _json(max_tokens=3), 400, "messages", path=CHATS),
    Bad("token_id_out_of_vocabulary", _json(prompt=[72, 105, 257]), 400, "prompt"),
    Bad("negative_token_id", _json(prompt=[72, -1]), 400, "prompt"),
    # Ids the engine's sampler would index its logits with: one past the vocabulary
    # would fail the engine's step, for every request on it.
    Bad(
        "logit_bias_out_of_vocabulary", _json(prompt="x", logit_bias={"257": 1}), 400, "logit_bias"
    ),
    Bad("logit_bias_not_a_token_id", _json(prompt="x", logit_bias={"a": 1}), 400, "logit_bias"),
    Bad(
        "stop_token_id_out_of_vocabulary",
        _json(prompt="x", stop_token_ids=[999]),
        400,
        "stop_token_ids",
    ),
    Bad(
        "chat_allowed_token_ids_out_of_vocabulary",
        _json(messages=CHAT, allowed_token_ids=[1, 10**6]),
        400,
        "allowed_token_ids",
        path=CHATS,
    ),
    Bad(
        "allowed_token_ids_empty", _json(prompt="x", allowed_token_ids=[]), 400, "allowed_token_ids"
    ),
    Bad("bad_word_of_no_token", _json(prompt="x", bad_words=[" "]), 400, "bad_words"),
    Bad(
        "untrusted_chat_template",
        _json(messages=CHAT, chat_template="{{ messages }}"),
        400,
        "chat_template",
        path=CHATS,
    ),
    Bad("wrong_method", b"", 405, None, method="GET"),
    # One engine: rank 0 only (a stream is refused before it starts).
    Bad("rank_past_the_engines", _json(prompt="x"), 400, None, headers=RANK("1")),
    Bad("negative_rank", _json(prompt="x", stream=True), 400, None, headers=RANK("-1")),
    Bad("unknown_path", _json(prompt="x"), 404, None, path="/v1/nope"),
]


ROUTING_ERRORS = {"wrong_method": "Method Not Allowed", "unknown_path": "Not Found"}


@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=[bad.name for bad in BAD_REQUESTS])
async def test_a_bad_request_gets_an_openai_error_and_the_server_serves_on(
    default_server: ApiServer, bad: Bad
) -> None:
    async with http(default_server) as client:
        response = await client.request(
            bad.method,
            bad.path,
            content=bad.body,
            headers={"content-type": "application/json", **bad.headers},
        )
        assert response.status_code == bad.status, response.text
        assert response.headers["content-type"] == "application/json"
        if bad.name in ROUTING_ERRORS:
            # Routing errors are FastAPI's, as vLLM's server answers them.
            assert response.json() == {"detail": ROUTING_ERRORS[bad.name]}
        else:
            assert_openai_error(response.json(), bad.status, param=bad.param)
        if bad.status == 405:
            assert response.headers["allow"] == "POST"
        # On the same connection, and on a new one.
        await completion(client, prompt=PROMPT, max_tokens=2)
    async with http(default_server) as client:
        await completion(client, prompt=PROMPT, max_tokens=2)


@pytest.mark.parametrize("depth", [900, 5000])
@pytest.mark.parametrize("where", ["prompt", "content", "extra_field", "tool_arguments"])
async def test_a_body_nested_too_deep_for_python_is_a_400(
    default_server: ApiServer, where: str, depth: int
) -> None:
    # 5000 deep: past what the JSON decoder walks. 900: decoded, then too deep for the
    # chat's preparation or the template. Either way the client's mistake, never a 500
    # (the fixture also holds the log to no traceback).
    nested = b"[" * depth + b"]" * depth
    bodies = {
        "prompt": (COMPLETIONS, b'{"prompt": ' + nested + b"}"),
        "content": (CHATS, b'{"messages": [{"role": "user", "content": ' + nested + b"}]}"),
        "extra_field": (
            CHATS,
            b'{"messages": [{"role": "user", "content": "x", "extra": ' + nested + b"}]}",
        ),
        "tool_arguments": (
            CHATS,
            b'{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"type": '
            b'"function", "function": {"name": "f", "arguments": {"a": ' + nested + b"}}}]}]}",
        ),
    }
    path, body = bodies[where]
    async with http(default_server) as client:
        response = await client.post(path, content=body, headers=JSON_HEADERS)
        assert response.status_code == 400, response.text[:300]
        assert_openai_error(response.json(), 400)
        await completion(client, prompt=PROMPT, max_tokens=2)


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx"]
)
@pytest.mark.parametrize("path", [COMPLETIONS, CHATS, "/tokenize", "/detokenize"])
async def test_a_post_not_declared_json_is_refused_as_vllm_refuses_it(
    default_server: ApiServer, path: str, content_type: str | None
) -> None:
    # A web page can make a browser POST a form or text/plain to any address without
    # asking first, never application/json: this keeps pages away from the API.
    fields: dict[str, Any] = {
        "/v1/chat/completions": {"messages": CHAT},
        "/detokenize": {"tokens": [72]},
    }
    body = _json(model=MODEL, **fields.get(path, {"prompt": "x", "max_tokens": 2}))
    headers = {} if content_type is None else {"content-type": content_type}
    async with http(default_server) as client:
        response = await client.post(path, content=body, headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == (
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
        )
        assert_openai_error(response.json(), 400, param=None)
        for declared in ("application/json", "Application/JSON; charset=utf-8"):
            response = await client.post(path, content=body, headers={"content-type": declared})
            assert response.status_code == 200, response.text


async def test_the_openai_client_raises_its_own_errors_for_bad_requests(
    default_server: ApiServer,
) -> None:
    def ask() -> list[openai.APIStatusError]:
        errors: list[openai.APIStatusError] = []
        with openai_client(default_server) as client:
            with pytest.raises(openai.BadRequestError) as bad:
                client.completions.create(model=MODEL, prompt="x", temperature=5)
            errors.append(bad.value)
            with pytest.raises(openai.BadRequestError) as bad:
                client.chat.completions.create(model=MODEL, messages=CHAT, n=0)
            errors.append(bad.value)
            with pytest.raises(openai.NotFoundError) as missing:
                client.completions.create(model="nope", prompt="x")
            errors.append(missing.value)
            # And it serves on.
            assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        return errors

    temperature, n, model = await in_thread(ask)
    assert (temperature.status_code, n.status_code, model.status_code) == (400, 400, 404)
    assert_openai_error({"error": temperature.body}, 400, param="temperature")
    assert_openai_error({"error": n.body}, 400, param=None)  # as vLLM 0.34
    assert_openai_error({"error": model.body}, 404, param="model", error_type="NotFoundError")


async def test_a_prompt_longer_than_the_model_is_a_400_and_max_tokens_is_cut_to_what_is_left(
    small_server: ApiServer,
) -> None:
    async with http(small_server) as client:
        too_long = await client.post("/v1/completions", json={"prompt": "x" * 65, "max_tokens": 1})
        error = assert_openai_error(too_long.json(), 400, param="input_tokens")
        assert too_long.status_code == 400
        assert "64" in error["message"]
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x" * 64}], "max_tokens": 1},
        )
        assert chat.status_code == 400
        assert_openai_error(chat.json(), 400, param="input_tokens")
        # 60 prompt tokens leave 4 of the 64 for the completion, whatever it asks for.
        cut = await completion(client, prompt="x" * 60, max_tokens=100, ignore_eos=True)
        assert cut["usage"] == {
            "prompt_tokens": 60,
            "total_tokens": 64,
            "completion_tokens": 4,
            "completion_tokens_details": None,
        }
        assert cut["choices"][0]["finish_reason"] == "length"


async def test_a_body_declared_larger_than_the_limit_is_a_413(default_server: ApiServer) -> None:
    # 64 MiB declared (the limit is 32 MiB), 64 KiB sent: the answer comes at once.
    connection = h11.Connection(h11.CLIENT)
    head = h11.Request(
        method="POST",
        target=COMPLETIONS,
        headers=[
            ("host", "127.0.0.1"),
            ("content-type", "application/json"),
            ("content-length", str(64 * 1024 * 1024)),
        ],
    )
    status, body = 0, b""
    stream = await trio.open_tcp_stream("127.0.0.1", default_server.port)
    async with stream:
        await stream.send_all(
            connection.send(head) + connection.send(h11.Data(data=b'{"prompt": "' + b"x" * 65536))
        )
        with trio.fail_after(10):
            while not isinstance(event := connection.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    connection.receive_data(await stream.receive_some())
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
    assert status == 413
    assert_openai_error(json.loads(body), 413)
    async with http(default_server) as client:
        await completion(client, prompt=PROMPT, max_tokens=2)


async def test_a_megabyte_prompt_is_a_400(default_server: ApiServer) -> None:
    async with http(default_server) as client:
        response = await client.post("/v1/completions", json={"prompt": "cat " * 250_000})
        assert response.status_code == 400
        # Refused by its length in characters before it is tokenized, as vLLM does.
        error = assert_openai_error(response.json(), 400, param="input_text")
        assert "4096" in error["message"]
        await completion(client, prompt=PROMPT, max_tokens=2)


# -- fuzzed requests: valid requests of random shapes, a field or two set to anything

_anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(-2, 300), max_size=4),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 3) | st.booleans(), max_size=2),
)
"""Values of every JSON kind, none of which makes a request long (a huge max_tokens)."""
_flag = st.booleans()
_text = st.text(max_size=12)
_some_text = st.text(min_size=1, max_size=12)
_token_ids = st.lists(st.integers(0, 255), min_size=1, max_size=6)

SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 1, 5, 50]),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(0, 2**63 - 1),
    "stop": _some_text | st.lists(_some_text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 256), max_size=3),
    "stream": _flag,
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": _flag, "continuous_usage_stats": _flag}
    ),
    "ignore_eos": _flag,
    "min_tokens": st.integers(0, 4),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": _token_ids,
    "bad_words": st.lists(_some_text, max_size=2),
    "include_stop_str_in_output": _flag,
    "skip_special_tokens": _flag,
    "spaces_between_special_tokens": _flag,
    "truncate_prompt_tokens": st.integers(1, 10),
    "prompt_logprobs": st.integers(0, 3),
    "add_special_tokens": _flag,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"])},
        optional={"json_schema": st.just({"name": "x", "schema": {"type": "object"}})},
    ),
    "structured_outputs": st.sampled_from(
        [{"choice": ["yes", "no"]}, {"regex": "[ab]{1,5}"}, {"json": {"type": "object"}}]
    ),
    "priority": st.integers(-10, 10),
    "user": _text,
    "request_id": _some_text,
    "cache_salt": _some_text,
    "return_token_ids": _flag,
}
"""The fields completions and chats share, with values vLLM takes."""
COMPLETION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **SAMPLING,
    "max_tokens": st.integers(1, 16),
    "echo": _flag,
    "logprobs": st.integers(0, 5),
}
CHAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **SAMPLING,
    "max_tokens": st.integers(1, 16),
    "logprobs": _flag,
    "top_logprobs": st.integers(0, 5),
    "echo": _flag,
    "add_generation_prompt": _flag,
    "continue_final_message": _flag,
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    "tool_choice": st.sampled_from(["none", "auto"]),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x"]), _flag),
    "documents": st.lists(st.fixed_dictionaries({"title": _text, "text": _text}), max_size=2),
}
_PROMPTS = (
    st.text(min_size=1, max_size=30)
    | _token_ids
    | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=2)
)
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]), "content": _text}
    ),
    min_size=1,
    max_size=3,
)
_BOUNDS = frozenset({"max_tokens", "max_completion_tokens"})
"""What keeps a request short: never removed, never set to null."""


@st.composite
def fuzzed_requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A request of valid fields in a random combination, then up to two fields (any of
    the route's) set to a value of any kind or removed."""
    if draw(st.booleans()):
        path, fields = COMPLETIONS, COMPLETION_FIELDS
        body = draw(st.fixed_dictionaries({"prompt": _PROMPTS}, optional=COMPLETION_FIELDS))
    else:
        path, fields = CHATS, CHAT_FIELDS
        body = draw(
            st.fixed_dictionaries(
                {"messages": _MESSAGES, "max_completion_tokens": st.integers(1, 16)},
                optional=CHAT_FIELDS,
            )
        )
    # Combinations vLLM refuses, made valid (the mutations below make others).
    if "stream_options" in body:
        body["stream"] = True
    if body.get("stream"):
        body.pop("prompt_logprobs", None)
    if path == CHATS and body.get("top_logprobs"):
        body["logprobs"] = True
    if body.get("continue_final_message"):
        body["add_generation_prompt"] = False
    names = sorted({*fields, *body})
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        if name in _BOUNDS:
            body[name] = draw(_anything.filter(lambda value: value is not None))
        elif draw(st.booleans()):
            body[name] = draw(_anything)
        else:
            body.pop(name, None)
    return path, body


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=fuzzed_requests())
async def test_fuzzed_requests_get_an_answer_or_an_openai_error_never_a_500(
    default_server: ApiServer, request: tuple[str, dict[str, Any]]
) -> None:
    path, body = request
    status, headers, content = await post_json(default_server, path, body)
    if status != 200:
        assert status in (400, 404), (body, status, content)
        assert headers["content-type"] == "application/json"
        assert_openai_error(json.loads(content), status)
        return
    if headers["content-type"].startswith("text/event-stream"):
        chunks = sse_chunks(content)
        assert not [c for c in chunks if "error" in c], (body, chunks)
        assert all(c["choices"] or "usage" in c for c in chunks), (body, chunks)
    else:
        answer = json.loads(content)
        assert answer["choices"], (body, answer)
        assert answer["usage"]["completion_tokens"] >= 0


# ------------------------------------------------------------------ the API key


async def test_an_api_key_guards_the_v1_routes_and_only_them(key_server: ApiServer) -> None:
    def ask(api_key: str) -> Any:
        with openai_client(key_server, api_key=api_key) as client:
            return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)

    with pytest.raises(openai.AuthenticationError) as raised:
        await in_thread(ask, "wrong")
    assert raised.value.status_code == 401
    assert_openai_error({"error": raised.value.body}, 401, param=None)
    answer = await in_thread(ask, "sekret")
    assert answer.usage.completion_tokens == 2

    async with http(key_server) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic sekret"}):
            for method, path in (("POST", COMPLETIONS), ("POST", CHATS), ("GET", "/v1/models")):
                response = await client.request(
                    method, path, json={"prompt": PROMPT, "messages": CHAT}, headers=headers
                )
                assert response.status_code == 401, (headers, path)
                assert response.headers["www-authenticate"] == "Bearer"
                assert_openai_error(response.json(), 401)
        models = await client.get("/v1/models", headers={"authorization": "Bearer sekret"})
        assert models.status_code == 200
        # Outside /v1 no key is needed (as in vLLM).
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.post("/tokenize", json={"prompt": PROMPT})).status_code == 200


# ------------------------------------------------------------------ leaving is aborting


async def test_a_client_that_leaves_mid_stream_has_its_engine_request_aborted(
    long_server: ApiServer,
) -> None:
    [engine] = long_server.engines.values()
    async with http(long_server) as client:
        before = await metrics(client)
        async with sse_stream(long_server, long_stream()) as stream:
            for _ in range(20):
                assert await stream.next() is not None
            await wait_engine_busy(engine)
            generating = await metrics(client)
            assert sample(generating, "vllm:generation_tokens_total") > sample(
                before, "vllm:generation_tokens_total"
            )
            # The engine's scheduler says it runs it (its statistics, as vLLM's).
            assert sample(generating, "vllm:num_requests_running") == 1
            assert sample(generating, "vllm:kv_cache_usage_perc") > 0
        # Gone: the engine stops working for it, and nothing counts it as done.
        await wait_engine_idle(engine)
        after = await metrics(client)
        for reason in ("stop", "length", "abort", "error"):
            assert sample(after, "vllm:request_success_total", finished_reason=reason) == sample(
                before, "vllm:request_success_total", finished_reason=reason
            )
        generated = sample(after, "vllm:generation_tokens_total")
        answer = await completion(client, prompt=PROMPT, max_tokens=5, ignore_eos=True)
        assert answer["usage"]["completion_tokens"] == 5
        assert sample(await metrics(client), "vllm:generation_tokens_total") == generated + 5


async def test_a_storm_of_streams_half_of_which_leave_at_random_moments(
    long_server: ApiServer,
) -> None:
    rng = random.Random(20261207)
    leavers = set(rng.sample(range(50), 25))
    # How many events each leaver reads before it goes (0: as soon as the head came).
    leave_after = {i: rng.randint(0, 30) for i in leavers}
    [engine] = long_server.engines.values()
    finished: dict[int, list[dict[str, Any]]] = {}
    left: set[int] = set()

    async def one(i: int) -> None:
        if i in leavers:
            body = long_stream()
        else:
            body = long_stream(
                max_tokens=120, temperature=0, stream_options={"include_usage": True}
            )
        async with sse_stream(long_server, body) as stream:
            if i in leavers:
                for _ in range(leave_after[i]):
                    assert await stream.next() is not None
                left.add(i)
                return
            finished[i] = sse_chunks(await stream.body())

    async with http(long_server) as client:
        reference = await greedy_text(client, 120)
        before = await metrics(client)
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(one, i)
    assert left == leavers
    assert set(finished) == set(range(50)) - leavers
    for chunks in finished.values():
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == reference
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 120
    await wait_engine_idle(engine)
    async with http(long_server) as client:
        after = await metrics(client)
        assert sample(after, "vllm:request_success_total", finished_reason="length") == (
            sample(before, "vllm:request_success_total", finished_reason="length") + 25
        )
        for reason in ("stop", "abort", "error"):
            assert sample(after, "vllm:request_success_total", finished_reason=reason) == sample(
                before, "vllm:request_success_total", finished_reason=reason
            )
        assert await greedy_text(client, 120) == reference


# ------------------------------------------------------------------ the concurrency limit


async def test_past_max_concurrent_requests_a_request_gets_503_at_once_until_a_slot_frees(
    limited_server: ApiServer,
) -> None:
    one_token = {"prompt": PROMPT, "max_tokens": 1}

    def ask_with_openai() -> None:
        with (
            openai_client(limited_server) as client,
            pytest.raises(openai.InternalServerError) as raised,
        ):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert raised.value.status_code == 503
        assert_openai_error({"error": raised.value.body}, 503)

    async def refused(client: httpx.AsyncClient) -> None:
        with trio.fail_after(5):  # at once: nothing is queued
            completions = await client.post(COMPLETIONS, json=one_token)
            chat = await client.post(CHATS, json={"messages": CHAT, "max_tokens": 1})
        for response in (completions, chat):
            assert response.status_code == 503, response.text
            assert_openai_error(
                response.json(), 503, param=None, error_type="ServiceUnavailableError"
            )

    async with (
        sse_stream(limited_server, long_stream()) as first,
        http(limited_server) as client,
    ):
        assert await first.next() is not None
        async with sse_stream(limited_server, long_stream()) as second:
            assert await second.next() is not None
            await refused(client)
            await in_thread(ask_with_openai)
            # What generates nothing is served.
            assert (await client.get("/v1/models")).status_code == 200
            assert (await client.post("/tokenize", json={"prompt": PROMPT})).status_code == 200
        # The second left: its slot is free once the server has seen it go.
        with trio.fail_after(5):
            while (status := (await client.post(COMPLETIONS, json=one_token)).status_code) == 503:
                await trio.sleep(0.02)
        assert status == 200
        # Requests that finish give their slot back: one after another, all served.
        for _ in range(5):
            assert (await client.post(COMPLETIONS, json=one_token)).status_code == 200
        async with sse_stream(limited_server, long_stream()) as third:
            assert await third.next() is not None
            await refused(client)


# ------------------------------------------------------------------ signals


async def _wait_exit(server: ApiServer, since: float, within_s: float) -> int:
    """The server's exit code, once it has exited; at most ``within_s`` seconds after
    ``since`` (``trio.current_time()``)."""
    with trio.move_on_at(since + within_s):
        while (code := server.process.poll()) is None:
            await trio.sleep(0.02)
        return code
    raise AssertionError(f"the server did not exit within {within_s} s:\n{server.tail()}")


async def _wait_engines_gone(engines: list[int]) -> None:
    with trio.move_on_after(10) as waited:
        while any(alive(pid) for pid in engines):
            await trio.sleep(0.05)
    assert not waited.cancelled_caught, [pid for pid in engines if alive(pid)]


async def _refused(server: ApiServer) -> bool:
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    except OSError:
        return True
    await stream.aclose()
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_drains_the_streams_then_exits_0_leaving_no_engine(
    draining_server: ApiServer, signum: signal.Signals
) -> None:
    server = draining_server
    engines = list(server.engines.values())
    results: dict[str, tuple[list[str], BaseException | None]] = {}

    async def read(name: str, stream: SseStream) -> None:
        results[name] = await stream.rest_or_cut()

    async with (
        sse_stream(server, long_stream()) as endless,
        sse_stream(
            server,
            # Long enough to be in flight at the signal, short enough for the 2 s.
            long_stream(max_tokens=300, stream_options={"include_usage": True}),
        ) as short,
    ):
        assert await endless.next() is not None
        assert await short.next() is not None
        server.send_signal(signum)
        signalled = trio.current_time()
        with trio.fail_after(5):  # stops accepting
            while not await _refused(server):
                await trio.sleep(0.02)
        with trio.fail_after(2 + 10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, "endless", endless)
                nursery.start_soon(read, "short", short)
    # The short one finished within the 2 s, whole.
    short_seen, short_cut = results["short"]
    assert short_cut is None
    assert short_seen[-1] == "[DONE]"
    assert json.loads(short_seen[-2])["usage"]["completion_tokens"] == 300
    # The endless one was cut at the deadline: never a stream that looks finished.
    endless_seen, endless_cut = results["endless"]
    assert endless_cut is not None or endless_seen[-1] == "[DONE]", endless_seen[-2:]
    # Exit 0 within the 2 s and a margin (stopping the engine, leaving Python).
    assert await _wait_exit(server, signalled, 2 + 10) == 0
    assert "Traceback" not in server.log(), server.tail()
    await _wait_engines_gone(engines)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_second_signal_while_the_engines_stop_still_exits_0(
    draining_server: ApiServer, signum: signal.Signals
) -> None:
    server = draining_server
    engines = list(server.engines.values())
    async with sse_stream(server, long_stream()) as endless:
        assert await endless.next() is not None
        server.send_signal(signal.SIGTERM)
        _, cut = await endless.rest_or_cut()
    assert cut is not None  # at the 2 s deadline
    # The server now stops its engines (a tenth of a second or more); a signal then is
    # a second signal too: it stops at once, and cleanly. Sent at once: a fast machine
    # may have stopped them all within 0.1 s.
    assert server.process.poll() is None
    server.send_signal(signum)
    assert await _wait_exit(server, trio.current_time(), 10) == 0, server.tail()
    assert "Traceback" not in server.log(), server.tail()
    await _wait_engines_gone(engines)


async def test_a_second_signal_stops_at_once(patient_server: ApiServer) -> None:
    server = patient_server
    engines = list(server.engines.values())
    async with sse_stream(server, long_stream()) as endless:
        assert await endless.next() is not None
        server.send_signal(signal.SIGTERM)
        with trio.fail_after(5):  # draining: it stops accepting, and would wait a minute
            while not await _refused(server):
                await trio.sleep(0.02)
        assert server.process.poll() is None
        server.send_signal(signal.SIGTERM)
        assert await _wait_exit(server, trio.current_time(), 10) == 0
        seen, cut = await endless.rest_or_cut()
        assert cut is not None or seen[-1] == "[DONE]", seen[-2:]
    assert "Traceback" not in server.log(), server.tail()
    await _wait_engines_gone(engines)


# The engines' startup: vLLM's launcher faked (``tests/fake_vllm_cli.py``), so that it
# fails, or takes a minute to load its model, as vLLM's does.
FAKE_VLLM = Path(__file__).parents[1] / "fake_vllm_cli.py"
TOKENIZER_DIR = Path(trio_enginecore.text.__file__).with_name("_ngram_tokenizer")
ENGINE_CORE_PID = re.compile(r"engine core pid=(\d+)")


def _over_fake_vllm(tmp_path: Path, *vllm_flags: str) -> ApiServer:
    return start(
        tmp_path / "server.log",
        "--vllm",
        "--model",
        str(TOKENIZER_DIR),
        "--vllm-command",
        f"{sys.executable} {FAKE_VLLM}",
        "--",
        *vllm_flags,
    )


async def test_engines_that_cannot_start_exit_3_saying_why(tmp_path: Path) -> None:
    server = _over_fake_vllm(tmp_path, "--fail-with", "no model here")
    assert await _wait_exit(server, trio.current_time(), 60) == 3
    # Its last words: one message (the launcher's exit, what vLLM said, its stderr's
    # tail), not our traceback.
    log = server.log()
    said = log[log.rindex("trio-enginecore api-server: engine failed to start") :]
    assert "exited with code 1" in said, said
    assert "ValueError: no model here" in said, said
    assert "ExceptionGroup" not in log, server.tail()


async def test_vllms_variables_set_the_limits_of_a_request(tmp_path: Path) -> None:
    wrong = start(tmp_path / "wrong.log", env={"VLLM_MAX_N_SEQUENCES": "many"})
    assert await _wait_exit(wrong, trio.current_time(), 30) == 2
    assert "VLLM_MAX_N_SEQUENCES must be an integer, not 'many'" in wrong.log(), wrong.tail()
    server = start(tmp_path / "server.log", env={"VLLM_MAX_N_SEQUENCES": "2"})
    try:
        await trio.to_thread.run_sync(server.wait_ready)
        async with http(server) as client:
            answer = await completion(client, prompt=PROMPT, max_tokens=2, n=2)
            assert len(answer["choices"]) == 2
            response = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 3}
            )
            assert response.status_code == 400
            assert response.json()["error"]["message"].startswith("n must be at most 2, got 3.")
    finally:
        assert server.stop() == 0, server.tail()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_while_the_engines_load_stops_at_once_leaving_no_process(
    tmp_path: Path, signum: signal.Signals
) -> None:
    server = _over_fake_vllm(tmp_path, "--load-time-s", "60")
    with trio.fail_after(60):
        while not (found := ENGINE_CORE_PID.search(server.log())):
            assert server.process.poll() is None, server.tail()
            await trio.sleep(0.05)
    launchers = children(server.process.pid)
    assert launchers, server.tail()
    server.send_signal(signum)
    assert await _wait_exit(server, trio.current_time(), 10) == 0, server.tail()
    assert "Traceback" not in server.log(), server.tail()
    await _wait_engines_gone([*launchers, int(found[1])])


# ------------------------------------------------------------------ an engine dies


async def test_an_engine_killed_mid_stream_fails_its_streams_and_the_other_serves_on(
    two_engine_server: ApiServer,
) -> None:
    server = two_engine_server
    assert sorted(server.engines) == [0, 1]
    rank = [{"x-data-parallel-rank": "0"}, {"x-data-parallel-rank": "1"}]
    async with (
        sse_stream(server, long_stream(), headers=rank[0]) as doomed,
        sse_stream(server, long_stream(), headers=rank[1]) as survivor,
    ):
        assert await doomed.next() is not None
        assert await survivor.next() is not None
        os.kill(server.engines[0], signal.SIGKILL)
        with trio.fail_after(10):
            seen, cut = await doomed.rest_or_cut()
        assert cut is None, cut
        assert seen[-1] == "[DONE]"
        assert_openai_error(
            json.loads(seen[-2]), 503, param=None, error_type="ServiceUnavailableError"
        )
        # The other engine's stream goes on.
        for _ in range(50):
            assert await survivor.next() is not None
    async with http(server) as client:
        for _ in range(4):
            answer = await completion(client, prompt=PROMPT, max_tokens=3, ignore_eos=True)
            assert answer["usage"]["completion_tokens"] == 3
        one_token = {"prompt": PROMPT, "max_tokens": 1}
        on_dead = await client.post(COMPLETIONS, json=one_token, headers=rank[0])
        assert on_dead.status_code == 503
        assert_openai_error(on_dead.json(), 503)
        on_live = await client.post(COMPLETIONS, json=one_token, headers=rank[1])
        assert on_live.status_code == 200
    assert not alive(server.engines[0])


# ------------------------------------------------------------------ logprobs


async def test_completion_logprobs_describe_each_token_as_vllm_builds_them(
    default_server: ApiServer,
) -> None:
    async with http(default_server) as client:
        answer = await completion(
            client, prompt=PROMPT, max_tokens=8, logprobs=2, seed=3, ignore_eos=True
        )
    (choice,) = answer["choices"]
    logprobs = choice["logprobs"]
    # One entry per token, whose texts make the text, each starting where the last ended.
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 8
    starts = [0]
    for token in logprobs["tokens"][:-1]:
        starts.append(starts[-1] + len(token))
    assert logprobs["text_offset"] == starts
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        # The chosen token first, then the top 2: at most logprobs + 1 entries.
        assert logprob <= 0
        assert next(iter(top)) == token
        assert top[token] == logprob
        assert 1 <= len(top) <= 3


async def test_streamed_chat_logprobs_come_with_each_chunk(default_server: ApiServer) -> None:
    async with http(default_server) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": CHAT,
                "max_completion_tokens": 5,
                "logprobs": True,
                "top_logprobs": 2,
                "seed": 3,
                "stream": True,
            },
        )
    assert response.status_code == 200
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[1:-1]]  # after the role chunk
    content = [item for c in chunks for item in c["choices"][0]["logprobs"]["content"]]
    assert len(content) == 5
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert "".join(item["token"] for item in content) == text
    for item in content:
        assert item["bytes"] == list(item["token"].encode())
        assert len(item["top_logprobs"]) == 2
        assert item["logprob"] <= 0


async def test_more_logprobs_than_the_engine_allows_is_a_400(default_server: ApiServer) -> None:
    async with http(default_server) as client:
        response = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "logprobs": 30}
        )
        assert response.status_code == 400, response.text
        assert "max allowed: 20" in response.json()["error"]["message"]
        await completion(client, prompt=PROMPT, max_tokens=2)  # and it serves on


async def test_the_logprobs_limit_is_the_servers_and_words_its_refusals_as_vllm(
    small_server: ApiServer,
) -> None:
    # --max-logprobs 3: the server refuses more itself (vLLM's frontend does; its
    # engine core would compute them), naming the field; 3 is served.
    asks = [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 4}, "sample", "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 4}, "prompt", "prompt_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 4},
            "sample",
            "logprobs",
        ),
    ]
    async with http(small_server) as client:
        for path, fields, what, param in asks:
            response = await client.post(path, json={"model": MODEL, "max_tokens": 2, **fields})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["message"] == (
                f"Requested {what} logprobs of 4, which is greater than max allowed: 3 "
                f"(parameter={param}, value=4)"
            )
            assert error["param"] == param
        answer = await completion(client, prompt=PROMPT, max_tokens=2, logprobs=3)
    tops = answer["choices"][0]["logprobs"]["top_logprobs"]
    # The top 3, and the chosen token when it is not among them.
    assert all(3 <= len(top) <= 4 for top in tops), tops

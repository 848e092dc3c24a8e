"""What the OpenAI routes hand the engine, seen from a scripted engine
(``trio_enginecore.testing``): the app in-process over the real client and text layer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from trio_enginecore.server import Headers, OpenAIApp, Request, ServerSettings
from trio_enginecore.testing import FakeEngine, open_fake_engine_client
from trio_enginecore.text import AsyncLLM, builtin_tokenizer


@pytest.fixture
async def served() -> AsyncIterator[tuple[OpenAIApp, FakeEngine]]:
    engine = FakeEngine(vocab_size=256)
    async with open_fake_engine_client(engine) as client:
        llm = AsyncLLM(client, builtin_tokenizer(), max_model_len=128)
        app = OpenAIApp(llm, ServerSettings(served_model_names=["ngram"]))
        try:
            yield app, engine
        finally:
            app.close()


async def post(app: OpenAIApp, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = Request(
        "POST",
        path,
        Headers([(b"content-type", b"application/json")]),
        json.dumps(body).encode(),
    )
    response = await app(request)
    return response.status, json.loads(response.body)


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"prompt": "The river"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
async def test_a_requests_cache_salt_and_priority_reach_the_engine(
    served: tuple[OpenAIApp, FakeEngine], path: str, fields: dict[str, Any]
) -> None:
    # The salt keeps one tenant's prompts out of another's prefix cache: dropped, it
    # would silently share them.
    app, engine = served
    status, _ = await post(
        app, path, {"model": "ngram", "max_tokens": 2, "cache_salt": "tenant-a", **fields}
    )
    assert status == 200
    [request] = engine.requests
    assert request.cache_salt == "tenant-a"
    status, _ = await post(app, path, {"model": "ngram", "max_tokens": 2, **fields})
    assert status == 200
    assert engine.requests[-1].cache_salt is None


@pytest.mark.parametrize("salt", ["a" * 129, "a@b", "a/b", "a\\b", "a\x00b", ""])
async def test_a_cache_salt_vllm_would_refuse_is_refused_in_its_words(
    served: tuple[OpenAIApp, FakeEngine], salt: str
) -> None:
    app, engine = served
    status, body = await post(
        app, "/v1/completions", {"model": "ngram", "prompt": "x", "cache_salt": salt}
    )
    assert status == 400
    assert body["error"]["param"] == "cache_salt"
    if salt:
        assert body["error"]["message"] == (
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL. (parameter=cache_salt)"
        )
    assert engine.requests == []

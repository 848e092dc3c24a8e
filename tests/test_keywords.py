"""A misspelt keyword names the right one, wherever the library takes keywords.

The settings classes (``EngineConfig``, ``ClientOptions``, ``Liveness``, ``Restart``,
``RemoteEngines``, ``RayEngines``), the openers' options (``open_engine_client(**options)``
and the other openers, the blocking clients, the text layer's), and a request's
sampling keywords (``EngineCoreRequest.for_tokens``) each answer an unknown keyword with
a ``TypeError`` that says which keyword was wrong and, when one is close, ``did you
mean ...?``. Nothing is started before the error.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    SyncMPClient,
    connect_engine_client,
    make_client,
    open_engine_client,
)
from trio_enginecore._keywords import unknown_keyword
from trio_enginecore.client import (
    ClientOptions,
    Liveness,
    RayEngines,
    RemoteEngines,
    Restart,
    open_ray_engine_client,
)
from trio_enginecore.server import ServerSettings

from .support import children_of_this_process

HANDSHAKE = "tcp://127.0.0.1:5999"

# (what is called, the keywords it is given, the wrong one, the one it should suggest)
SETTINGS: list[tuple[Callable[..., Any], dict[str, Any], str, str]] = [
    (EngineConfig, {"max_num_seq": 8}, "max_num_seq", "max_num_seqs"),
    (EngineConfig, {"modle": "ngram"}, "modle", "model"),
    (EngineConfig, {"data_parallel": 2}, "data_parallel", "data_parallel_size"),
    (ClientOptions, {"on_engine_failur": "fail"}, "on_engine_failur", "on_engine_failure"),
    (ClientOptions, {"ready_timeout": 5.0}, "ready_timeout", "ready_timeout_s"),
    (Liveness, {"progress_timeout": 300}, "progress_timeout", "progress_timeout_s"),
    (Restart, {"max_restart": 3}, "max_restart", "max_restarts"),
    (RemoteEngines, {"handshake_address": HANDSHAKE, "rank": {1}}, "rank", "ranks"),
    (RayEngines, {"stratagy": "PACK"}, "stratagy", "strategy"),
    (
        ServerSettings,
        {"served_model_names": ["m"], "max_concurrent_request": 4},
        "max_concurrent_request",
        "max_concurrent_requests",
    ),
]


@pytest.mark.parametrize(
    ("cls", "keywords", "wrong", "right"),
    SETTINGS,
    ids=[f"{cls.__name__}-{wrong}" for cls, _, wrong, _ in SETTINGS],
)
def test_a_settings_class_names_the_nearest_field(
    cls: Callable[..., Any], keywords: dict[str, Any], wrong: str, right: str
) -> None:
    message = (
        f"{cls.__name__}() got an unexpected keyword argument '{wrong}'; did you mean '{right}'?"
    )
    with pytest.raises(TypeError) as caught:
        cls(**keywords)
    assert str(caught.value) == message
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__  # the attrs error is not shown too


def test_a_keyword_like_no_field_is_named_alone() -> None:
    with pytest.raises(TypeError) as caught:
        EngineConfig(xyzzy=1)  # type: ignore[call-arg]
    assert str(caught.value) == "EngineConfig() got an unexpected keyword argument 'xyzzy'"


def test_other_errors_of_a_settings_class_are_left_as_they_are() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig\.model must be one of"):
        EngineConfig(model="nope")
    with pytest.raises(TypeError, match="positional"):
        EngineConfig("counter")  # type: ignore[misc]
    # The signature help() and the docs show is still attrs' own.
    assert "max_num_seqs" in inspect.signature(EngineConfig).parameters


def test_private_names_are_never_suggested() -> None:
    error = unknown_keyword("f", "eos_token_id", ["_eos_token_id", "seed"])
    assert str(error) == "f() got an unexpected keyword argument 'eos_token_id'"


# An opener's suggestions cover the options and its own parameters.
OPENERS: list[tuple[Callable[..., Any], str, str]] = [
    (open_engine_client, "on_engine_failur", "on_engine_failure"),
    (open_engine_client, "cancel_on_failur", "cancel_on_failure"),
    (open_engine_client, "multiproces", "multiprocess"),
    (make_client, "ready_timeout", "ready_timeout_s"),
    (SyncMPClient, "liveliness", "liveness"),
]


@pytest.mark.parametrize(
    ("opener", "wrong", "right"),
    OPENERS,
    ids=[f"{opener.__name__}-{wrong}" for opener, wrong, _ in OPENERS],
)
def test_an_opener_names_the_nearest_option_before_starting_anything(
    opener: Callable[..., Any], wrong: str, right: str
) -> None:
    message = (
        f"{opener.__name__}() got an unexpected keyword argument '{wrong}'; did you mean '{right}'?"
    )
    with pytest.raises(TypeError) as caught:
        opener(EngineConfig(), **{wrong: 1})
    assert str(caught.value) == message
    assert children_of_this_process() == []


async def test_the_async_openers_name_the_nearest_option() -> None:
    async with trio.open_nursery() as nursery:
        with pytest.raises(TypeError, match=r"connect_engine_client\(\).*did you mean 'remote'\?"):
            await connect_engine_client(nursery, EngineConfig(), remot=None)  # type: ignore[call-arg]
    with pytest.raises(
        TypeError,
        match=r"open_ray_engine_client\(\).*'ready_timout_s'; did you mean 'ready_timeout_s'\?",
    ):
        async with open_ray_engine_client(ready_timout_s=5.0):  # type: ignore[call-arg]
            pass  # pragma: no cover
    assert children_of_this_process() == []


@pytest.mark.parametrize(
    ("wrong", "right"),
    [
        ("max_token", "max_tokens"),
        ("temprature", "temperature"),
        ("stop_token_id", "stop_token_ids"),
        ("request_i", "request_id"),  # one of for_tokens' own
        ("priorty", "priority"),
    ],
)
def test_a_requests_sampling_keywords_name_the_nearest(wrong: str, right: str) -> None:
    with pytest.raises(TypeError) as caught:
        EngineCoreRequest.for_tokens([1, 2], **{wrong: 1})
    assert str(caught.value) == (
        f"EngineCoreRequest.for_tokens() got an unexpected keyword argument '{wrong}'; "
        f"did you mean '{right}'?"
    )


def test_a_requests_bad_sampling_value_is_still_named_as_before() -> None:
    with pytest.raises(TypeError, match=r"SamplingParams\.seed must be an int or None"):
        EngineCoreRequest.for_tokens([1, 2], seed="1")  # type: ignore[arg-type]


async def test_the_text_layers_openers_name_the_nearest_keyword() -> None:
    pytest.importorskip("tokenizers")
    from trio_enginecore.text import SyncLLM, open_llm

    with pytest.raises(TypeError, match=r"open_llm\(\).*'tokeniser'; did you mean 'tokenizer'\?"):
        async with open_llm(tokeniser="x"):  # type: ignore[call-arg]
            pass  # pragma: no cover
    with pytest.raises(TypeError, match=r"SyncLLM\(\).*'tokeniser'; did you mean 'tokenizer'\?"):
        SyncLLM(tokeniser="x")  # type: ignore[call-arg]
    assert children_of_this_process() == []

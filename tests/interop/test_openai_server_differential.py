"""Our OpenAI server against vLLM's, byte for byte: the same requests
(``http_differential.CASES``) to ``vllm serve`` and to ``trio-enginecore api-server``,
both serving the same model directory on the same engine (vLLM's engine core with the
counter executor, one step per 50 ms).

vLLM's server runs first (``vllm_server.py``: its API server and engine core as
shipped) and every case is recorded; it is stopped, then ours is started with ``--vllm``
(it launches ``vllm serve DIR --headless`` with the same engine flags) and answers the
same cases. Each answer must be sane (statuses, JSON bodies, SSE streams ending with
``data: [DONE]``) and equal to vLLM's once what is random is normalised (ids,
``created``, the fingerprint's hash: ``http_differential.normalise``), except:

* error messages that vLLM takes from pydantic's validation (malformed JSON, a field
  of the wrong type, a missing field): the status and the error's shape must match,
  not the wording, nor the ``type`` (``"Bad Request"`` there, ``"BadRequestError"``
  here, as for vLLM's other 400s);
* a prompt that ends inside a character (``vllm_leaks_prompt_text``): vLLM's first
  text repeats the prompt's text; ours starts after it (``repair_text``): our text
  must be the end of vLLM's;
* headers: ``content-type`` must be equal; uvicorn's ``server`` and Starlette's ``vary:
  Origin`` are not ours.

Our server frames vLLM 0.34's OpenAI API (0.33's whole responses had two more null
fields), so this module runs in the 0.34 session. With
``TRIO_ENGINECORE_RECORD_VLLM_HTTP=PATH`` vLLM's answers are written to ``PATH``.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import httpx
import pytest

from .http_differential import (
    CASES,
    CHAT,
    MODEL,
    PROMPT_TEXT_OUT,
    check_sane,
    comparable,
    normalised,
    record,
    sse_events,
)
from .launched import vllm_command
from .support import project_command, require_vllm, vllm_release, vllm_version
from .vllm_server import (
    SERVE_FLAGS,
    STEP_S,
    free_port,
    http_server,
    served_env,
    vllm_server,
    write_served_model,
)

require_vllm()
if vllm_release() != "0.34":
    pytest.skip(
        "our server frames vLLM 0.34's OpenAI API: compared in the 0.34 session",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(600)

RECORD_VARIABLE = "TRIO_ENGINECORE_RECORD_VLLM_HTTP"

Answers = dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_served_model(tmp_path_factory.mktemp("served") / "model")


def _record_all(url: str) -> list[dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=60.0) as client:
        return [record(client, case) for case in CASES]


@pytest.fixture(scope="module")
def vllm_answers(model_dir: Path) -> list[dict[str, Any]]:
    """``vllm serve``'s answer to every case (the server is stopped before ours runs:
    two servers and two engines at once are too much for a 2-core machine)."""
    with vllm_server(model_dir, model_dir.parent / "vllm-serve.log") as url:
        return _record_all(url)


@pytest.fixture(scope="module")
def our_answers(model_dir: Path, vllm_answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``trio-enginecore api-server --vllm``'s answer to every case, on the same model
    and engine flags (after vLLM's server stopped)."""
    port = free_port()
    command = project_command(
        "api-server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm",
        "--vllm-command",
        shlex.join(vllm_command()),
        "--",
        *SERVE_FLAGS,
    )
    log = model_dir.parent / "api-server.log"
    with http_server(command, port, log, env=served_env(), name="trio-enginecore api-server"):
        return _record_all(f"http://127.0.0.1:{port}")


def _by_name(recorded: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {answer["name"]: answer for answer in recorded}


def _json(answers: dict[str, dict[str, Any]], name: str) -> Any:
    return json.loads(answers[name]["body"])


def _chunks(answers: dict[str, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [json.loads(event) for event in sse_events(answers[name]["body"])[:-1]]


def check_counter_model(answers: dict[str, dict[str, Any]]) -> None:
    """What the counter model writes, as vLLM's server must have said it (so that no
    case drifts into one that tests nothing)."""
    (choice,) = _json(answers, "completions")["choices"]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT_TEXT_OUT, "length")
    (choice,) = _json(answers, "completions_stop")["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        "tuvw",
        "stop",
        "xyz",
    )
    (choice,) = _json(answers, "completions_stop_included")["choices"]
    assert choice["text"] == "tuvwxyz"
    (choice,) = _json(answers, "completions_min_tokens_stop")["choices"]
    assert (choice["text"], choice["stop_reason"]) == ("tuvwx", "yz")
    (choice,) = _json(answers, "completions_stop_token_ids")["choices"]
    assert (choice["text"], choice["stop_reason"]) == ("tuvw", 120)
    (choice,) = _json(answers, "completions_ignore_eos")["choices"]
    assert choice["text"] == "\ufffd" * 6 + "\u0000\u0001\u0002\u0003"  # vllm_leaks_prompt_text
    (choice,) = _json(answers, "completions_eos")["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    (choice,) = _json(answers, "completions_special_tokens_kept")["choices"]
    assert "<|endoftext|>\u0000\u0001" in choice["text"]
    assert [c["text"] for c in _json(answers, "completions_n2")["choices"]] == ["tuvw"] * 2

    chunks = _chunks(answers, "completions_stream_usage")
    # One event per token: the steps are slow enough for the API server to keep up.
    assert [c["text"] for chunk in chunks for c in chunk["choices"]] == list("tuvwx"), (
        "vLLM's API server merged the tokens of several steps: a machine this busy "
        "cannot tell which events a stream has"
    )
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5

    (choice,) = _json(answers, "chat")["choices"]
    assert choice["message"]["content"] == ";<=>?@AB"
    chunks = _chunks(answers, "chat_stream_n2_usage")
    roles = [chunk["choices"][0] for chunk in chunks[:2]]
    assert [(c["index"], c["delta"]) for c in roles] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
    ]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6

    # Logprobs: the counter's, the sampled token first and on top (see fake_executor).
    (choice,) = _json(answers, "completions_logprobs")["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list("tuvwxy")
    assert logprobs["token_logprobs"] == [-0.25] * 6
    assert logprobs["top_logprobs"][0] == {"t": -0.25, "u": -0.75}
    (choice,) = _json(answers, "chat_logprobs")["choices"]
    first = choice["logprobs"]["content"][0]
    assert (first["token"], first["logprob"]) == (";", -0.25)
    assert [top["token"] for top in first["top_logprobs"]] == [";", "<"]

    assert [m["id"] for m in _json(answers, "models")["data"]] == [MODEL]
    assert _json(answers, "tokenize_chat")["count"] == len(
        f"User: {CHAT[0]['content']}\n\nAssistant:"
    )


def test_vllm_openai_server_answers(vllm_answers: list[dict[str, Any]], model_dir: Path) -> None:
    """vLLM's answers are sane and say what the counter model predicts (so that no case
    drifts into one that tests nothing); written to ``$TRIO_ENGINECORE_RECORD_VLLM_HTTP``
    when it is set."""
    for answer, case in zip(vllm_answers, CASES, strict=True):
        check_sane(answer, case)
    check_counter_model(_by_name(vllm_answers))
    path = os.environ.get(RECORD_VARIABLE)
    if path:
        document = {
            "vllm_version": vllm_version(),
            "served_model_name": MODEL,
            "step_s": STEP_S,
            "serve_flags": list(SERVE_FLAGS),
            "cases": [
                {
                    **normalised(answer, model_dir=str(model_dir)),
                    "interleaved": case.interleaved,
                    "vllm_leaks_prompt_text": case.vllm_leaks_prompt_text,
                    "raw": {"headers": answer["headers"], "body": answer["body"]},
                }
                for answer, case in zip(vllm_answers, CASES, strict=True)
            ],
        }
        Path(path).write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")


# vLLM answers these from pydantic's validation: its wording and its type "Bad Request".
_PYDANTIC_ERRORS = frozenset(
    {
        "bad_json",
        "bad_json_chat",
        "bad_temperature_type",
        "bad_missing_messages",
        "bad_too_many_stop_strings",
        "bad_content_type",
        "bad_no_content_type",
    }
)
# ... of which these with vLLM's message word for word.
_VALIDATION_MESSAGES_EQUAL = frozenset({"bad_content_type", "bad_no_content_type"})


def _texts(body: str) -> str:
    """Every choice's text (or content) of a response or stream, joined."""
    if body.startswith("data: "):
        chunks = [json.loads(e) for e in sse_events(body)[:-1]]
    else:
        chunks = [json.loads(body)]
    return "".join(
        choice.get("text") or (choice.get("message") or {}).get("content") or ""
        for chunk in chunks
        for choice in chunk.get("choices", [])
    )


def test_our_server_answers_every_case_as_vllms_does(
    vllm_answers: list[dict[str, Any]], our_answers: list[dict[str, Any]], model_dir: Path
) -> None:
    differences = []
    for theirs, ours, case in zip(vllm_answers, our_answers, CASES, strict=True):
        check_sane(ours, case)
        expected = comparable(theirs, case, model_dir=str(model_dir))
        got = comparable(ours, case, model_dir=str(model_dir))
        assert got["status"] == expected["status"], (case.name, got, expected)
        content_type = [dict(x["headers"]).get("content-type") for x in (got, expected)]
        assert content_type[0] == content_type[1], (case.name, content_type)
        if case.name in _PYDANTIC_ERRORS:
            error = json.loads(got["body"])["error"]
            assert set(error) == {"message", "type", "param", "code"}, (case.name, error)
            assert error["code"] == expected["status"], (case.name, error)
            if case.name in _VALIDATION_MESSAGES_EQUAL:
                theirs = json.loads(expected["body"])["error"]["message"]
                assert error["message"] == theirs, (case.name, error, theirs)
            continue
        if case.vllm_leaks_prompt_text:
            assert _texts(expected["body"]).endswith(_texts(got["body"])), case.name
            continue
        if got["body"] != expected["body"]:
            differences.append(
                f"{case.name}:\n  vLLM: {expected['body']!r}\n  ours: {got['body']!r}"
            )
    assert not differences, "\n".join(differences)

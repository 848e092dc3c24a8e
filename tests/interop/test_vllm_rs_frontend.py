"""vLLM's Rust OpenAI frontend (``vllm-rs frontend``) serves HTTP in front of our engine.

Each vLLM wheel (0.33.0, 0.34.0) ships ``vllm/vllm-rs``. In its ``frontend`` mode it is
the worker that ``vllm serve`` starts when ``VLLM_USE_RUST_FRONTEND=1``: it inherits a
listening HTTP socket and the listeners of its input ROUTER and output PULL as file
descriptors, serves OpenAI-compatible HTTP, and drives engines over the engine-core
protocol. It does no startup handshake: it waits for the engines to connect and send
their ready message, so ours attaches to it (``trio-enginecore serve --input-address
... --output-address ...``). 0.34's then calls the engine's ``is_inference_ready``
utility and exits if that call fails. ``vllm_side/rust_frontend.py`` plays vLLM's supervisor: it
writes a model directory whose byte-level ``tokenizer.json`` matches our ``ngram``
model (token = byte, 256 = EOS; ``vllm_side/byte_tokenizer.py``), binds the listeners
and starts ``vllm-rs frontend``.

Our engine also attaches to a second client, a :class:`~trio_enginecore.SyncMPClient`
of ours at client index 1, that only calls ``get_request_counts``: it sees inside the
engine, so a test can check that a request the HTTP client gave up on really left the
engine's scheduler. One stack serves every test of the module (it starts in about
2 s); the checks of the logs come last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from trio_enginecore import EngineConfig, SyncMPClient
from trio_enginecore.engine import NgramModel

from .support import VllmProcess, error_lines, project_command, require_vllm

require_vllm()

SERVED_MODEL = "byte-ngram"
ENGINE_MAX_MODEL_LEN = 1024  # config.json says 4096: the frontend must take the engine's
STEP_TIME_S = 0.01  # a 1000-token request runs for ~10 s unless aborted
EOS = 256
MODEL = NgramModel()


def greedy(prompt: str, max_tokens: int) -> list[int]:
    """The tokens our engine's ngram model generates at temperature 0 (argmax), up to
    and including EOS."""
    tokens, output = list(prompt.encode()), list[int]()
    while len(output) < max_tokens:
        token = int(np.argmax(MODEL.distribution(tokens)))
        output.append(token)
        tokens.append(token)
        if token == EOS:
            break
    return output


@dataclass
class Stack:
    base_url: str
    frontend: VllmProcess
    engine: subprocess.Popen[bytes]
    engine_log: Path
    observer: SyncMPClient
    started: dict[str, Any]
    ready_s: float = 0.0

    def post(self, body: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        response = httpx.post(
            f"{self.base_url}/v1/completions",
            json={"model": SERVED_MODEL, **body},
            timeout=timeout_s,
        )
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def logs(self) -> str:
        return (
            f"--- vllm-rs frontend log:\n{self.frontend.log_tail(30)}\n"
            f"--- engine log:\n{self.engine_log_text()[-3000:]}"
        )

    def engine_log_text(self) -> str:
        return self.engine_log.read_text(errors="replace")


def _wait_until_serving(stack: Stack, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stack.frontend.process.poll() is not None or stack.engine.poll() is not None:
            raise AssertionError(f"a process of the stack exited\n{stack.logs()}")
        try:
            if httpx.get(f"{stack.base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"vllm-rs frontend not serving within {timeout_s} s\n{stack.logs()}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("vllm-rs")
    frontend_in, frontend_out = f"ipc://{tmp}/frontend-in", f"ipc://{tmp}/frontend-out"
    observer_in, observer_out = f"ipc://{tmp}/observer-in", f"ipc://{tmp}/observer-out"
    start = time.monotonic()
    frontend = VllmProcess(
        "rust_frontend.py",
        [
            "--model-dir",
            str(tmp / "model"),
            "--input-address",
            frontend_in,
            "--output-address",
            frontend_out,
            "--served-model-name",
            SERVED_MODEL,
        ],
        tmp / "frontend.log",
    )
    engine_log = tmp / "engine.log"
    engine: subprocess.Popen[bytes] | None = None
    lifeline_read, lifeline_write = os.pipe()
    observer: SyncMPClient | None = None
    try:
        started = frontend.next_report(30)
        assert started["event"] == "started", started
        with engine_log.open("w") as log:
            engine = subprocess.Popen(
                project_command(
                    "serve",
                    "--input-address",
                    frontend_in,
                    "--output-address",
                    frontend_out,
                    "--input-address",
                    observer_in,
                    "--output-address",
                    observer_out,
                    "--model",
                    "ngram",
                    "--max-model-len",
                    str(ENGINE_MAX_MODEL_LEN),
                    "--step-time-s",
                    str(STEP_TIME_S),
                    "--log-level",
                    "DEBUG",  # "ABORT of N request(s)"
                    # Stops at once if this process dies, however (kill -9 included).
                    "--lifeline-fd",
                    str(lifeline_read),
                ),
                stderr=log,
                pass_fds=[lifeline_read],
            )
        os.close(lifeline_read)
        observer = SyncMPClient(
            EngineConfig(model="ngram"),
            input_address=observer_in,
            output_address=observer_out,
            client_index=1,
            ready_timeout_s=30,
        )
        result = Stack(
            f"http://127.0.0.1:{started['port']}", frontend, engine, engine_log, observer, started
        )
        _wait_until_serving(result, 30)
        result.ready_s = time.monotonic() - start
        yield result
    finally:
        if observer is not None:
            observer.close()
        frontend.stop()
        if engine is not None:
            if engine.poll() is None:
                engine.send_signal(signal.SIGTERM)  # drains (nothing is left) and exits 0
            try:
                engine.wait(15)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait()
        else:
            os.close(lifeline_read)
        os.close(lifeline_write)


def test_the_stack_starts_and_the_tokenizer_is_byte_level(
    stack: Stack, timings: dict[str, float]
) -> None:
    timings["vllm-rs frontend + our engine: start -> HTTP ready"] = stack.ready_s
    assert stack.ready_s < 30
    check = stack.started["tokenizer_check"]
    assert check["ids_are_bytes"], check
    assert check["decoded"] == check["sample"]  # EOS is special: skipped when decoding
    assert check["vocab_size"] == EOS + 1


def test_models_lists_the_served_model_with_the_engines_max_model_len(stack: Stack) -> None:
    models = httpx.get(f"{stack.base_url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [SERVED_MODEL]
    # From our engine's ready message, not from config.json (4096).
    assert models["data"][0]["max_model_len"] == ENGINE_MAX_MODEL_LEN


def test_completion_text_is_the_ngram_models_greedy_text(
    stack: Stack, timings: dict[str, float]
) -> None:
    prompt = "When a request is cancelled, the scheduler"
    tokens = greedy(prompt, 48)
    assert EOS not in tokens  # a length-limited completion
    start = time.monotonic()
    result = stack.post(
        {"prompt": prompt, "max_tokens": 48, "temperature": 0, "return_token_ids": True}
    )
    timings["vllm-rs: 48-token completion over HTTP"] = time.monotonic() - start
    (choice,) = result["choices"]
    assert choice["prompt_token_ids"] == list(prompt.encode())
    assert choice["token_ids"] == tokens
    assert choice["text"] == MODEL.detokenize(tokens)
    assert choice["finish_reason"] == "length"
    assert result["model"] == SERVED_MODEL
    assert result["usage"]["prompt_tokens"] == len(prompt.encode())
    assert result["usage"]["completion_tokens"] == 48


def test_eos_from_the_engine_ends_the_completion_with_stop(stack: Stack) -> None:
    # A paragraph of the model's corpus ends here: its most likely next token is EOS.
    prompt = "The children counted the boats that drifted back towards the harbour."
    assert greedy(prompt, 10) == [EOS]
    result = stack.post({"prompt": prompt, "max_tokens": 10, "temperature": 0})
    (choice,) = result["choices"]
    assert choice["text"] == ""  # EOS is a special token: not in the text
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None
    assert result["usage"]["completion_tokens"] == 1


def test_streaming_client_disconnect_aborts_the_request_in_our_engine(
    stack: Stack, timings: dict[str, float]
) -> None:
    prompt = "The scheduler runs in steps."
    max_tokens = 1000  # ~10 s of steps: only an abort ends it within the checks below
    expected_text = MODEL.detokenize(greedy(prompt, max_tokens))
    assert stack.observer.get_request_counts() == (0, 0)  # (waiting, running)
    engine_log_before = len(stack.engine_log_text())
    streamed, running, completion_id, disconnected = "", None, None, None
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            f"{stack.base_url}/v1/completions",
            json={
                "model": SERVED_MODEL,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            },
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            assert line != "data: [DONE]", "the stream ended before the disconnect"
            chunk = json.loads(line.removeprefix("data: "))
            completion_id = chunk["id"]
            (choice,) = chunk["choices"]
            assert choice.get("finish_reason") is None, choice
            streamed += choice["text"]
            if running is None and len(streamed) >= 10:
                # The request runs in our engine while the client reads.
                running = stack.observer.get_request_counts()
            if len(streamed) >= 20:
                # Leaving the line iterator closes the HTTP connection mid-stream
                # (httpx cannot reuse a connection whose response was not read).
                disconnected = time.monotonic()
                break
    assert disconnected is not None, f"the stream ended after {streamed!r}"
    assert running == (0, 1)
    assert expected_text.startswith(streamed), (streamed, expected_text[:40])

    deadline = disconnected + 5.0
    while (counts := stack.observer.get_request_counts()) != (0, 0):
        assert time.monotonic() < deadline, f"still {counts} 5 s after the disconnect"
        time.sleep(0.02)
    timings["vllm-rs: HTTP disconnect -> request gone from our engine"] = (
        time.monotonic() - disconnected
    )
    # vllm-rs aborted it (its engine request id is the completion id plus a suffix)
    # with an ABORT message, which our engine received.
    dropped = f'auto-aborting request due to dropped stream request_id="{completion_id}-'
    assert dropped in stack.frontend.log(), stack.logs()
    assert "ABORT of 1 request(s)" in stack.engine_log_text()[engine_log_before:], stack.logs()

    # The engine serves on.
    result = stack.post({"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert result["choices"][0]["text"] == expected_text[:8]


def test_no_errors_were_logged(stack: Stack) -> None:
    assert error_lines(stack.frontend.log()) == [], stack.logs()
    problems = [
        line
        for line in stack.engine_log_text().splitlines()
        if " ERROR " in line or " CRITICAL " in line or "Traceback" in line
    ]
    assert problems == [], stack.logs()

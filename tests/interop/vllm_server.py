"""vLLM's own OpenAI server (``vllm serve``) on CPU, for the HTTP differential tests.

``vllm serve DIR`` runs as shipped: its API server (FastAPI on uvicorn, its
``AsyncLLM``, tokenizer, detokenizer, chat template) and the engine core it starts;
only the model executor is the interop suite's counter executor
(``vllm_side/fake_executor.py``). The model directory (:func:`write_served_model`) is
the tiny llama of ``vllm_side/common.py`` with the package's built-in tokenizer (ids
0-255 are the bytes, 256 is ``<|endoftext|>``, the EOS; a chat template
``"User: ...\\n\\nAssistant:"``) and ``vocab_size`` the tokenizer's, so that the counter
model walks through the tokenizer's ids and wraps after the EOS.

vLLM 0.33 runs its real ``vllm`` executable, 0.34 the same entry point behind
``vllm_side/vllm_cli.py`` (the Triton-check answer): ``launched.vllm_command``. Its
environment needs, beyond what the engine core needs, ``prometheus-fastapi-instrumentator``
and ``model-hosting-container-standards`` (both in ``noxfile.py``'s recipes).

Each model step of the counter executor takes ``step_s`` (default 50 ms): vLLM's
API server then sees one token per request per step and streams one SSE event per
token, as it would at a real model's pace, even on a busy machine; with zero-cost
steps the tokens of several steps are merged into one event, as they come, and a
stream's events are no longer reproducible.

:func:`http_server` runs any such server (ours too: ``trio-enginecore api-server
--vllm ... -- SERVE_FLAGS``, in :func:`served_env`) the same way: on a loopback port,
ready when ``GET /health`` answers, stopped with its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Final

import httpx

from .launched import group_members, vllm_command, write_model
from .support import VLLM_SIDE, vllm_env

SERVED_MODEL_NAME: Final = "tiny"
MAX_MODEL_LEN: Final = 1024
STEP_S: Final = 0.05
"""How long each step of the counter model takes (the fake executor's
``TRIO_ENGINECORE_FAKE_STEP_S``)."""

SERVE_FLAGS: Final = (
    "--distributed-executor-backend",
    "fake_executor.CounterExecutor",
    "--load-format",
    "dummy",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
)
"""The engine's flags of ``vllm serve``: the counter executor, no weights. The same
flags go to our server's ``-- VLLM_SERVE_FLAGS`` (its headless ``vllm serve``)."""

_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_served_model(directory: Path) -> Path:
    """The model directory both servers serve: the tiny llama's ``config.json`` with
    the built-in tokenizer's files, its ``vocab_size`` the tokenizer's (257)."""
    from trio_enginecore.text import BUILTIN_TOKENIZER_DIR, load_tokenizer

    write_model("llama", directory)
    for name in _TOKENIZER_FILES:
        (directory / name).write_bytes((BUILTIN_TOKENIZER_DIR / name).read_bytes())
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert tokenizer_config.get("chat_template"), "the built-in tokenizer has no chat template"
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] = load_tokenizer(directory).vocab_size
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def free_port() -> int:
    """A TCP port free on the loopback interface now (the server binds it later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


_GUARD: Final = """
import os, select, signal, subprocess, sys


class Stop(Exception):
    pass


def stop(signum, frame):
    raise Stop


parent = os.pidfd_open(int(sys.argv[1]))
signal.signal(signal.SIGTERM, stop)
child = None
try:
    child = subprocess.Popen(sys.argv[2:])
    select.select([parent, os.pidfd_open(child.pid)], [], [])
except Stop:
    pass
if child is not None and child.poll() is not None:
    sys.exit(child.returncode)
orphaned = select.select([parent], [], [], 0)[0]
if child is not None:
    child.terminate()
    try:
        child.wait(20)
    except subprocess.TimeoutExpired:
        pass
if orphaned:
    os.killpg(0, signal.SIGKILL)
sys.exit(0 if child is None or child.returncode is None else child.returncode)
"""
"""Runs the server as its child, in its process group: ``guard PARENT_PID
COMMAND...``. It forwards a SIGTERM to the server and exits with its code; and when
the test's process dies first (killed, or a timeout's ``os._exit``), it stops the
server the same way, then kills the whole group: the engine core too, which
``vllm serve`` leaves behind when it is killed, or when a SIGTERM arrives before its
HTTP server has started (vLLM 0.34 hangs then). Waits on pidfds, not by polling."""


def _tail(log_path: Path, lines: int = 60) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def _stop(
    process: subprocess.Popen[bytes], name: str, log_path: Path, timeout_s: float = 30.0
) -> None:
    """SIGTERM to the guard, which passes it on to the server (``vllm serve``'s API
    server then stops its engine core), then SIGKILL to whatever is left of the
    process group; then no member of the group may be left."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout_s)
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10
    while (left := group_members(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"{name} (group {process.pid}) left processes {left}:\n{_tail(log_path)}"


@contextmanager
def http_server(
    command: Sequence[str],
    port: int,
    log_path: Path,
    *,
    env: dict[str, str],
    name: str = "the server",
    ready_timeout_s: float = 240.0,
) -> Iterator[str]:
    """Run ``command``, an HTTP server listening on ``127.0.0.1:PORT``, for the
    duration of the block, which gets its base URL (``http://127.0.0.1:PORT``) once
    ``GET /health`` answers 200. It runs under the guard (:data:`_GUARD`), in a new
    process group; its output goes to ``log_path``, whose tail a failure to start
    quotes. At the end it is stopped and its whole process group is gone."""
    url = f"http://127.0.0.1:{port}"
    guarded = [sys.executable, "-I", "-c", _GUARD, str(os.getpid()), *command]
    log: IO[bytes]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            guarded,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # the guard leads the group of the server's processes
        )
        try:
            _wait_ready(process, name, url, log_path, ready_timeout_s)
            yield url
        finally:
            _stop(process, name, log_path)


@contextmanager
def vllm_server(
    model: Path,
    log_path: Path,
    *,
    served_model_name: str = SERVED_MODEL_NAME,
    step_s: float = STEP_S,
    extra_flags: Sequence[str] = (),
    ready_timeout_s: float = 240.0,
) -> Iterator[str]:
    """Run ``vllm serve MODEL`` on a free loopback port with the counter executor for
    the duration of the block (:func:`http_server`), which gets its base URL. Its
    output (API server and engine core) goes to ``log_path``."""
    port = free_port()
    command = [
        *vllm_command(),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        served_model_name,
        *SERVE_FLAGS,
        *extra_flags,
    ]
    with http_server(
        command,
        port,
        log_path,
        env=served_env(step_s),
        name="vllm serve",
        ready_timeout_s=ready_timeout_s,
    ) as url:
        yield url


def served_env(step_s: float = STEP_S) -> dict[str, str]:
    """The environment of a server whose engine is vLLM's with the counter executor
    (``vllm serve``, or ours launching ``vllm serve --headless``): the executor's
    folder on ``PYTHONPATH``, its step time, vLLM's CPU platform, no network."""
    return vllm_env(PYTHONPATH=str(VLLM_SIDE), TRIO_ENGINECORE_FAKE_STEP_S=str(step_s))


def _wait_ready(
    process: subprocess.Popen[bytes], name: str, url: str, log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=2.0) as client:
        while True:
            code = process.poll()
            if code is not None:
                raise AssertionError(
                    f"{name} exited with code {code} before it was ready; its log "
                    f"({log_path}) ends:\n{_tail(log_path)}"
                )
            with suppress(httpx.TransportError):
                if client.get("/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{name} was not ready within {timeout_s} s; its log ({log_path}) "
                    f"ends:\n{_tail(log_path)}"
                )
            time.sleep(0.2)  # the next poll of /health

"""Our client runs under a vLLM supervisor that binds the client's listeners for it.

``vllm serve`` binds its frontends' input ROUTER and output PULL itself, before any
frontend runs, with ``make_zmq_listener`` (``vllm/utils/network_utils.py``), hands each
frontend the listening sockets as file descriptors and closes its own copies; then its
supervisor ``launch_core_engines`` starts the engine core for those addresses.
``vllm_side/launch_bound_listeners.py`` does exactly that, in the vLLM environment,
with our client as the frontend: ``listener_client.py``, run with the project's
interpreter, adopts the two descriptors (``ListenerFd``) and drives vLLM's real
engine core (counter executor).

What the test proves: the client accepts vLLM's engine on sockets it never bound, that
vLLM's helper created (a TCP one whose port the kernel chose, a Unix-domain one in a
directory vLLM created); the addresses it reads from the descriptors are the ones vLLM
bound and gave the engine; 8 concurrent streams come back exact; once the client was
open the descriptors were its own; once it is gone nothing accepts at either address
(vLLM closed its copies, the client closed its); and vLLM logged no ERROR.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from trio_enginecore import FinishReason

from ..support import expected
from . import listener_client
from .support import VllmProcess, error_lines, require_vllm, vllm_process, vllm_version

require_vllm()

CLIENT_PROGRAM = Path(listener_client.__file__)


def wanted() -> tuple[dict[str, list[int]], dict[str, str]]:
    """The exact tokens and finish reasons of ``listener_client.requests()``."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for request in listener_client.requests():
        prompt = request.prompt_token_ids
        params = request.sampling_params
        assert prompt is not None
        assert params is not None
        if params.stop_token_ids:
            (stop,) = params.stop_token_ids
            tokens[request.request_id] = expected(prompt, stop - prompt[-1])
            finish[request.request_id] = FinishReason.STOP.name
        else:
            assert params.max_tokens is not None
            tokens[request.request_id] = expected(prompt, params.max_tokens)
            finish[request.request_id] = FinishReason.LENGTH.name
    return tokens, finish


def explain(vllm: VllmProcess, client_log: Path) -> str:
    client = client_log.read_text(errors="replace") if client_log.exists() else "(none)"
    return f"\nvLLM's log ends:\n{vllm.log_tail()}\nthe client's stderr:\n{client[-4000:]}"


def next_event(vllm: VllmProcess, event: str, timeout_s: float, client_log: Path) -> dict[str, Any]:
    report = vllm.next_report(timeout_s)
    assert report["event"] == event, f"{report}{explain(vllm, client_log)}"
    return report


@pytest.mark.timeout(300)
def test_our_client_adopts_the_listeners_a_vllm_supervisor_bound(
    tmp_path: Path, timings: dict[str, float]
) -> None:
    # A directory that does not exist yet: make_zmq_listener creates it.
    socket_file = tmp_path / "listeners" / "output"
    client_log = tmp_path / "client.log"
    args = [
        "--input-address",
        "tcp://127.0.0.1:0",
        "--output-address",
        f"ipc://{socket_file}",
        "--client-python",
        sys.executable,
        "--client-program",
        str(CLIENT_PROGRAM),
        "--client-log",
        str(client_log),
    ]
    with vllm_process("launch_bound_listeners.py", args, tmp_path / "vllm.log") as vllm:
        bound = next_event(vllm, "bound", 60, client_log)
        started = next_event(vllm, "started", 180, client_log)
        client = next_event(vllm, "client", 200, client_log)["report"]
        exited = next_event(vllm, "client_exited", 30, client_log)
        stopped = next_event(vllm, "stopped", 60, client_log)
        code = vllm.process.wait(30)

    # What vLLM bound: port 0 resolved to the kernel's port, the ipc path as given; and
    # its own copies closed once the client was started.
    input_address, output_address = bound["input_address"], bound["output_address"]
    assert input_address.startswith("tcp://127.0.0.1:")
    assert int(input_address.rpartition(":")[2]) > 0
    assert output_address == f"ipc://{socket_file}"
    assert bound["closed_here"] == [True, True]
    assert len(started["pids"]) == 1

    # The client read vLLM's addresses from the descriptors, took them over, and was
    # served by vLLM's engine, exactly.
    assert client["addresses"] == [input_address, output_address]
    assert client["handed_over"] == [True, True]
    assert client["vllm_version"] == vllm_version()
    assert client["max_model_len"] == 1024
    tokens, finish = wanted()
    assert client["tokens"] == tokens
    assert client["finish"] == finish
    assert client["requests_in_flight"] == 0

    # The client exited cleanly, and with it went the last copies of the listeners.
    assert exited["code"] == 0, explain(vllm, client_log)
    assert exited["still_accepting"] == {"input": False, "output": False}
    assert "Traceback" not in client_log.read_text()

    # vLLM stopped its engine itself (no failure), removed its socket file, and logged
    # no ERROR on the way.
    assert stopped["failed"] is None
    assert stopped["ipc_files_left"] == []
    assert not socket_file.exists()
    assert code == 0, explain(vllm, client_log)
    assert error_lines(vllm.log()) == []

    timings["listener fds under vLLM: engine startup"] = started["startup_s"]
    timings["listener fds under vLLM: client ready"] = client["ready_s"]
    timings["listener fds under vLLM: 8 streams"] = client["streams_s"]

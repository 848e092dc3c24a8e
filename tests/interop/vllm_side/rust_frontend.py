"""Run vLLM's Rust OpenAI frontend (``vllm-rs frontend``) for engines that attach.

The Python supervisor part of ``vllm serve`` with ``VLLM_USE_RUST_FRONTEND=1``
(``run_multi_api_server`` in ``vllm/entrypoints/cli/serve.py`` and
``RustFrontendProcessManager`` in ``vllm/v1/utils.py``), without vLLM's engine
launcher: this script binds the frontend's listeners itself, as vLLM's
``make_zmq_listener`` does (a plain listening stream socket: ``AF_UNIX`` for
``ipc://``, ``AF_INET`` for ``tcp://``), plus the HTTP socket, and hands the three to
``vllm-rs frontend`` as inherited file descriptors. The Rust frontend adopts them as
its ROUTER (requests) and PULL (outputs) and waits for ``--engine-count`` engines to
connect and send their ready message there, as an engine started with vLLM's
``client_addresses`` does, or ours in attach mode
(``trio-enginecore serve --input-address A --output-address B``). It never
handshakes: that is the supervisor's job, and here there is none to do.

The model directory is written first (``byte_tokenizer.py``: a byte-level
``tokenizer.json`` and a ``config.json``); the frontend reads only local files.

Prints ``@{"event": "started", "port": ..., "pid": ..., "command": [...], ...}`` once
the frontend process runs (not yet serving: it serves HTTP once the engine is
connected), and ``@{"event": "exited", "code": ...}`` when it ends. SIGTERM/SIGINT stop
it (SIGTERM to vllm-rs, then SIGKILL after 10 s), as they do when the test goes away.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from byte_tokenizer import write_model_dir
from common import exit_with_parent, fail, say


def listener(address: str) -> tuple[socket.socket, str]:
    """A listening socket for a ZMQ bind address (vLLM's ``make_zmq_listener``)."""
    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rest)
        sock.bind(rest)
    elif scheme == "tcp":
        host, _, port = rest.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, int(port)))
        address = f"tcp://{host}:{sock.getsockname()[1]}"
    else:
        fail(f"cannot hand over a {scheme} listener: {address}")
    sock.listen()
    return sock, address


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True, help="where to write the model")
    parser.add_argument("--input-address", required=True, help="ipc:// or tcp:// to bind")
    parser.add_argument("--output-address", required=True, help="ipc:// or tcp:// to bind")
    parser.add_argument("--served-model-name", default="byte-ngram")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--engine-ready-timeout-s", type=int, default=60)
    args = parser.parse_args()
    exit_with_parent()

    model_dir, vllm_rs, check = write_model_dir(Path(args.model_dir))
    input_sock, input_address = listener(args.input_address)
    output_sock, output_address = listener(args.output_address)
    http = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    http.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    http.bind((args.host, 0))
    http.listen()
    port = http.getsockname()[1]

    # What RustFrontendProcessManager puts in --args-json for
    # `vllm serve MODEL --served-model-name NAME`: the non-default serve arguments
    # (model_tag is the positional model) and the two env-driven settings it forwards.
    shared = {
        "model_tag": str(model_dir),
        "served_model_name": [args.served_model_name],
        "engine_ready_timeout_secs": args.engine_ready_timeout_s,
        "http_timeout_keep_alive": 5,
    }
    fds = [http.fileno(), input_sock.fileno(), output_sock.fileno()]
    command = [
        str(vllm_rs),
        "frontend",
        "--listen-fd",
        str(fds[0]),
        "--input-listener-fd",
        str(fds[1]),
        "--output-listener-fd",
        str(fds[2]),
        "--engine-start-index",
        "0",
        "--engine-count",
        "1",
        "--data-parallel-size",
        "1",
        "--args-json",
        json.dumps(shared, sort_keys=True),
    ]
    # Its stdout goes to our stderr (the log): our stdout carries only the reports.
    process = subprocess.Popen(command, pass_fds=fds, stdout=sys.stderr)
    for sock in (http, input_sock, output_sock):
        sock.close()  # the frontend owns them now, as after vLLM's hand-over

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    say(
        event="started",
        pid=process.pid,
        port=port,
        input_address=input_address,
        output_address=output_address,
        model_dir=str(model_dir),
        command=command,
        tokenizer_check=check,
    )
    stopped = False
    try:
        process.wait()
    except SystemExit:
        stopped = True
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for address in (input_address, output_address):
            if address.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(address.removeprefix("ipc://"))
    say(event="exited", code=process.returncode, stopped=stopped)
    return 0 if stopped or process.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

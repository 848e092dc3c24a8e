"""vLLM as the supervisor that binds: it binds the client's listeners, then starts the
client with their descriptors, then the engine.

What ``vllm serve`` does for its own frontends (``bind_engine_zmq_listeners`` and the
frontend process managers in ``vllm/v1/utils.py``), with our client as the frontend:

1. bind and listen the client's input (ROUTER) and output (PULL) sockets with vLLM's
   ``make_zmq_listener`` (``vllm/utils/network_utils.py``), which returns a
   ``ZmqListener``: the address it bound (a ``tcp://`` port 0 resolved to the port the
   kernel chose) and the listening ``socket.socket``;
2. start the client program (``--client-python --client-program``, in the project's
   environment) with the two descriptors inherited (``pass_fds``) and their numbers as
   arguments, its stderr in ``--client-log``;
3. close this process's copies (``ZmqListener.close``), as vLLM does once its frontend
   has started: from then on only the client holds the listeners;
4. start the engine core for those addresses with vLLM's supervisor,
   ``launch_core_engines`` (as ``launch_attach.py``), which handshakes with it on its
   own private socket; the engine then connects to the addresses vLLM bound, where the
   client accepts.

Reports, in order: ``@{"event": "bound", ...}`` (the addresses and descriptors, the
client's pid), ``@{"event": "started", ...}`` (the engine pids, once READY),
``@{"event": "client", "report": {...}}`` for each report line of the client's,
``@{"event": "client_exited", ...}`` (its exit code, and whether anything still
accepts at either address now that it is gone), and ``@{"event": "stopped", ...}``.
If an engine dies first, ``@{"event": "engine_died", ...}`` comes instead of the
client's reports. SIGTERM/SIGINT stop everything.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import exit_with_parent, fail, say, vllm_config, write_model


def accepts_connections(address: str) -> bool:
    """Whether something still listens at ``address`` (``tcp://`` or ``ipc://``)."""
    target: str | tuple[str, int]
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        family, target = socket.AF_INET, (host, int(port))
    else:
        family, target = socket.AF_UNIX, address.removeprefix("ipc://")
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(target)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input-address", required=True, help="ipc:// or tcp:// to bind")
    parser.add_argument("--output-address", required=True, help="ipc:// or tcp:// to bind")
    parser.add_argument("--client-python", required=True)
    parser.add_argument("--client-program", required=True)
    parser.add_argument("--client-log", required=True)
    parser.add_argument("--client-timeout-s", type=float, default=180.0)
    args = parser.parse_args()
    exit_with_parent()

    import zmq
    from fake_executor import CounterExecutor
    from vllm.utils.network_utils import make_zmq_listener
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    config = vllm_config(write_model("llama"))
    inputs = make_zmq_listener(args.input_address, zmq.ROUTER)
    outputs = make_zmq_listener(args.output_address, zmq.PULL)
    fds = [inputs.socket.fileno(), outputs.socket.fileno()]
    client_log = open(args.client_log, "w")  # noqa: SIM115 (open until the end)
    client = subprocess.Popen(
        [args.client_python, args.client_program, *map(str, fds)],
        pass_fds=fds,
        stdout=subprocess.PIPE,
        stderr=client_log,
        text=True,
    )
    # The client has its copies; vLLM's go, as vLLM's frontend managers close theirs.
    inputs.close()
    outputs.close()
    say(
        event="bound",
        input_address=inputs.address,
        output_address=outputs.address,
        fds=fds,
        client_pid=client.pid,
        closed_here=[inputs.socket.fileno() == -1, outputs.socket.fileno() == -1],
    )

    client_lines: list[str] = []

    def read_client() -> None:
        assert client.stdout is not None
        client_lines.extend(client.stdout)

    reader = threading.Thread(target=read_client, name="client-stdout", daemon=True)
    reader.start()

    addresses = EngineZmqAddresses(inputs=[inputs.address], outputs=[outputs.address])
    start = time.monotonic()
    manager = None
    try:
        with launch_core_engines(config, CounterExecutor, False, addresses) as launch:
            manager = launch.engine_manager
        assert manager is not None
        say(
            event="started",
            pids=[process.pid for process in manager.processes],
            startup_s=time.monotonic() - start,
        )
        deadline = time.monotonic() + args.client_timeout_s
        while client.poll() is None and time.monotonic() < deadline:
            died = connection.wait(manager.sentinels(), timeout=0.2)
            if died:
                say(event="engine_died", exits=manager.finished_procs())
                break
        if client.poll() is None:
            client.kill()
        code = client.wait()
        reader.join(10)
        for line in client_lines:
            if line.startswith("@{"):
                say(event="client", report=json.loads(line[1:]))
        say(
            event="client_exited",
            code=code,
            # The client closed its listeners, and vLLM's copies were closed above:
            # nothing may accept at either address any more.
            still_accepting={
                "input": accepts_connections(inputs.address),
                "output": accepts_connections(outputs.address),
            },
        )
    except SystemExit:
        raise
    except BaseException as exc:
        fail(f"{type(exc).__name__}: {exc}")
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        client_log.close()
        if manager is not None:
            manager.shutdown()
        # ZmqListener.cleanup: the socket is closed already; the ipc:// file goes too.
        inputs.cleanup()
        outputs.cleanup()
        say(
            event="stopped",
            failed=manager.failed_proc_name if manager is not None else None,
            exits=manager.finished_procs() if manager is not None else {},
            ipc_files_left=[
                address
                for address in (inputs.address, outputs.address)
                if address.startswith("ipc://") and os.path.exists(address[len("ipc://") :])
            ],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

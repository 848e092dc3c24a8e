"""Start vLLM engine cores for a client that bound its own ROUTER and PULL (attach).

vLLM's supervisor, ``launch_core_engines`` (``vllm/v1/engine/utils.py``), as vLLM's
``MPClient`` calls it after binding its sockets, but for a client in another process:
ours, which binds ``--input-address`` (ROUTER) and ``--output-address`` (PULL) and
waits for the engines' ready messages there. vLLM handshakes with the engines it
started over its own private socket, and (for data parallelism) starts its
``DPCoordinator``. Leaving the ``with`` block waits for every engine's READY; then this
process watches the engines and stops when one exits, or on SIGTERM/SIGINT.

Prints ``@{"event": "started", ...}`` (the engine pids, the coordinator's addresses if
any) once every engine is READY, and ``@{"event": "stopped", ...}`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import ANNOUNCE_VERSION_VARIABLE, exit_with_parent, say, vllm_config, write_model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input-address", action="append", required=True)
    parser.add_argument("--output-address", action="append", required=True)
    parser.add_argument("--model", default="llama", choices=["llama", "mixtral"])
    parser.add_argument(
        "--model-dir", help="serve this model directory (its config.json) instead of --model"
    )
    parser.add_argument(
        "--announce-version",
        help="the version the engine core announces in its ready message instead of "
        'vLLM\'s own ("dev", as vLLM run from a source tree)',
    )
    parser.add_argument("--data-parallel-size", type=int, default=1)
    args = parser.parse_args()
    exit_with_parent()
    if args.announce_version:
        # Read where the executor is imported, here and in each engine process.
        os.environ[ANNOUNCE_VERSION_VARIABLE] = args.announce_version

    from fake_executor import CounterExecutor
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines

    model_dir = args.model_dir or write_model(args.model)
    config = vllm_config(model_dir, data_parallel_size=args.data_parallel_size)

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    addresses = EngineZmqAddresses(inputs=args.input_address, outputs=args.output_address)
    start = time.monotonic()
    manager = coordinator = None
    try:
        with launch_core_engines(config, CounterExecutor, False, addresses) as launch:
            manager, coordinator = launch.engine_manager, launch.coordinator
        assert manager is not None
        say(
            event="started",
            pids=[process.pid for process in manager.processes],
            startup_s=time.monotonic() - start,
            coordinator_pid=coordinator.proc.pid if coordinator is not None else None,
            stats_publish_address=launch.addresses.frontend_stats_publish_address,
        )
        manager.monitor_engine_liveness()
    finally:
        if manager is not None:
            manager.shutdown()
        if coordinator is not None:
            coordinator.shutdown()
        say(
            event="stopped",
            failed=manager.failed_proc_name if manager is not None else None,
            exits=manager.finished_procs() if manager is not None else {},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

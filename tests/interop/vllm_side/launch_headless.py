"""Start vLLM engine cores headless, joining a frontend's handshake address.

What ``vllm serve --headless`` does (vLLM's ``run_headless``): vLLM's own
``CoreEngineProcManager(local_client=False, ...)`` starts ``EngineCoreProc``
processes that say HELLO to the frontend at ``--handshake-address``, receive the
addresses to serve, connect to them and report READY; then this process watches them
and stops when one exits, or on SIGTERM/SIGINT. Only the executor is ours.

Prints ``@{"event": "started", "pids": [...]}`` once the engine processes exist and
``@{"event": "stopped", "failed": name-or-null}`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import ANNOUNCE_VERSION_VARIABLE, exit_with_parent, say, vllm_config, write_model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--handshake-address", required=True)
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
    parser.add_argument("--data-parallel-rank", type=int, default=0)
    parser.add_argument("--local-engines", type=int, default=1)
    args = parser.parse_args()
    exit_with_parent()
    if args.announce_version:
        # Read where the executor is imported, here and in each engine process.
        os.environ[ANNOUNCE_VERSION_VARIABLE] = args.announce_version

    from fake_executor import CounterExecutor
    from vllm.v1.engine.utils import CoreEngineProcManager

    parallel = {}
    if args.data_parallel_size > 1:  # vLLM refuses data-parallel settings without DP
        parallel = {
            "data_parallel_size": args.data_parallel_size,
            "data_parallel_size_local": args.local_engines,
            "data_parallel_start_rank": args.data_parallel_rank,
        }
    model_dir = args.model_dir or write_model(args.model)
    config = vllm_config(model_dir, headless=True, **parallel)

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    manager = CoreEngineProcManager(
        local_engine_count=args.local_engines,
        start_index=args.data_parallel_rank,
        local_start_index=0,
        vllm_config=config,
        local_client=False,
        handshake_address=args.handshake_address,
        executor_class=CounterExecutor,
        log_stats=False,
    )
    say(event="started", pids=[process.pid for process in manager.processes])
    try:
        manager.monitor_engine_liveness()
    finally:
        manager.shutdown()
        say(event="stopped", failed=manager.failed_proc_name, exits=manager.finished_procs())
    return 0


if __name__ == "__main__":
    sys.exit(main())

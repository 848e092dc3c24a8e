"""A fake of vLLM's command line, for testing our launcher of vLLM's engine cores.

The real ``vllm serve MODEL --headless`` is tested in the interop sessions
(``tests/interop/test_client_launches_vllm.py``, with vLLM installed); this stands in
for it in the default suite, with its shape as ``VllmLauncher`` sees it and nothing
else:

- ``serve MODEL --headless --data-parallel-address H --data-parallel-rpc-port P
  [--data-parallel-size N --data-parallel-size-local 1 --data-parallel-start-rank R]``
  (the rank flags only with ``N > 1``, as vLLM wants them);
- it is a *launcher*: it logs a few lines on stderr in vLLM's format
  (``(MainProcess pid=N) INFO 12-06 22:22:08 [serve.py:239] Launching ...``, one
  glog line as torch writes them, a DEBUG line when ``VLLM_LOGGING_LEVEL=DEBUG``),
  then starts the engine core as its *child*, in its own process group, and waits
  for it; it logs the child's pid (``... engine core pid=M``);
- the engine core is the project's reference engine (``trio_enginecore serve
  --headless --handshake-address tcp://H:P --rank R --data-parallel-size N``), its
  log lines in vLLM's format with vLLM's process prefix (``(EngineCore_DP0 pid=M)
  INFO ...``), its level from ``VLLM_LOGGING_LEVEL``. It gets no lifeline and no
  ``--exit-with-parent``: as vLLM's engine core, it dies only of a signal to its
  process group (the client's lifeline SIGIO, the client's kills) or of its own;
- when the engine core ends, however, the launcher exits with code 0, as vLLM's
  does; SIGTERM (and SIGINT) are forwarded to the engine core, whose end the
  launcher then waits for.

Flags of its own: ``--fail-with MESSAGE`` prints a traceback ending in
``ValueError: MESSAGE`` and exits 1 without starting an engine core (vLLM refusing a
model); ``--load-time-s S`` has the engine core sleep S seconds before it says HELLO
(vLLM loading a model); any other flag (``--step-time-s 0.01``) is passed to the
reference engine.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType


def _vllm_line(process: str, level: str, where: str, message: str) -> str:
    stamp = time.strftime("%m-%d %H:%M:%S")
    return f"({process} pid={os.getpid()}) {level} {stamp} [{where}] {message}"


def _say(level: str, where: str, message: str) -> None:
    print(_vllm_line("MainProcess", level, where, message), file=sys.stderr, flush=True)


def _glog_line(letter: str, where: str, message: str) -> str:
    now = time.time()
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now))
    micros = int(now % 1 * 1_000_000)
    return f"{letter}{stamp}.{micros:06d} {os.getpid()} {where}] {message}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm serve")
    parser.add_argument("model")
    parser.add_argument("--headless", action="store_true")
    parser.add_argument("--data-parallel-address", required=True)
    parser.add_argument("--data-parallel-rpc-port", type=int, required=True)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size-local", type=int)
    parser.add_argument("--data-parallel-start-rank", type=int)
    parser.add_argument("--fail-with", metavar="MESSAGE")
    parser.add_argument("--load-time-s", type=float, default=0.0)
    return parser


def _fail(message: str) -> int:
    _say("ERROR", "core.py:708", "EngineCore failed to start.")
    print(
        "Traceback (most recent call last):\n"
        '  File "/venv/lib/python3.12/site-packages/vllm/entrypoints/cli/main.py", '
        "line 73, in main\n"
        "    args.dispatch_function(args)\n"
        '  File "/venv/lib/python3.12/site-packages/vllm/engine/arg_utils.py", '
        "line 1203, in create_engine_config\n"
        "    raise ValueError(message)\n"
        f"ValueError: {message}",
        file=sys.stderr,
        flush=True,
    )
    return 1


def serve(argv: list[str]) -> int:
    """``vllm serve MODEL --headless ...``: the launcher."""
    parser = _parser()
    args, engine_flags = parser.parse_known_args(argv)
    if not args.headless:
        parser.error("this fake only launches headless engine cores (--headless)")
    rank_flags = (args.data_parallel_size_local, args.data_parallel_start_rank)
    if args.data_parallel_size == 1 and rank_flags != (None, None):
        parser.error("--data-parallel-size-local/--data-parallel-start-rank need data parallelism")
    if args.data_parallel_size > 1 and (args.data_parallel_size_local or 1) != 1:
        parser.error("this fake launches one engine core (--data-parallel-size-local 1)")
    rank = args.data_parallel_start_rank or 0
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO")
    address = f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}"

    print(
        _glog_line("W", "torch/_library/triton.py:53", "Triton not available"),
        file=sys.stderr,
        flush=True,
    )
    if level == "DEBUG":
        _say("DEBUG", "__init__.py:38", "No plugins for group vllm.platform_plugins found.")
    _say("INFO", "utils.py:253", f"non-default args: {{'model': {args.model!r}, 'headless': True}}")
    if args.fail_with is not None:
        return _fail(args.fail_with)
    _say(
        "INFO",
        "serve.py:239",
        f"Launching 1 data parallel engine(s) in headless mode, with head node address {address}.",
    )
    _say("WARNING", "interface.py:522", "Pin memory is not available on this platform.")

    child: subprocess.Popen[bytes] | None = None
    stopping: list[int] = []

    def forward(signum: int, _: FrameType | None) -> None:
        stopping.append(signum)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    engine_core = [
        sys.executable,
        str(Path(__file__).resolve()),
        "engine-core",
        f"EngineCore_DP{rank}",
        str(args.load_time_s),
        "serve",
        "--headless",
        "--handshake-address",
        address,
        "--rank",
        str(rank),
        "--data-parallel-size",
        str(args.data_parallel_size),
        "--log-level",
        level,
        *engine_flags,
    ]
    # Same process group (not a new session): the client's signals to the group reach
    # the engine core too. Its stderr is the launcher's own; the lifeline's read end,
    # which the launcher holds, is not passed on (close_fds).
    child = subprocess.Popen(engine_core, stdin=subprocess.DEVNULL)
    _say("INFO", "utils.py:837", f"Started EngineCore_DP{rank}: engine core pid={child.pid}")
    if stopping:  # a signal came while the engine core was being started
        os.kill(child.pid, stopping[0])
    code = child.wait()
    if stopping:
        _say("INFO", "launcher.py:101", "Shutting down.")
    else:
        _say(
            "ERROR",
            "utils.py:880",
            f"Engine core proc EngineCore_DP{rank} died unexpectedly (exit code {code}), "
            "shutting down.",
        )
    return 0


def engine_core(argv: list[str]) -> int:
    """The engine core: ``trio_enginecore serve ARGUMENTS`` logging as vLLM's engine
    core does (``(EngineCore_DP0 pid=N) INFO 12-06 22:22:08 [file.py:line] ...``)."""
    process, load_time_s, *arguments = argv
    # This script's directory (tests/) must not shadow anything the engine imports.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [entry for entry in sys.path if entry and str(Path(entry).resolve()) != here]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"({process} pid={os.getpid()}) %(levelname)s %(asctime)s "
            "[%(filename)s:%(lineno)d] %(message)s",
            datefmt="%m-%d %H:%M:%S",
        )
    )
    root = logging.getLogger()
    root.addHandler(handler)  # the CLI's own logging.basicConfig then does nothing
    root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    if float(load_time_s) > 0:
        logging.getLogger("vllm.model_executor").info("Loading weights (%s s)...", load_time_s)
        time.sleep(float(load_time_s))
    sys.argv = ["trio_enginecore", *arguments]
    try:
        runpy.run_module("trio_enginecore", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:1] == ["engine-core"]:
        return engine_core(argv[1:])
    print("usage: vllm serve MODEL --headless ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The ``trio-enginecore`` command line."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

from . import __version__
from .config import MODELS, add_engine_flags, config_from_flags

_SERVE_DESCRIPTION = """\
Run one reference EngineCore process. It speaks vLLM 0.33's engine-core protocol, so
trio-enginecore clients and vLLM's own clients can drive it.

Two ways to start:
  attach mode     --input-address A --output-address B: connect straight to a client
                  that bound those addresses (vLLM's `client_addresses`), send the
                  ready message and serve. When the client leaves (or is killed),
                  abort its requests and serve the next client to bind A and B.
  handshake mode  --handshake-address H: say HELLO to the client at H, receive the
                  addresses to serve, then serve and report READY.

SIGTERM or SIGINT drains: new requests are refused, in-flight ones may finish for
--drain-timeout-s seconds, the rest are aborted, and the process exits 0. A second
signal stops at once. Exit codes: 0 drained, 1 fatal engine error (after sending
ENGINE_CORE_DEAD to the clients), 2 bad command line or an address ZeroMQ cannot use
(malformed, unknown transport; one line on stderr), 3 startup failed (no handshake
reply, the coordinator never ready, ...), 4 the client that launched this engine is
gone (--lifeline-fd or --exit-with-parent; stopped at once, nothing drained).
"""

_COORDINATOR_DESCRIPTION = """\
Run the data-parallel coordinator of a group of engines and their clients, until
SIGTERM or SIGINT. Clients launch one themselves; run it as a program to share one
between clients on several hosts. Exit codes: 0 stopped by a signal, 2 bad command
line or an address that cannot be bound (in use, malformed, an interface this host
does not have; one line on stderr).
"""

_KEYGEN_DESCRIPTION = """\
Write NAME.key (the public key, to give to the other side) and NAME.key_secret (both
halves, mode 0600, to keep) in DIRECTORY. An existing pair is never overwritten
without --force. Exit codes: 0 written, 1 a file of the pair already exists (nothing
written) or cannot be written, 2 bad command line (an empty NAME, a NAME that is a path).
"""

EXIT_INTERRUPTED = 130
"""The exit code after Ctrl-C (128 + SIGINT), as shells report it."""


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


def _fd_number(text: str) -> int:
    """An argparse type: the number of a file descriptor this process has open."""
    try:
        fd = int(text)
    except ValueError:
        message = f"expected a file descriptor number, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    try:
        os.fstat(fd)
    except (OSError, OverflowError, ValueError):
        raise argparse.ArgumentTypeError(f"{fd} is not an open file descriptor") from None
    return fd


def _key_pair_name(text: str) -> str:
    """An argparse type: the name stem of a key pair (the check write_key_pair makes)."""
    from ._curve import check_key_pair_name

    try:
        check_key_pair_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level on stderr (default: %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "relay"],
        help="'text': timestamped lines for a terminal or a log file; 'relay': 'LEVEL "
        "message' lines with no timestamp, for a parent process that re-logs them at "
        "their level (clients that launch engines ask for it) (default: %(default)s)",
    )


def _configure_logging(args: argparse.Namespace, tag: str) -> None:
    if args.log_format == "relay":
        template = "%(levelname)s %(message)s"
    else:
        template = f"%(asctime)s {tag} %(levelname)s %(message)s"
    logging.basicConfig(level=args.log_level, format=template, stream=sys.stderr)


def _serve_parser(serve: argparse.ArgumentParser) -> None:
    where = serve.add_argument_group("where to serve (attach mode or handshake mode)")
    where.add_argument(
        "--input-address",
        action="append",
        default=[],
        metavar="ADDR",
        help="a client's ROUTER address to connect a DEALER to (attach mode; repeat for "
        "several clients, in client-index order)",
    )
    where.add_argument(
        "--output-address",
        action="append",
        default=[],
        metavar="ADDR",
        help="a client's PULL address to PUSH outputs to (attach mode; one per input)",
    )
    where.add_argument(
        "--handshake-address",
        metavar="ADDR",
        help="a client's handshake ROUTER address (handshake mode)",
    )
    where.add_argument(
        "--headless",
        action="store_true",
        help="this engine runs on another host than the client (reported in the handshake)",
    )
    where.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this engine exits (checked twice a "
        "second, from the end of the imports on; for engines started by hand)",
    )
    where.add_argument(
        "--lifeline-fd",
        type=_fd_number,
        metavar="FD",
        help="the read end of a pipe whose write end the launching process keeps open: "
        "stop at once when it reads end-of-file, i.e. when that process is gone, however "
        "it died (clients that launch engines pass it; checked before the handshake)",
    )
    where.add_argument(
        "--handshake-timeout-s",
        type=float,
        default=300.0,
        metavar="S",
        help="how long to wait for the client's handshake reply (default: 300)",
    )
    where.add_argument(
        "--rejoin-timeout-s",
        type=_non_negative_seconds,
        default=300.0,
        metavar="S",
        help="--headless: when the frontend leaves (its connection closes), drop its "
        "requests and join the next frontend at the handshake address, waiting up to S "
        "seconds for one, then exit with code 4; 0: exit when the frontend leaves "
        "(default: 300)",
    )
    security = serve.add_argument_group("authentication (CURVE, on tcp:// connections)")
    security.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="this engine's secret key certificate (NAME.key_secret from "
        "`trio-enginecore keygen`); requires --curve-server-key",
    )
    security.add_argument(
        "--curve-server-key",
        metavar="KEY",
        help="the client's public key: its NAME.key certificate, or the 40 Z85 characters "
        "(write --curve-server-key=KEY: a key may start with '-')",
    )
    # One option per engine setting, from EngineConfig itself.
    add_engine_flags(serve)
    _add_log_level(serve)


def _bench_parser(bench: argparse.ArgumentParser) -> None:
    bench.description = (
        "Measure the Trio client against a reference engine on this machine: throughput, "
        "client CPU per token and per message, latency, utility round trip. The full "
        "comparison with the asyncio and blocking baselines is `nox -s bench`."
    )
    bench.add_argument(
        "--concurrency",
        type=_positive_int,
        nargs="+",
        default=[1, 64, 512],
        metavar="C",
        help="requests in flight at once; several values run in turn (default: 1 64 512)",
    )
    bench.add_argument(
        "--tokens", type=_positive_int, default=64, help="tokens per request (default: 64)"
    )
    bench.add_argument(
        "--step-time-s", type=float, default=0.0, help="simulated engine step time (default: 0)"
    )
    bench.add_argument(
        "--duration-s", type=float, default=3.0, help="seconds per workload (default: 3)"
    )
    bench.add_argument(
        "--mode",
        choices=["batch", "stream", "both"],
        default="both",
        help="batch API (add_request/get_output), per-request streams, or both",
    )
    bench.add_argument("--model", choices=MODELS, default="counter", help="engine model")
    bench.add_argument(
        "--transport", choices=["ipc", "tcp"], default="ipc", help="ipc:// or loopback tcp://"
    )
    bench.add_argument(
        "--utility-calls", type=int, default=200, help="utility round trips to time (default: 200)"
    )
    bench.add_argument(
        "--quick", action="store_true", help="tiny sizes and 0.5 s per workload (a smoke test)"
    )
    bench.add_argument(
        "--json",
        action="store_true",
        help="print the results as JSON on stdout, and nothing else (the table goes to stderr)",
    )
    bench.epilog = (
        "Progress goes to stderr: one line redrawn in place on a terminal, otherwise a "
        "plain line every few seconds at most. Ctrl-C stops the engine and exits 130."
    )


def _run_bench(args: argparse.Namespace) -> int:
    import json

    import trio

    from ._bench import format_table, run_cli_bench

    if args.quick:
        args.concurrency, args.duration_s, args.utility_calls = [1, 16], 0.5, 20
    modes: list[Literal["batch", "stream"]] = (
        ["batch", "stream"] if args.mode == "both" else [args.mode]
    )
    rows = trio.run(
        lambda: run_cli_bench(
            concurrency=args.concurrency,
            tokens=args.tokens,
            step_time_s=args.step_time_s,
            duration_s=args.duration_s,
            modes=modes,
            model=args.model,
            transport=args.transport,
            utility_calls=args.utility_calls,
        ),
        restrict_keyboard_interrupt_to_checkpoints=True,
    )
    if args.json:
        print(format_table(rows), file=sys.stderr)
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
    return 0


def _api_server_parser(commands: Any) -> None:
    try:
        from .server._command import DESCRIPTION, add_api_server_arguments
    except ImportError:  # the `server` extra is not installed
        commands.add_parser(
            "api-server",
            help="serve OpenAI's API (needs the 'server' extra)",
            description="Needs the 'server' extra: pip install '/path/to/trio-enginecore[server]'.",
        )
        return
    add_api_server_arguments(
        commands.add_parser(
            "api-server",
            help="serve OpenAI's API (completions, chat, models, metrics) over engine cores",
            description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-enginecore",
        description="A Trio-native engine-core client for vLLM-compatible LLM engines.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "demo",
        help="stream generations from the built-in engine",
        description="Launch the built-in engine, stream generations, cancel one, call "
        "utilities and shut down. Ctrl-C stops the engine and exits 130.",
    )
    _serve_parser(
        commands.add_parser(
            "serve",
            help="run a reference EngineCore process",
            description=_SERVE_DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    _api_server_parser(commands)
    _bench_parser(commands.add_parser("bench", help="measure the Trio client on your machine"))
    keygen = commands.add_parser(
        "keygen",
        help="write a CURVE key pair for authenticated TCP",
        description=_KEYGEN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    keygen.add_argument(
        "name", type=_key_pair_name, help="file name stem, e.g. 'client' or 'engine-3'"
    )
    keygen.add_argument(
        "--directory", default=".", help="where to write them (default: the current directory)"
    )
    keygen.add_argument(
        "--force", action="store_true", help="replace an existing NAME.key / NAME.key_secret"
    )
    coordinator = commands.add_parser(
        "coordinator",
        help="run the data-parallel coordinator (clients launch it themselves)",
        description=_COORDINATOR_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    coordinator.add_argument(
        "--engines", type=_positive_int, required=True, help="number of engines (at least 1)"
    )
    coordinator.add_argument(
        "--stats-address", required=True, help="address to bind for the engines' counts (PULL)"
    )
    coordinator.add_argument(
        "--engine-publish-address",
        required=True,
        help="address to bind for the engines' START_DP_WAVE subscription (XPUB)",
    )
    coordinator.add_argument(
        "--publish-address", required=True, help="address to bind for clients (XPUB)"
    )
    coordinator.add_argument(
        "--min-interval-s",
        type=float,
        default=0.1,
        help="least time between two publications to clients (default: %(default)s)",
    )
    coordinator.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the launching process exits"
    )
    coordinator.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="CURVE on the tcp:// addresses: the frontends' secret key certificate (the "
        "clients' and the coordinator's key pair); requires --curve-allow",
    )
    coordinator.add_argument(
        "--curve-allow",
        action="append",
        default=[],
        metavar="KEY",
        help="an engine public key to admit: a NAME.key file, or --curve-allow=KEY (Z85); "
        "repeat per engine",
    )
    _add_log_level(coordinator)
    return parser


def _run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .engine._serve import serve

    attach = bool(args.input_address or args.output_address)
    if attach == (args.handshake_address is not None):
        parser.error("serve needs either --input-address/--output-address or --handshake-address")
    if attach and len(args.input_address) != len(args.output_address):
        parser.error("give one --output-address per --input-address")
    curve = None
    if (args.curve_secret_key is None) != (args.curve_server_key is None):
        parser.error("--curve-secret-key and --curve-server-key go together")
    if args.curve_secret_key is not None:
        from ._curve import CurveClient, CurveKeyPair, load_public_key

        try:
            curve = CurveClient(
                CurveKeyPair.load(args.curve_secret_key), load_public_key(args.curve_server_key)
            )
        except (OSError, ValueError) as exc:
            parser.error(f"CURVE keys: {exc}")
    try:
        config = config_from_flags(args)
    except ValueError as exc:
        parser.error(str(exc))
    _configure_logging(args, f"engine[{config.data_parallel_rank}]")
    return serve(
        config,
        inputs=args.input_address,
        outputs=args.output_address,
        handshake_address=args.handshake_address,
        headless=args.headless,
        handshake_timeout_s=args.handshake_timeout_s,
        rejoin_timeout_s=args.rejoin_timeout_s,
        exit_with_parent=args.exit_with_parent,
        lifeline_fd=args.lifeline_fd,
        curve=curve,
    )


def _run_api_server(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        from .server._command import run_api_server
    except ImportError as exc:
        parser.error(
            f"api-server needs the 'server' extra ({exc.name} is missing): "
            "pip install '/path/to/trio-enginecore[server]'"
        )
    return run_api_server(parser, args)


def _run_keygen(args: argparse.Namespace) -> int:
    from ._curve import write_key_pair

    try:
        public, secret = write_key_pair(args.directory, args.name, overwrite=args.force)
    except FileExistsError as exc:
        print(
            f"trio-enginecore keygen: {exc.filename} already exists; pass --force to replace "
            "the key pair (nothing was written)",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        print(f"trio-enginecore keygen: cannot write the key pair: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def _interrupted(error: BaseException) -> bool:
    """Whether ``error`` is Ctrl-C: a KeyboardInterrupt, or a group holding one (Trio
    delivers it through the nurseries it crosses, beside the cancellations it caused)."""
    if isinstance(error, KeyboardInterrupt):
        return True
    if isinstance(error, BaseExceptionGroup):
        group = cast("BaseExceptionGroup[BaseException]", error)
        return group.subgroup(KeyboardInterrupt) is not None
    return False


def _unless_interrupted(command: str, run: Callable[[], int]) -> int:
    """``run()``, or one line and exit code 130 after Ctrl-C (and no traceback)."""
    try:
        return run()
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        if not _interrupted(exc):
            raise
        print(f"trio-enginecore {command}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _run_demo() -> int:
    import trio

    from ._demo import run_demo

    # Ctrl-C is raised at a checkpoint only, never in the middle of the client's own
    # bookkeeping: leaving the client's block then stops the engine as usual.
    trio.run(run_demo, restrict_keyboard_interrupt_to_checkpoints=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trio-enginecore`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    command: str = args.command
    return _unless_interrupted(command, lambda: _run_command(parser, args))


def _run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _run_serve(parser, args)
    if args.command == "bench":
        return _run_bench(args)
    if args.command == "api-server":
        return _run_api_server(parser, args)
    if args.command == "keygen":
        return _run_keygen(args)
    if args.command == "coordinator":
        from ._curve import CurveServer
        from .coordinator import CoordinatorAddresses
        from .coordinator._command import coordinator_command

        _configure_logging(args, "coordinator")
        if bool(args.curve_secret_key) != bool(args.curve_allow):
            parser.error("--curve-secret-key and --curve-allow go together")
        curve = None
        if args.curve_secret_key:
            try:
                curve = CurveServer.from_files(args.curve_secret_key, args.curve_allow)
            except (OSError, ValueError) as exc:
                parser.error(f"CURVE keys: {exc}")
        return coordinator_command(
            curve=curve,
            engines=args.engines,
            addresses=CoordinatorAddresses(
                stats=args.stats_address,
                engine_publish=args.engine_publish_address,
                publish=args.publish_address,
            ),
            min_interval_s=args.min_interval_s,
            exit_with_parent=args.exit_with_parent,
        )
    return _run_demo()  # "demo", the only command left


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

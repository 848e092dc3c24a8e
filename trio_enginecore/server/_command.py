"""``trio-enginecore api-server``: the OpenAI-compatible server as a program.

With no arguments it launches the built-in reference engine (the ``ngram`` model) and
serves it with its shipped tokenizer on 127.0.0.1:8000. ``--vllm`` launches vLLM's
engine cores instead (``vllm serve MODEL --headless`` per rank, owned by this process),
``--attach`` binds the addresses vLLM engine cores started elsewhere connect to.

SIGINT or SIGTERM: stop accepting, let requests in flight finish for
``--shutdown-timeout-s``, cancel the rest (their engine requests aborted), stop the
engines, exit 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Final, cast

import trio

from .._groups import leaves
from .._program import EXIT_ADDRESS, EXIT_OK, EXIT_STARTUP
from ..config import MODELS, EngineConfig
from ..errors import EngineStartupError, ModelDirectoryError

__all__ = ["add_api_server_arguments", "run_api_server"]

logger = logging.getLogger("trio_enginecore.server")

DESCRIPTION: Final = """\
Serve OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics with vLLM's metric names, /tokenize, /detokenize) over engine cores.

Engines: by default the built-in reference engine (its 'ngram' model writes English
with the shipped tokenizer); --vllm launches vLLM's engine cores (`vllm serve MODEL
--headless` per rank; vLLM's flags after `--`); --remote serves headless engine cores
that join its handshake address (on other hosts too); --attach binds the addresses of
vLLM engine cores started elsewhere.

SIGINT or SIGTERM stops accepting, lets requests in flight finish for
--shutdown-timeout-s, aborts the rest and stops the engines (exit 0); a second signal
stops at once. Exit codes: 0 stopped by a signal, 2 bad command line or an address
that cannot be bound, 3 the engines did not start or the model directory cannot be used.
"""


def add_api_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``api-server`` command's options."""
    serving = parser.add_argument_group("what and where to serve")
    serving.add_argument(
        "--model",
        metavar="DIR",
        help="the model directory: its tokenizer and chat template (default: the "
        "built-in tokenizer, for the reference engine's 'ngram' model); with --vllm, "
        "what vLLM serves",
    )
    serving.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names clients give as 'model' (default: the model's directory name, "
        "'ngram' for the built-in one); responses name the first",
    )
    serving.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    serving.add_argument(
        "--port", type=int, default=8000, help="default: %(default)s; 0 picks a free one"
    )
    serving.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY)",
    )
    serving.add_argument(
        "--max-concurrent-requests",
        type=int,
        metavar="N",
        help="generation requests served at once; past it, 503 (default: no limit)",
    )
    serving.add_argument(
        "--chat-template", help="a chat template (a name of the model's, or a file) to use"
    )
    serving.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests bring their own chat_template",
    )
    serving.add_argument(
        "--max-logprobs",
        type=int,
        metavar="N",
        help="the most logprobs a request may ask for, -1 for the vocabulary (default: 20, "
        "vLLM's; with --vllm, the --max-logprobs among vLLM's flags if given there); the "
        "reference engine takes it too",
    )
    serving.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=30.0,
        help="on SIGINT/SIGTERM, how long requests in flight may finish (default: %(default)s)",
    )
    engines = parser.add_argument_group("engines")
    engines.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine cores (ranks) to launch or attach (default: %(default)s)",
    )
    engines.add_argument(
        "--on-engine-failure",
        choices=("fail", "route_around", "restart"),
        default="route_around",
        help="an engine's death: stop serving, serve on with the others, or also restart "
        "it (launched engines only) (default: %(default)s)",
    )
    engines.add_argument(
        "--engine-model",
        choices=MODELS,
        default="ngram",
        help="the reference engine's model (default: %(default)s)",
    )
    engines.add_argument(
        "--max-model-len",
        type=int,
        help="the reference engine's longest prompt plus output (default: its own)",
    )
    engines.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="the reference engine sends no scheduler statistics or request events: "
        "/metrics then has no requests running or waiting, KV cache use, queue, prefill "
        "or decode times (as with vLLM's flag of that name; pass it to vLLM after --)",
    )
    engines.add_argument(
        "--vllm",
        action="store_true",
        help="launch vLLM's engine cores serving --model (flags for `vllm serve` after --)",
    )
    engines.add_argument(
        "--vllm-command",
        default="vllm",
        help="how to run vLLM's command line, split as a shell would (default: %(default)s)",
    )
    engines.add_argument(
        "--remote",
        metavar="tcp://HOST:PORT",
        help="bind this handshake address and serve the headless engine cores that join "
        "there (`vllm serve MODEL --headless --data-parallel-address HOST "
        "--data-parallel-rpc-port PORT`, on this host or others)",
    )
    engines.add_argument(
        "--attach",
        nargs=2,
        metavar=("INPUT", "OUTPUT"),
        help="bind these addresses (vLLM's client_addresses) and serve the engine cores "
        "that connect",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="default: %(default)s",
    )
    parser.add_argument("vllm_arguments", nargs="*", help=argparse.SUPPRESS)


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"trio-enginecore api-server: {message}\n")
    sys.stderr.flush()
    return code


def run_api_server(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the server until a signal; the exit code."""
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if sum(map(bool, (args.vllm, args.attach, args.remote))) > 1:
        parser.error("--vllm, --attach and --remote do not go together: give one")
    if args.vllm and not args.model:
        parser.error("--vllm needs --model (the model vLLM serves)")
    if args.vllm_arguments and not args.vllm:
        parser.error(f"unexpected arguments {args.vllm_arguments} (vLLM's flags need --vllm)")
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        parser.error("--max-concurrent-requests must be at least 1")
    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be at least 1")
    if args.max_logprobs is None:
        given = _vllm_max_logprobs(args.vllm_arguments) if args.vllm else None
        args.max_logprobs = DEFAULT_MAX_LOGPROBS if given is None else given
    if args.max_logprobs < -1:
        parser.error("--max-logprobs must be -1 (the vocabulary) or at least 0")
    from ._openai_requests import RequestLimits

    try:
        # vLLM's variables, read as `vllm serve` reads them (n, prompts, stop strings).
        args.limits = RequestLimits.from_environment(os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    # The signals are this program's from here to its exit. Until the run's signal
    # receiver opens, and after it closes (the engines stopped, the interpreter on its
    # way out), a signal is only noted: Python's defaults would end the process by
    # SIGTERM (exit -15) or a KeyboardInterrupt in the middle of its shutdown.
    early = _EarlySignals()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, early.note)
    try:
        return trio.run(_serve, args, early, restrict_keyboard_interrupt_to_checkpoints=True)
    except BaseException as exc:
        failure = _sole_failure(exc)
        if isinstance(failure, EngineStartupError | ModelDirectoryError):
            return _fail(str(failure), EXIT_STARTUP)
        if isinstance(failure, OSError):
            return _fail(f"cannot listen on {args.host}:{args.port}: {failure}", EXIT_ADDRESS)
        raise


DEFAULT_MAX_LOGPROBS: Final = 20
"""vLLM's default ``--max-logprobs``."""


def _vllm_max_logprobs(vllm_arguments: Sequence[str]) -> int | None:
    """The ``--max-logprobs`` among vLLM's flags (vLLM's frontend checks it, and so
    must ours), or None."""
    value: str | None = None
    for i, word in enumerate(vllm_arguments):
        if word.replace("_", "-") == "--max-logprobs" and i + 1 < len(vllm_arguments):
            value = vllm_arguments[i + 1]
        elif word.replace("_", "-").startswith("--max-logprobs="):
            value = word.split("=", 1)[1]
    try:
        return None if value is None else int(value)
    except ValueError:
        return None  # vLLM refuses it itself


class _EarlySignals:
    """The signals that came while no signal receiver was open."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def note(self, signum: int, frame: object) -> None:
        self.received.append(signum)


def _sole_failure(error: BaseException) -> BaseException | None:
    """The one exception ``error`` stands for (itself, or the only one in its group
    beside the cancellations it caused), or None for several."""
    failures = [leaf for leaf in leaves(error) if not isinstance(leaf, trio.Cancelled)]
    return failures[0] if len(failures) == 1 else None


def _engine_options(args: argparse.Namespace, model_dir: str | None) -> dict[str, Any]:
    from ..client import RemoteEngines, VllmEngines

    options: dict[str, Any] = {"on_engine_failure": args.on_engine_failure}
    if args.vllm:
        options["vllm"] = VllmEngines(
            model_dir or "",
            list(args.vllm_arguments),
            data_parallel_size=args.data_parallel_size,
            command=tuple(shlex.split(args.vllm_command)),
        )
        # vLLM's engine cores load the model before they answer: minutes on a GPU.
        options["ready_timeout_s"] = 1800.0
    elif args.attach:
        options["input_address"], options["output_address"] = args.attach
        options["ready_timeout_s"] = 1800.0
    elif args.remote:
        options["remote"] = RemoteEngines(args.remote)
        options["ready_timeout_s"] = 1800.0
    return options


async def _serve(args: argparse.Namespace, early: _EarlySignals) -> int:
    # The receiver opens first: a signal while the tokenizer loads, the engines start
    # or stop is a stop, never Python's default (SIGTERM's death, SIGINT's
    # KeyboardInterrupt in some task).
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        if early.received:
            logger.info("%s: stopping at once", signal.Signals(early.received[0]).name)
            return EXIT_OK
        async with trio.open_nursery() as guard:
            stopping = _Stopping(guard.cancel_scope)
            guard.start_soon(_watch_signals, signals, stopping, args.shutdown_timeout_s)
            await _start_and_serve(args, stopping)
            guard.cancel_scope.cancel()  # the engines stopped: no more signals to watch
    return EXIT_OK


async def _start_and_serve(args: argparse.Namespace, stopping: _Stopping) -> None:
    """Load the tokenizer, start the engines, serve until ``stopping.drain``."""
    from ..client import TrioEngineClient, open_engine_client
    from ..text import AsyncLLM, builtin_tokenizer, load_tokenizer
    from ._http import serve_http
    from ._openai_app import OpenAIApp, ServerSettings

    model_dir: str | None = args.model
    if model_dir is None:
        tokenizer = builtin_tokenizer()
        root = "ngram"
    else:
        tokenizer = await trio.to_thread.run_sync(load_tokenizer, model_dir)
        root = str(Path(model_dir))
    names = tuple(args.served_model_name or (Path(root).name or root,))
    chat_template = args.chat_template
    if chat_template is not None:
        chat_template = await trio.to_thread.run_sync(_template_text, chat_template)
    options = _engine_options(args, model_dir)
    config: EngineConfig | None
    if args.vllm:
        config = None
    elif args.attach or args.remote:
        config = EngineConfig(data_parallel_size=args.data_parallel_size)
    else:
        changes: dict[str, Any] = {
            "model": args.engine_model,
            "data_parallel_size": args.data_parallel_size,
        }
        if model_dir is not None:
            changes["vocab_size"] = max(tokenizer.vocab_size, 257)
        if args.max_model_len is not None:
            changes["max_model_len"] = args.max_model_len
        changes["max_logprobs"] = args.max_logprobs
        # As `vllm serve`: the engine's statistics on, for /metrics.
        changes["log_stats"] = not args.disable_log_stats
        config = EngineConfig(**changes)
    listeners = await trio.open_tcp_listeners(args.port, host=args.host)
    opened = cast(
        "AbstractAsyncContextManager[TrioEngineClient]", open_engine_client(config, **options)
    )
    async with opened as client:
        llm = AsyncLLM(client, tokenizer)
        app = OpenAIApp(
            llm,
            ServerSettings(
                served_model_names=names,
                model_root=root,
                api_key=args.api_key,
                max_concurrent_requests=args.max_concurrent_requests,
                chat_template=chat_template,
                trust_request_chat_template=args.trust_request_chat_template,
                max_logprobs=args.max_logprobs,
                limits=args.limits,
            ),
        )
        try:
            async with trio.open_nursery() as nursery:
                server = await nursery.start(serve_http, app, listeners)
                stopping.serving = True
                host, port = _bound(listeners)
                logger.info(
                    "serving %r on http://%s:%d (OpenAI API under /v1; %d engine(s))",
                    names[0],
                    host,
                    port,
                    len(client.engines),
                )
                # One line on stderr whatever the log level: scripts wait for it.
                sys.stderr.write(
                    f"trio-enginecore api-server: serving {names[0]!r} on http://{host}:{port}\n"
                )
                sys.stderr.flush()
                await stopping.drain.wait()
                await server.shutdown(args.shutdown_timeout_s)
                nursery.cancel_scope.cancel()
        finally:
            app.close()


class _Stopping:
    """What a signal does: before the server serves, or a second time, stop at once
    (cancel everything: the client then kills its engines); the first while serving,
    drain."""

    def __init__(self, everything: trio.CancelScope) -> None:
        self.everything = everything
        self.serving = False
        self.drain = trio.Event()


async def _watch_signals(
    signals: AsyncIterator[int], stopping: _Stopping, deadline_s: float
) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        if stopping.serving and not stopping.drain.is_set():
            logger.info("%s: stopping; requests in flight may finish for %.0f s", name, deadline_s)
            stopping.drain.set()
        else:
            logger.info("%s: stopping at once", name)
            stopping.everything.cancel()


def _template_text(chat_template: str) -> str:
    """``--chat-template``: a file's text, or (not a file) a name or a template."""
    path = Path(chat_template)
    return path.read_text(encoding="utf-8") if path.is_file() else chat_template


def _bound(listeners: Sequence[trio.SocketListener]) -> tuple[str, int]:
    address: Any = listeners[0].socket.getsockname()
    return str(address[0]), int(address[1])

"""Starting engine processes and the client side of the startup handshake."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Final

import trio

from ..config import EngineConfig
from ._engines import EngineHandle

__all__ = [
    "arm_lifeline",
    "close_lifeline",
    "engine_command",
    "engine_log_level",
    "engine_logger",
    "launch_engine",
    "open_lifeline",
    "parse_relayed_line",
    "serve_arguments",
    "start_engine_process",
    "stop_engines",
]

logger = logging.getLogger("trio_enginecore.client")

_STDERR_DRAIN_S: Final = 1.0
_DEAD_ENGINE_EXIT_S: Final = 2.0
_ENGINE_LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
_RELAY_LEVELS: Final = {
    name: logging.getLevelNamesMapping()[name] for name in (*_ENGINE_LOG_LEVELS, "CRITICAL")
}


def serve_arguments(config: EngineConfig) -> list[str]:
    """The ``trio-enginecore serve`` flags that reproduce ``config``."""
    arguments = [
        "--model",
        config.model,
        "--rank",
        str(config.data_parallel_rank),
        "--data-parallel-size",
        str(config.data_parallel_size),
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--max-model-len",
        str(config.max_model_len),
        "--max-loras",
        str(config.max_loras),
        "--step-time-s",
        repr(config.step_time_s),
        "--seed",
        str(config.seed),
        "--drain-timeout-s",
        repr(config.drain_timeout_s),
        "--vllm-version",
        config.vllm_version,
    ]
    if config.vocab_size is not None:
        arguments += ["--vocab-size", str(config.vocab_size)]
    if config.log_stats:
        arguments.append("--log-stats")
    if config.enable_fault_injection:
        arguments.append("--enable-fault-injection")
    return arguments


def engine_logger(rank: int) -> logging.Logger:
    """The logger an engine's relayed log lines go to: ``trio_enginecore.engine.rank<N>``."""
    return logging.getLogger(f"trio_enginecore.engine.rank{rank}")


def engine_log_level(rank: int) -> str:
    """The ``--log-level`` for a launched engine: what its relay logger would show,
    so an engine does not format lines nobody will see, and DEBUG here is DEBUG there."""
    level = engine_logger(rank).getEffectiveLevel()
    return next((name for name in _ENGINE_LOG_LEVELS if level <= _RELAY_LEVELS[name]), "ERROR")


def engine_command(
    config: EngineConfig,
    handshake_address: str,
    *,
    log_level: str | None = None,
    lifeline_fd: int | None = None,
) -> list[str]:
    """The command line that starts one engine of ``config`` in handshake mode.

    Its log lines come in the relay format (level first, no timestamp), which
    :func:`start_engine_process` re-logs once, at their own level. With
    ``lifeline_fd`` (the read end of a pipe from :func:`open_lifeline`, passed to the
    process), the engine stops when the pipe's write end closes; without it, when its
    parent process exits (``--exit-with-parent``).
    """
    stop_with_client = (
        ["--exit-with-parent"] if lifeline_fd is None else ["--lifeline-fd", str(lifeline_fd)]
    )
    return [
        sys.executable,
        "-m",
        "trio_enginecore",
        "serve",
        "--handshake-address",
        handshake_address,
        *stop_with_client,
        "--log-level",
        log_level or engine_log_level(config.data_parallel_rank),
        "--log-format",
        "relay",
        *serve_arguments(config),
    ]


def open_lifeline() -> tuple[int, int]:
    """A new lifeline pipe for one engine: ``(read_end, write_end)``.

    The engine gets the read end (``pass_fds`` and ``--lifeline-fd``); the client keeps
    the write end open for as long as it lives and closes its copy of the read end
    once the engine is started. When the client exits, however it exits, the kernel
    closes the write end and the engine reads end-of-file. Both ends are
    non-inheritable, so no other child process (nor a second engine) gets a copy of the
    write end that would keep the pipe open.
    """
    read_end, write_end = os.pipe()
    assert not os.get_inheritable(write_end)
    return read_end, write_end


def parse_relayed_line(line: str, previous: int | None) -> tuple[int, str]:
    """The level and message of one stderr line of an engine in relay format.

    A line that does not start with a level name continues the previous record (a
    traceback, a multi-line message) and keeps its level; with no previous record it
    is something the engine wrote outside logging (an interpreter crash, say): WARNING.
    """
    name, _, message = line.partition(" ")
    level = _RELAY_LEVELS.get(name)
    if level is not None:
        return level, message
    return (logging.WARNING if previous is None else previous), line


async def start_engine_process(
    engine: EngineHandle,
    command: list[str],
    nursery: trio.Nursery,
    *,
    lifeline: int | None = None,
) -> None:
    """Start the engine's process and a task that keeps the tail of its stderr.

    ``lifeline`` is the read end of the engine's lifeline pipe (:func:`open_lifeline`):
    the engine inherits it at the same number, and is armed with it
    (:func:`arm_lifeline`). The caller closes its own copy afterwards.
    """
    engine.process = await trio.lowlevel.open_process(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=() if lifeline is None else (lifeline,),
        # The engine must not inherit our Ctrl-C: the client shuts it down itself.
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if lifeline is not None:
        arm_lifeline(lifeline, engine.process.pid)
    logger.debug("started %s: %s", engine.describe(), " ".join(command))
    nursery.start_soon(_read_stderr, engine)


async def launch_engine(
    engine: EngineHandle,
    config: EngineConfig,
    handshake_address: str,
    nursery: trio.Nursery,
    *,
    extra_arguments: Sequence[str] = (),
) -> None:
    """Launch the reference engine of ``engine.rank`` (``config`` with that rank),
    pointed at ``handshake_address``, with a lifeline: it stops by itself once this
    process is gone, however this process dies (the pipe's write end, kept in
    ``engine.lifeline`` until the client closes it, closes then)."""
    read_end, engine.lifeline = open_lifeline()
    try:
        command = engine_command(
            config.evolve(data_parallel_rank=engine.rank),
            handshake_address,
            lifeline_fd=read_end,
        )
        await start_engine_process(engine, [*command, *extra_arguments], nursery, lifeline=read_end)
    finally:
        os.close(read_end)


def close_lifeline(engine: EngineHandle) -> None:
    """Close the write end of ``engine``'s lifeline pipe (idempotent): a launched engine
    still running then stops at once."""
    if engine.lifeline is not None:
        fd, engine.lifeline = engine.lifeline, None
        os.close(fd)


async def stop_engines(engines: Sequence[EngineHandle], timeout_s: float) -> None:
    """Stop the launched ones among ``engines``: SIGTERM, then SIGKILL after
    ``timeout_s``; then relay their last stderr lines and close their lifelines."""
    processes = [e.process for e in engines if e.process is not None]
    # An engine that reported a fatal error is on its way out: a SIGTERM now would
    # cut off its last log lines, which say why it failed. Only a process that died
    # is waited for: a restarted engine's new process is healthy (its death, still
    # recorded until it is ready, was the old process's), and waiting for it to exit
    # by itself would stall every close during a restart.
    dying = [
        e.process
        for e in engines
        if e.process is not None and e.state == "dead" and e.process.returncode is None
    ]
    if dying:
        with trio.move_on_after(min(_DEAD_ENGINE_EXIT_S, timeout_s)):
            for process in dying:
                await process.wait()
    for engine in engines:
        if engine.process is not None and engine.process.returncode is None:
            logger.debug("shutdown: sending SIGTERM to %s", engine.describe())
            engine.process.terminate()
    with trio.move_on_after(timeout_s):
        for process in processes:
            await process.wait()
    for process in processes:
        if process.returncode is None:
            logger.warning("engine pid %d did not exit in %g s; killing it", process.pid, timeout_s)
            process.kill()
            await process.wait()
    # An exited engine's last lines (often why it died) are still in the pipe:
    # let the reader relay them before the pipe is closed under it.
    with trio.move_on_after(_STDERR_DRAIN_S):
        for engine in engines:
            if engine.process is not None:
                await engine.stderr_done.wait()
    for engine in engines:
        # The engines have exited (after SIGTERM, or SIGKILL): their lifelines go.
        close_lifeline(engine)
        if engine.process is not None:
            logger.debug("shutdown: %s", engine.exit_description(with_stderr=False))
            if engine.process.stderr is not None:
                await engine.process.stderr.aclose()


def arm_lifeline(read_end: int, pid: int) -> None:
    """Have the kernel send SIGIO to process ``pid`` when the lifeline pipe's write end
    closes (or anything is written to it).

    The engine watches its lifeline itself once it runs ``serve``, which ignores
    SIGIO; before that, while Python starts and imports the package, SIGIO's default
    action ends it at once. The open file is the engine's too, so this holds after
    the client closed its copy of ``read_end``; it ends when the engine exits. Where
    the platform has no ``O_ASYNC`` for pipes, the engine only notices once it runs.
    """
    try:
        fcntl.fcntl(read_end, fcntl.F_SETOWN, pid)
        flags = fcntl.fcntl(read_end, fcntl.F_GETFL)
        fcntl.fcntl(read_end, fcntl.F_SETFL, flags | os.O_ASYNC)
    except (OSError, AttributeError) as exc:  # pragma: no cover - not on Linux
        logger.debug("cannot have SIGIO sent on the lifeline (%s)", exc)


async def _read_stderr(engine: EngineHandle) -> None:
    process = engine.process
    assert process is not None
    assert process.stderr is not None
    relay = engine_logger(engine.rank)
    level: int | None = None
    buffer = b""
    try:
        async for chunk in process.stderr:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", errors="replace").rstrip()
                if line:
                    level, message = parse_relayed_line(line, level)
                    engine.stderr_tail.append(line)
                    relay.log(level, "%s", message)
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        pass
    finally:
        if buffer.strip():
            engine.stderr_tail.append(buffer.decode("utf-8", errors="replace").rstrip())
        engine.stderr_done.set()

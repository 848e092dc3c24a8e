"""Starting engine processes and the client side of the startup handshake."""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import tempfile
from typing import Final

import attrs
import trio

from ..config import EngineConfig
from ..engine import identity_for_rank
from ..protocol import EngineCoreReadyResponse
from ._lb import EngineLoad

__all__ = [
    "EngineHandle",
    "engine_command",
    "engine_log_level",
    "engine_logger",
    "parse_relayed_line",
    "private_ipc_dir",
    "serve_arguments",
    "start_engine_process",
]

logger = logging.getLogger("trio_enginecore.client")

STDERR_TAIL_LINES: Final = 20
_ENGINE_LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
_RELAY_LEVELS: Final = {
    name: logging.getLevelNamesMapping()[name] for name in (*_ENGINE_LOG_LEVELS, "CRITICAL")
}
# A unix socket path must fit in ~107 bytes; keep the directory well below that.
_MAX_IPC_DIR_LEN: Final = 60


def private_ipc_dir() -> str:
    """A new directory, mode 0700, for this client's ipc:// sockets.

    Uses the system temp dir unless its path is too long for unix socket addresses
    (a long ``TMPDIR`` breaks ipc:// silently), in which case ``/tmp`` is used.
    """
    base = tempfile.gettempdir()
    if len(base) > _MAX_IPC_DIR_LEN - 20:
        base = "/tmp"
    return tempfile.mkdtemp(prefix="tec-", dir=base)


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
    for name in _ENGINE_LOG_LEVELS:
        if level <= logging.getLevelNamesMapping()[name]:
            return name
    return "ERROR"


def engine_command(
    config: EngineConfig, handshake_address: str, *, log_level: str | None = None
) -> list[str]:
    """The command line that starts one engine of ``config`` in handshake mode.

    Its log lines come in the relay format (level first, no timestamp), which
    :func:`start_engine_process` re-logs once, at their own level.
    """
    return [
        sys.executable,
        "-m",
        "trio_enginecore",
        "serve",
        "--handshake-address",
        handshake_address,
        "--exit-with-parent",
        "--log-level",
        log_level or engine_log_level(config.data_parallel_rank),
        "--log-format",
        "relay",
        *serve_arguments(config),
    ]


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


@attrs.define(eq=False)
class EngineHandle:
    """What the client knows about one engine."""

    rank: int
    identity: bytes
    process: trio.Process | None = None
    stderr_tail: collections.deque[str] = attrs.field(
        factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES)
    )
    stderr_done: trio.Event = attrs.field(factory=trio.Event)
    ready: EngineCoreReadyResponse | None = None
    load: EngineLoad = attrs.field(factory=EngineLoad)
    alive: bool = True
    death: str | None = None

    @classmethod
    def for_rank(cls, rank: int) -> EngineHandle:
        """A handle for the engine of data-parallel rank ``rank`` (its DEALER identity
        as vLLM defines it)."""
        return cls(rank=rank, identity=identity_for_rank(rank))

    def describe(self) -> str:
        pid = f", pid {self.process.pid}" if self.process is not None else ""
        return f"engine rank {self.rank}{pid}"

    def exit_description(self, *, with_name: bool = True, with_stderr: bool = True) -> str:
        """How the engine's process ended, with its last stderr lines."""
        parts = [self.describe()] if with_name else []
        if self.process is not None and self.process.returncode is not None:
            code = self.process.returncode
            parts.append(
                f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
            )
        if with_stderr and self.stderr_tail:
            parts.append("last stderr lines:\n  " + "\n  ".join(self.stderr_tail))
        return "; ".join(parts)


async def start_engine_process(
    engine: EngineHandle, command: list[str], nursery: trio.Nursery
) -> None:
    """Start the engine's process and a task that keeps the tail of its stderr."""
    engine.process = await trio.lowlevel.open_process(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        # The engine must not inherit our Ctrl-C: the client shuts it down itself.
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    logger.debug("started %s: %s", engine.describe(), " ".join(command))
    nursery.start_soon(_read_stderr, engine)


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

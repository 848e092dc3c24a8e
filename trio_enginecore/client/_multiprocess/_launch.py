"""Starting engine processes, holding what the client keeps of each, and stopping them.

A launched engine is an :class:`~trio_enginecore.client._core._engines.EngineHandle`
for what the client knows of it (its rank, its state, its process id for the messages)
and a :class:`LaunchedProcess` for what the client holds of its process: the
``trio.Process``, the tail of its stderr (relayed to logging, line by line, at the
engine's own levels) and the write end of its *lifeline* pipe, which stops the engine
however the client ends. :class:`LaunchedProcesses` are an engine group's, by rank.

What is launched is a launcher's to say: :class:`ReferenceLauncher` starts the
reference engine (``trio-enginecore serve``, one process), :class:`VllmLauncher`
vLLM's own engine core (``vllm serve --headless``: a launcher process and its
engine-core child, reached as one process group; see :mod:`._vllm`).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Final, Protocol, final

import attrs
import trio

from ...config import EngineConfig, engine_flags
from ...errors import EngineStartupError
from .._core._engines import EngineHandle
from ._vllm import VllmEngines, parse_vllm_line, vllm_error_line, vllm_not_found

__all__ = [
    "STDERR_TAIL_LINES",
    "EngineLauncher",
    "LaunchCommand",
    "LaunchedProcess",
    "LaunchedProcesses",
    "ReferenceLauncher",
    "VllmLauncher",
    "arm_lifeline",
    "engine_command",
    "engine_log_level",
    "engine_logger",
    "exit_description",
    "open_lifeline",
    "parse_relayed_line",
    "serve_arguments",
]

logger = logging.getLogger("trio_enginecore.client")

STDERR_TAIL_LINES: Final = 20
"""How many of a launched engine's last stderr lines are kept for its death message."""
_STDERR_DRAIN_S: Final = 1.0
_DEAD_ENGINE_EXIT_S: Final = 2.0
_ENGINE_LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
_RELAY_LEVELS: Final = {
    name: logging.getLevelNamesMapping()[name] for name in (*_ENGINE_LOG_LEVELS, "CRITICAL")
}


def serve_arguments(config: EngineConfig) -> list[str]:
    """The ``trio-enginecore serve`` flags that reproduce ``config``."""
    return engine_flags(config)


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


@final
@attrs.frozen
class LaunchCommand:
    """How to start one engine process, as a launcher says."""

    argv: list[str]
    env: dict[str, str]
    process_group: bool = False
    """The engine is a tree of processes (vLLM's launcher and its engine core): the
    lifeline's signal and the kills reach its whole process group."""
    parse_line: Callable[[str, int | None], tuple[int, str]] = parse_relayed_line
    """The level and message of one of its stderr lines."""
    launcher_name: str | None = None
    """What the process started is, when it is not the engine itself (for the
    messages: "its vLLM launcher ... exited with code 0")."""
    error_line: Callable[[Sequence[str]], str | None] | None = None
    """Finds, in its last stderr lines, the one that says why it failed."""


class EngineLauncher(Protocol):
    """What an engine group launches for each of its ranks."""

    def command(self, rank: int, handshake_address: str, lifeline_fd: int) -> LaunchCommand:
        """The command starting rank ``rank``'s engine, saying HELLO at
        ``handshake_address``, with the lifeline's read end at ``lifeline_fd``."""
        ...

    def not_started(self, argv: Sequence[str], error: OSError) -> Exception:
        """The error for a command that could not be run at all."""
        ...

    @property
    def serves(self) -> str:
        """What the engines serve, for the client's "ready" log line."""
        ...


@final
@attrs.frozen
class ReferenceLauncher:
    """Launches the reference engine of ``config`` (``trio-enginecore serve``), each rank
    with its own ``data_parallel_rank``."""

    config: EngineConfig

    def command(self, rank: int, handshake_address: str, lifeline_fd: int) -> LaunchCommand:
        argv = engine_command(
            self.config.evolve(data_parallel_rank=rank), handshake_address, lifeline_fd=lifeline_fd
        )
        return LaunchCommand(argv, {**os.environ, "PYTHONUNBUFFERED": "1"})

    def not_started(self, argv: Sequence[str], error: OSError) -> Exception:
        return error

    @property
    def serves(self) -> str:
        return repr(self.config.model)


@final
@attrs.frozen
class VllmLauncher:
    """Launches vLLM's engine cores (``vllm serve --headless``; see :mod:`._vllm`)."""

    vllm: VllmEngines

    def command(self, rank: int, handshake_address: str, lifeline_fd: int) -> LaunchCommand:
        # vLLM does not know the lifeline: its pipe's read end is only held open by the
        # launcher (pass_fds), and the kernel's SIGIO (default action: terminate) ends
        # the whole process group when the client is gone.
        return LaunchCommand(
            self.vllm.serve_command(rank, handshake_address),
            self.vllm.environment(rank, engine_log_level(rank)),
            process_group=True,
            parse_line=parse_vllm_line,
            launcher_name="its vLLM launcher (vllm serve --headless)",
            error_line=vllm_error_line,
        )

    def not_started(self, argv: Sequence[str], error: OSError) -> Exception:
        return EngineStartupError(vllm_not_found(argv, error))

    @property
    def serves(self) -> str:
        return f"{self.vllm.model!r} (vLLM)"


@final
@attrs.define(eq=False)
class LaunchedProcess:
    """What the client holds of one engine process it launched."""

    process: trio.Process
    lifeline: int | None = None
    """The write end of the engine's lifeline pipe, while the client holds it."""
    how: LaunchCommand | None = None
    """How it was started (``None``: a reference engine's plain process)."""
    stderr_tail: collections.deque[str] = attrs.field(
        factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES)
    )
    stderr_done: trio.Event = attrs.field(factory=trio.Event)
    """Set once the stderr reader has read all the process wrote."""

    @property
    def exited(self) -> bool:
        return self.process.returncode is not None

    @property
    def process_group(self) -> bool:
        """Whether the engine is the process group its process leads."""
        return self.how is not None and self.how.process_group

    def kill_if_running(self) -> bool:
        """Kill the process if it still runs (a hung or stopped engine holds memory and
        devices until it goes), with its process group if the engine is one; whether
        it did."""
        if self.process.returncode is None:
            if self.process_group:
                _kill_group(self.process.pid, signal.SIGKILL)
            self.process.kill()
            return True
        self.kill_stragglers()
        return False

    def kill_stragglers(self) -> None:
        """Kill what is left of the engine's process group once its leader has exited
        (an engine core whose launcher was killed): nothing of an engine outlives it.
        Not for single-process engines."""
        if self.process_group:
            _kill_group(self.process.pid, signal.SIGKILL)

    def terminate(self) -> None:
        """Ask the engine to stop (SIGTERM to its process: vLLM's launcher then stops
        its engine core itself)."""
        self.process.terminate()

    def error_line(self) -> str | None:
        """The line of its last stderr lines that says why it failed, if its launcher
        knows how to find one."""
        if self.how is None or self.how.error_line is None:
            return None
        return self.how.error_line(list(self.stderr_tail))

    def close_lifeline(self) -> None:
        """Close the write end of the lifeline pipe (idempotent): the engine, if it
        still runs, then stops at once."""
        if self.lifeline is not None:
            fd, self.lifeline = self.lifeline, None
            os.close(fd)

    async def wait_stderr(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until its last stderr lines are read: an exited
        engine's last lines, often why it died, may still be in the pipe."""
        with trio.move_on_after(timeout_s):
            await self.stderr_done.wait()


def exit_description(
    engine: EngineHandle,
    launched: LaunchedProcess | None,
    *,
    with_name: bool = True,
    with_stderr: bool = True,
) -> str:
    """How the engine's process ended, with its last stderr lines (for an engine not
    launched here, or still running, only its name)."""
    parts = [engine.describe()] if with_name else []
    if launched is not None:
        code = launched.process.returncode
        if code is not None:
            ended = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
            if launched.how is not None and launched.how.launcher_name is not None:
                # vLLM's launcher exits (code 0) when its engine core ends, however the
                # engine core ended: the engine's own last lines say more.
                ended = f"{launched.how.launcher_name} {ended}"
            parts.append(ended)
        said = launched.error_line()
        if said is not None:
            parts.append(f"it said: {said}")
        if with_stderr and launched.stderr_tail:
            parts.append("last stderr lines:\n  " + "\n  ".join(launched.stderr_tail))
    return "; ".join(parts)


@final
class LaunchedProcesses:
    """The engine processes a client launched, by rank: launched, replaced by a
    restart, stopped with the client.

    Each engine's :attr:`~trio_enginecore.client._core._engines.EngineHandle.pid` is set
    when its process starts, for the messages that name it.
    """

    def __init__(self, launcher: EngineLauncher) -> None:
        self.launcher = launcher
        self._by_rank: dict[int, LaunchedProcess] = {}

    def get(self, engine: EngineHandle) -> LaunchedProcess | None:
        """The process of ``engine``, if this client launched it (and has not
        forgotten it to start another)."""
        return self._by_rank.get(engine.rank)

    def exited(self, engine: EngineHandle) -> bool:
        """Whether ``engine`` is a launched engine whose process exited."""
        launched = self._by_rank.get(engine.rank)
        return launched is not None and launched.exited

    def describe_exit(
        self, engine: EngineHandle, *, with_name: bool = True, with_stderr: bool = True
    ) -> str:
        """:func:`exit_description` of ``engine``."""
        return exit_description(
            engine, self._by_rank.get(engine.rank), with_name=with_name, with_stderr=with_stderr
        )

    async def launch(
        self,
        engine: EngineHandle,
        handshake_address: str,
        nursery: trio.Nursery,
        *,
        extra_arguments: Sequence[str] = (),
    ) -> LaunchedProcess:
        """Launch the engine of ``engine.rank`` (as the launcher says), pointed at
        ``handshake_address``, with a lifeline: it stops by itself once this process
        is gone, however this process dies (the pipe's write end, kept until
        :meth:`stop` or a restart closes it, closes then). Its stderr is read by a
        task in ``nursery``.

        Raises:
            OSError: the reference engine's process could not be started.
            EngineStartupError: vLLM's command could not be run (not installed, say).
        """
        assert engine.rank not in self._by_rank, "forget the old process first"
        read_end, write_end = open_lifeline()
        try:
            how = self.launcher.command(engine.rank, handshake_address, read_end)
            command = [*how.argv, *extra_arguments]
            try:
                process = await trio.lowlevel.open_process(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    pass_fds=(read_end,),
                    # The engine must not inherit our Ctrl-C: the client shuts it down.
                    # Its own session is also its own process group, which a vLLM
                    # engine core shares with its launcher.
                    start_new_session=True,
                    env=how.env,
                )
            except BaseException as exc:
                os.close(write_end)
                if isinstance(exc, OSError):
                    raise self.launcher.not_started(command, exc) from exc
                raise
            arm_lifeline(read_end, -process.pid if how.process_group else process.pid)
        finally:
            os.close(read_end)
        launched = self._by_rank[engine.rank] = LaunchedProcess(process, write_end, how)
        engine.pid = process.pid
        logger.debug("started %s: %s", engine.describe(), " ".join(command))
        nursery.start_soon(_read_stderr, engine.rank, launched)
        return launched

    async def forget(self, engine: EngineHandle) -> None:
        """Remove what is left of a dead engine's process, before another is started
        for its rank: kill it if it still runs (declared dead, it may not have exited
        yet: after a fatal error, say), wait for it, relay its last stderr lines,
        close its lifeline. Not a checkpoint if there is no process."""
        launched = self._by_rank.get(engine.rank)
        if launched is None:
            return
        old = launched.process
        launched.kill_if_running()
        await old.wait()
        launched.kill_stragglers()
        await launched.wait_stderr(1.0)
        if old.stderr is not None:
            await old.stderr.aclose()
        launched.close_lifeline()
        del self._by_rank[engine.rank]

    async def stop(self, engines: Sequence[EngineHandle], timeout_s: float) -> None:
        """Stop the launched ones among ``engines``: SIGTERM, then SIGKILL after
        ``timeout_s``; then relay their last stderr lines and close their lifelines.
        Meant to run shielded (the client's ``aclose``): bounded by ``timeout_s`` and
        two short waits."""
        ours = [(e, self._by_rank[e.rank]) for e in engines if e.rank in self._by_rank]
        processes = [launched.process for _, launched in ours]
        # An engine that reported a fatal error is on its way out: a SIGTERM now would
        # cut off its last log lines, which say why it failed. Only a process that died
        # is waited for: a restarted engine's new process is healthy (its death, still
        # recorded until it is ready, was the old process's), and waiting for it to exit
        # by itself would stall every close during a restart.
        dying = [
            launched.process
            for engine, launched in ours
            if engine.state == "dead" and not launched.exited
        ]
        if dying:
            with trio.move_on_after(min(_DEAD_ENGINE_EXIT_S, timeout_s)):
                for process in dying:
                    await process.wait()
        for engine, launched in ours:
            if not launched.exited:
                logger.debug("shutdown: sending SIGTERM to %s", engine.describe())
                launched.terminate()
        with trio.move_on_after(timeout_s):
            for process in processes:
                await process.wait()
        for _, launched in ours:
            process = launched.process
            if process.returncode is None:
                logger.warning(
                    "engine pid %d did not exit in %g s; killing it", process.pid, timeout_s
                )
                launched.kill_if_running()
                await process.wait()
            launched.kill_stragglers()
        # An exited engine's last lines (often why it died) are still in the pipe:
        # let the reader relay them before the pipe is closed under it.
        with trio.move_on_after(_STDERR_DRAIN_S):
            for _, launched in ours:
                await launched.stderr_done.wait()
        for engine, launched in ours:
            # The engines have exited (after SIGTERM, or SIGKILL): their lifelines go.
            launched.close_lifeline()
            logger.debug("shutdown: %s", exit_description(engine, launched, with_stderr=False))
            if launched.process.stderr is not None:
                await launched.process.stderr.aclose()


def _kill_group(leader: int, sig: signal.Signals) -> None:
    # The group is gone when every process of it has exited: nothing left to do.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, sig)


def arm_lifeline(read_end: int, pid: int) -> None:
    """Have the kernel send SIGIO to process ``pid`` (to process group ``-pid`` when
    negative) when the lifeline pipe's write end closes (or anything is written to it).

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


async def _read_stderr(rank: int, launched: LaunchedProcess) -> None:
    """Relay the engine's stderr to its logger and keep its tail, until the pipe ends
    or is closed; ``stderr_done`` is set on the way out, whatever ends it."""
    stderr = launched.process.stderr
    assert stderr is not None
    relay = engine_logger(rank)
    parse_line = parse_relayed_line if launched.how is None else launched.how.parse_line
    level: int | None = None
    buffer = b""
    try:
        async for chunk in stderr:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", errors="replace").rstrip()
                if line:
                    level, message = parse_line(line, level)
                    launched.stderr_tail.append(line)
                    relay.log(level, "%s", message)
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        pass
    finally:
        if buffer.strip():
            launched.stderr_tail.append(buffer.decode("utf-8", errors="replace").rstrip())
        launched.stderr_done.set()

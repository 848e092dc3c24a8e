"""Starting engine processes and the client side of the startup handshake."""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from typing import Any, Final

import attrs
import trio

from ..config import EngineConfig
from ..engine import identity_for_rank
from ..protocol import EngineCoreReadyResponse
from ._lb import EngineLoad

__all__ = [
    "OWNER_FILE",
    "DirectoryOwner",
    "EngineHandle",
    "arm_lifeline",
    "engine_command",
    "engine_log_level",
    "engine_logger",
    "open_lifeline",
    "parse_relayed_line",
    "private_ipc_dir",
    "remove_stale_ipc_dirs",
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


_IPC_DIR_PREFIX: Final = "tec-"
OWNER_FILE: Final = "owner.json"
"""The file in a private ipc directory that says which process created it."""
_OWNER_FILE_MAX_BYTES: Final = 4096


def private_ipc_dir() -> str:
    """A new directory, mode 0700, for this client's ipc:// sockets.

    Uses the system temp dir unless its path is too long for unix socket addresses
    (a long ``TMPDIR`` breaks ipc:// silently), in which case ``/tmp`` is used.

    The directory holds :data:`OWNER_FILE`, which names this process (see
    :class:`DirectoryOwner`). First, the directories of clients that are gone (killed
    before they could remove theirs) are removed: ``tec-*`` directories of this user,
    in that same temp dir, whose owner file names a process that no longer runs.
    """
    base = tempfile.gettempdir()
    if len(base) > _MAX_IPC_DIR_LEN - 20:
        base = "/tmp"
    remove_stale_ipc_dirs(base)
    path = tempfile.mkdtemp(prefix=_IPC_DIR_PREFIX, dir=base)
    owner = DirectoryOwner.this_process()
    if owner is not None:
        try:
            with open(os.path.join(path, OWNER_FILE), "x", encoding="utf-8") as file:
                file.write(owner.to_json())
        except OSError as exc:  # pragma: no cover - a full disk; the sockets may still fit
            logger.warning("could not write the owner of %s, never cleaned up: %s", path, exc)
    return path


def _proc_stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: index 0 is field 3
    (the state), index 19 field 22 (the start time, in clock ticks since boot).

    Raises:
        OSError: no such process, or no /proc.
    """
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
        text = file.read()
    # The command name (field 2) is in parentheses and may hold spaces and ")".
    return text.rsplit(")", 1)[1].split()


def _read_text(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as file:
        return file.read().strip()


@attrs.frozen
class DirectoryOwner:
    """The process that created a private ipc directory, as its owner file says.

    ``pid`` alone would do until the pid is reused; the start time (field 22 of
    ``/proc/<pid>/stat``) tells a reused pid apart, the boot id a reboot, the pid
    namespace and the host name a process this one cannot see (a container, another
    host sharing the directory), whose directory is never taken for stale.
    """

    pid: int
    start: str
    boot: str
    pid_namespace: str
    host: str

    @classmethod
    def this_process(cls) -> DirectoryOwner | None:
        """This process, or None where there is no /proc to tell it by."""
        try:
            return cls(
                pid=os.getpid(),
                start=_proc_stat_fields("self")[19],
                boot=_read_text("/proc/sys/kernel/random/boot_id"),
                pid_namespace=os.readlink("/proc/self/ns/pid"),
                host=socket.gethostname(),
            )
        except (OSError, IndexError):
            return None

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self)) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DirectoryOwner | None:
        """The owner an owner file names, or None if it is not one."""
        try:
            fields: Any = json.loads(text)
            owner = cls(**fields)
        except (ValueError, TypeError):
            return None
        kinds = (int, str, str, str, str)
        values = attrs.astuple(owner)
        if not all(type(value) is kind for value, kind in zip(values, kinds, strict=True)):
            return None
        return owner

    def is_gone(self, current: DirectoryOwner) -> bool:
        """Whether this owner is certainly no longer running, as seen by ``current``
        (this process). False when it cannot tell."""
        if (self.host, self.pid_namespace) != (current.host, current.pid_namespace):
            return False  # another host or container: its processes are not ours to see
        if self.boot != current.boot:
            return True  # the machine rebooted since
        try:
            fields = _proc_stat_fields(self.pid)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if fields[0] in ("Z", "X"):
            return True  # a zombie: it has exited, its parent has not reaped it yet
        return fields[19] != self.start  # another process got the pid


def remove_stale_ipc_dirs(base: str) -> list[str]:
    """Remove the private ipc directories in ``base`` whose owner is gone; return them.

    Only directories (not symbolic links) named ``tec-*``, owned by this user, with
    an owner file (a regular file of this user) that names a process certainly gone.
    Anything else is left alone: another user's directory, one without an owner file
    (another program's, or one being created), one of a live client, one of a process
    on another host or in another pid namespace.
    """
    current = DirectoryOwner.this_process()
    if current is None:
        return []
    uid = os.getuid()
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(_IPC_DIR_PREFIX):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            continue
        owner = _read_owner(entry.path, uid)
        if owner is None or not owner.is_gone(current):
            continue
        path = os.path.join(base, entry.name)
        logger.debug("removing %s: the client that created it (pid %d) is gone", path, owner.pid)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _read_owner(directory: str, uid: int) -> DirectoryOwner | None:
    """The owner named by ``directory``'s owner file, if it is a regular file of
    ``uid`` (never following a symbolic link)."""
    path = os.path.join(directory, OWNER_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
            return None
        data = os.read(fd, _OWNER_FILE_MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return DirectoryOwner.from_json(data.decode("utf-8", errors="replace"))


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
    lifeline: int | None = None
    """The write end of the engine's lifeline pipe, while the client holds it."""

    def close_lifeline(self) -> None:
        """Close the write end of the lifeline pipe (idempotent): a launched engine
        still running then stops at once."""
        if self.lifeline is not None:
            fd, self.lifeline = self.lifeline, None
            os.close(fd)

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

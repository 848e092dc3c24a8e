"""Private directories for ipc:// sockets (a client's, a coordinator's), and the removal
of those of processes that died before they could remove theirs."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import tempfile
from typing import Any, Final

import attrs

__all__ = ["OWNER_FILE", "DirectoryOwner", "private_ipc_dir", "remove_stale_ipc_dirs"]

# The client's logger: clients create nearly all of these directories, and programs
# configured it for these messages before the module moved here.
logger = logging.getLogger("trio_enginecore.client")

# A unix socket path must fit in ~107 bytes; keep the directory well below that.
_MAX_IPC_DIR_LEN: Final = 60


_IPC_DIR_PREFIX: Final = "tec-"
OWNER_FILE: Final = "owner.json"
"""The file in a private ipc directory that says which process created it."""
_OWNER_FILE_MAX_BYTES: Final = 4096


def private_ipc_dir() -> str:
    """A new directory, mode 0700, for this process's ipc:// sockets (a client's, or a
    coordinator's).

    Uses the system temp dir unless its path is too long for unix socket addresses
    (a long ``TMPDIR`` breaks ipc:// silently), in which case ``/tmp`` is used.

    The directory holds :data:`OWNER_FILE`, which names this process (see
    :class:`DirectoryOwner`). First, the directories of processes that are gone (killed
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

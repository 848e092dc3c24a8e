"""The private socket directories of clients that were killed are removed by the next.

A client binds its ipc:// sockets in a ``tec-*`` directory of the temp dir and removes
it when it closes; a client killed with SIGKILL cannot. Each directory holds an owner
file naming the process that made it (pid, start time, boot, pid namespace, host), so
the next client to start can tell a dead owner from a live one, and removes only the
directories of this user whose owner is certainly gone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio

from trio_enginecore import EngineConfig, open_engine_client
from trio_enginecore._ipc_dirs import (
    OWNER_FILE,
    DirectoryOwner,
    private_ipc_dir,
    remove_stale_ipc_dirs,
)

from .frontends import frontend_helper, ipc_dirs, proc_stat


@pytest.fixture
def short_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A temp dir of its own for the clients of the test, in-process ones included,
    short enough for ipc:// socket paths."""
    path = tempfile.mkdtemp(prefix="tsd-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def owner_of(directory: str | Path) -> DirectoryOwner | None:
    return DirectoryOwner.from_json((Path(directory) / OWNER_FILE).read_text())


def a_gone_process() -> DirectoryOwner:
    """The owner record of a process that ran and exited (and was reaped)."""
    current = DirectoryOwner.this_process()
    assert current is not None
    process = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return attrs.evolve(current, pid=int(process.stdout))


def plant(base: str, name: str, owner: DirectoryOwner | None, text: str | None = None) -> Path:
    """A ``tec-*`` directory as a client leaves it: a socket-ish file and the owner file."""
    directory = Path(base) / name
    directory.mkdir(mode=0o700)
    (directory / "input").write_text("")
    if owner is not None:
        (directory / OWNER_FILE).write_text(owner.to_json())
    elif text is not None:
        (directory / OWNER_FILE).write_text(text)
    return directory


async def test_a_killed_clients_directory_is_removed_by_the_next_client_only(
    short_tmp: str,
) -> None:
    with trio.fail_after(60):
        async with frontend_helper(short_tmp) as frontends:
            killed = await frontends.start()
            live = await frontends.start()
            with trio.fail_after(20):
                await killed.ready.wait()
                await live.ready.wait()
            killed_dir, live_dir = killed.engine.ipc_dir, live.engine.ipc_dir
            owner = owner_of(killed_dir)
            assert owner is not None
            assert owner.pid == killed.pid

            killed.kill()
            assert await killed.engine.wait_exit(5)
            # A client killed with SIGKILL leaves its directory behind...
            assert Path(killed_dir).is_dir()
            foreign = Path(short_tmp) / "tec-not-a-client"
            foreign.mkdir(mode=0o700)
            (foreign / "data").write_text("someone else's")

            # ...and the next client to start removes it, and nothing else.
            async with open_engine_client(EngineConfig()):
                assert not Path(killed_dir).exists()
                assert Path(live_dir).is_dir()
                assert (live_dir_owner := owner_of(live_dir)) is not None
                assert live_dir_owner.pid == live.pid
                assert (foreign / "data").read_text() == "someone else's"
            assert ipc_dirs(short_tmp) == {os.path.basename(live_dir), foreign.name}


def test_an_owner_is_gone_once_exited_a_zombie_or_its_pid_reused() -> None:
    current = DirectoryOwner.this_process()
    assert current is not None
    assert not current.is_gone(current)
    assert a_gone_process().is_gone(current)
    # Another process now has the pid: its start time differs.
    assert attrs.evolve(current, start=str(int(current.start) + 1)).is_gone(current)
    # A zombie has exited: its pid is still taken, until its parent reaps it.
    zombie = subprocess.Popen([sys.executable, "-c", ""])
    try:
        deadline = time.monotonic() + 10
        while (stat := proc_stat(zombie.pid)) is not None and stat[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert stat is not None
        assert attrs.evolve(current, pid=zombie.pid, start=stat[19]).is_gone(current)
    finally:
        zombie.wait()
    # A reboot since: gone. Another host or pid namespace: cannot tell, so not gone.
    assert attrs.evolve(current, boot="another boot").is_gone(current)
    assert not attrs.evolve(a_gone_process(), host="another-host").is_gone(current)
    assert not attrs.evolve(a_gone_process(), pid_namespace="pid:[1]").is_gone(current)


def test_only_this_users_directories_with_an_owner_file_naming_a_dead_process_go(
    short_tmp: str,
) -> None:
    gone = a_gone_process()
    stale = plant(short_tmp, "tec-stale", gone)
    live = plant(short_tmp, "tec-live", DirectoryOwner.this_process())
    no_owner = plant(short_tmp, "tec-no-owner", None)
    garbage = plant(short_tmp, "tec-garbage", None, text='{"pid": "not a number"}')
    other_name = plant(short_tmp, "other-stale", gone)
    # A symbolic link named like a directory of ours, to a stale-looking directory.
    target = plant(short_tmp, "link-target", gone)
    link = Path(short_tmp) / "tec-link"
    link.symlink_to(target)
    # An owner file that is a symbolic link to a stale owner file.
    linked_owner = plant(short_tmp, "tec-linked-owner", None)
    (linked_owner / OWNER_FILE).symlink_to(stale / OWNER_FILE)
    planted = [live, no_owner, garbage, other_name, target, linked_owner]
    if os.geteuid() == 0:
        # Another user's directory, with a stale owner file: not ours to remove.
        foreign = plant(short_tmp, "tec-foreign", gone)
        for path in (foreign, foreign / OWNER_FILE, foreign / "input"):
            os.chown(path, 65534, 65534)
        planted.append(foreign)

    assert remove_stale_ipc_dirs(short_tmp) == [str(stale)]
    assert not stale.exists()
    for directory in planted:
        assert (directory / "input").exists(), directory
    assert link.is_symlink()
    # The next private directory is removed by no one while this process lives.
    mine = private_ipc_dir()
    assert os.path.dirname(mine) == short_tmp
    assert owner_of(mine) == DirectoryOwner.this_process()
    assert oct(os.stat(mine).st_mode & 0o777) == oct(0o700)
    assert remove_stale_ipc_dirs(short_tmp) == []

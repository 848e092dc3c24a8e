"""Frontend processes to kill: programs that open a client, and the engines they launch.

A *frontend* is a process that has imported trio_enginecore and runs
``open_engine_client(EngineConfig())``, printing ``ready <pid>`` once the client is
ready, then waits forever. The tests SIGKILL them at chosen moments and watch what
their engines do.

They are forked from one helper process that has done the imports once (a frontend
costs a fork, not an interpreter start): each line on the helper's stdin starts one,
and the helper answers ``started <pid>``. A frontend's engine is found as its child
whose command line is ``... -m trio_enginecore serve ...``; after the kill the
engine is reparented, so the tests keep its pid (and start time, against pid reuse).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from .support import children_of

FRONTEND_HELPER = r"""
import os, sys
import trio
from trio_enginecore import EngineConfig, open_engine_client

async def frontend():
    async with open_engine_client(EngineConfig()):
        print("ready", os.getpid(), flush=True)
        await trio.sleep_forever()

for line in sys.stdin:
    while True:  # reap the frontends that were killed
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            trio.run(frontend)
        finally:
            os._exit(0)
    print("started", pid, flush=True)
"""

ENGINE_COMMAND = b"trio_enginecore\0serve\0"


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (index 0 is the state,
    19 the start time), or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def engines_in(base: str) -> list[int]:
    """Live engine processes whose command line mentions ``base`` (whoever their
    parent is now)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            line = cmdline(int(entry.name))
            stat = proc_stat(int(entry.name))
            if ENGINE_COMMAND in line and base.encode() in line and stat and stat[0] != "Z":
                found.append(int(entry.name))
    return found


def ipc_dirs(base: str) -> set[str]:
    """The client socket directories (``tec-*``) in ``base``."""
    return {entry.name for entry in Path(base).iterdir() if entry.name.startswith("tec-")}


@attrs.define
class Engine:
    """An engine process, told apart from a later process that reuses its pid."""

    pid: int
    start: str
    command: bytes

    @property
    def running(self) -> bool:
        stat = proc_stat(self.pid)
        return stat is not None and stat[19] == self.start and stat[0] not in ("Z", "X")

    @property
    def ipc_dir(self) -> str:
        """The directory of the handshake socket on the engine's command line."""
        words = self.command.split(b"\0")
        address = words[words.index(b"--handshake-address") + 1].decode()
        return os.path.dirname(address.removeprefix("ipc://"))

    async def wait_exit(self, timeout_s: float) -> bool:
        """Whether the engine exited within ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            while self.running:
                await trio.sleep(0.01)
            return True
        return False


def _engine_child(pid: int) -> Engine | None:
    # Children are listed per thread that forked them (trio forks in a worker thread).
    children: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        children = children_of(pid)
    for child in children:
        line = cmdline(child)
        stat = proc_stat(child)
        if ENGINE_COMMAND in line and stat is not None:
            return Engine(child, stat[19], line)
    return None


@attrs.define
class Frontend:
    pid: int
    engine: Engine
    launched_at: float
    """trio.current_time() when its engine was first seen running its own program."""
    ready: trio.Event

    def kill(self) -> None:
        os.kill(self.pid, 9)


@attrs.define
class Frontends:
    helper: trio.Process
    started: trio.MemoryReceiveChannel[int]
    ready: dict[int, trio.Event] = attrs.field(factory=dict[int, trio.Event])

    async def start(self, timeout_s: float = 20) -> Frontend:
        """Start a frontend; return once its engine process runs (before it is ready)."""
        assert self.helper.stdin is not None
        with trio.fail_after(timeout_s):
            await self.helper.stdin.send_all(b"go\n")
            pid = await self.started.receive()
            event = self.ready.setdefault(pid, trio.Event())
            while (engine := _engine_child(pid)) is None:
                await trio.sleep(0.002)
        return Frontend(pid, engine, trio.current_time(), event)

    async def _read(self, send: trio.MemorySendChannel[int]) -> None:
        assert self.helper.stdout is not None
        buffer = b""
        async with send:
            async for chunk in self.helper.stdout:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    what, pid = line.decode().split()
                    if what == "started":
                        await send.send(int(pid))
                    else:
                        self.ready.setdefault(int(pid), trio.Event()).set()


@asynccontextmanager
async def frontend_helper(tmpdir: str) -> AsyncIterator[Frontends]:
    """The helper process forking frontends whose temp dir (so whose client socket
    directories) is ``tmpdir``. On exit every frontend and engine left is killed."""
    env = {**os.environ, "TMPDIR": tmpdir, "OPENBLAS_NUM_THREADS": "1"}
    helper = await trio.lowlevel.open_process(
        [sys.executable, "-c", FRONTEND_HELPER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    send, receive = trio.open_memory_channel[int](math.inf)
    frontends = Frontends(helper, receive)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(frontends._read, send)  # pyright: ignore[reportPrivateUsage]
            try:
                yield frontends
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            for pid in children_of(helper.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            assert helper.stdin is not None
            await helper.stdin.aclose()
            with trio.move_on_after(5):
                await helper.wait()
            if helper.returncode is None:
                helper.kill()
                await helper.wait()
            for pid in engines_in(tmpdir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)

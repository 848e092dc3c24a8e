"""Small helpers shared by the client tests."""

from __future__ import annotations

import os
import random
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from trio_enginecore import EngineCoreRequest, RequestStream
from trio_enginecore.client import TrioEngineClient
from trio_enginecore.engine import CounterModel


def expected(prompt: list[int], n: int) -> list[int]:
    """The tokens the counter model generates after ``prompt``."""
    return CounterModel.expected_tokens(prompt, n)


def with_changed_sampling(request: EngineCoreRequest, **changes: Any) -> EngineCoreRequest:
    """``request``, its sampling parameters changed after they were built (as a
    program that mutates them does: nothing checks an attribute assignment)."""
    params = request.sampling_params
    assert params is not None
    for name, value in changes.items():
        setattr(params, name, value)
    return request


async def streamed_tokens(stream: RequestStream) -> list[int]:
    """Every token of a stream, to its end."""
    tokens: list[int] = []
    async for out in stream:
        tokens += out.new_token_ids
    return tokens


async def stream_tokens(client: TrioEngineClient, request: EngineCoreRequest) -> list[int]:
    """Every token of ``request``, streamed by ``client`` to its end."""
    async with client.stream(request) as stream:
        return await streamed_tokens(stream)


async def stop_process(process: trio.Process, *, grace_s: float | None = 5.0) -> None:
    """Stop ``process`` (if it still runs) and reap it, shielded from cancellation.

    It gets SIGTERM and ``grace_s`` seconds to exit, then SIGKILL; with ``grace_s=None``
    SIGKILL at once (a SIGSTOPped process would not act on a SIGTERM).
    """
    with trio.CancelScope(shield=True):
        if grace_s is not None:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace_s):
                await process.wait()
        if process.returncode is None:
            process.kill()
        await process.wait()


def open_fds() -> set[str]:
    """This process's open file descriptors."""
    return set(os.listdir("/proc/self/fd"))


def children_of(pid: int) -> list[int]:
    """Pids of the live children of process ``pid``, from /proc."""
    parent = str(pid)
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Field 4 is the parent pid; the command name (field 2) may contain spaces.
            if stat.rsplit(")", 1)[1].split()[1] == parent:
                found.append(int(entry.name))
    return found


def children_of_this_process() -> list[int]:
    """Pids of this process's live children, from /proc."""
    return children_of(os.getpid())


def process_is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (a test binds it just after).

    Taken below the kernel's ephemeral range: a port in that range can be taken,
    between now and the test's bind, as the local end of any outgoing connection (of
    another test worker, or of a proxy connecting to it before anyone listens there,
    which the kernel may answer with a connection to itself). Seen once in CI: "Address
    already in use" on a port this function had given.
    """
    low = _ephemeral_ports_start()
    if low < 2048:  # no room below it: any free port
        with socket.socket() as sock:
            sock.bind((host, 0))
            free: int = sock.getsockname()[1]
            return free
    while True:
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class _StepCounter(trio.abc.Instrument):
    """Counts the steps of one task: every step after its first follows a schedule
    point (the task yielded to the scheduler and was resumed)."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def schedule_points(call: Callable[[], Awaitable[Any]]) -> int:
    """How many times the calling task yields to the scheduler while awaiting ``call()``."""
    counter = _StepCounter(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(counter)
    try:
        await call()
    finally:
        trio.lowlevel.remove_instrument(counter)
    return counter.steps


async def read_line(stream: trio.abc.ReceiveStream, *, what: str = "the program") -> bytes:
    """One line from a child's stdout (the child says when it got somewhere)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = await stream.receive_some(100)
        assert chunk, f"{what} exited before it printed a line (so far: {line!r})"
        line += chunk
    return line

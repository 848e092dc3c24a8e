"""A client that dies, at any moment, leaves no engine running and no socket directory.

A client keeps the write end of each launched engine's *lifeline* pipe; the engine has
the read end (``serve --lifeline-fd``). When the client dies, however it dies, the
kernel closes the write end: the engine reads end-of-file, first thing in ``serve``
if it was still importing, or from a task watching the pipe, and stops at once (exit
code 4), dropping whatever it had queued for the client. The next client to start
removes the socket directory the dead one left.

The frontends killed here are real client processes (``tests/frontends.py``); the
engines are real ``trio-enginecore serve`` processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from trio_enginecore._zmq import make_socket
from trio_enginecore.protocol import EngineCoreRequestType
from trio_enginecore.serial import MsgpackEncoder

from .enginepeer import RANK0, make_request, serve_command
from .frontends import Engine, engines_in, frontend_helper, ipc_dirs, proc_stat
from .support import process_is_running

ENGINE_EXIT_S = 2.0
"""How long an engine may take to exit once its client is killed (the kernel's SIGIO
on its lifeline ends it, or its own watch of the lifeline)."""
UNARMED_EXIT_S = 10.0
"""How long an engine may take to exit when its client is killed between the engine's
``exec`` and the moment the client arms the lifeline (a few microseconds, which a
kill right at the launch hits): the kernel then sends no SIGIO, and the engine stops
when its imports end and it finds the lifeline closed, a second or so, several on a
loaded machine."""

CLIENT_GONE = "the client that launched this engine is gone"
AFTER_READY_S = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4)


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A temp dir short enough for the clients' ipc:// sockets (a pytest tmp_path is
    not: the clients would fall back to /tmp, shared with everyone)."""
    path = tempfile.mkdtemp(prefix="tsd-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------ frontends killed


async def test_a_client_killed_at_any_moment_of_its_startup_leaves_no_engine_behind(
    short_tmp: str,
) -> None:
    """20 frontends are SIGKILLed, from the moment their engine starts (still
    importing) through the handshake to after the client is ready: every engine exits
    (within 2 s once the client is ready), and each new client removes the directory
    of the one killed before."""
    kills: list[tuple[float, bool]] = []  # (delay after the launch, was the client ready)
    with trio.fail_after(100):
        async with frontend_helper(short_tmp) as frontends:

            async def trial(*, delay_s: float, after_ready: bool) -> float:
                frontend = await frontends.start()
                engine_dir = frontend.engine.ipc_dir
                assert os.path.dirname(engine_dir) == short_tmp
                # The new client removed the directory of the one killed before it.
                assert ipc_dirs(short_tmp) == {os.path.basename(engine_dir)}
                if after_ready:
                    with trio.fail_after(20):
                        await frontend.ready.wait()
                    await trio.sleep(delay_s)
                else:
                    await trio.sleep_until(frontend.launched_at + delay_s)
                delay = trio.current_time() - frontend.launched_at
                kills.append((delay, frontend.ready.is_set()))
                frontend.kill()
                limit_s = ENGINE_EXIT_S if frontend.ready.is_set() else UNARMED_EXIT_S
                assert await frontend.engine.wait_exit(limit_s), (
                    f"the engine of a client killed {delay:.3f} s after launching it "
                    f"(ready: {frontend.ready.is_set()}) still runs {limit_s} s later"
                )
                return delay

            # Killed after the client is ready; these tell how long a startup takes
            # on this machine...
            startup_s = min([await trial(delay_s=s, after_ready=True) for s in AFTER_READY_S])
            # ...and these are killed at 14 moments spread over a startup.
            for step in range(14):
                await trial(delay_s=startup_s * step / 14, after_ready=False)

            # One more client, left normally: it removed the last killed one's
            # directory on its way in, and removes its own on its way out.
            last = await frontends.start()
            with trio.fail_after(20):
                await last.ready.wait()
            assert ipc_dirs(short_tmp) == {os.path.basename(last.engine.ipc_dir)}
            os.kill(last.pid, 2)  # SIGINT: KeyboardInterrupt leaves the client's block
            assert await last.engine.wait_exit(10)
            with trio.fail_after(10):
                while ipc_dirs(short_tmp):
                    await trio.sleep(0.01)
    assert len(kills) == 20
    assert any(not ready for _, ready in kills), "no kill came before the client was ready"
    assert any(ready for _, ready in kills)
    assert engines_in(short_tmp) == []


# ---------------------------------------------------- an engine and its lifeline


async def test_an_engine_whose_client_is_gone_before_it_starts_exits_4_without_a_word(
    short_tmp: str,
) -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)  # the client died while the engine was being started
    ctx: zmq.Context[Any] = zmq.Context()
    handshake = make_socket(ctx, zmq.ROUTER)
    try:
        address = handshake.bind(f"ipc://{short_tmp}/handshake")
        command = serve_command("--handshake-address", address, "--lifeline-fd", str(read_end))
        with trio.fail_after(30):
            result = await trio.run_process(
                command, pass_fds=(read_end,), capture_stderr=True, check=False
            )
        assert result.returncode == 4
        assert (
            f"{CLIENT_GONE} (its lifeline pipe is closed): not starting" in result.stderr.decode()
        )
        assert handshake.raw.poll(0) == 0, "the engine said HELLO to a client that is gone"
    finally:
        os.close(read_end)
        handshake.close()
        ctx.term()


async def test_an_engine_whose_client_vanishes_while_serving_exits_4_at_once(
    short_tmp: str,
) -> None:
    """Not after a drain, nor after the output socket's linger (4 s) towards a client
    that will never read what it queued."""
    ctx: zmq.Context[Any] = zmq.Context()
    router = make_socket(ctx, zmq.ROUTER)
    pull = make_socket(ctx, zmq.PULL)
    read_end, write_end = os.pipe()
    process: trio.Process | None = None
    try:
        inp = router.bind(f"ipc://{short_tmp}/input")
        out = pull.bind(f"ipc://{short_tmp}/output")
        command = serve_command(
            "--input-address", inp, "--output-address", out, "--lifeline-fd", str(read_end),
            "--step-time-s", "0.005",
        )  # fmt: skip
        process = await trio.lowlevel.open_process(
            command, pass_fds=(read_end,), stderr=subprocess.PIPE
        )
        os.close(read_end)
        with trio.fail_after(30):
            identity, _ = await router.recv_multipart()  # the ready message
            assert identity == RANK0
            request = make_request("long", max_tokens=1_000_000)
            frames = MsgpackEncoder().encode(request)
            await router.send_multipart([RANK0, EngineCoreRequestType.ADD.value, *frames])
            await pull.recv_multipart()  # it is generating
        # The client vanishes: its sockets go, the engine queues outputs for nobody...
        pull.close(linger=0)
        router.close(linger=0)
        await trio.sleep(0.2)
        assert process.returncode is None
        # ...and then its lifeline breaks.
        os.close(write_end)
        write_end = -1
        with trio.fail_after(ENGINE_EXIT_S):
            code = await process.wait()
        assert code == 4
        assert process.stderr is not None
        with trio.fail_after(5):
            stderr = b""
            async for chunk in process.stderr:
                stderr += chunk
        assert CLIENT_GONE.encode() in stderr
        assert b"without draining" in stderr
    finally:
        if write_end >= 0:
            os.close(write_end)
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()
        router.close()
        pull.close()
        ctx.term()


ENGINE_BY_HAND = """
import subprocess, sys
engine = subprocess.Popen(sys.argv[2:], stderr=open(sys.argv[1], "wb"))
print(engine.pid, flush=True)
engine.wait()
"""


async def test_exit_with_parent_still_stops_an_engine_started_by_hand(short_tmp: str) -> None:
    """Without a lifeline, ``--exit-with-parent`` polls the parent as before."""
    ctx: zmq.Context[Any] = zmq.Context()
    handshake = make_socket(ctx, zmq.ROUTER)
    stderr_file = Path(short_tmp) / "engine.stderr"
    line = b""
    try:
        address = handshake.bind(f"ipc://{short_tmp}/handshake")
        command = serve_command("--handshake-address", address, "--exit-with-parent")
        with trio.fail_after(30):
            parent = await trio.lowlevel.open_process(
                [sys.executable, "-c", ENGINE_BY_HAND, str(stderr_file), *command],
                stdout=subprocess.PIPE,
            )
            assert parent.stdout is not None
            while not line.endswith(b"\n"):
                line += await parent.stdout.receive_some(100)
            stat = proc_stat(int(line))
            assert stat is not None
            engine = Engine(int(line), stat[19], b"")
            await handshake.recv_multipart()  # HELLO: its watcher is running
            parent.kill()
            await parent.wait()
            await parent.stdout.aclose()
        assert await engine.wait_exit(ENGINE_EXIT_S)
        text = stderr_file.read_text()
        assert f"{CLIENT_GONE} (the launching process, pid {parent.pid}, exited)" in text
    finally:
        if line and process_is_running(int(line)):
            os.kill(int(line), 9)
        handshake.close()
        ctx.term()


def test_serve_refuses_a_lifeline_fd_it_does_not_have_as_a_usage_error() -> None:
    result = subprocess.run(
        serve_command("--handshake-address", "ipc:///nowhere", "--lifeline-fd", "999"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "argument --lifeline-fd: 999 is not an open file descriptor" in result.stderr
    assert "Traceback" not in result.stderr

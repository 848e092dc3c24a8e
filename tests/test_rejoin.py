"""A headless engine outlives its frontend: it rejoins the next one, or exits on time.

A headless engine (``trio-enginecore serve --headless --handshake-address ...``) used to
serve the first frontend only: after that frontend went away it kept running, never
said HELLO again, and every later frontend waited for it in vain (vLLM #32136). Now it
watches its connection to the frontend: when the connection closes (the frontend
closed its client, exited, or was killed with SIGKILL) it drops that frontend's
requests and goes back to the handshake, joining the next frontend that binds the
handshake address; after ``--rejoin-timeout-s`` with no frontend it exits with code 4
and says why.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, RemoteEngines, open_engine_client

from .support import children_of_this_process, expected, free_port, read_line, stop_process
from .test_remote import headless_command

CONFIG = EngineConfig(step_time_s=0.01)
EXIT_CLIENT_GONE = 4


def headless(address: str, *extra: str) -> list[str]:
    return [*headless_command(CONFIG, address), *extra]


@asynccontextmanager
async def engine_process(command: list[str]) -> AsyncIterator[trio.Process]:
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield process
    finally:
        await stop_process(process)
        if process.stderr is not None:
            await process.stderr.aclose()


async def serve_one_frontend(address: str, prompt: int) -> None:
    """A frontend in this process: a client over the remote engine, exact results."""
    async with open_engine_client(CONFIG, remote=RemoteEngines(address)) as client:
        request = EngineCoreRequest.for_tokens([prompt], request_id="same-id", max_tokens=6)
        async with client.stream(request) as outputs:
            tokens = [t async for o in outputs for t in o.new_token_ids]
        assert tokens == expected([prompt], 6)


FRONTEND = textwrap.dedent(
    """
    import sys, trio
    from trio_enginecore import EngineConfig, EngineCoreRequest, RemoteEngines
    from trio_enginecore import open_engine_client

    async def main():
        remote = RemoteEngines(sys.argv[1])
        async with open_engine_client(EngineConfig(step_time_s=0.01), remote=remote) as c:
            request = EngineCoreRequest.for_tokens([1], max_tokens=1_000_000)
            async with c.stream(request) as outputs:
                await outputs.receive()
                print("streaming", flush=True)
                await trio.sleep_forever()

    trio.run(main)
    """
)


async def a_frontend_killed_mid_stream(address: str) -> None:
    """A frontend process that the test kills with SIGKILL while its request runs."""
    frontend = await trio.lowlevel.open_process(
        [sys.executable, "-c", FRONTEND, address], stdout=subprocess.PIPE
    )
    assert frontend.stdout is not None
    assert await read_line(frontend.stdout, what="the frontend") == b"streaming\n"
    frontend.send_signal(signal.SIGKILL)
    await frontend.wait()
    await frontend.stdout.aclose()


async def test_a_headless_engine_serves_frontend_after_frontend_one_killed_among_them() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with trio.fail_after(90):
        async with engine_process(headless(address)) as engine:
            await serve_one_frontend(address, 1)  # leaves cleanly
            await a_frontend_killed_mid_stream(address)  # leaves by SIGKILL
            await serve_one_frontend(address, 2)
            await serve_one_frontend(address, 3)
            # One engine process served them all.
            assert engine.returncode is None
    assert children_of_this_process() == []


async def test_a_headless_engine_with_no_frontend_to_rejoin_exits_and_says_why() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with trio.fail_after(60):
        async with engine_process(headless(address, "--rejoin-timeout-s", "1")) as engine:
            await serve_one_frontend(address, 1)
            left = trio.current_time()
            assert await engine.wait() == EXIT_CLIENT_GONE
            assert trio.current_time() - left < 10
            assert engine.stderr is not None
            stderr = b""
            async for chunk in engine.stderr:
                stderr += chunk
    text = stderr.decode()
    assert "the frontend left" in text
    assert f"no frontend answered at {address} within 1 s after the last one left" in text


async def test_with_a_rejoin_timeout_of_zero_a_headless_engine_exits_when_its_frontend_leaves() -> (
    None
):
    address = f"tcp://127.0.0.1:{free_port()}"
    with trio.fail_after(60):
        async with engine_process(headless(address, "--rejoin-timeout-s", "0")) as engine:
            await serve_one_frontend(address, 1)
            assert await engine.wait() == EXIT_CLIENT_GONE


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_a_rejoin_timeout_that_is_not_a_number_of_seconds_is_refused(value: str) -> None:
    result = subprocess.run(
        [*headless("tcp://127.0.0.1:1"), "--rejoin-timeout-s", value],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--rejoin-timeout-s" in result.stderr

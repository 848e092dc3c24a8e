"""An engine cut off by the network is dead within 3 s, as a killed one is; one whose
connection the network resets, and that makes it again, is not.

A cut is silent: nothing closes, nothing is refused, packets just stop. Only the
heartbeats on the client's input socket can tell, so these tests cut the path while
both processes run on:

* an attached engine whose connections go through TCP proxies that stop forwarding
  (they keep both sides open and drop what comes);
* a remote engine in its own network namespace, joined to this one by a veth pair,
  whose link is taken down (root and ``ip netns`` needed; skipped otherwise).

A reset is loud but brief: both ends get a TCP RST mid-step, and the engine's libzmq
connects again through the same proxies 0.1 s later, whatever its busy loop is doing.
With steps of 5 s that hold the engine's thread (and the GIL), the engine cannot show
life within the 0.5 s grace: it must not be taken for dead, while a killed or stopped
engine behind the same proxies still is, within 3 s.

Real engine processes, real TCP; default liveness settings.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    RemoteEngines,
    open_engine_client,
)
from trio_enginecore.client import TrioEngineClient
from trio_enginecore.client._multiprocess._launch import serve_arguments

from .enginepeer import serve_command
from .proxies import FreezableProxy
from .support import expected, free_port, stop_process, stream_tokens

CONFIG = EngineConfig(step_time_s=0.01)
NOTICED_WITHIN_S = 3.0
"""What the default liveness settings promise for a cut-off engine."""


async def time_to_death_after(
    client: TrioEngineClient, cut: Callable[[], Awaitable[None]]
) -> tuple[float, str]:
    """Stream a long request, ``cut()`` the path, and return how long its stream took
    to raise ``EngineDeadError``, and the error's message."""
    request = EngineCoreRequest.for_tokens([1], request_id="cut-off", max_tokens=1_000_000)
    async with client.stream(request) as outputs:
        await outputs.receive()
        await cut()
        cut_at = trio.current_time()
        with pytest.raises(EngineDeadError) as died:
            async for _ in outputs:
                pass
    return trio.current_time() - cut_at, str(died.value)


@pytest.mark.parametrize("paths", ["both", "input"])
async def test_an_attached_engine_behind_a_path_that_stops_forwarding_is_dead_within_3s(
    paths: str,
) -> None:
    """Both of its connections cut; or only the one requests take, while its outputs
    still come: it cannot be reached, which is what an engine is for."""
    input_port, output_port = free_port(), free_port()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            to_input, to_output = FreezableProxy(input_port), FreezableProxy(output_port)
            await nursery.start(to_input.run)
            await nursery.start(to_output.run)
            process = await trio.lowlevel.open_process(
                serve_command(
                    "--input-address",
                    f"tcp://127.0.0.1:{to_input.port}",
                    "--output-address",
                    f"tcp://127.0.0.1:{to_output.port}",
                    *serve_arguments(CONFIG),
                )
            )

            async def cut() -> None:
                await trio.lowlevel.checkpoint()
                to_input.freeze()
                if paths == "both":
                    to_output.freeze()

            try:
                with pytest.raises(EngineDeadError):
                    async with open_engine_client(
                        CONFIG,
                        input_address=f"tcp://127.0.0.1:{input_port}",
                        output_address=f"tcp://127.0.0.1:{output_port}",
                        ready_timeout_s=20,
                    ) as client:
                        elapsed, message = await time_to_death_after(client, cut)
                # The engine itself ran on all along: it was the path.
                assert process.returncode is None
            finally:
                await stop_process(process, grace_s=None)
                nursery.cancel_scope.cancel()
    assert elapsed < NOTICED_WITHIN_S, elapsed
    assert "engine rank 0 died: its connection was lost" in message
    assert "the network between us failed" in message


# ---------------------------------------------------- a connection reset mid-step

LONG_STEP_S = 5.0
FOREVER = 1_000_000
"""Tokens of a request that outlives every test."""


def stepping(held: bool) -> EngineConfig:
    """Steps of 5 s: sleeping ones (the engine's Trio loop runs meanwhile), or, held,
    each spinning in Python with the GIL (``stall_steps``, set once the client is
    ready), as a vLLM engine's busy loop is in a long step."""
    if held:
        return EngineConfig(step_time_s=0, enable_fault_injection=True)
    return EngineConfig(step_time_s=LONG_STEP_S, enable_fault_injection=True)


@asynccontextmanager
async def behind_proxies(
    cfg: EngineConfig, *, held: bool
) -> AsyncIterator[tuple[TrioEngineClient, trio.Process, list[FreezableProxy]]]:
    """An engine in attach mode whose two connections go through proxies, and a client
    attached to it (default liveness settings), its steps of 5 s; the engine is
    killed on the way out. What the client's block raises is raised as itself."""
    input_port, output_port = free_port(), free_port()
    error: Exception | None = None
    async with trio.open_nursery() as nursery:
        proxies = [FreezableProxy(input_port), FreezableProxy(output_port)]
        for proxy in proxies:
            await nursery.start(proxy.run)
        process = await trio.lowlevel.open_process(
            serve_command(
                "--input-address",
                f"tcp://127.0.0.1:{proxies[0].port}",
                "--output-address",
                f"tcp://127.0.0.1:{proxies[1].port}",
                *serve_arguments(cfg),
            )
        )
        try:
            async with open_engine_client(
                cfg,
                input_address=f"tcp://127.0.0.1:{input_port}",
                output_address=f"tcp://127.0.0.1:{output_port}",
                ready_timeout_s=20,
            ) as client:
                if held:
                    await client.call_utility("stall_steps", LONG_STEP_S)
                yield client, process, proxies
        except Exception as exc:
            error = exc  # raised below, outside the nursery: not in a group
        finally:
            await stop_process(process, grace_s=None)
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error


async def watch_states(client: TrioEngineClient, seen: set[str]) -> None:
    """Record every state the client's view of its engine goes through."""
    while True:
        seen.update(engine.state for engine in client.statistics().engines)
        await trio.sleep(0.02)


async def reset_mid_step(
    client: TrioEngineClient, proxies: list[FreezableProxy]
) -> tuple[float, EngineDeadError]:
    """Stream a long request; once its first token came (its next step under way),
    reset both connections; how long after the reset the stream failed, and how.

    The reference engine drops the requests of a connection it lost, and greets the
    new one with its ready message: the stream fails, saying so, once the engine's
    Python runs again (at once with sleeping steps, when its step ends when held)."""
    request = EngineCoreRequest.for_tokens([5], request_id="reset", max_tokens=FOREVER)
    async with client.stream(request) as outputs:
        await outputs.receive()
        await trio.sleep(0.5)  # well into the next step
        assert [proxy.reset() for proxy in proxies] == [1, 1]
        reset_at = trio.current_time()
        with pytest.raises(EngineDeadError) as lost:
            async for _ in outputs:
                pass
    return trio.current_time() - reset_at, lost.value


@pytest.mark.parametrize("held", [False, True], ids=["sleeping-steps", "gil-holding-steps"])
async def test_a_connection_reset_mid_step_is_not_a_death(held: bool) -> None:
    seen: set[str] = set()
    with trio.fail_after(90):
        async with (
            behind_proxies(stepping(held), held=held) as (client, process, proxies),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(watch_states, client, seen)
            waited, lost = await reset_mid_step(client, proxies)
            assert "engine rank 0" in str(lost)
            assert "sent a second ready message" in str(lost)
            assert lost.retryable  # the engine is in service: sending again may succeed
            if held:
                # It could say nothing before its step ended: kept, suspect, past the
                # 0.5 s it has to be back, because it connected again at once.
                assert waited > 1.0, waited
                assert "suspect" in seen
            assert "dead" not in seen
            assert not client.is_dead
            # The same engine serves on, on its new connections (the reference engine
            # also reopens its output socket when a client's input connection ends).
            assert proxies[0].connections == 2
            assert proxies[1].connections >= 2
            assert process.returncode is None
            await client.call_utility("stall_steps", 0)
            after = EngineCoreRequest.for_tokens([44, 7], request_id="after", max_tokens=1)
            assert await stream_tokens(client, after) == expected([44, 7], 1)
            assert [engine.state for engine in client.statistics().engines] == ["alive"]
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
async def test_behind_proxies_that_reset_a_killed_or_stopped_engine_is_dead_within_3s(
    sig: signal.Signals,
) -> None:
    """Mid-step, with steps of 5 s held: the engine cannot reconnect (killed, or
    stopped with its libzmq thread), so the proxies' readiness to carry a new
    connection changes nothing. The stopped one first came back from a reset: its new
    connections are watched as its first ones were."""
    with trio.fail_after(90):
        with pytest.raises(EngineDeadError):
            async with behind_proxies(stepping(True), held=True) as (client, process, proxies):
                if sig is signal.SIGSTOP:
                    await reset_mid_step(client, proxies)
                    assert not client.is_dead
                request = EngineCoreRequest.for_tokens([9], request_id="doomed", max_tokens=FOREVER)
                async with client.stream(request) as outputs:
                    await outputs.receive()
                    await trio.sleep(0.5)  # well into the next step
                    os.kill(process.pid, sig)
                    signalled = trio.current_time()
                    with pytest.raises(EngineDeadError) as died:
                        async for _ in outputs:
                            pass
                    elapsed = trio.current_time() - signalled
    assert elapsed < NOTICED_WITHIN_S, elapsed
    assert "engine rank 0 died: its connection was lost" in str(died.value)


# ------------------------------------------------------------ a network namespace


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"tecprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


needs_namespaces = pytest.mark.skipif(
    not _can_make_namespaces(), reason="needs root and `ip netns` (network namespaces)"
)


async def _ip(*args: str, check: bool = True) -> None:
    await trio.run_process(["ip", *args], check=check, capture_stdout=True, capture_stderr=True)


@asynccontextmanager
async def namespace_joined_by_a_link() -> AsyncIterator[tuple[str, str, str, str]]:
    """A network namespace and a veth pair joining it to this one: ``(namespace,
    this side's address, its side's address, this side's link)``; removed on exit."""
    tag = secrets.token_hex(3)
    namespace, here, there = f"tec{tag}", f"vh{tag}", f"vn{tag}"
    subnet = 16 + secrets.randbelow(200)
    near, far = f"10.231.{subnet}.1", f"10.231.{subnet}.2"
    await _ip("netns", "add", namespace)
    try:
        await _ip("link", "add", here, "type", "veth", "peer", "name", there)
        await _ip("link", "set", there, "netns", namespace)
        await _ip("addr", "add", f"{near}/30", "dev", here)
        await _ip("link", "set", here, "up")
        await _ip("netns", "exec", namespace, "ip", "addr", "add", f"{far}/30", "dev", there)
        await _ip("netns", "exec", namespace, "ip", "link", "set", there, "up")
        await _ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        yield namespace, near, far, here
    finally:
        with trio.CancelScope(shield=True):
            await _ip("link", "del", here, check=False)
            await _ip("netns", "del", namespace, check=False)


@needs_namespaces
async def test_a_remote_engine_whose_network_link_goes_down_is_dead_within_3s() -> None:
    with trio.fail_after(60):
        async with namespace_joined_by_a_link() as (namespace, near, _, link):
            address = f"tcp://{near}:{free_port(near)}"
            process = await trio.lowlevel.open_process(
                [
                    "ip",
                    "netns",
                    "exec",
                    namespace,
                    *serve_command("--headless", "--handshake-address", address),
                    *serve_arguments(CONFIG),
                ],
                stdin=subprocess.DEVNULL,
            )
            try:
                with pytest.raises(EngineDeadError):
                    async with open_engine_client(
                        CONFIG, remote=RemoteEngines(address), ready_timeout_s=30
                    ) as client:
                        elapsed, message = await time_to_death_after(
                            client, partial(_ip, "link", "set", link, "down")
                        )
                assert process.returncode is None  # it ran on, cut off
            finally:
                await stop_process(process, grace_s=None)
    assert elapsed < NOTICED_WITHIN_S, elapsed
    assert "engine rank 0 died: its connection was lost" in message

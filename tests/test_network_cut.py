"""An engine cut off by the network is dead within 3 s, as a killed one is.

A cut is silent: nothing closes, nothing is refused, packets just stop. Only the
heartbeats on the client's input socket can tell, so these tests cut the path while
both processes run on:

* an attached engine whose connections go through TCP proxies that stop forwarding
  (they keep both sides open and drop what comes);
* a remote engine in its own network namespace, joined to this one by a veth pair,
  whose link is taken down (root and ``ip netns`` needed; skipped otherwise).

Real engine processes, real TCP; default liveness settings.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import final

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
from .support import free_port, stop_process

CONFIG = EngineConfig(step_time_s=0.01)
NOTICED_WITHIN_S = 3.0
"""What the default liveness settings promise for a cut-off engine."""


@final
class FreezableProxy:
    """Forwards each TCP connection accepted on 127.0.0.1 to ``target_port``, bytes
    both ways, until :meth:`freeze`: from then on it forwards nothing, drops what
    comes, and closes nothing; new connections are accepted and held, never forwarded.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.frozen = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_tcp, self._forward, 0, host="127.0.0.1")
            )
            self.port = listeners[0].socket.getsockname()[1]
            task_status.started()

    def freeze(self) -> None:
        self.frozen.set()

    async def _forward(self, engine_side: trio.SocketStream) -> None:
        async with engine_side:
            if self.frozen.is_set():
                await trio.sleep_forever()
            try:
                client_side = await trio.open_tcp_stream("127.0.0.1", self.target_port)
            except OSError:
                return  # nobody listening yet: the engine tries again
            async with client_side, trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, engine_side, client_side)
                nursery.start_soon(self._pump, client_side, engine_side)

    async def _pump(self, source: trio.SocketStream, sink: trio.SocketStream) -> None:
        try:
            async for chunk in source:
                if self.frozen.is_set():
                    await trio.sleep_forever()  # what came is dropped; nothing closes
                await sink.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await trio.sleep_forever()  # a closed side is not passed on either


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

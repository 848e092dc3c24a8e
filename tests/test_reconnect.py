"""An attached engine's connection cut and re-made: the requests it lost fail, it serves on.

The engine's input DEALER reconnects by itself (libzmq does, in the background), and the
reference engine, seeing its connection to the client lost and then made again, aborts
that client's requests and sends its ready message anew. The client sees the
connection close (its socket monitor), and gives the engine 0.5 s to be back: the
second ready message, on the new connection, is what it takes for what it is, the loss
of every request it had there: their streams raise ``EngineDeadError`` at once instead
of waiting for ever, its calls fail, and the engine stays in service: for new requests,
and watched on its new connection. An engine not back in time is dead.

A real engine process and a real TCP connection, cut in the middle by a byte-level
proxy between the engine's input DEALER and the client's input ROUTER (the output
connection is direct); an absolute timeout on everything.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import final

import attrs
import pytest
import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, EngineDeadError, open_engine_client
from trio_enginecore.client import TrioEngineClient
from trio_enginecore.client._multiprocess._launch import serve_arguments

from .enginepeer import serve_command
from .support import children_of_this_process, expected, free_port, stop_process, stream_tokens

CONFIG = EngineConfig(step_time_s=0.01)
LONG = 100_000
"""Tokens of a request that outlives the test many times over (0.01 s a step)."""
READY_TIMEOUT_S = 20.0
"""Generous: a loaded 2-core machine starts Python slowly; no speed claim."""
NOTICED_WITHIN_S = 5.0
"""From the cut to the last lost stream failing. It takes about 0.2 s (libzmq
reconnects after 100 ms); the bound is far above that, and far below "for ever", which
is what it was."""
STOP_NOTICED_WITHIN_S = 3.0
"""What the default liveness settings promise for a stopped or cut-off engine (see
test_liveness.py)."""


@final
class CuttableProxy:
    """Forwards every TCP connection accepted on 127.0.0.1 to ``target_port`` there,
    bytes both ways, until :meth:`cut`. It keeps listening, so whoever was cut off can
    connect again; a connection after the first is held ``reconnect_delay_s`` before it
    is forwarded (a path that takes a while to come back)."""

    def __init__(self, target_port: int, *, reconnect_delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.reconnect_delay_s = reconnect_delay_s
        self.port = 0
        self.connections = 0
        """Connections forwarded to the target (attempts it refused not counted)."""
        self._live: set[trio.CancelScope] = set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_tcp, self._forward, 0, host="127.0.0.1")
            )
            self.port = listeners[0].socket.getsockname()[1]
            task_status.started()

    def cut(self) -> int:
        """Close both sides of every live connection; how many there were."""
        cut = len(self._live)
        for scope in self._live:
            scope.cancel()
        return cut

    async def _forward(self, engine_side: trio.SocketStream) -> None:
        async with engine_side:
            if self.connections:
                await trio.sleep(self.reconnect_delay_s)
            try:
                client_side = await trio.open_tcp_stream("127.0.0.1", self.target_port)
            except OSError:
                return  # nobody listening yet: the engine tries again
            async with client_side:
                with trio.CancelScope() as scope:
                    self._live.add(scope)
                    self.connections += 1
                    try:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(_pump, engine_side, client_side, scope)
                            nursery.start_soon(_pump, client_side, engine_side, scope)
                    finally:
                        self._live.discard(scope)
            # Leaving the two ``async with`` closes both sockets: each peer sees its
            # connection end, as when a NAT or a firewall on the path resets it.


async def _pump(
    source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope
) -> None:
    try:
        async for chunk in source:
            await sink.send_all(chunk)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    scope.cancel()  # one direction ended: the connection is over


@attrs.define
class ProxiedEngine:
    proxy: CuttableProxy
    process: trio.Process
    input_address: str
    output_address: str

    @asynccontextmanager
    async def client(self) -> AsyncIterator[TrioEngineClient]:
        # Liveness checks at their defaults: a reconnection must not pass for a death.
        async with open_engine_client(
            CONFIG,
            input_address=self.input_address,
            output_address=self.output_address,
            ready_timeout_s=READY_TIMEOUT_S,
        ) as client:
            assert self.proxy.connections == 1
            yield client


@asynccontextmanager
async def engine_behind_a_proxy(*, reconnect_delay_s: float = 0.0) -> AsyncIterator[ProxiedEngine]:
    """An engine in attach mode whose input connection goes through a
    :class:`CuttableProxy`; the client binds the real addresses.

    On exit the engine gets SIGTERM and must exit 0, leaving no child process behind.
    """
    input_port, output_port = free_port(), free_port()
    async with trio.open_nursery() as nursery:
        proxy = CuttableProxy(input_port, reconnect_delay_s=reconnect_delay_s)
        await nursery.start(proxy.run)
        output_address = f"tcp://127.0.0.1:{output_port}"
        process = await trio.lowlevel.open_process(
            serve_command(
                "--input-address",
                f"tcp://127.0.0.1:{proxy.port}",
                "--output-address",
                output_address,
                *serve_arguments(CONFIG),
            )
        )
        try:
            yield ProxiedEngine(proxy, process, f"tcp://127.0.0.1:{input_port}", output_address)
            # The same process, still serving: nothing here restarted it.
            assert process.poll() is None
        finally:
            await stop_process(process)
            nursery.cancel_scope.cancel()
    assert process.returncode == 0
    assert children_of_this_process() == []


async def lost_stream(
    client: TrioEngineClient,
    prompt: list[int],
    streaming: trio.Semaphore,
    received: dict[str, list[int]],
    failures: dict[str, EngineDeadError],
) -> None:
    """Stream a request too long to end; once it has tokens, release ``streaming``.
    It must fail with ``EngineDeadError``; what it got before is in ``received``."""
    rid = f"lost-{prompt[0]}"
    request = EngineCoreRequest.for_tokens(prompt, request_id=rid, max_tokens=LONG)
    tokens = received[rid] = []
    with pytest.raises(EngineDeadError) as lost:
        async with client.stream(request) as outputs:
            async for output in outputs:
                if output.new_token_ids and not tokens:
                    streaming.release()
                tokens += output.new_token_ids
    failures[rid] = lost.value


async def cut_while_streaming(
    client: TrioEngineClient, proxy: CuttableProxy, prompts: list[list[int]]
) -> dict[str, list[int]]:
    """Stream ``prompts``, cut the connection once each has tokens, and wait (bounded)
    until each stream fails for the second ready message; the tokens each got."""
    received: dict[str, list[int]] = {}
    failures: dict[str, EngineDeadError] = {}
    streaming = trio.Semaphore(0)
    # Unbounded until the cut, then NOTICED_WITHIN_S for the nursery to end, that is
    # for every lost stream to fail.
    with trio.fail_at(math.inf) as noticed:
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(lost_stream, client, prompt, streaming, received, failures)
            for _ in prompts:
                await streaming.acquire()
            assert client.statistics().requests_in_flight == len(prompts)
            assert proxy.cut() == 1
            # The proxy still listens: the engine's DEALER reconnects through it, and
            # the engine greets "a new client" (us) with its ready message.
            noticed.deadline = trio.current_time() + NOTICED_WITHIN_S
    assert sorted(failures) == sorted(received)
    for failure in failures.values():
        assert "engine rank 0" in str(failure), failure
        assert "sent a second ready message" in str(failure), failure
    return received


async def test_requests_lost_to_a_reconnection_fail_at_once_and_the_engine_serves_on() -> None:
    prompts = [[11], [22], [33]]
    with trio.fail_after(60):
        async with engine_behind_a_proxy() as engine, engine.client() as client:
            received = await cut_while_streaming(client, engine.proxy, prompts)
            for prompt in prompts:
                tokens = received[f"lost-{prompt[0]}"]
                # What came before the cut was exact: nothing lost, nothing twice.
                assert tokens == expected(prompt, len(tokens))
            assert engine.proxy.connections == 2
            # In service, and holding nothing of the lost requests.
            assert not client.is_dead
            assert client.statistics().requests_in_flight == 0
            assert await client.get_request_counts() == (0, 0)
            after = EngineCoreRequest.for_tokens([44, 7], request_id="after", max_tokens=24)
            assert await stream_tokens(client, after) == expected([44, 7], 24)
            assert await client.is_sleeping() is False
            assert not client.is_dead


async def test_an_engine_that_reconnected_is_still_watched_on_its_new_connection() -> None:
    """The connection the second ready message came on is the engine's now: when the
    engine is stopped later, that connection's silence is its death, noticed as fast
    as on the first connection.

    The reconnection is held 0.2 s, within the 0.5 s an engine has to be back.
    """
    with trio.fail_after(60):
        async with engine_behind_a_proxy(reconnect_delay_s=0.2) as engine:
            with pytest.raises(EngineDeadError, match="connection was lost"):
                async with engine.client() as client:
                    await cut_while_streaming(client, engine.proxy, [[5]])
                    assert not client.is_dead
                    after = EngineCoreRequest.for_tokens([3], request_id="after", max_tokens=5)
                    assert await stream_tokens(client, after) == expected([3], 5)
                    os.kill(engine.process.pid, signal.SIGSTOP)
                    try:
                        with trio.move_on_after(STOP_NOTICED_WITHIN_S) as waited:
                            await client.wait_failed()
                    finally:
                        os.kill(engine.process.pid, signal.SIGCONT)
                    assert not waited.cancelled_caught, "the stopped engine went unnoticed"


async def test_a_connection_not_made_again_within_the_grace_is_a_death() -> None:
    """An engine gone for longer than it has to come back (0.5 s) is declared dead, as
    a killed or stopped one is: its requests fail at once, saying so."""
    with trio.fail_after(60):
        async with engine_behind_a_proxy(reconnect_delay_s=1.5) as engine:
            with pytest.raises(EngineDeadError) as died:
                async with engine.client() as client:
                    request = EngineCoreRequest.for_tokens([9], request_id="cut", max_tokens=LONG)
                    async with client.stream(request) as outputs:
                        await outputs.receive()
                        assert engine.proxy.cut() == 1
                        cut_at = trio.current_time()
                        with pytest.raises(EngineDeadError):
                            async for _ in outputs:
                                pass
                        assert trio.current_time() - cut_at < STOP_NOTICED_WITHIN_S
    assert "engine rank 0 died: its connection was lost" in str(died.value)
    assert "not made again within 0.5 s" in str(died.value)

"""An engine whose connection the network resets mid-step, and that libzmq connects
again without a word, is not dead; a killed one still is, within 3 s.

vLLM's engines send their ready message once: when the TCP connection of an engine's
input DEALER is reset (a NAT, a firewall, a flapping link), libzmq connects it again
in the background, and the engine says nothing on the new connection, nor answers
anything until its step ends, seconds later. The client sees a connection lost, and
0.1 s later a new one from the same host: that engine may have made it. It stays
*suspect* (in service) until it answers (then it is watched on that connection), its
new connection is lost too, or the progress deadline says it hung.

The engines here are :class:`~tests.hostile.ServingEngine` peers (the engine end of
the wire protocol, in this process: a DEALER with the engine's identity, a PUSH)
whose input goes through a :class:`~tests.proxies.FreezableProxy` that resets it; a
"step" is a time when they answer nothing; "killed" is their sockets closed. The
client is real, attached over TCP, with the default liveness settings unless a test
says otherwise. The same with real engine processes: ``test_network_cut.py``, and
vLLM's engine core: ``interop/test_vllm_liveness.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import zmq

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    Liveness,
    TrioMPClient,
    open_engine_client,
)

from .hostile import ServingEngine, finished, output
from .proxies import FreezableProxy
from .support import free_port

NOTICED_WITHIN_S = 3.0
"""What the default liveness settings promise for a killed engine."""
STEP_S = 3.0
"""A step in which the engines answer nothing: far past the 0.5 s grace and the 1.8 s
a silent connection takes to be dropped."""


class Engines:
    """The client, its engines behind the proxy, and how to stop one for good."""

    def __init__(
        self,
        client: TrioMPClient,
        engines: list[ServingEngine],
        proxy: FreezableProxy,
        serving: dict[int, trio.CancelScope],
    ) -> None:
        self.client = client
        self.engines = engines
        self.proxy = proxy
        self.serving = serving
        """Each engine's serving task, by rank."""

    def states(self) -> list[str]:
        return [engine.state for engine in self.client.statistics().engines]

    def kill(self, rank: int) -> None:
        """The engine's process is gone: its sockets closed (the proxy does not pass
        the close on, so the client learns of it from its heartbeats)."""
        self.serving[rank].cancel()
        self.engines[rank].close()

    async def step_ends(self, rank: int) -> None:
        """A long step ends: the engine answers every call that reached it meanwhile,
        and the ones that come."""
        engine = self.engines[rank]
        engine.silent = False
        calls, engine.ignored = engine.ignored, []
        for call in calls:
            await engine.reply(call, engine.answers.get(call.method))

    async def wait_states(self, states: list[str], within_s: float) -> None:
        with trio.fail_after(within_s):
            while self.states() != states:
                await trio.sleep(0.02)


async def _serve(engine: ServingEngine, scope: trio.CancelScope) -> None:
    with scope:
        await engine.serve()


@asynccontextmanager
async def engines_behind_a_proxy(size: int = 1, **options: Any) -> AsyncIterator[Engines]:
    """``size`` serving engines whose input connections go through one proxy (one
    host, as the client sees them), and a client attached to them over TCP: with
    several engines, it routes around a dead one. What the client's block raises is
    raised as itself."""
    input_port, output_port = free_port(), free_port()
    ctx: zmq.Context[Any] = zmq.Context()
    options.setdefault("on_engine_failure", "route_around" if size > 1 else "fail")
    error: Exception | None = None
    engines: list[ServingEngine] = []
    try:
        async with trio.open_nursery() as nursery:
            proxy = FreezableProxy(input_port)
            await nursery.start(proxy.run)
            engines += [
                ServingEngine(
                    ctx,
                    f"tcp://127.0.0.1:{proxy.port}",
                    f"tcp://127.0.0.1:{output_port}",
                    rank=rank,
                )
                for rank in range(size)
            ]
            serving: dict[int, trio.CancelScope] = {}
            for engine in engines:
                await engine.send_ready()  # queued until the client binds
                serving[engine.rank] = trio.CancelScope()
                nursery.start_soon(_serve, engine, serving[engine.rank])
            try:
                async with open_engine_client(
                    EngineConfig(data_parallel_size=size),
                    input_address=f"tcp://127.0.0.1:{input_port}",
                    output_address=f"tcp://127.0.0.1:{output_port}",
                    ready_timeout_s=20,
                    **options,
                ) as client:
                    assert proxy.connections == size
                    yield Engines(client, engines, proxy, serving)
            except Exception as exc:
                error = exc  # raised below, outside the nursery: not in a group
            finally:
                nursery.cancel_scope.cancel()
    finally:
        for engine in engines:
            engine.close()
        ctx.term()
    if error is not None:
        raise error


async def record_states(peers: Engines, seen: set[str]) -> None:
    while True:
        seen.update(peers.states())
        await trio.sleep(0.02)


async def test_an_engine_reset_mid_step_stays_in_service_watched_on_its_new_connection() -> None:
    """Its stream in flight fails, retryable (what was on its way when the connection
    broke may be lost: a stream is exact or fails), and is aborted on the engine; the
    engine was never dead, serves the next request exactly, and is watched on its new
    connection: killed now, it is dead within 3 s."""
    seen: set[str] = set()
    with trio.fail_after(60), pytest.raises(EngineDeadError) as died:
        async with engines_behind_a_proxy() as peers, trio.open_nursery() as nursery:
            nursery.start_soon(record_states, peers, seen)
            (engine,) = peers.engines
            request = EngineCoreRequest.for_tokens([1], request_id="r", max_tokens=3)
            with pytest.raises(EngineDeadError, match="made it again") as lost:
                async with peers.client.stream(request) as outputs:
                    await engine.expect_adds("r")
                    await engine.send(output("r", 2))
                    assert (await outputs.receive()).new_token_ids == [2]
                    # Its next step runs; the network resets its connection meanwhile.
                    engine.stop_answering()
                    assert peers.proxy.reset() == 1
                    await trio.sleep(STEP_S)
                    assert peers.states() == ["suspect"]
                    assert not peers.client.is_dead
                    # The step ends: its outputs, and its answers to the client's calls.
                    await engine.send(output("r", 3))
                    await peers.step_ends(0)
                    async for _ in outputs:
                        pass
            assert lost.value.retryable
            await peers.wait_states(["alive"], within_s=5)
            with trio.fail_after(5):
                while "r" not in engine.aborted:
                    await trio.sleep(0.02)
            again = EngineCoreRequest.for_tokens([5], request_id="again", max_tokens=2)
            async with peers.client.stream(again) as outputs:
                await engine.expect_adds("again")
                await engine.send(output("again", 6))
                await engine.send(finished("again", 7))
                tokens = [t async for out in outputs for t in out.new_token_ids]
            assert tokens == [6, 7]
            assert peers.proxy.connections == 2
            assert "dead" not in seen
            # Killed now: its new connection's silence is its death, as its first's.
            peers.kill(0)
            killed = trio.current_time()
            await peers.client.wait_failed()
            elapsed = trio.current_time() - killed
            nursery.cancel_scope.cancel()
    assert elapsed < NOTICED_WITHIN_S, elapsed
    assert "engine rank 0 died: its connection was lost" in str(died.value)


async def test_an_engine_killed_before_it_answered_on_its_new_connection_is_dead_in_3s() -> None:
    """Reset mid-step, connected again, then killed before its step ended: the new
    connection goes silent too, and with it the last connection it may have had."""
    with trio.fail_after(60), pytest.raises(EngineDeadError) as died:
        async with engines_behind_a_proxy() as peers:
            peers.engines[0].stop_answering()
            assert peers.proxy.reset() == 1
            await trio.sleep(1.0)
            assert peers.states() == ["suspect"]
            peers.kill(0)
            killed = trio.current_time()
            await peers.client.wait_failed()
            elapsed = trio.current_time() - killed
    assert elapsed < NOTICED_WITHIN_S, elapsed
    assert "its connection was lost" in str(died.value)


async def test_an_engine_silent_on_its_new_connection_is_dead_by_the_progress_deadline() -> None:
    """Connected again, but silent for ever (hung in its step, or the new connection
    was not its own): the progress deadline decides, as for any engine with work."""
    with trio.fail_after(60), pytest.raises(EngineDeadError) as died:
        async with engines_behind_a_proxy(liveness=Liveness(progress_timeout_s=3.0)) as peers:
            peers.engines[0].stop_answering()
            assert peers.proxy.reset() == 1
            reset_at = trio.current_time()
            await peers.client.wait_failed()
            elapsed = trio.current_time() - reset_at
    assert 3.0 <= elapsed < 3.0 + 3.0, elapsed
    assert "no progress for 3." in str(died.value)


async def test_engines_of_one_host_reset_together_then_one_killed() -> None:
    """Two engines behind one proxy (one host: their new connections cannot be told
    apart) reset in a step, both back when it ends; then one is killed. Each new
    connection may be either's: when one goes silent, both must answer again; the
    one that does holds the connection left, and the other, which cannot have one,
    is dead within 3 s. The survivor serves on."""
    seen: set[str] = set()
    with trio.fail_after(60):
        async with engines_behind_a_proxy(2) as peers, trio.open_nursery() as nursery:
            for engine in peers.engines:
                engine.stop_answering()
            assert peers.proxy.reset() == 2
            await trio.sleep(STEP_S)
            assert peers.states() == ["suspect", "suspect"]
            nursery.start_soon(record_states, peers, seen)
            for rank in (0, 1):
                await peers.step_ends(rank)
            await peers.wait_states(["alive", "alive"], within_s=5)
            assert "dead" not in seen
            peers.kill(1)
            killed = trio.current_time()
            while peers.states()[1] != "dead":
                await trio.sleep(0.02)
            elapsed = trio.current_time() - killed
            await peers.wait_states(["alive", "dead"], within_s=5)
            assert not peers.client.is_dead
            assert await peers.client.is_sleeping() is False  # rank 0 answers
            (death,) = [e.death for e in peers.client.statistics().engines if e.death]
            nursery.cancel_scope.cancel()
    assert elapsed < NOTICED_WITHIN_S, elapsed
    assert "its connection was lost" in death

"""A slow engine is not a dead one; a dead, stopped, cut-off or hung one is noticed.

Two questions, asked of every kind of engine with the default settings unless a test
says otherwise (``Liveness()``):

* *is it still there?* A killed (``SIGKILL``), stopped (``SIGSTOP``) or cut-off engine
  is ``EngineDeadError`` within 3 s, for that engine alone, whether its steps take
  10 ms or 5 s: a launched engine's exit, and for every engine its connection under
  ZeroMQ heartbeats, which libzmq answers in the engine whatever its busy loop does.
* *is it making progress?* A busy loop that hangs with its sockets alive is dead once
  ``progress_timeout_s`` passes; long steps, a caller's long utility and a starved CPU
  are not.

Real engine processes and sockets; each engine's busy loop is held by the reference
engine's fault-injection utilities (``stall``, ``stall_steps``), which spin holding
the GIL, as a busy engine thread does.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import Literal

import attrs
import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    Liveness,
    RemoteEngines,
    open_engine_client,
)
from trio_enginecore.client import Restart, TrioEngineClient
from trio_enginecore.client._multiprocess._launch import serve_arguments

from .enginepeer import serve_command
from .support import (
    children_of_this_process,
    expected,
    free_port,
    process_is_running,
    stop_process,
    stream_tokens,
)

NOTICED_WITHIN_S = 3.0
"""What the defaults promise for a killed, stopped or cut-off engine of any kind."""
LONG_STEP_S = 5.0
SHORT_STEP_S = 0.01
FOREVER = 1_000_000
"""Tokens of a request that outlives every test."""

Kind = Literal["launched", "attached", "remote"]
KINDS: tuple[Kind, ...] = ("launched", "attached", "remote")


def config(engines: int = 1, step_time_s: float = SHORT_STEP_S) -> EngineConfig:
    return EngineConfig(
        data_parallel_size=engines, step_time_s=step_time_s, enable_fault_injection=True
    )


def endless(rank: int | None = None, prompt: int = 1) -> EngineCoreRequest:
    return EngineCoreRequest.for_tokens(
        [prompt], request_id=f"on-{rank}", max_tokens=FOREVER, data_parallel_rank=rank
    )


@attrs.define
class Engines:
    """A client and its engines' processes, by rank (ours to signal, whatever kind)."""

    client: TrioEngineClient
    processes: list[trio.Process | None]
    kind: Kind

    def pid(self, rank: int) -> int:
        process = self.processes[rank]
        if process is not None:
            return process.pid
        pid = self.client.engine_pids[rank]
        assert pid is not None
        return pid


@asynccontextmanager
async def started_elsewhere(
    kind: Kind, cfg: EngineConfig, directory: str
) -> AsyncIterator[tuple[list[trio.Process], dict[str, object]]]:
    """Engine processes started by hand (attached, or joining over TCP), and the
    options of a client that reaches them. Stopped (and continued first, if a test
    stopped them) when the block ends."""
    if kind == "attached":
        inp, out = f"ipc://{directory}/in", f"ipc://{directory}/out"
        options: dict[str, object] = {"input_address": inp, "output_address": out}
        where = ["--input-address", inp, "--output-address", out]
    else:
        address = f"tcp://127.0.0.1:{free_port()}"
        options = {"remote": RemoteEngines(address)}
        where = ["--headless", "--handshake-address", address]
    processes = [
        await trio.lowlevel.open_process(
            serve_command(*where, *serve_arguments(cfg.evolve(data_parallel_rank=rank))),
            stdin=subprocess.DEVNULL,
        )
        for rank in range(cfg.data_parallel_size)
    ]
    try:
        yield processes, options
    finally:
        with trio.CancelScope(shield=True):
            for process in processes:
                if process.returncode is None:
                    os.kill(process.pid, signal.SIGCONT)
                    await stop_process(process, grace_s=None)


@asynccontextmanager
async def engines_of(kind: Kind, cfg: EngineConfig, **options: object) -> AsyncIterator[Engines]:
    """A client of ``cfg``'s engines, of the given kind: several engines route around
    a death, one fails the client."""
    policy = "route_around" if cfg.data_parallel_size > 1 else "fail"
    options.setdefault("on_engine_failure", policy)
    if kind == "launched":
        async with open_engine_client(cfg, **options) as client:  # type: ignore[arg-type]
            yield Engines(client, [None] * cfg.data_parallel_size, kind)
        return
    directory = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    try:
        async with (
            started_elsewhere(kind, cfg, directory) as (processes, reach),
            open_engine_client(
                cfg,
                ready_timeout_s=30,
                **reach,  # type: ignore[arg-type]
                **options,  # type: ignore[arg-type]
            ) as client,
        ):
            yield Engines(client, list(processes), kind)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------- killed or stopped


@pytest.mark.parametrize("step_time_s", [SHORT_STEP_S, LONG_STEP_S], ids=["short", "long"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
@pytest.mark.parametrize("count", [1, 3], ids=["one", "three"])
@pytest.mark.parametrize("kind", KINDS)
async def test_a_killed_or_stopped_engine_is_dead_within_3s_alone_whatever_its_steps(
    kind: Kind, count: int, sig: signal.Signals, step_time_s: float
) -> None:
    victim = count - 1
    died: list[EngineDeadError] = []
    elapsed: list[float] = []
    with trio.fail_after(60):
        with pytest.raises(EngineDeadError) if count == 1 else _nothing():
            async with engines_of(kind, config(count, step_time_s)) as engines:
                client = engines.client
                async with AsyncExitStack() as opened:
                    streams = [
                        await opened.enter_async_context(client.stream(endless(rank)))
                        for rank in range(count)
                    ]
                    for stream in streams:
                        await stream.receive()  # the first step is at once
                    os.kill(engines.pid(victim), sig)
                    signalled = trio.current_time()
                    with pytest.raises(EngineDeadError) as failed:
                        async for _ in streams[victim]:
                            pass
                    elapsed.append(trio.current_time() - signalled)
                    died.append(failed.value)
                    states = [engine.state for engine in client.statistics().engines]
                    if count > 1:
                        # The others serve on: in service, their streams open.
                        assert states[:victim] == ["alive"] * victim
                        assert not client.is_dead
                        assert client.statistics().requests_in_flight == count - 1
    assert elapsed[0] < NOTICED_WITHIN_S, elapsed
    message = str(died[0])
    assert f"engine rank {victim}" in message
    if kind == "launched" and sig is signal.SIGKILL:
        assert "was killed by signal 9" in message
    else:
        assert "its connection was lost" in message
    if kind == "launched":
        # A stopped engine of ours is killed: it would hold its memory for ever.
        assert ("killed it" in message) == (sig is signal.SIGSTOP)
    assert children_of_this_process() == [] or kind != "launched"


@contextmanager
def _nothing() -> Iterator[None]:
    yield


async def test_without_checks_a_stopped_launched_engine_goes_unnoticed() -> None:
    """The counterpart: what the checks are for (liveness=None turns them off)."""
    with trio.fail_after(30):
        async with open_engine_client(config(), liveness=None) as client:
            (pid,) = client.engine_pids
            assert pid is not None
            async with client.stream(endless()) as outputs:
                await outputs.receive()
                os.kill(pid, signal.SIGSTOP)
                with trio.move_on_after(NOTICED_WITHIN_S + 1) as waited:
                    async for _ in outputs:
                        pass
                assert waited.cancelled_caught
                assert not client.is_dead
            os.kill(pid, signal.SIGCONT)


async def test_after_one_death_fails_the_client_the_engines_left_are_still_watched() -> None:
    """Under ``"fail"`` the other engines' streams keep streaming after a death, so a
    second engine that then stops must still be noticed: its streams raise, they do
    not wait forever (as after a MoE rank's kill, when the rank left hangs)."""
    with trio.fail_after(30):
        with pytest.raises(EngineDeadError, match="engine rank 0"):
            async with open_engine_client(config(2)) as client:
                first, second = client.engine_pids
                assert first is not None
                assert second is not None
                async with client.stream(endless(1)) as outputs:
                    await outputs.receive()
                    os.kill(first, signal.SIGKILL)
                    await client.wait_failed()
                    await outputs.receive()  # the survivor's stream goes on...
                    os.kill(second, signal.SIGSTOP)
                    stopped = trio.current_time()
                    with pytest.raises(EngineDeadError, match=r"engine rank 1.*connection") as hung:
                        async for _ in outputs:
                            pass
                    # ...until its engine stops too, and that is noticed in time.
                    assert trio.current_time() - stopped < NOTICED_WITHIN_S
                assert "killed it" in str(hung.value)
    assert not process_is_running(second)
    assert children_of_this_process() == []


# ------------------------------------------------------------- slow, not dead


@pytest.mark.parametrize("held", [False, True], ids=["sleeping-step", "gil-holding-step"])
async def test_steps_of_5s_keep_serving_exact_streams_with_the_defaults(held: bool) -> None:
    """A long prefill, a slow device: the engine answers nothing between steps, and
    the client waits, as vLLM's does. Held: each step spins in Python, holding the
    GIL, so that nothing of the engine's own Python runs for 5 s at a time."""
    prompt = [7, 3]
    with trio.fail_after(60):
        async with open_engine_client(config(step_time_s=0 if held else LONG_STEP_S)) as client:
            if held:
                await client.call_utility("stall_steps", LONG_STEP_S)
            request = EngineCoreRequest.for_tokens(prompt, max_tokens=3)
            assert await stream_tokens(client, request) == expected(prompt, 3)
            assert [engine.state for engine in client.statistics().engines] == ["alive"]
            assert not client.is_dead


async def test_a_callers_10s_utility_is_not_a_hang_even_with_a_3s_progress_timeout() -> None:
    """The engine's busy loop is held 10 s by a utility you called (a LoRA load, a
    weight update): time the caller waits on is not counted, and the heartbeats are
    answered all along. Its requests wait, then finish exactly."""
    prompt = [5]
    with trio.fail_after(60):
        async with open_engine_client(
            config(), liveness=Liveness(progress_timeout_s=3.0)
        ) as client:
            request = EngineCoreRequest.for_tokens(prompt, max_tokens=400)
            async with client.stream(request) as outputs:
                tokens = (await outputs.receive()).new_token_ids
                await client.call_utility("stall", 10.0)
                async for output in outputs:
                    tokens += output.new_token_ids
            assert tokens == expected(prompt, 400)
            assert not client.is_dead


@contextmanager
def every_core_busy() -> Iterator[None]:
    """A busy loop on every core, at normal priority."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def renice_every_thread(pid: int, niceness: int) -> None:
    """Lower the priority of each thread of ``pid`` (libzmq's I/O thread included: a
    process's niceness is per thread on Linux)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), niceness)


async def test_a_cpu_starved_engine_is_never_declared_dead() -> None:
    """Niced to 19 beside a busy loop on every core: slow, and alive."""
    prompts = [[11], [22], [33]]
    with trio.fail_after(120):
        async with open_engine_client(config()) as client:
            (pid,) = client.engine_pids
            assert pid is not None
            renice_every_thread(pid, 19)
            with every_core_busy():
                deadline = trio.current_time() + 10
                while trio.current_time() < deadline:
                    for prompt in prompts:
                        request = EngineCoreRequest.for_tokens(prompt, max_tokens=20)
                        assert await stream_tokens(client, request) == expected(prompt, 20)
                    assert await client.is_sleeping() is False
            states = [engine.state for engine in client.statistics().engines]
            assert states == ["alive"]
            assert not client.is_dead


# ----------------------------------------------------------------------- hung


@pytest.mark.parametrize("kind", ["launched", "remote"])
async def test_a_hung_busy_loop_with_live_sockets_is_dead_after_the_progress_timeout(
    kind: Kind,
) -> None:
    """The heartbeats go on (libzmq answers them); no output, no reply does."""
    progress_timeout_s = 3.0
    with trio.fail_after(60):
        with pytest.raises(EngineDeadError) as caught:
            async with engines_of(
                kind, config(), liveness=Liveness(progress_timeout_s=progress_timeout_s)
            ) as engines:
                client = engines.client
                pid = engines.pid(0)
                async with client.stream(endless()) as outputs:
                    await outputs.receive()
                    await client.call_utility("stall_steps", 3600.0)  # hangs the next step
                    hung = trio.current_time()
                    with pytest.raises(EngineDeadError):
                        async for _ in outputs:
                            pass
                    waited = trio.current_time() - hung
                    assert progress_timeout_s <= waited < progress_timeout_s + 2.5, waited
                    # The process and its sockets were alive all along.
                    if kind == "remote":
                        assert process_is_running(pid)
    message = str(caught.value)
    assert "engine rank 0" in message
    assert "no progress for 3." in message
    assert "with 1 request(s) pending" in message
    assert "raise Liveness.progress_timeout_s (3 s) if your steps are longer" in message
    if kind == "launched":
        assert "killed it" in message
        assert children_of_this_process() == []


# ------------------------------------------------------------------ closing


async def test_closing_while_a_restarted_engine_starts_is_prompt() -> None:
    """Its previous death is still recorded, but its new process is healthy: the
    close does not wait for it to exit by itself."""
    with trio.fail_after(60):
        async with open_engine_client(
            config(), on_engine_failure=Restart(backoff_s=0.01)
        ) as client:
            (first,) = client.engine_pids
            assert first is not None
            os.kill(first, signal.SIGKILL)
            while client.engine_pids[0] in (first, None):
                await trio.sleep(0.005)
            assert client.statistics().engines[0].state == "restarting"
            leaving = trio.current_time()
    assert trio.current_time() - leaving < 1.0
    assert children_of_this_process() == []

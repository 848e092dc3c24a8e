"""A slow vLLM engine core is not a dead one; a killed, stopped or hung one is noticed.

What our client's liveness checks promise against vLLM's real engine core (the release
under test), headless and attached (``engines.py``), with the default settings
(``Liveness()``: ZeroMQ heartbeats every 0.3 s, 1.5 s to answer, 60 s to progress)
unless a test says otherwise:

* *slow is not dead*: steps of 5 s, and a 10 s ``collective_rpc`` (which vLLM runs on
  its busy loop's thread) the caller waits on while streams are in flight: the streams
  go on, exact, and the engine is never even suspected; a caller's own utility excuses
  the engine even with ``progress_timeout_s=3``;
* *is it still there*: a ``SIGKILL`` or ``SIGSTOP`` of vLLM's ``EngineCore`` process
  (not its launcher) is ``EngineDeadError`` within 3 s, whether its steps take 10 ms or
  5 s, saying its connection was lost: libzmq answers the heartbeats inside the engine
  whatever its Python does, so a killed engine's connection closes and a stopped one's
  heartbeats go unanswered;
* *is it making progress*: a busy loop that hangs with its process, sockets and vLLM's
  I/O threads alive (a step that never ends) is ``EngineDeadError`` once
  ``progress_timeout_s`` passed with a request pending and nothing from it, not before,
  and the message says so;
* *a reset is not a death*: both of an attached engine core's TCP connections reset
  mid-step (5 s steps; through proxies that send both ends a RST, then carry the
  connections libzmq makes again by itself): the engine is suspect, never dead; its
  stream in flight fails, retryable (what was on its way may be lost), and is aborted
  on the engine; the next request is exact; once it answers it is watched on its new
  connection: a ``SIGKILL`` then is noticed within 3 s;
* with heartbeats on, vLLM logs no ERROR, no traceback and no warning about the
  connection in a run where nothing went wrong.

Each test starts its own engine (20 to 30 s on two cores): the newest release's session
runs every mode and signal (nine engines), an older release's each mode once and each
signal once (four). The data-parallel counterpart (three ranks, one killed and one
stopped, ``route_around``) is in ``test_our_client_drives_vllm_dp.py``.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    Liveness,
    RequestStream,
    open_engine_client,
)

from ..proxies import FreezableProxy
from ..support import expected, free_port, process_is_running
from .engines import VllmEngine, vllm_engine
from .support import on_the_newest_release, require_vllm, trouble_lines, vllm_process
from .workloads import generate

require_vllm()

NOTICED_WITHIN_S = 3.0
"""What the defaults promise for a killed or stopped engine of any kind."""
SHORT_STEP_S = 0.01
LONG_STEP_S = 5.0
UTILITY_S = 10.0
"""How long the caller's ``collective_rpc`` holds the engine's busy loop."""
HANG_S = 3600.0
"""A step that outlives every test: the busy loop hangs in it."""
PROGRESS_TIMEOUT_S = 3.0
HANG_NOTICED_WITHIN_S = PROGRESS_TIMEOUT_S + 2.5
"""The progress deadline, and at most a few of the client's checks after it."""


def _newest_only(*values: object, id: str) -> object:
    """A parameter an older release's session skips (its time goes to what differs)."""
    return pytest.param(
        *values,
        id=id,
        marks=pytest.mark.skipif(
            not on_the_newest_release(), reason="the newest release's session runs each case"
        ),
    )


def only_alive(engine: VllmEngine) -> bool:
    return [e.state for e in engine.client.statistics().engines] == ["alive"]


async def watch_states(engine: VllmEngine, seen: set[str]) -> None:
    """Record every state the client's view of the engine goes through."""
    while True:
        seen.update(e.state for e in engine.client.statistics().engines)
        await trio.sleep(0.05)


async def rest_of(outputs: RequestStream, tokens: list[int]) -> FinishReason | None:
    """Stream to the end, adding to ``tokens``: the finish reason."""
    finish = None
    async for output in outputs:
        tokens += output.new_token_ids
        finish = output.finish_reason
    return finish


# ------------------------------------------------------------- slow, not dead


@pytest.mark.parametrize("mode", ["headless", _newest_only("attach", id="attach")])
async def test_steps_of_5s_and_a_10s_collective_rpc_keep_serving_exact_streams_with_the_defaults(
    mode: str, tmp_path: Path, timings: dict[str, float]
) -> None:
    """Two streams of 3 tokens over 5 s steps; after the first token, the caller's
    ``block(10)`` holds the busy loop too: 15 s and more without a word from it while
    requests are in flight. Nothing is declared dead, or even suspected."""
    async with vllm_engine(mode, tmp_path) as engine:
        client = engine.client
        seen: set[str] = set()
        await engine.rpc("set_step_delay", LONG_STEP_S)
        prompts = [[7, 3], [500]]
        with trio.fail_after(4 * LONG_STEP_S + UTILITY_S + 20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_states, engine, seen)
                start = trio.current_time()
                async with (
                    client.stream(EngineCoreRequest.for_tokens(prompts[0], max_tokens=3)) as a,
                    client.stream(EngineCoreRequest.for_tokens(prompts[1], max_tokens=3)) as b,
                ):
                    tokens: list[list[int]] = [list((await a.receive()).new_token_ids), []]
                    await engine.rpc("block", UTILITY_S)
                    finishes = [await rest_of(a, tokens[0]), await rest_of(b, tokens[1])]
                timings[f"3 tokens of 5 s steps and a 10 s utility, {mode}"] = (
                    trio.current_time() - start
                )
                nursery.cancel_scope.cancel()
        assert tokens == [expected(prompts[0], 3), expected(prompts[1], 3)]
        assert finishes == [FinishReason.LENGTH, FinishReason.LENGTH]
        assert seen == {"alive"}
        assert not client.is_dead
        # Short steps again: it serves on.
        await engine.rpc("set_step_delay", 0)
        request = EngineCoreRequest.for_tokens([41], max_tokens=4)
        assert await generate(client, request) == (expected([41], 4), FinishReason.LENGTH)
    # The whole run, the client's close and the launcher's shutdown included.
    assert trouble_lines(engine.launcher.log()) == []


@pytest.mark.parametrize("mode", [_newest_only("headless", id="headless"), "attach"])
def test_with_a_3s_progress_timeout_a_callers_10s_utility_is_no_hang_but_a_step_that_never_ends_is(
    mode: str, tmp_path: Path, timings: dict[str, float]
) -> None:
    # Run by hand, not by pytest-trio, whose nursery would wrap the exception the test
    # expects in an ExceptionGroup.
    trio.run(_utility_then_hang, mode, tmp_path, timings)


async def _utility_then_hang(mode: str, tmp_path: Path, timings: dict[str, float]) -> None:
    liveness = Liveness(progress_timeout_s=PROGRESS_TIMEOUT_S)
    with pytest.raises(EngineDeadError) as caught:  # the client's block raises it on the way out
        async with vllm_engine(mode, tmp_path, liveness=liveness) as engine:
            try:
                client = engine.client
                await engine.rpc("set_step_delay", SHORT_STEP_S)
                # The caller's utility holds the busy loop for 10 s, a stream in flight:
                # excused, and the heartbeats are answered all along.
                prompt = [5]
                with trio.fail_after(UTILITY_S + 30):
                    async with client.stream(
                        EngineCoreRequest.for_tokens(prompt, max_tokens=300)
                    ) as outputs:
                        tokens = list((await outputs.receive()).new_token_ids)
                        await engine.rpc("block", UTILITY_S)
                        finish = await rest_of(outputs, tokens)
                assert (tokens, finish) == (expected(prompt, 300), FinishReason.LENGTH)
                assert only_alive(engine)

                # Then a step that never ends: vLLM's input and output threads, its
                # sockets and libzmq's heartbeats live on; its busy loop does not.
                request = EngineCoreRequest.for_tokens([9], max_tokens=1000)
                async with client.stream(request) as outputs:
                    await outputs.receive()
                    hung = trio.current_time()
                    await engine.rpc("set_step_delay", HANG_S)  # from the next step on
                    with trio.fail_after(HANG_NOTICED_WITHIN_S + 10):
                        with pytest.raises(EngineDeadError) as died:
                            async for _ in outputs:
                                pass
                    waited = trio.current_time() - hung
                timings[f"hung step -> EngineDeadError (3 s progress timeout), {mode}"] = waited
                assert PROGRESS_TIMEOUT_S <= waited < HANG_NOTICED_WITHIN_S, waited
                # The engine's process was never at fault: it is still there.
                assert process_is_running(engine.engine_pid)
            finally:
                engine.kill()  # hung: the client did not launch it, so did not kill it
    for error in (died.value, caught.value):
        message = str(error)
        assert "engine rank 0" in message
        assert "no progress for 3." in message
        assert "with 1 request(s) pending" in message
        assert "raise Liveness.progress_timeout_s (3 s) if your steps are longer" in message
        assert "connection was lost" not in message


# --------------------------------------------------------- killed or stopped

# Each signal with short and long steps, and each mode with both signals: four engines
# rather than all eight combinations (each takes 20 to 30 s to start).
# An older release's session: each mode and each signal once.
SIGNALLED = [
    _newest_only("headless", signal.SIGKILL, SHORT_STEP_S, id="headless-kill-short-steps"),
    pytest.param("headless", signal.SIGSTOP, LONG_STEP_S, id="headless-stop-long-steps"),
    _newest_only("attach", signal.SIGSTOP, SHORT_STEP_S, id="attach-stop-short-steps"),
    pytest.param("attach", signal.SIGKILL, LONG_STEP_S, id="attach-kill-long-steps"),
]


@pytest.mark.parametrize(("mode", "sig", "step_s"), SIGNALLED)
def test_a_killed_or_stopped_engine_core_is_dead_within_3s_whatever_its_steps(
    mode: str, sig: signal.Signals, step_s: float, tmp_path: Path, timings: dict[str, float]
) -> None:
    trio.run(_signalled, mode, sig, step_s, tmp_path, timings)  # by hand, as above


async def _signalled(
    mode: str, sig: signal.Signals, step_s: float, tmp_path: Path, timings: dict[str, float]
) -> None:
    failures: list[float] = []
    messages: list[str] = []
    with pytest.raises(EngineDeadError):
        async with vllm_engine(mode, tmp_path) as engine:
            try:
                # vLLM's EngineCore process itself is signalled, not its launcher.
                assert await engine.rpc("executor_pid") == engine.engine_pid
                await engine.rpc("set_step_delay", step_s)
                flowing = trio.Event()
                signalled_at = 0.0

                async def doomed(i: int) -> None:
                    request = EngineCoreRequest.for_tokens([i], max_tokens=1000)
                    with pytest.raises(EngineDeadError) as died:
                        async with engine.client.stream(request) as outputs:
                            async for _ in outputs:
                                flowing.set()
                    failures.append(trio.current_time() - signalled_at)
                    messages.append(str(died.value))

                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(doomed, i)
                    with trio.fail_after(step_s + 30):
                        await flowing.wait()  # the next step is under way
                    signalled_at = trio.current_time()
                    engine.send_signal(sig)
                    with trio.fail_after(NOTICED_WITHIN_S + 10):
                        while len(failures) < 4:
                            await trio.sleep(0.05)
            finally:
                engine.kill()  # a stopped one would hold its launcher's shutdown
    name = f"{'kill -9' if sig is signal.SIGKILL else 'SIGSTOP'}, {step_s:g} s steps"
    timings[f"{name} -> EngineDeadError, {mode}"] = max(failures)
    assert max(failures) < NOTICED_WITHIN_S, failures
    for message in messages:
        assert "engine rank 0" in message
        assert "its connection was lost" in message


# ---------------------------------------------------- a connection reset mid-step


@asynccontextmanager
async def attached_through_proxies(
    tmp_path: Path,
) -> AsyncIterator[tuple[VllmEngine, list[FreezableProxy]]]:
    """vLLM's engine core started by its own supervisor for our client (attach mode),
    over TCP, its input and output connections each through a
    :class:`~tests.proxies.FreezableProxy`. What the client's block raises is raised
    as itself."""
    input_port, output_port = free_port(), free_port()
    error: Exception | None = None
    async with trio.open_nursery() as nursery:
        proxies = [FreezableProxy(input_port), FreezableProxy(output_port)]
        for proxy in proxies:
            await nursery.start(proxy.run)
        args = [
            "--input-address",
            f"tcp://127.0.0.1:{proxies[0].port}",
            "--output-address",
            f"tcp://127.0.0.1:{proxies[1].port}",
        ]
        try:
            with vllm_process("launch_attach.py", args, tmp_path / "vllm-tcp.log") as launcher:
                start = trio.current_time()
                async with open_engine_client(
                    EngineConfig(),
                    input_address=f"tcp://127.0.0.1:{input_port}",
                    output_address=f"tcp://127.0.0.1:{output_port}",
                    ready_timeout_s=90,
                ) as client:
                    ready_s = trio.current_time() - start
                    started = await trio.to_thread.run_sync(launcher.next_report, 30)
                    assert started["event"] == "started", started
                    (pid,) = started["pids"]
                    yield VllmEngine("attach", client, launcher, ready_s, pid), proxies
        except Exception as exc:
            error = exc  # raised below, outside the nursery: not in a group
        finally:
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error


def test_a_connection_reset_mid_step_is_not_a_death_and_the_new_one_is_watched(
    tmp_path: Path, timings: dict[str, float]
) -> None:
    trio.run(_reset_mid_step, tmp_path, timings)  # by hand, as above


async def _reset_mid_step(tmp_path: Path, timings: dict[str, float]) -> None:
    """vLLM sends its ready message once and says nothing on the connection libzmq
    makes again; mid-step it answers nothing for seconds. Kept, suspect, for as long
    as its step runs, because a new connection came from where its lost one did."""
    seen: set[str] = set()
    prompt = [7, 3]
    with pytest.raises(EngineDeadError) as died:  # the client's block, after the kill
        async with attached_through_proxies(tmp_path) as (engine, proxies):
            try:
                client = engine.client
                await engine.rpc("set_step_delay", LONG_STEP_S)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_states, engine, seen)
                    request = EngineCoreRequest.for_tokens(prompt, request_id="reset", max_tokens=3)
                    with trio.fail_after(4 * LONG_STEP_S + 30):
                        # What was on its way when the connections broke may be lost:
                        # the stream fails (retryable) rather than risk a gap.
                        with pytest.raises(EngineDeadError, match="made it again") as lost:
                            async with client.stream(request) as outputs:
                                tokens = list((await outputs.receive()).new_token_ids)
                                await trio.sleep(1.0)  # well into the next step
                                assert [proxy.reset() for proxy in proxies] == [1, 1]
                                reset_at = trio.current_time()
                                await rest_of(outputs, tokens)
                        while not only_alive(engine):  # it answered the client's calls
                            await trio.sleep(0.05)
                    timings["reset mid-step (5 s steps) -> stream failed, alive"] = (
                        trio.current_time() - reset_at
                    )
                    nursery.cancel_scope.cancel()
                assert lost.value.retryable
                # The request was aborted on the engine; the next one is exact.
                await engine.rpc("set_step_delay", 0)
                with trio.fail_after(30):
                    while "reset" not in await engine.rpc("finished_request_ids"):
                        await trio.sleep(0.1)
                again = EngineCoreRequest.for_tokens(prompt, max_tokens=3)
                assert await generate(client, again) == (
                    expected(prompt, 3),
                    FinishReason.LENGTH,
                )
                assert "suspect" in seen
                assert "dead" not in seen
                assert not client.is_dead
                assert [proxy.connections for proxy in proxies] == [2, 2]
                # Watched on its new connection: killed now, noticed as on its first.
                engine.send_signal(signal.SIGKILL)
                killed_at = trio.current_time()
                with trio.fail_after(NOTICED_WITHIN_S + 10):
                    await client.wait_failed()
                elapsed = trio.current_time() - killed_at
            finally:
                engine.kill()
    timings["kill -9 after a reset -> EngineDeadError"] = elapsed
    assert elapsed < NOTICED_WITHIN_S, elapsed
    assert "engine rank 0 died: its connection was lost" in str(died.value)

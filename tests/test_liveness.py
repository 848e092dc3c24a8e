"""A hung engine is noticed, whatever its kind, and the code in the client's block is told.

A process that is alive is not an engine that works: these tests stop engines with
SIGSTOP (alive, never answering) and kill attached ones with SIGKILL (no child process
of ours: nothing else would say so), and check the death is reported within the
default deadline, and that a hung engine we launched is killed.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    Liveness,
    open_engine_client,
)
from trio_enginecore.client import TrioEngineClient
from trio_enginecore.client._launch import serve_arguments
from trio_enginecore.testing import FakeEngine, open_fake_engine_client

from .enginepeer import serve_command
from .support import children_of_this_process, process_is_running, stop_process

DEADLINE_S = 2.0
"""What the defaults promise on loopback: a hang noticed within 2 s."""


def test_the_default_checks_notice_a_hang_within_two_seconds() -> None:
    defaults = Liveness()
    assert defaults.interval_s + defaults.timeout_s < DEADLINE_S


async def time_to_death(client: TrioEngineClient, pid: int, sig: signal.Signals) -> float:
    """Send ``sig`` to the engine while a request streams; the time until the stream
    raises ``EngineDeadError``."""
    request = EngineCoreRequest.for_tokens([1], request_id="victim", max_tokens=1_000_000)
    async with client.stream(request) as outputs:
        await outputs.receive()
        os.kill(pid, sig)
        sent = trio.current_time()
        with pytest.raises(EngineDeadError) as died:
            async for _ in outputs:
                pass
    assert "engine rank 0" in str(died.value)
    return trio.current_time() - sent


async def test_a_stopped_launched_engine_is_reported_dead_in_time_and_killed() -> None:
    with trio.fail_after(30):
        with pytest.raises(EngineDeadError, match="stopped responding for") as caught:
            async with open_engine_client(EngineConfig(step_time_s=0.01)) as client:
                (pid,) = client.engine_pids
                assert pid is not None
                elapsed = await time_to_death(client, pid, signal.SIGSTOP)
                assert elapsed <= DEADLINE_S, elapsed
                assert client.is_dead
                failure = await client.wait_failed()
                assert "killed it" in str(failure)
    assert "engine rank 0" in str(caught.value)
    # It was killed (a stopped process would have ignored the SIGTERM of the shutdown).
    assert not process_is_running(pid)
    assert children_of_this_process() == []


@asynccontextmanager
async def attached_engine(config: EngineConfig) -> AsyncIterator[tuple[str, str, trio.Process]]:
    directory = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    inp, out = f"ipc://{directory}/in", f"ipc://{directory}/out"
    process = await trio.lowlevel.open_process(
        serve_command("--input-address", inp, "--output-address", out, *serve_arguments(config))
    )
    try:
        yield inp, out, process
    finally:
        await stop_process(process, grace_s=None)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
async def test_an_attached_engine_killed_or_stopped_is_reported_dead_in_time(
    sig: signal.Signals,
) -> None:
    config = EngineConfig(step_time_s=0.01)
    with trio.fail_after(30):
        async with attached_engine(config) as (inp, out, process):
            with pytest.raises(EngineDeadError, match="no answer to a liveness check"):
                async with open_engine_client(
                    config, input_address=inp, output_address=out
                ) as client:
                    elapsed = await time_to_death(client, process.pid, sig)
                    assert elapsed <= DEADLINE_S, elapsed
            # Not ours to kill: an attached engine is left as it is.
            assert process.returncode is None or sig is signal.SIGKILL


async def test_without_checks_a_stopped_launched_engine_goes_unnoticed() -> None:
    """The counterpart: what the checks are for (liveness=None turns them off)."""
    with trio.fail_after(30):
        async with open_engine_client(EngineConfig(step_time_s=0.01), liveness=None) as client:
            (pid,) = client.engine_pids
            assert pid is not None
            request = EngineCoreRequest.for_tokens([1], max_tokens=1_000_000)
            async with client.stream(request) as outputs:
                await outputs.receive()
                os.kill(pid, signal.SIGSTOP)
                with trio.move_on_after(DEADLINE_S + 1) as waited:
                    async for _ in outputs:
                        pass
                assert waited.cancelled_caught
                assert not client.is_dead
            os.kill(pid, signal.SIGCONT)


# ------------------------------------------------------------- the body is told


async def test_wait_failed_returns_the_error_every_call_then_raises() -> None:
    engine = FakeEngine(step_time_s=0.01)
    with pytest.raises(EngineDeadError, match="the GPU fell off the bus"):
        async with open_fake_engine_client(engine) as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep, 0.05)
                failures: list[EngineDeadError] = []

                async def wait() -> None:
                    failures.append(await client.wait_failed())

                nursery.start_soon(wait)
                await trio.sleep(0.02)
                assert failures == []
                engine.kill("the GPU fell off the bus")
            (failure,) = failures
            assert type(failure) is EngineDeadError
            assert "the GPU fell off the bus" in str(failure)
            # Failed already: it returns at once (and is still a checkpoint).
            assert str(await client.wait_failed()) == str(failure)
            with pytest.raises(EngineDeadError, match="the GPU fell off the bus"):
                await client.is_sleeping()


async def test_wait_failed_raises_closed_resource_error_when_the_client_closes_healthy() -> None:
    async with open_fake_engine_client() as client:
        raised: list[BaseException] = []

        async def wait() -> None:
            try:
                await client.wait_failed()
            except trio.ClosedResourceError as exc:
                raised.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            await client.aclose()
        assert len(raised) == 1


async def test_a_cancelled_wait_failed_changes_nothing() -> None:
    engine = FakeEngine()
    with pytest.raises(EngineDeadError):
        async with open_fake_engine_client(engine) as client:
            with trio.move_on_after(0.01) as scope:
                await client.wait_failed()
            assert scope.cancelled_caught
            engine.kill("later")
            assert "later" in str(await client.wait_failed())


async def test_with_cancel_on_failure_a_server_in_the_block_stops_and_one_error_leaves() -> None:
    engine = FakeEngine(step_time_s=0.01)
    served: list[str] = []
    with trio.fail_after(10):
        with pytest.raises(EngineDeadError, match="power cut") as caught:
            async with open_fake_engine_client(engine, cancel_on_failure=True):
                async with trio.open_nursery() as server:

                    async def handle_forever() -> None:
                        while True:
                            served.append("request")
                            await trio.sleep(0.01)

                    server.start_soon(handle_forever)
                    await trio.sleep(0.05)
                    engine.kill("power cut")
                    await trio.sleep_forever()  # the server's main loop
                pytest.fail("the body was not cancelled")  # pragma: no cover
    assert type(caught.value) is EngineDeadError
    assert served


async def test_without_cancel_on_failure_the_body_keeps_running() -> None:
    engine = FakeEngine()
    with pytest.raises(EngineDeadError, match="power cut"):
        async with open_fake_engine_client(engine) as client:
            engine.kill("power cut")
            await trio.sleep(0.05)
            # Still running: the body decides (its calls raise).
            with pytest.raises(EngineDeadError):
                await client.get_request_counts()


async def test_cancel_on_failure_with_real_engines_stops_a_body_when_one_is_killed() -> None:
    with trio.fail_after(30):
        with pytest.raises(EngineDeadError, match="signal 9"):
            async with open_engine_client(
                EngineConfig(data_parallel_size=2), cancel_on_failure=True
            ) as client:
                pid = client.engine_pids[1]
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                await trio.sleep_forever()
    assert children_of_this_process() == []


async def test_a_block_that_ends_normally_with_cancel_on_failure_raises_nothing() -> None:
    async with open_fake_engine_client(cancel_on_failure=True) as client:
        assert await client.is_sleeping() is False


async def test_after_one_death_fails_the_client_the_engines_left_are_still_watched() -> None:
    """Under ``"fail"`` the other engines' streams keep streaming after a death, so a
    second engine that then hangs must still be noticed: its streams raise, they do
    not wait forever (as after a MoE rank's kill, when the rank left hangs)."""
    with trio.fail_after(30):
        with pytest.raises(EngineDeadError, match="engine rank 0"):
            async with open_engine_client(
                EngineConfig(data_parallel_size=2, step_time_s=0.01)
            ) as client:
                first, second = client.engine_pids
                assert first is not None
                assert second is not None
                request = EngineCoreRequest.for_tokens(
                    [1], request_id="on-1", max_tokens=1_000_000, data_parallel_rank=1
                )
                async with client.stream(request) as outputs:
                    await outputs.receive()
                    os.kill(first, signal.SIGKILL)
                    await client.wait_failed()
                    await outputs.receive()  # the survivor's stream goes on...
                    os.kill(second, signal.SIGSTOP)
                    stopped = trio.current_time()
                    with pytest.raises(EngineDeadError, match=r"engine rank 1.*stopped") as hung:
                        async for _ in outputs:
                            pass
                    # ...until its engine hangs too, and that is noticed in time.
                    assert trio.current_time() - stopped <= DEADLINE_S
                assert "killed it" in str(hung.value)
    assert not process_is_running(second)
    assert children_of_this_process() == []

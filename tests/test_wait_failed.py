"""The code in a client's block is told when the client fails: ``wait_failed()``, and
``cancel_on_failure=True``.

How deaths and hangs are noticed is in test_liveness.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio

from trio_enginecore import EngineConfig, EngineDeadError, open_engine_client
from trio_enginecore.testing import FakeEngine, open_fake_engine_client

from .support import children_of_this_process


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

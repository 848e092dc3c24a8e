"""Our client drives vLLM's real engine core (one engine; the release under test).

vLLM's ``EngineCoreProc`` runs as shipped (handshake, input and output threads, busy
loop, scheduler, KV cache manager, utilities, ``ENGINE_CORE_DEAD``) in the vLLM
environment, with only the model executor replaced by ``vllm_side/fake_executor.py``
(the counter model). Two ways in, both stock vLLM:

- ``headless``: vLLM's ``CoreEngineProcManager(local_client=False)`` (what ``vllm serve
  --headless`` runs) joins our client's handshake address
  (``open_engine_client(remote=RemoteEngines(...))``);
- ``attach``: our client binds its ROUTER and PULL (``input_address`` /
  ``output_address``) and vLLM's supervisor ``launch_core_engines`` starts the engine
  for it, handshaking with it on its own private socket.

The client's liveness checks are the defaults (ZeroMQ heartbeats on): a normal run
leaves no ERROR, traceback or warning about the connection in vLLM's log. (An engine
core announcing ``"dev"``, as vLLM run from a source tree does, is served in
``test_client_launches_vllm.py``.) Each test starts its own engine (tens of seconds on
two cores): a fatal error ends it. What the liveness checks make of a slow, killed,
stopped or hung vLLM engine is in ``test_vllm_liveness.py``.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import pytest
import trio

from trio_enginecore import (
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    UtilityCallError,
)

from ..support import expected
from .engines import MODES, VllmEngine, vllm_engine
from .support import (
    at_least,
    installed_vllm_version,
    require_vllm,
    trouble_lines,
    vllm_pythons,
    vllm_release,
    vllm_version,
)
from .workloads import cancel_half_midway, exact_streams, generate

require_vllm()


@pytest.mark.parametrize("mode", MODES)
async def test_exact_streams_cancellation_and_utilities(
    mode: str, tmp_path: Path, timings: dict[str, float]
) -> None:
    async with vllm_engine(mode, tmp_path) as engine:
        client = engine.client
        timings[f"time to ready, {mode}"] = engine.ready_s
        ready = client.engines[0]
        assert ready is not None
        # vLLM's own ready response: its version, and the KV blocks it sized from what
        # the executor reported (4096 blocks of 16 tokens).
        assert ready.vllm_version == vllm_version()
        assert (ready.num_gpu_blocks, ready.block_size, ready.max_model_len) == (4096, 16, 1024)
        assert await engine.rpc("executor_pid") == engine.engine_pid

        await exact_streams(client)

        # 64 more, slower (10 ms a step): half are cancelled mid-way, and vLLM's
        # scheduler finishes exactly those while the others still run.
        await engine.rpc("clear_request_log")
        await engine.rpc("set_step_delay", 0.01)

        async def finished() -> set[str]:
            return set(await engine.rpc("finished_request_ids"))

        await cancel_half_midway(client, finished)
        await engine.rpc("set_step_delay", 0)

        # Utilities, through the typed methods, answered by vLLM's EngineCore.
        assert await client.is_sleeping() is False
        await client.sleep(1)
        assert await client.is_sleeping() is True
        assert await client.wake_up() is True
        assert await client.is_sleeping() is False
        assert await client.reset_prefix_cache() is True
        assert await client.get_supported_tasks() == ("generate",)
        assert await client.list_loras() == set()
        await client.set_weight_version("v7")
        assert await client.get_weight_version() == "v7"
        await client.pause_scheduler("abort")
        assert await client.is_scheduler_paused() is True
        await client.resume_scheduler()
        assert await client.is_scheduler_paused() is False
        if at_least("0.34"):
            # 0.34's utilities, through our typed wrappers.
            assert await client.is_inference_ready() is True
            assert await client.checkpoint_state() == ("running", None)
            # vLLM refuses to prepare without its sleep mode (off: this is a CPU),
            # and says why; nothing changed.
            reason = await client.checkpoint_prepare()
            assert reason is not None
            assert "sleep-mode" in reason
            assert await client.checkpoint_state() == ("running", None)
            await client.pause_scheduler("keep", True, reset_connector=True)
            assert await client.is_inference_ready() is False
            await client.resume_scheduler()
            assert await client.is_inference_ready() is True
        else:
            # What a 0.33 engine lacks is refused before it is sent.
            with pytest.raises(UtilityCallError, match=r"not sent.*new in vLLM 0\.34"):
                await client.is_inference_ready()
            with pytest.raises(UtilityCallError, match=r"not sent.*pause_scheduler"):
                await client.pause_scheduler("keep", True, reset_connector=True)
        # After all that, the engine still serves.
        request = EngineCoreRequest.for_tokens([41], max_tokens=4)
        assert await generate(client, request) == (expected([41], 4), FinishReason.LENGTH)
        assert not client.is_dead
    # Heartbeats and the client's periodic call all along, then the client's close and
    # the launcher's shutdown: nothing vLLM complains of.
    assert trouble_lines(engine.launcher.log()) == []


@pytest.mark.parametrize("mode", MODES)
async def test_fatal_executor_error_is_engine_dead(
    mode: str, tmp_path: Path, timings: dict[str, float]
) -> None:
    with pytest.raises(EngineDeadError):  # the client's block raises it on the way out
        async with vllm_engine(mode, tmp_path) as engine:
            await engine.rpc("arm_fault")
            request = EngineCoreRequest.for_tokens([3], max_tokens=100)
            start = trio.current_time()
            with trio.fail_after(20), pytest.raises(EngineDeadError) as died:
                await generate(engine.client, request)
            assert "ENGINE_CORE_DEAD" in str(died.value)
            timings[f"fatal error -> EngineDeadError, {mode}"] = trio.current_time() - start
            with pytest.raises(EngineDeadError):
                await engine.client.is_sleeping()
            # vLLM's engine exits after reporting; its launcher notices and stops.
            launcher = engine.launcher.process
            await trio.to_thread.run_sync(partial(launcher.wait, 30))
    assert engine.launcher.reports[-1]["event"] == "stopped"
    assert engine.launcher.reports[-1]["failed"] == "EngineCore"
    assert "EngineCore encountered a fatal error." in engine.launcher.log()


@pytest.mark.skipif(
    vllm_release() != "0.34" or "0.33" not in vllm_pythons(),
    reason="run in vLLM 0.34's session, once vLLM 0.33's environment is built too",
)
async def test_one_process_drives_a_vllm_033_and_a_vllm_034_engine_at_once(
    tmp_path: Path, timings: dict[str, float]
) -> None:
    """Two clients of ours in one process, one per engine: each speaks its engine's
    release (0.34's engine takes prompts only as int32 arrays, 0.33's only as lists)."""
    pythons = vllm_pythons()
    async with AsyncExitStack() as stack:
        engines: dict[str, VllmEngine] = {}
        for release in ("0.33", "0.34"):
            directory = tmp_path / release
            directory.mkdir()
            engines[release] = await stack.enter_async_context(
                vllm_engine("attach", directory, python=pythons[release])
            )
        for release, engine in engines.items():
            ready = engine.client.engines[0]
            assert ready is not None
            assert ready.vllm_version == installed_vllm_version(pythons[release])
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for engine in engines.values():
                nursery.start_soon(exact_streams, engine.client)
        timings["64 exact streams on a 0.33 and a 0.34 engine at once"] = (
            trio.current_time() - start
        )
        for engine in engines.values():
            request = EngineCoreRequest.for_tokens(list(range(1, 300)), max_tokens=4)
            # A prompt long enough for 0.34's packed array to go as its own frame.
            assert await generate(engine.client, request) == (
                expected(list(range(1, 300)), 4),
                FinishReason.LENGTH,
            )
            assert trouble_lines(engine.launcher.log()) == []


@pytest.mark.xfail(
    strict=True,
    raises=UtilityCallError,
    reason="vLLM's EngineCore (0.33 and 0.34) has no get_request_counts utility "
    "('EngineCoreProc' object has no attribute 'get_request_counts'; its "
    "Scheduler.get_request_counts() is internal): it is a reference-engine utility",
)
def test_get_request_counts_on_vllm(tmp_path: Path) -> None:
    async def main() -> None:
        async with vllm_engine("attach", tmp_path) as engine:
            assert await engine.client.get_request_counts() == (0, 0)

    trio.run(main)  # by hand: pytest-trio would wrap the exception in a group

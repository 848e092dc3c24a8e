"""Our client drives vLLM's real engine cores (the release under test) in data parallel.

Dense ranks (the llama config: independent ``EngineCoreProc`` s) and MoE ranks (the
mixtral config: ``DPEngineCoreProc`` s in lockstep, a gloo all-reduce deciding when a
request wave ends), every way the client meets them:

- ``headless``: one vLLM launcher (``CoreEngineProcManager(local_client=False)``) starts
  both ranks, which join our client's handshake; our coordinator (a task of the client);
- ``per-rank``: one headless launcher per rank, as two hosts run them; the ranks of a MoE
  group meet where the client's handshake tells them (``data_parallel_master_ip``);
- ``launched``: our client launches each rank itself, ``vllm serve --headless``
  (``VllmEngines``, see ``launched.py``), and owns it;
- ``attach``: our client binds its ROUTER and PULL and vLLM's supervisor
  (``launch_core_engines``) starts the engines and vLLM's own ``DPCoordinator``, which
  the client follows from the address in the engines' ready messages.

For each: ready; 64 exact streams over both engines ending on LENGTH and STOP; half of 64
more cancelled mid-way, and vLLM's schedulers finished exactly those ids, each on the
engine that had it; the typed utility wrappers; for MoE, the waves the client sees are
vLLM's (0, True), (1, False), (1, True), (2, False), ... (each phase in one wave, which
a long request holds open, so that a loaded machine cannot split it); for dense, no
wave at all. No ERROR, traceback or warning about the connection in vLLM's logs, with
the client's liveness checks (ZeroMQ heartbeats) the defaults, as in every test here.

When a rank dies: a MoE rank's ``kill -9`` or fatal error is ``EngineDeadError``; of
three dense ranks on one host (one launcher each) under ``on_engine_failure=
"route_around"``, a killed and a stopped rank fail only their own requests, each within
the 3 s the defaults promise, and the rank left serves on.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    EngineStartupError,
    FinishReason,
    RemoteEngines,
    open_engine_client,
)
from trio_enginecore.client import DPLBTrioMPClient

from ..support import expected, free_port
from .launched import relayed_engine_lines, vllm_engines, write_model
from .support import (
    VllmProcess,
    on_the_newest_release,
    require_vllm,
    trouble_lines,
    vllm_version,
)
from .workloads import cancel_half_midway, exact_streams, generate

require_vllm()

# Each way of meeting the ranks once, and each coordinator with MoE waves once: our
# coordinator (per-rank mixtral; headless mixtral met the same coordinator the same way)
# and vLLM's (attach mixtral; attach llama met vLLM's supervisor as it does, with no wave).
MODES = [
    ("headless", "llama"),
    ("launched", "llama"),
    ("per-rank", "mixtral"),
    ("attach", "mixtral"),
]
# The older releases' sessions: vLLM's own launcher with dense ranks, and vLLM's
# supervisor and coordinator with MoE waves (what differs from release to release).
OLDER_RELEASE_MODES = [("headless", "llama"), ("attach", "mixtral")]


@dataclass
class VllmGroup:
    client: DPLBTrioMPClient
    launchers: list[VllmProcess]
    ready_s: float
    pids: list[int]
    waves: list[tuple[int, bool]] = field(default_factory=list[tuple[int, bool]])
    relayed: list[str] = field(default_factory=list[str])
    """The log lines of engines the client launched, as it relays them."""

    async def rpc_all(self, method: str, *args: Any) -> list[Any]:
        """``collective_rpc`` of each engine's fake executor, by rank."""
        results = await self.client.call_utility_all("collective_rpc", method, None, list(args))
        assert all(isinstance(result, list) and len(result) == 1 for result in results)
        return [result[0] for result in results]

    def logs(self) -> str:
        return "\n".join([*(launcher.log() for launcher in self.launchers), *self.relayed])


@asynccontextmanager
async def vllm_group(
    mode: str,
    model: str,
    tmp_path: Path,
    *,
    size: int = 2,
    **options: Any,
) -> AsyncIterator[VllmGroup]:
    """``size`` vLLM engine cores of ``model`` started by ``mode``'s launchers, and our
    client, ready, its view of the waves logged. ``options``: more of
    ``open_engine_client``'s options (the liveness checks are the defaults)."""
    if mode == "launched":
        async with _launched_group(model, tmp_path, size, **options) as group:
            yield group
        return
    config = EngineConfig(data_parallel_size=size)
    client_args: dict[str, Any]
    scripts: list[tuple[str, list[str]]]
    if mode == "attach":
        inputs, outputs = f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/output"
        dp = ["--data-parallel-size", str(size), "--model", model]
        scripts = [
            ("launch_attach.py", ["--input-address", inputs, "--output-address", outputs, *dp])
        ]
        client_args = {"input_address": inputs, "output_address": outputs}
    else:
        address = f"tcp://127.0.0.1:{free_port()}"
        common = ["--handshake-address", address, "--model", model]
        common += ["--data-parallel-size", str(size)]
        if mode == "headless":
            scripts = [("launch_headless.py", [*common, "--local-engines", str(size)])]
        else:
            scripts = [
                ("launch_headless.py", [*common, "--data-parallel-rank", str(rank)])
                for rank in range(size)
            ]
        remote = RemoteEngines(
            address,
            # One launcher per rank: a MoE group meets where we tell it.
            data_parallel_master_ip="127.0.0.1"
            if mode == "per-rank" and model == "mixtral"
            else None,
        )
        client_args = {"remote": remote}
    async with _launchers(scripts, tmp_path) as launchers:
        start = trio.current_time()
        try:
            async with open_engine_client(
                config, ready_timeout_s=60 * size, **client_args, **options
            ) as client:
                assert isinstance(client, DPLBTrioMPClient)
                ready_s = trio.current_time() - start
                pids: list[int] = []
                for launcher in launchers:
                    started = await trio.to_thread.run_sync(launcher.next_report, 30)
                    assert started["event"] == "started", started
                    pids += started["pids"]
                group = VllmGroup(client, launchers, ready_s, pids)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_log_waves, group)
                    yield group
                    nursery.cancel_scope.cancel()
        except EngineStartupError as exc:
            tails = "\n".join(launcher.log_tail() for launcher in launchers)
            raise AssertionError(f"{exc}\nvLLM's logs end:\n{tails}") from exc


@asynccontextmanager
async def _launched_group(
    model: str, tmp_path: Path, size: int, **options: Any
) -> AsyncIterator[VllmGroup]:
    """``vllm_group``'s ``launched`` mode: the client launches the ranks itself; their
    log is what the client relays of it."""
    vllm = vllm_engines(
        write_model(model, tmp_path / model), data_parallel_size=size, moe=model == "mixtral"
    )
    with relayed_engine_lines() as lines:
        start = trio.current_time()
        async with open_engine_client(vllm=vllm, ready_timeout_s=60 * size, **options) as client:
            assert isinstance(client, DPLBTrioMPClient)
            ready_s = trio.current_time() - start
            pids = await client.call_utility_all("collective_rpc", "executor_pid", None, [])
            group = VllmGroup(client, [], ready_s, [pid for (pid,) in pids], relayed=lines)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_log_waves, group)
                yield group
                nursery.cancel_scope.cancel()


@asynccontextmanager
async def _launchers(
    scripts: list[tuple[str, list[str]]], tmp_path: Path
) -> AsyncIterator[list[VllmProcess]]:
    launchers: list[VllmProcess] = []
    try:
        for i, (script, args) in enumerate(scripts):
            launchers.append(VllmProcess(script, args, tmp_path / f"vllm-{i}.log"))
        yield launchers
    finally:
        for launcher in launchers:
            launcher.stop()


async def _log_waves(group: VllmGroup) -> None:
    with suppress(EngineDeadError, trio.ClosedResourceError):  # the group's end
        while True:
            group.waves.append(await group.client.wait_wave_change())


async def _wave_state(group: VllmGroup, wanted: tuple[int, bool]) -> None:
    with trio.fail_after(20):
        while (group.client.current_wave, group.client.engines_running) != wanted:
            await trio.sleep(0.02)


@asynccontextmanager
async def _one_wave(group: VllmGroup, request_id: str | None) -> AsyncIterator[None]:
    """Hold one request wave of MoE ranks open for the block (``request_id``; None: do
    nothing, for dense ranks), however slowly the block's requests come: on a loaded
    machine short requests sent one after another can finish, and end their wave,
    before the last is sent, and a short wave's start and end can reach the client at
    once. A long request (1000 steps of 20 ms) streamed until the client sees the wave
    running, and aborted after the block (its engine's executor hears of that in a
    later step); the steps are short again after it."""
    if request_id is None:
        yield
        return
    await group.rpc_all("set_step_delay", 0.02)
    anchor = EngineCoreRequest.for_tokens([1], request_id=request_id, max_tokens=1000)
    async with group.client.stream(anchor) as outputs:
        await outputs.receive()
        with trio.fail_after(20):
            while not group.client.engines_running:
                await trio.sleep(0.02)
        yield
    await group.rpc_all("set_step_delay", 0)


@pytest.mark.parametrize(
    ("mode", "model"), MODES if on_the_newest_release() else OLDER_RELEASE_MODES
)
async def test_data_parallel_2(
    mode: str, model: str, tmp_path: Path, timings: dict[str, float]
) -> None:
    moe = model == "mixtral"
    async with vllm_group(mode, model, tmp_path) as group:
        client = group.client
        timings[f"time to ready, DP 2 {model} {mode}"] = group.ready_s
        for rank, ready in enumerate(client.engines):
            assert ready is not None
            assert ready.vllm_version == vllm_version()
            assert ready.data_parallel_rank == rank
        assert sorted(await group.rpc_all("executor_pid")) == sorted(group.pids)
        assert (client.current_wave, client.engines_running) == (0, False)

        # MoE: the 64 exact streams in one wave, the last request in another.
        first_wave, last_wave = ("wave-1", "wave-3") if moe else (None, None)

        # 64 concurrent streams, exact tokens, over both engines.
        async with _one_wave(group, first_wave):
            ids = await exact_streams(client)
        scheduled = await group.rpc_all("scheduled_request_ids")
        assert all(scheduled), f"an engine got no request: {scheduled}"
        assert (set(scheduled[0]) | set(scheduled[1])) - {first_wave} == ids
        assert not set(scheduled[0]) & set(scheduled[1])
        if moe:
            await _wave_state(group, (1, False))

        # 64 more, slower: half cancelled mid-way; each engine's scheduler finishes
        # exactly the cancelled ids it had, while the others still run.
        await group.rpc_all("clear_request_log")
        await group.rpc_all("set_step_delay", 0.01)
        finished: list[list[str]] = [[], []]

        async def finished_ids() -> set[str]:
            nonlocal finished
            # Less the first wave's anchor, whose end the executor may hear of now.
            finished = [
                sorted(set(names) - {first_wave})
                for names in await group.rpc_all("finished_request_ids")
            ]
            return set(finished[0]) | set(finished[1])

        cancelled = await cancel_half_midway(client, finished_ids)
        scheduled = await group.rpc_all("scheduled_request_ids")
        for rank in range(2):
            # An abort reached the engine that had the request, and only that one.
            assert set(finished[rank]) == cancelled & set(scheduled[rank])
        await group.rpc_all("set_step_delay", 0)
        if moe:
            await _wave_state(group, (2, False))

        # The typed utilities, answered by both engines, which must agree.
        assert await client.is_sleeping() is False
        assert await client.reset_prefix_cache() is True
        assert await client.get_supported_tasks() == ("generate",)
        assert await client.list_loras() == set()
        await client.set_weight_version("v7")
        assert await client.get_weight_version() == "v7"
        request = EngineCoreRequest.for_tokens([41], max_tokens=4)
        async with _one_wave(group, last_wave):
            assert await generate(client, request) == (expected([41], 4), FinishReason.LENGTH)
        if moe:
            await _wave_state(group, (3, False))
    if moe:
        # What vLLM's coordinator publishes for three waves, in order.
        assert group.waves == [(0, True), (1, False), (1, True), (2, False), (2, True), (3, False)]
    else:
        # Dense ranks run no waves: nothing to see, and no START_DP_WAVE sent them.
        assert group.waves == []
        assert "Unrecognized input request type" not in group.logs()
    assert trouble_lines(group.logs()) == []


@pytest.mark.skipif(
    not on_the_newest_release(), reason="our handshake's rule: the newest release's session"
)
def test_moe_ranks_of_separate_launchers_told_nothing_never_form_their_group(
    tmp_path: Path,
) -> None:
    """What the handshake's parallel_config fixes: without it each launcher picks its
    own ports for the group, the ranks never meet, and the startup error says so."""

    async def main() -> None:
        address = f"tcp://127.0.0.1:{free_port()}"
        scripts = [
            (
                "launch_headless.py",
                [
                    "--handshake-address",
                    address,
                    "--model",
                    "mixtral",
                    "--data-parallel-size",
                    "2",
                    "--data-parallel-rank",
                    str(rank),
                ],
            )
            for rank in range(2)
        ]
        async with _launchers(scripts, tmp_path):
            remote = RemoteEngines(address)
            with pytest.raises(EngineStartupError) as caught:
                async with open_engine_client(
                    EngineConfig(data_parallel_size=2), remote=remote, ready_timeout_s=60
                ):
                    pytest.fail("a MoE group whose ranks were told nothing cannot form")
        message = str(caught.value)
        for rank in range(2):
            assert f"engine rank {rank} said HELLO but never READY" in message
        assert "RemoteEngines(data_parallel_master_ip=...)" in message

    trio.run(main)  # by hand: pytest-trio would wrap the exception in a group


@pytest.mark.parametrize(
    ("mode", "death"),
    [("per-rank", "kill -9"), ("attach", "fatal error")]
    if on_the_newest_release()
    else [("per-rank", "kill -9")],
)
def test_a_dead_moe_rank_is_engine_dead(
    mode: str, death: str, tmp_path: Path, timings: dict[str, float]
) -> None:
    trio.run(_dead_moe_rank, mode, death, tmp_path, timings)  # by hand, as above


async def _dead_moe_rank(mode: str, death: str, tmp_path: Path, timings: dict[str, float]) -> None:
    with pytest.raises(EngineDeadError):
        async with vllm_group(mode, "mixtral", tmp_path) as group:
            client = group.client
            await group.rpc_all("set_step_delay", 0.01)
            pids = await group.rpc_all("executor_pid")
            flowing = trio.Event()
            failures: list[float] = []
            started_at = 0.0

            async def doomed(i: int) -> None:
                request = EngineCoreRequest.for_tokens([i], max_tokens=1000, data_parallel_rank=1)
                with pytest.raises(EngineDeadError):
                    async with client.stream(request) as outputs:
                        async for _ in outputs:
                            flowing.set()
                failures.append(trio.current_time() - started_at)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(doomed, i)
                await flowing.wait()
                started_at = trio.current_time()
                if death == "kill -9":
                    os.kill(pids[1], signal.SIGKILL)  # rank 0 then hangs in its all-reduce
                else:
                    # The fault fires in the engines' next step: its reply may not make it.
                    with suppress(EngineDeadError):
                        await client.call_utility_all("collective_rpc", "arm_fault", None, [])
                with trio.fail_after(20):
                    while len(failures) < 4:
                        await trio.sleep(0.05)
            timings[f"{death} of a MoE rank -> EngineDeadError, DP 2 {mode}"] = max(failures)
            with pytest.raises(EngineDeadError):
                await client.is_sleeping()


@pytest.mark.timeout(300)  # three launchers, each importing vLLM, on two cores
async def test_of_three_ranks_on_one_host_a_killed_and_a_stopped_one_fail_only_their_requests(
    tmp_path: Path, timings: dict[str, float]
) -> None:
    """Three dense ranks, one launcher each (vLLM's ``CoreEngineProcManager`` stops all
    its engines when one dies, so ranks of one launcher cannot outlive each other),
    launched by the client (``VllmEngines``), and ``on_engine_failure="route_around"``,
    the liveness checks the defaults. Rank 1 (10 ms steps) is killed mid-stream, then
    rank 2 (5 s steps) stopped mid-step: each time only that rank's streams fail,
    within 3 s, saying its connection was lost or its launcher exited (whichever the
    client saw first); rank 0's streams go on to their exact end, and new requests go
    to it."""
    ranks = 3
    async with vllm_group(
        "launched", "llama", tmp_path, size=ranks, on_engine_failure="route_around"
    ) as group:
        client = group.client
        timings["time to ready, DP 3 llama launched"] = group.ready_s
        pids = await group.rpc_all("executor_pid")
        assert sorted(pids) == sorted(group.pids)
        await group.rpc_all("set_step_delay", 0.02)  # 1000 tokens: 20 s and more
        await group.rpc_all("set_step_delay", 5.0, pids[2])  # rank 2's executor only
        finished: dict[tuple[int, int], tuple[list[int], FinishReason | None]] = {}
        failed: dict[tuple[int, int], tuple[float, str]] = {}
        flowing = [trio.Event() for _ in range(ranks)]

        async def stream(rank: int, i: int) -> None:
            prompt = [100 * rank + i + 1]
            request = EngineCoreRequest.for_tokens(
                prompt, request_id=f"rank{rank}-{i}", max_tokens=1000, data_parallel_rank=rank
            )
            tokens: list[int] = []
            finish = None
            try:
                async with client.stream(request) as outputs:
                    async for output in outputs:
                        flowing[rank].set()
                        tokens += output.new_token_ids
                        finish = output.finish_reason
            except EngineDeadError as exc:
                failed[rank, i] = (trio.current_time(), str(exc))
            else:
                finished[rank, i] = (tokens, finish)

        async def failures_of(rank: int, sig: signal.Signals) -> float:
            signalled = trio.current_time()
            os.kill(pids[rank], sig)
            with trio.fail_after(3.0 + 10):
                while len([key for key in failed if key[0] == rank]) < 2:
                    await trio.sleep(0.02)
            return max(failed[rank, i][0] for i in range(2)) - signalled

        try:
            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for rank in range(ranks):
                        for i in range(2):
                            nursery.start_soon(stream, rank, i)
                    for event in flowing:
                        await event.wait()
                    killed = await failures_of(1, signal.SIGKILL)
                    assert set(failed) == {(1, 0), (1, 1)}
                    stopped = await failures_of(2, signal.SIGSTOP)
                    assert set(failed) == {(1, 0), (1, 1), (2, 0), (2, 1)}
                    # Rank 0's streams are still going, and nothing else failed.
                    assert finished == {}
                    assert client.statistics().requests_in_flight == 2
                    assert not client.is_dead
                    states = [engine.state for engine in client.statistics().engines]
                    assert states == ["alive", "dead", "dead"]
                    await group.rpc_all("set_step_delay", 0)  # rank 0, the one left
        finally:
            with suppress(ProcessLookupError):  # stopped: it would hold its launcher's exit
                os.kill(pids[2], signal.SIGKILL)
        timings["kill -9 of a rank -> its EngineDeadError, DP 3 route_around"] = killed
        timings["SIGSTOP of a rank -> its EngineDeadError, DP 3 route_around"] = stopped
        assert killed < 3.0
        assert stopped < 3.0
        for (rank, _), (_, message) in failed.items():
            assert f"engine rank {rank}" in message
            assert "its connection was lost" in message or "its vLLM launcher" in message
        assert finished == {
            (0, i): (expected([i + 1], 1000), FinishReason.LENGTH) for i in range(2)
        }
        # New requests go to the one rank left, and end exactly.
        await exact_streams(client, count=16)
        assert not client.is_dead

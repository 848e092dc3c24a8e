"""Engines placed by Ray (the ``ray`` extra; ``nox -s ray``).

A local Ray cluster on this machine (2 CPUs, started by the test, or by the client
itself in the first test) places real reference engines in actors, which join the
client over TCP as headless engines. Skipped, with the reason, when Ray is not
installed or its cluster cannot start. The checks that nothing is left use Ray's state
API (``ray.util.state``, served by the dashboard: ``ray[default]``) and the process
table.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, EngineDeadError, EngineStartupError
from trio_enginecore.client import (
    EngineHandle,
    RayEngines,
    RemoteEngines,
    Restart,
    open_ray_engine_client,
)
from trio_enginecore.curve import CurveServer

from .support import children_of, children_of_this_process, expected, process_is_running

try:
    import ray as _ray
except ImportError:  # the default install: only the tests that need no Ray run
    _ray = None
ray: Any = _ray

needs_ray = pytest.mark.skipif(ray is None, reason="Ray is not installed (pip install '.[ray]')")
pytestmark = pytest.mark.timeout(240)

ENGINE_ACTOR = "EngineActor"


def engine_processes() -> list[int]:
    """Pids of running headless engines started by Ray actors (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"trio_enginecore" in arguments
            and b"--headless" in arguments
            and process_is_running(int(entry.name))
        ):
            found.append(int(entry.name))
    return found


def ray_processes() -> list[int]:
    """Pids of this process's children that are Ray's (GCS, raylet, workers...)."""
    found = []
    for pid in children_of_this_process():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ray" in command and process_is_running(pid):
            found.append(pid)
    return found


async def wait_for(condition: Any, timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.2)


def alive_engine_actors() -> list[Any]:
    from ray.util.state import list_actors

    filters = [("class_name", "=", ENGINE_ACTOR), ("state", "=", "ALIVE")]
    return list(list_actors(filters=filters, detail=True))


def live_placement_groups() -> list[Any]:
    from ray.util.state import list_placement_groups

    return [pg for pg in list_placement_groups() if pg.state != "REMOVED"]


async def nothing_left() -> None:
    """No engine actor alive, no placement group, no engine process (they may take a
    moment to be reported as gone)."""
    await wait_for(
        lambda: not alive_engine_actors() and not live_placement_groups() and not engine_processes()
    )


def where(client: Any, rank: int) -> str:
    """Where the client says rank ``rank``'s engine runs (its actor and node)."""
    location = client.statistics().engines[rank].location
    assert location is not None
    return str(location)


async def stream_exactly(client: Any, i: int, max_tokens: int = 6) -> None:
    prompt = [i % 50 + 1, i % 7 + 1]
    tokens: list[int] = []
    async with client.stream(
        EngineCoreRequest.for_tokens(prompt, request_id=f"r{i}", max_tokens=max_tokens)
    ) as outputs:
        async for output in outputs:
            tokens += output.new_token_ids
    assert tokens == expected(prompt, max_tokens)


async def read_until_cancelled(client: Any, i: int) -> None:
    request = EngineCoreRequest.for_tokens([1], request_id=f"long-{i}", max_tokens=4000)
    async with client.stream(request) as outputs:
        async for _ in outputs:
            pass
    raise AssertionError("a long generation ended before it was cancelled")  # pragma: no cover


# ------------------------------------------------------------------- pure parts


def test_ray_engines_check_their_settings() -> None:
    with pytest.raises(ValueError, match="engine_secret_keys"):
        RayEngines(curve=CurveServer.__new__(CurveServer))
    with pytest.raises(ValueError, match="go with curve"):
        RayEngines(engine_secret_keys=["/keys/engine-0.key_secret"])
    with pytest.raises(ValueError, match="reserve something"):
        RayEngines(resources_per_engine={"CPU": 0})
    with pytest.raises(ValueError, match="strategy"):
        RayEngines(strategy="EVERYWHERE")  # type: ignore[arg-type]
    remote = RemoteEngines("tcp://127.0.0.1:5570", locations={1: "host-b"})
    assert remote.locations == {1: "host-b"}
    assert remote == RemoteEngines("tcp://127.0.0.1:5570", locations={1: "host-b"})
    assert hash(remote) == hash(RemoteEngines("tcp://127.0.0.1:5570"))
    handle = EngineHandle.for_rank(1)
    handle.location = remote.locations[1]
    assert handle.describe() == "engine rank 1 (host-b)"
    arguments = RayEngines().engine_arguments(EngineConfig(data_parallel_size=2), 1, "tcp://h:1")
    assert arguments[:3] == ["--headless", "--handshake-address", "tcp://h:1"]
    assert "--exit-with-parent" in arguments
    assert arguments[arguments.index("--rank") + 1] == "1"


def test_the_default_install_neither_pulls_nor_imports_ray() -> None:
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert not any(
        d.split(">")[0].split("=")[0].strip() == "ray" for d in project["project"]["dependencies"]
    )
    assert project["project"]["optional-dependencies"]["ray"] == ["ray>=2.9"]
    program = (
        "import sys, trio_enginecore, trio_enginecore.client; "
        "from trio_enginecore.client import RayEngines; RayEngines(); "
        "print('ray' in sys.modules)"
    )
    imported = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    )
    assert imported.stdout.strip() == "False"


# ------------------------------------------- a cluster the client starts itself


@needs_ray
async def test_a_cluster_the_client_starts_is_its_own_and_stops_with_it() -> None:
    if ray.is_initialized():  # pragma: no cover - the order of the tests
        pytest.skip("this process is connected to Ray already")
    spec = RayEngines(
        init_options={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False},
        curve="ephemeral",
    )
    try:
        async with open_ray_engine_client(EngineConfig(), spec) as client:
            assert ray.is_initialized()
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(stream_exactly, client, i)
    except EngineStartupError as exc:  # pragma: no cover - depends on the machine
        if not ray.is_initialized() and "Ray" in str(exc):
            pytest.skip(f"a local Ray cluster cannot start here: {exc}")
        raise
    assert not ray.is_initialized()
    await wait_for(lambda: not engine_processes() and not ray_processes())


# ------------------------------------------------ on a cluster the test started


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    if ray.is_initialized():  # pragma: no cover
        ray.shutdown()
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=True,  # the state API (ray.util.state) is the dashboard's
            dashboard_host="127.0.0.1",
            log_to_driver=False,
        )
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"a local Ray cluster cannot start here: {exc!r}")
    try:
        live_placement_groups()
    except Exception as exc:  # pragma: no cover - ray without the dashboard
        ray.shutdown()
        pytest.skip(f"Ray's state API is not available (install 'ray[default]'): {exc!r}")
    yield
    ray.shutdown()


# Steps of 10 ms: a long generation lasts long enough to be cancelled mid-way.
DP2 = EngineConfig(data_parallel_size=2, step_time_s=0.01)


@needs_ray
@pytest.mark.usefixtures("ray_cluster")
async def test_two_engines_placed_by_ray_serve_exact_streams_and_cancellation() -> None:
    spec = RayEngines(resources_per_engine={"CPU": 1}, strategy="SPREAD")
    async with open_ray_engine_client(DP2, spec) as client:
        actors = alive_engine_actors()
        assert len(actors) == 2
        (group,) = live_placement_groups()
        assert group.state == "CREATED"
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(stream_exactly, client, i)
        assert client.statistics().protocol_errors == 0

        # Cancellation reaches the engine that owns each request: long generations
        # on both engines, cancelled with their scope.
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(read_until_cancelled, client, i)
                counts: list[tuple[int, int]] = []
                with trio.move_on_after(10) as waited:
                    while True:
                        counts = await client.get_request_counts_per_engine()
                        running = [r for _, r in counts]
                        if sum(running) == 8 and all(running):
                            break
                        await trio.sleep(0.05)
                assert not waited.cancelled_caught, f"(waiting, running) per engine: {counts}"
                scope.cancel()
        with trio.fail_after(10):
            while await client.get_request_counts_per_engine() != [(0, 0), (0, 0)]:
                await trio.sleep(0.05)
    await nothing_left()


@needs_ray
@pytest.mark.usefixtures("ray_cluster")
async def test_a_killed_engine_actor_is_an_engine_death_naming_its_node() -> None:
    with pytest.raises(EngineDeadError) as raised:
        async with open_ray_engine_client(DP2, RayEngines()) as client:
            (victim, _) = alive_engine_actors()
            assert len(engine_processes()) == 2
            os.kill(victim.pid, signal.SIGKILL)
            with trio.fail_after(15):
                while True:  # until the death is noticed: a stream then fails
                    await stream_exactly(client, 1)
                    await trio.sleep(0.05)
    from ray.util.state import get_node

    node = get_node(victim.node_id)
    message = str(raised.value)
    assert f"(Ray actor {victim.actor_id} on node {node.node_ip} " in message, message
    assert f"node id {victim.node_id}" in message, message
    assert "died: its connection was lost" in message, message
    assert client.is_dead
    await nothing_left()


@needs_ray
@pytest.mark.usefixtures("ray_cluster")
async def test_a_killed_engine_actor_is_replaced_in_its_bundle_under_the_restart_policy() -> None:
    policy = Restart(backoff_s=0.1, max_backoff_s=0.5)
    spec = RayEngines(curve="ephemeral")  # the new actor makes a new key pair
    async with open_ray_engine_client(DP2, spec, on_engine_failure=policy) as client:
        first = {a.actor_id: a for a in alive_engine_actors()}
        victim = next(a for a in first.values() if f"Ray actor {a.actor_id}" in where(client, 1))
        long = EngineCoreRequest.for_tokens(
            [1], request_id="long", max_tokens=100_000, data_parallel_rank=1
        )
        with pytest.raises(EngineDeadError) as died:
            async with client.stream(long) as outputs:
                await outputs.receive()
                os.kill(victim.pid, signal.SIGKILL)
                async for _ in outputs:
                    pass
        assert f"Ray actor {victim.actor_id}" in str(died.value)
        await wait_for(lambda: client.statistics().engines[1].state == "alive")
        assert client.statistics().engines[1].restarts == 1
        (replacement,) = [a for a in alive_engine_actors() if a.actor_id not in first]
        assert f"Ray actor {replacement.actor_id}" in where(client, 1)
        assert replacement.node_id == victim.node_id  # the same bundle, the same node
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(stream_exactly, client, i)
        assert not client.transport.refusals  # the new engine's key was admitted
        assert len(engine_processes()) == 2
    await nothing_left()


@needs_ray
@pytest.mark.usefixtures("ray_cluster")
async def test_a_placement_that_cannot_be_met_fails_and_leaves_nothing() -> None:
    spec = RayEngines(resources_per_engine={"CPU": 2}, placement_timeout_s=2)
    with pytest.raises(EngineStartupError, match=r"could not place 2 engine\(s\)"):
        async with open_ray_engine_client(DP2, spec):
            pass  # pragma: no cover
    await nothing_left()


@needs_ray
@pytest.mark.usefixtures("ray_cluster")
async def test_cancelled_half_way_through_the_startup_leaves_nothing() -> None:
    for delay in (0.5, 2.0):
        with trio.move_on_after(delay) as scope:
            async with open_ray_engine_client(DP2, RayEngines()):
                await trio.sleep_forever()  # pragma: no cover
        assert scope.cancelled_caught
        await nothing_left()


# ------------------------------------ a killed or stopped engine, whatever its steps

# How soon a killed or SIGSTOP-ped engine must be declared dead with the default
# Liveness (heartbeats every 0.3 s, 1.5 s without an answer, 0.5 s to reconnect).
DEATH_WITHIN_S = 3.0


def actor_of(client: Any, rank: int) -> Any:
    """The engine actor of rank ``rank`` (from Ray's state API)."""
    (actor,) = [
        a for a in alive_engine_actors() if f"Ray actor {a.actor_id} " in where(client, rank)
    ]
    return actor


def engine_pid_of(actor: Any) -> int:
    """The pid of the engine process an engine actor started (a child of its worker)."""
    (pid,) = [pid for pid in children_of(actor.pid) if pid in engine_processes()]
    return pid


def is_stopped(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state == "T"


async def stream_forever(
    client: Any, rank: int, tokens: dict[int, int], *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """A long generation pinned to ``rank``, counting its tokens in ``tokens[rank]``;
    started once its first output came."""
    request = EngineCoreRequest.for_tokens(
        [rank + 1], request_id=f"on-{rank}", max_tokens=100_000, data_parallel_rank=rank
    )
    started = False
    async with client.stream(request) as outputs:
        async for output in outputs:
            tokens[rank] += len(output.new_token_ids)
            if not started:
                started = True
                task_status.started()
    raise AssertionError(f"the generation on rank {rank} ended")  # pragma: no cover


def states(client: Any) -> list[str]:
    return [engine.state for engine in client.statistics().engines]


async def the_others_serve_on(client: Any, dead: int, step_time_s: float) -> None:
    """New requests go to the engines left, exact; one naming the dead rank fails."""
    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(stream_exactly, client, i, 2 if step_time_s < 1 else 1)
    late = EngineCoreRequest.for_tokens(
        [1], request_id="late", max_tokens=1, data_parallel_rank=dead
    )
    with pytest.raises(EngineDeadError, match=f"engine rank {dead} "):
        async with client.stream(late) as outputs:
            await outputs.receive()
    assert client.statistics().protocol_errors == 0


@needs_ray
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("step_time_s", [0.01, 5.0], ids=["short-steps", "long-steps"])
@pytest.mark.parametrize("engines", [1, 3], ids=["one-engine", "three-engines"])
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
async def test_a_killed_or_stopped_ray_engine_is_dead_within_3_s_whatever_its_steps(
    signum: signal.Signals, engines: int, step_time_s: float
) -> None:
    """Default liveness settings. The engine process of one Ray actor is killed or
    stopped mid-stream (mid-step with 5 s steps): its stream raises EngineDeadError
    within 3 s of the signal, naming the rank, the actor and its node, and the lost
    connection. With three engines (``route_around``) the other two serve on: their
    streams go on, new requests go to them.

    A stopped engine of three is continued once declared dead: it finds its client
    gone and exits, disturbing nobody. A stopped engine alone is left stopped: the
    client's clean-up kills it (after ``stop_timeout_s``) when the block ends."""
    config = EngineConfig(data_parallel_size=engines, step_time_s=step_time_s)
    spec = RayEngines(resources_per_engine={"CPU": 0.5}, stop_timeout_s=1.0)
    rank = engines // 2  # the middle one of three
    survivors = [r for r in range(engines) if r != rank]
    states_after = ["dead" if r == rank else "alive" for r in range(engines)]
    policy = "route_around" if survivors else "fail"
    # With one engine the client fails: leaving its block raises the death again.
    client_fails = contextlib.nullcontext() if survivors else pytest.raises(EngineDeadError)
    pid = 0
    try:
        with client_fails:
            async with open_ray_engine_client(config, spec, on_engine_failure=policy) as client:
                victim = actor_of(client, rank)
                pid = engine_pid_of(victim)
                tokens = dict.fromkeys(survivors, 0)
                async with trio.open_nursery() as nursery:
                    for survivor in survivors:
                        await nursery.start(stream_forever, client, survivor, tokens)
                    request = EngineCoreRequest.for_tokens(
                        [1], request_id="victim", max_tokens=100_000, data_parallel_rank=rank
                    )
                    with pytest.raises(EngineDeadError) as died:
                        async with client.stream(request) as outputs:
                            await outputs.receive()
                            os.kill(pid, signum)
                            signalled = trio.current_time()
                            async for _ in outputs:
                                pass
                    took = trio.current_time() - signalled
                    at_death = dict(tokens)
                    assert states(client) == states_after
                    if signum == signal.SIGSTOP:
                        assert is_stopped(pid)  # declared dead while stopped, not after
                    if survivors:
                        if signum == signal.SIGSTOP:
                            os.kill(pid, signal.SIGCONT)
                            await wait_for(lambda: pid not in engine_processes())
                        await the_others_serve_on(client, rank, step_time_s)
                        # The streams on the engines left went on all along.
                        await wait_for(
                            lambda: all(tokens[r] > at_death[r] for r in survivors),
                            timeout_s=step_time_s + 10,
                        )
                        assert states(client) == states_after
                        nursery.cancel_scope.cancel()
                    else:
                        assert client.is_dead
        if signum == signal.SIGSTOP:
            assert not process_is_running(pid)  # continued and exited, or killed
    finally:
        if signum == signal.SIGSTOP and pid:  # whatever failed, nothing stays stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    from ray.util.state import get_node

    message = str(died.value)
    assert took < DEATH_WITHIN_S, f"declared dead {took:.2f} s after {signum.name}: {message}"
    assert f"engine rank {rank} (Ray actor {victim.actor_id} on node " in message, message
    assert f"on node {get_node(victim.node_id).node_ip} " in message, message
    assert f"node id {victim.node_id}" in message, message
    assert "died: its connection was lost" in message, message
    await nothing_left()

"""Engines placed by Ray on several nodes, and a node lost under them.

Ray's ``cluster_utils.Cluster`` runs several real raylets (nodes, each with its own
node id and resources) on this machine: the placement group's ``STRICT_SPREAD`` puts
each engine on its own node, and removing a node kills every process on it, as a lost
host would. Skipped, with the reason, when Ray is not installed or cannot start.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, EngineDeadError
from trio_enginecore.client import RayEngines, Restart, open_ray_engine_client

from .test_ray import (
    alive_engine_actors,
    engine_processes,
    nothing_left,
    ray,
    stream_exactly,
    wait_for,
    where,
)

pytestmark = [
    pytest.mark.skipif(ray is None, reason="Ray is not installed (pip install '.[ray]')"),
    pytest.mark.timeout(300),
]

DP2 = EngineConfig(data_parallel_size=2, step_time_s=0.01)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head node with no CPU for engines, and three nodes of one CPU each."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # pragma: no cover
        ray.shutdown()
    try:
        made = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": True,
                "dashboard_host": "127.0.0.1",
            },
        )
        nodes = [made.add_node(num_cpus=1) for _ in range(3)]
        ray.init(address=made.address, log_to_driver=False)
        made.wait_for_nodes()
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"a Ray cluster of several nodes cannot start here: {exc!r}")
    made.engine_nodes = nodes
    yield made
    ray.shutdown()
    made.shutdown()


def node_of(cluster: Any, node_id: str) -> Any:
    (node,) = [n for n in cluster.engine_nodes if n.node_id == node_id]
    return node


async def test_strict_spread_puts_each_engine_on_a_node_of_its_own(cluster: Any) -> None:
    async with open_ray_engine_client(DP2, RayEngines(strategy="STRICT_SPREAD")) as client:
        actors = alive_engine_actors()
        assert len({actor.node_id for actor in actors}) == 2
        for rank in range(2):
            (mine,) = [a for a in actors if f"Ray actor {a.actor_id}" in where(client, rank)]
            assert f"node id {mine.node_id}" in where(client, rank)
        async with trio.open_nursery() as nursery:
            for i in range(60):
                nursery.start_soon(stream_exactly, client, i)
    await nothing_left()


async def test_an_engine_whose_node_is_lost_is_restarted_on_another_node(cluster: Any) -> None:
    policy = Restart(backoff_s=0.1, max_backoff_s=0.5)
    spec = RayEngines(strategy="STRICT_SPREAD", placement_timeout_s=60)
    async with open_ray_engine_client(DP2, spec, on_engine_failure=policy) as client:
        actors = alive_engine_actors()
        (victim,) = [a for a in actors if f"Ray actor {a.actor_id}" in where(client, 1)]
        long = EngineCoreRequest.for_tokens(
            [1], request_id="long", max_tokens=100_000, data_parallel_rank=1
        )
        with pytest.raises(EngineDeadError) as died:
            async with client.stream(long) as outputs:
                await outputs.receive()
                # Every process of the node goes: its raylet, the actor, the engine.
                lost = node_of(cluster, victim.node_id)
                await trio.to_thread.run_sync(cluster.remove_node, lost)
                cluster.engine_nodes.remove(lost)
                async for _ in outputs:
                    pass
        assert f"node id {victim.node_id}" in str(died.value)
        await wait_for(lambda: client.statistics().engines[1].restarts == 1, timeout_s=90)
        assert client.statistics().engines[1].state == "alive"
        assert f"node id {victim.node_id}" not in where(client, 1)
        # Ray placed the group's lost bundle on the node left, and the new actor in it.
        nodes = {a.node_id for a in alive_engine_actors()}
        assert len(nodes) == 2
        assert victim.node_id not in nodes
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(stream_exactly, client, i)
        assert len(engine_processes()) == 2
    await nothing_left()


async def test_without_a_restart_a_lost_node_is_an_engine_death_naming_it(cluster: Any) -> None:
    with pytest.raises(EngineDeadError) as raised:
        async with open_ray_engine_client(DP2, RayEngines(strategy="STRICT_SPREAD")) as client:
            actors = alive_engine_actors()
            (victim,) = [a for a in actors if f"Ray actor {a.actor_id}" in where(client, 0)]
            lost = node_of(cluster, victim.node_id)
            await trio.to_thread.run_sync(cluster.remove_node, lost)
            cluster.engine_nodes.remove(lost)
            with trio.fail_after(30):
                raise await client.wait_failed()
    message = str(raised.value)
    assert f"node id {victim.node_id}" in message, message
    assert "engine rank 0" in message, message
    await nothing_left()

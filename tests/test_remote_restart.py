"""Remote engines restarted through the user's ``EngineRestarter``.

The restarter here is what an operator's supervisor would be: it starts real
``trio-enginecore serve --headless`` processes that join the client over TCP with
CURVE, a new key pair for every start (so the client must admit the key each restart
returns). The client never launched them: only the restarter can start them again.
"""

from __future__ import annotations

import os
import signal
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, EngineDeadError, open_engine_client
from trio_enginecore.client import (
    EngineRestarter,
    RemoteEngines,
    Restart,
    RestartedEngine,
    TrioMPClient,
)
from trio_enginecore.curve import CurveServer, load_public_key, write_key_pair

from .support import children_of_this_process, expected, free_port, stop_process
from .test_remote import headless_command

CONFIG = EngineConfig(data_parallel_size=2, step_time_s=0.01)
FAST = Restart(backoff_s=0.05, max_backoff_s=0.2)


class HandStarter(EngineRestarter):
    """Starts headless engines as an operator's supervisor would, each with a key
    pair made for that start."""

    def __init__(self, directory: Path, address: str, *, fail_with: str | None = None) -> None:
        self.directory = directory
        self.address = address
        self.fail_with = fail_with
        self.client_public, self.client_secret = write_key_pair(directory, "client")
        self.processes: dict[int, trio.Process] = {}
        self.starts: dict[int, int] = {}
        self.stops: list[int] = []
        self.all_processes: list[trio.Process] = []

    async def start(self, rank: int) -> bytes:
        """Start rank ``rank``'s engine; its public key."""
        count = self.starts[rank] = self.starts.get(rank, 0) + 1
        public, secret = write_key_pair(self.directory, f"engine-{rank}-{count}")
        command = headless_command(
            CONFIG.evolve(data_parallel_rank=rank),
            self.address,
            secret_key=secret,
            server_key=self.client_public,
        )
        process = await trio.lowlevel.open_process(command, stdin=subprocess.DEVNULL)
        self.processes[rank] = process
        self.all_processes.append(process)
        return load_public_key(public)

    async def restart_engine(self, rank: int) -> RestartedEngine:
        old = self.processes.pop(rank, None)
        if old is not None:
            await stop_process(old, grace_s=None)
        if self.fail_with is not None:
            raise RuntimeError(self.fail_with)
        public = await self.start(rank)
        return RestartedEngine(location=f"host-b, start {self.starts[rank]}", public_key=public)

    async def stop_engine(self, rank: int) -> None:
        self.stops.append(rank)
        process = self.processes.pop(rank, None)
        if process is not None:
            await stop_process(process, grace_s=None)

    async def aclose(self) -> None:
        for process in self.all_processes:
            await stop_process(process)


def remote_engines(starter: HandStarter, publics: list[bytes]) -> RemoteEngines:
    return RemoteEngines(
        starter.address,
        curve=CurveServer.from_files(starter.client_secret, publics),
        locations={0: "host-a", 1: "host-b, start 1"},
        restarter=starter,
    )


async def exact_stream(client: TrioMPClient, i: int, *, rank: int | None = None) -> None:
    prompt = [i % 50 + 1, 3]
    tokens: list[int] = []
    request = EngineCoreRequest.for_tokens(
        prompt, request_id=f"r{i}", max_tokens=6, data_parallel_rank=rank
    )
    async with client.stream(request) as outputs:
        async for output in outputs:
            tokens += output.new_token_ids
    assert tokens == expected(prompt, 6)


async def test_a_killed_remote_engine_is_restarted_by_its_restarter_with_a_new_key(
    tmp_path: Path,
) -> None:
    starter = HandStarter(tmp_path, f"tcp://127.0.0.1:{free_port()}")
    try:
        publics = [await starter.start(rank) for rank in range(2)]
        with trio.fail_after(60):
            async with open_engine_client(
                CONFIG, remote=remote_engines(starter, publics), on_engine_failure=FAST
            ) as client:
                long = EngineCoreRequest.for_tokens(
                    [1], request_id="long", max_tokens=100_000, data_parallel_rank=1
                )
                with pytest.raises(EngineDeadError) as died:
                    async with client.stream(long) as outputs:
                        await outputs.receive()
                        os.kill(starter.processes[1].pid, signal.SIGKILL)
                        async for _ in outputs:
                            pass
                assert "engine rank 1 (host-b, start 1) died" in str(died.value)
                while client.statistics().engines[1].state != "alive":
                    await trio.sleep(0.05)
                status = client.statistics().engines[1]
                assert status.restarts == 1
                assert status.location == "host-b, start 2"  # the restarter's word
                assert starter.starts == {0: 1, 1: 2}
                # The new engine, with a key the client did not know at startup, serves
                # exactly, on its rank and balanced with the other.
                async with trio.open_nursery() as nursery:
                    for i in range(40):
                        nursery.start_soon(
                            partial(exact_stream, client, i, rank=1 if i < 20 else None)
                        )
                assert [e.state for e in client.statistics().engines] == ["alive", "alive"]
                assert not client.transport.refusals  # the new key was admitted
    finally:
        await starter.aclose()
    assert children_of_this_process() == []


async def kill_until_given_up(client: Any, starter: HandStarter, *, rank: int) -> str:
    """SIGKILL ``rank``'s engine; wait until the client gives it up; its death."""
    os.kill(starter.processes[rank].pid, signal.SIGKILL)
    while client.statistics().engines[rank].state != "dead":
        await trio.sleep(0.05)
    death = client.statistics().engines[rank].death
    assert death is not None
    return death


async def test_a_restarter_that_cannot_start_the_engine_gives_it_up_and_the_rest_serves(
    tmp_path: Path,
) -> None:
    starter = HandStarter(tmp_path, f"tcp://127.0.0.1:{free_port()}", fail_with="no capacity")
    policy = Restart(max_restarts=2, backoff_s=0.05, max_backoff_s=0.1)
    try:
        publics = [await starter.start(rank) for rank in range(2)]
        with trio.fail_after(60):
            async with open_engine_client(
                CONFIG, remote=remote_engines(starter, publics), on_engine_failure=policy
            ) as client:
                death = await kill_until_given_up(client, starter, rank=1)
                assert "not restarted again" in death
                assert "the engine restarter failed: RuntimeError('no capacity')" in death
                async with trio.open_nursery() as nursery:
                    for i in range(10):
                        nursery.start_soon(exact_stream, client, i)
                with pytest.raises(EngineDeadError, match="engine rank 1"):
                    await exact_stream(client, 99, rank=1)
    finally:
        await starter.aclose()
    assert children_of_this_process() == []


async def test_a_restarted_engine_not_ready_in_time_is_stopped_through_the_restarter(
    tmp_path: Path,
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    starter = HandStarter(tmp_path, address)
    wrong = f"tcp://127.0.0.1:{free_port()}"  # where nobody listens: never ready
    policy = Restart(max_restarts=1, backoff_s=0.05)
    try:
        publics = [await starter.start(rank) for rank in range(2)]
        with trio.fail_after(90):
            async with open_engine_client(
                CONFIG,
                remote=remote_engines(starter, publics),
                on_engine_failure=policy,
                # The first startup counts too: engines importing Python on a loaded
                # machine can take seconds to say HELLO.
                ready_timeout_s=10,
            ) as client:
                starter.address = wrong
                death = await kill_until_given_up(client, starter, rank=1)
                assert "not ready within 10 s" in death
                assert starter.stops == [1]
                assert 1 not in starter.processes
                await exact_stream(client, 1)
    finally:
        await starter.aclose()
    assert children_of_this_process() == []


def test_a_remote_engine_without_a_restarter_cannot_have_the_restart_policy() -> None:
    remote = RemoteEngines(f"tcp://127.0.0.1:{free_port()}")

    async def main() -> None:
        async with open_engine_client(CONFIG, remote=remote, on_engine_failure="restart"):
            pass  # pragma: no cover

    with pytest.raises(ValueError, match="give RemoteEngines a restarter"):
        trio.run(main)

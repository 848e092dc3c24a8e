"""Several engines: one client balancing over them, one client per engine, an engine
joining over TCP with CURVE, and an engine that dies and is restarted."""

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile

import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    RemoteEngines,
    open_coordinator,
    open_engine_client,
)
from trio_enginecore.client import DPTrioMPClient, Restart
from trio_enginecore.curve import CurveServer, write_key_pair


async def one_client_three_engines() -> None:
    print("1. one client balancing over three engines")
    config = EngineConfig(data_parallel_size=3, step_time_s=0.01)
    async with open_engine_client(config) as client:
        print(f"   client class: {type(client).__name__}")
        peak: list[tuple[int, int]] = []

        async def generate(request_id: str) -> None:
            async with client.stream(
                EngineCoreRequest.for_tokens([1, 2, 3], request_id=request_id, max_tokens=20)
            ) as outputs:
                async for _ in outputs:
                    pass

        async with trio.open_nursery() as nursery:
            for i in range(90):
                nursery.start_soon(generate, f"req-{i}")
            await trio.sleep(0.1)  # all 90 are in flight now
            peak = await client.get_request_counts_per_engine()
        print(f"   requests per engine while all 90 ran: {[w + r for w, r in peak]}")

        # A request may name its engine; the client sends it there.
        async with client.stream(
            EngineCoreRequest.for_tokens(
                [1, 2, 3], request_id="pinned", data_parallel_rank=2, max_tokens=3
            )
        ) as outputs:
            tokens = [t async for output in outputs for t in output.new_token_ids]
        print(f"   pinned to rank 2: {tokens}")

        # The engines ran (at least) one request wave, now over: they are paused.
        while client.engines_running:
            await client.wait_wave_change()
        ended = client.current_wave >= 1
        print(f"   engines running: {client.engines_running}, a wave has ended: {ended}")


async def one_client_per_engine() -> None:
    print("2. two clients, one engine each, sharing a coordinator")
    seen: list[str] = []
    async with open_coordinator(2) as coordinator:
        clients: list[DPTrioMPClient] = []
        all_open = trio.Event()
        both_saw_the_end = trio.Event()
        finished = trio.Event()

        async def frontend(rank: int) -> None:
            config = EngineConfig(
                data_parallel_size=2,
                data_parallel_rank=rank,
                data_parallel_external_lb=True,
                step_time_s=0.01,
            )
            async with open_engine_client(config, coordinator=coordinator) as client:
                assert isinstance(client, DPTrioMPClient)
                clients.append(client)
                if len(clients) == 2:
                    all_open.set()
                # Each client sees the group's waves, whoever starts them.
                wave, running = await client.wait_wave_change()
                seen.append(f"rank {rank} saw wave {wave} start: {running}")
                while client.engines_running:
                    await client.wait_wave_change()
                seen.append(f"rank {rank} saw wave {client.current_wave - 1} end")
                if len(seen) == 4:
                    both_saw_the_end.set()
                await finished.wait()

        # The engines of a group start together: open the clients concurrently.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(frontend, 0)
            await trio.sleep(0.05)
            nursery.start_soon(frontend, 1)
            await all_open.wait()
            first = next(c for c in clients if c.config.data_parallel_rank == 0)
            async with first.stream(
                EngineCoreRequest.for_tokens([1, 2, 3], request_id="hello", max_tokens=10)
            ) as outputs:
                async for _ in outputs:
                    pass
            await both_saw_the_end.wait()
            finished.set()
    for line in sorted(seen, key=lambda line: line[:6]):  # by rank, in order seen
        print(f"   {line}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def an_engine_over_tcp() -> None:
    print("3. an engine joining over TCP, authenticated with CURVE")
    with tempfile.TemporaryDirectory() as keys:
        # What `trio-enginecore keygen client` and `... keygen engine-0` write.
        client_public, client_secret = write_key_pair(keys, "client")
        engine_public, engine_secret = write_key_pair(keys, "engine-0")
        address = f"tcp://127.0.0.1:{free_port()}"
        # On the engine's host (here, this one):
        engine = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "trio_enginecore",
                "serve",
                "--headless",
                "--handshake-address",
                address,
                "--curve-secret-key",
                str(engine_secret),
                "--curve-server-key",
                str(client_public),
            ],
            stdin=subprocess.DEVNULL,
        )
        try:
            curve = CurveServer.from_files(client_secret, [engine_public])
            remote = RemoteEngines(address, curve=curve)
            async with open_engine_client(EngineConfig(), remote=remote) as client:
                print(f"   launched by the client: {client.engine_pids}")
                async with client.stream(
                    EngineCoreRequest.for_tokens([1, 2, 3], request_id="over-tcp", max_tokens=5)
                ) as outputs:
                    tokens = [t async for output in outputs for t in output.new_token_ids]
                print(f"   generated over CURVE: {tokens}")
        finally:
            engine.terminate()
            await engine.wait()


async def one_engine_dies() -> None:
    print("4. on_engine_failure=Restart(...): rank 1 of two is killed")
    config = EngineConfig(data_parallel_size=2, step_time_s=0.01)
    # "restart" with its default settings would do; a longer back-off (0.5 s by
    # default) keeps rank 1 out of service long enough to look at the client meanwhile.
    policy = Restart(backoff_s=1.0)
    async with open_engine_client(config, on_engine_failure=policy) as client:
        victim = client.engine_pids[1]
        assert victim is not None
        results: dict[int, str] = {}
        streaming = trio.Semaphore(0)

        async def generate(rank: int) -> None:
            request = EngineCoreRequest.for_tokens(
                [1, 2, 3], request_id=f"on-rank-{rank}", data_parallel_rank=rank, max_tokens=20
            )
            try:
                async with client.stream(request) as outputs:
                    tokens = list((await outputs.receive()).new_token_ids)
                    streaming.release()
                    tokens += [t async for output in outputs for t in output.new_token_ids]
                results[rank] = f"{len(tokens)} tokens"
            except EngineDeadError:
                results[rank] = "EngineDeadError"

        async with trio.open_nursery() as nursery:
            for rank in (0, 1):
                nursery.start_soon(generate, rank)
            for _ in range(2):
                await streaming.acquire()  # both requests are running
            os.kill(victim, signal.SIGKILL)
        # Only the requests of the engine that died fail; the others go on untouched.
        print(f"   the stream on rank 0: {results[0]}; on rank 1: {results[1]}")
        states = [engine.state for engine in client.statistics().engines]
        print(f"   engine states: {states}, client.is_dead={client.is_dead}")

        # Meanwhile new requests go to the engines in service; one naming rank 1 fails.
        pinned = EngineCoreRequest.for_tokens([1, 2, 3], request_id="r1", data_parallel_rank=1)
        try:
            await client.add_request(pinned)
        except EngineDeadError as exc:
            print(f"   pinned to rank 1: EngineDeadError: {str(exc).split(':')[0]}")
        async with client.stream(
            EngineCoreRequest.for_tokens([1, 2, 3], request_id="any", max_tokens=3)
        ) as outputs:
            tokens = [t async for output in outputs for t in output.new_token_ids]
        print(f"   not pinned: {tokens}")

        # Once the new rank-1 engine is ready, it is back in routing.
        with trio.fail_after(20):
            while True:
                if client.statistics().engines[1].state == "alive":
                    break
                await trio.sleep(0.05)
        pinned = EngineCoreRequest.for_tokens(
            [1, 2, 3], request_id="r1", data_parallel_rank=1, max_tokens=3
        )
        async with client.stream(pinned) as outputs:
            tokens = [t async for output in outputs for t in output.new_token_ids]
        restarts = [engine.restarts for engine in client.statistics().engines]
        print(f"   rank 1 is back: pinned to rank 1: {tokens}, restarts per engine: {restarts}")


async def main() -> None:
    await one_client_three_engines()
    await one_client_per_engine()
    await an_engine_over_tcp()
    await one_engine_dies()


if __name__ == "__main__":
    # Show the client's log lines (the death and the restart of part 4) among the
    # program's own: the package adds no handler, so nothing shows without this.
    logging.basicConfig(stream=sys.stdout, format="   %(levelname)s %(name)s: %(message)s")
    trio.run(main)

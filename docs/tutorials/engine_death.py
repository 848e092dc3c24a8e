"""When the engine dies: EngineDeadError everywhere (the default), or a restart."""

import logging
import os
import signal
import sys

import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    open_engine_client,
)

# enable_fault_injection turns on the engine's "inject_fault" utility, which makes
# the engine fail on purpose. It exists for tests like this one; never enable it in
# production.
CONFIG = EngineConfig(model="counter", step_time_s=0.01, enable_fault_injection=True)


async def fatal_error() -> None:
    print("1. the engine reports a fatal error")
    try:
        async with open_engine_client(CONFIG) as client:
            received = 0
            injected = False
            try:
                async with client.stream(
                    EngineCoreRequest.for_tokens([1, 2, 3], request_id="doomed", max_tokens=10_000)
                ) as outputs:
                    async for output in outputs:
                        received += len(output.new_token_ids)
                        if received >= 10 and not injected:
                            await client.call_utility("inject_fault")
                            injected = True
            except EngineDeadError as exc:
                print(f"   the stream raised EngineDeadError after {received} tokens:")
                print(f"     {exc}")

            # From now on every call fails at once: the client is dead for good.
            try:
                await client.get_request_counts()
            except EngineDeadError:
                print(f"   later calls raise EngineDeadError too (is_dead={client.is_dead})")
        # The block itself did not raise, so leaving it reports the death once more.
    except EngineDeadError:
        print("   leaving the client's block raised EngineDeadError")


async def killed_process() -> None:
    print("2. the engine process is killed")
    try:
        async with open_engine_client(CONFIG) as client:
            pid = client.engine_pids[0]
            assert pid is not None
            await client.add_request(
                EngineCoreRequest.for_tokens([1, 2, 3], request_id="orphan", max_tokens=10_000)
            )
            await client.get_output()  # the request is running
            os.kill(pid, signal.SIGKILL)
            # get_output() returns what already arrived, then raises.
            while True:
                await client.get_output()
    except EngineDeadError as exc:
        print(f"   get_output() raised EngineDeadError: {exc}")


async def restarted() -> None:
    print('3. on_engine_failure="restart": the client launches the engine again')
    async with open_engine_client(CONFIG, on_engine_failure="restart") as client:
        pid = client.engine_pids[0]
        assert pid is not None
        try:
            async with client.stream(
                EngineCoreRequest.for_tokens([1, 2, 3], request_id="victim", max_tokens=10_000)
            ) as outputs:
                await outputs.receive()  # the request is running
                os.kill(pid, signal.SIGKILL)
                async for _ in outputs:
                    pass
        except EngineDeadError as exc:
            # The requests the engine had fail, as under "fail"; the client does not.
            print(f"   the stream raised EngineDeadError: {exc}")
        engine = client.statistics().engines[0]
        print(f"   engine rank 0 is {engine.state!r}; client.is_dead={client.is_dead}")

        # A new request waits for the engine to be back in service (at most
        # Restart.wait_s, 30 s), then runs on it. The same id may be used again.
        token_ids: list[int] = []
        async with client.stream(
            EngineCoreRequest.for_tokens([1, 2, 3], request_id="victim", max_tokens=5)
        ) as outputs:
            async for output in outputs:
                token_ids.extend(output.new_token_ids)
        engine = client.statistics().engines[0]
        new_pid = client.engine_pids[0] != pid
        print(
            f"   engine rank 0 is {engine.state!r}, restarts={engine.restarts}, new pid: {new_pid}"
        )
        print(f"   the request sent again generated {token_ids}")
    print("   leaving the client's block raised nothing: the client never failed")


async def main() -> None:
    await fatal_error()
    await killed_process()
    await restarted()


if __name__ == "__main__":
    # The client logs each death and restart on the "trio_enginecore.client" logger;
    # the package adds no handler of its own, so nothing shows until the program
    # configures logging. This line sends the records to stdout, among the prints.
    logging.basicConfig(stream=sys.stdout, format="   %(levelname)s %(name)s: %(message)s")
    trio.run(main)

"""When the engine dies: EngineDeadError everywhere, then a fresh client."""

import os
import signal

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


async def restart() -> None:
    print("3. restarting means opening a new client")
    async with open_engine_client(CONFIG) as client:
        token_ids: list[int] = []
        async with client.stream(
            EngineCoreRequest.for_tokens([1, 2, 3], request_id="again", max_tokens=5)
        ) as outputs:
            async for output in outputs:
                token_ids.extend(output.new_token_ids)
        print(f"   a new engine (pid {client.engine_pids[0]}) generated {token_ids}")


async def main() -> None:
    await fatal_error()
    await killed_process()
    await restart()


if __name__ == "__main__":
    trio.run(main)

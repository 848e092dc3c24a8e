"""Cancellation and timeouts: what a cancelled stream and a timed-out utility call do."""

import trio

from trio_enginecore import (
    AsyncEngineCoreClient,
    EngineConfig,
    EngineCoreRequest,
    open_engine_client,
)


async def cancel_a_stream(client: AsyncEngineCoreClient) -> None:
    print("1. a stream under move_on_after(0.2)")
    received = 0
    # The "counter" model continues a prompt 1, 2, 3 with 4, 5, 6, ...
    request = EngineCoreRequest.for_tokens([1, 2, 3], request_id="long", max_tokens=10_000)
    with trio.move_on_after(0.2) as scope:
        async with client.stream(request) as outputs:
            async for output in outputs:
                if received == 0:
                    waiting, running = await client.get_request_counts()
                    print(f"   while streaming, the engine has ({waiting}, {running})")
                received += len(output.new_token_ids)
    print(f"   timed out: {scope.cancelled_caught}, after {received} tokens")
    # Leaving the stream's block sent ABORT before this line runs.
    counts = await client.get_request_counts()
    print(f"   after the timeout, (waiting, running) = {counts}")
    print(f"   requests in flight on the client: {client.statistics().requests_in_flight}")


async def time_out_a_utility_call(client: AsyncEngineCoreClient) -> None:
    print("2. a utility call under move_on_after(0.1)")
    await client.add_request(
        EngineCoreRequest.for_tokens([1, 2, 3], request_id="short", max_tokens=50)
    )
    await client.get_output()  # its first token: the request is running now
    # pause_scheduler("wait") only replies once the running requests have finished,
    # which takes 49 more steps of 10 ms here: longer than our timeout.
    with trio.move_on_after(0.1) as scope:
        await client.pause_scheduler("wait")
    print(f"   timed out: {scope.cancelled_caught}")

    # The client forgot the call, but the engine still carries it out.
    finished = False
    while not finished:
        message = await client.get_output()
        finished = any(output.finished for output in message.outputs)
    paused = await client.is_scheduler_paused()
    print(f"   once the request finished, is_scheduler_paused() = {paused}")
    await client.resume_scheduler()
    paused = await client.is_scheduler_paused()
    print(f"   after resume_scheduler(), is_scheduler_paused() = {paused}")


async def main() -> None:
    config = EngineConfig(model="counter", step_time_s=0.01)
    async with open_engine_client(config) as client:
        await cancel_a_stream(client)
        await time_out_a_utility_call(client)


if __name__ == "__main__":
    trio.run(main)

"""Per-request deadlines: a cancel scope around a stream, for a running or a queued request."""

import trio

from trio_enginecore import (
    AsyncEngineCoreClient,
    EngineConfig,
    EngineCoreRequest,
    open_engine_client,
)

# One request runs at a time, so a second one has to wait in the engine's queue.
CONFIG = EngineConfig(model="counter", max_num_seqs=1, step_time_s=0.01)


def check(promise: bool, what: str) -> None:
    """Stop the program (exit status 1) if the engine or the client broke a promise."""
    if not promise:
        raise AssertionError(f"broken promise: {what}")


async def check_nothing_in_flight(client: AsyncEngineCoreClient, when: str = "afterwards") -> None:
    counts = await client.get_request_counts()
    print(f"   {when}, (waiting, running) = {counts}")
    in_flight = client.statistics().requests_in_flight
    print(f"   requests in flight on the client: {in_flight}")
    check(counts == (0, 0), "the engine dropped every request")
    check(in_flight == 0, "the client forgot every request")


async def running_request(client: AsyncEngineCoreClient) -> None:
    print("1. a running request under move_on_after(0.3)")
    # The "counter" model continues a prompt 1, 2, 3 with 4, 5, 6, ...
    request = EngineCoreRequest.for_tokens([1, 2, 3], request_id="running", max_tokens=10_000)
    tokens: list[int] = []
    with trio.move_on_after(0.3) as scope:
        async with client.stream(request) as outputs:
            async for output in outputs:
                tokens.extend(output.new_token_ids)
    # The tokens that came before the deadline are ours; leaving the block sent ABORT.
    as_predicted = tokens == list(range(4, 4 + len(tokens)))
    print(f"   deadline hit: {scope.cancelled_caught}, after {len(tokens)} tokens")
    print(f"   tokens 4, 5, 6, ... as the counter model predicts: {as_predicted}")
    check(scope.cancelled_caught, "the deadline ended the stream")
    check(as_predicted, "every token produced before the deadline was delivered")
    await check_nothing_in_flight(client)


async def hold_the_only_slot(
    client: AsyncEngineCoreClient, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Stream a long request; report started once it runs; run until cancelled."""
    request = EngineCoreRequest.for_tokens([1, 2, 3], request_id="long", max_tokens=10_000)
    running = False
    async with client.stream(request) as outputs:
        async for _output in outputs:
            if not running:
                running = True
                task_status.started()


async def queued_request(client: AsyncEngineCoreClient) -> None:
    print("2. a queued request under move_on_after(0.5)")
    async with trio.open_nursery() as nursery:
        await nursery.start(hold_the_only_slot, client)
        print("   'long' is running: it holds the only slot (max_num_seqs=1)")

        request = EngineCoreRequest.for_tokens([10, 11], request_id="queued", max_tokens=5)
        received = 0
        counts_while_waiting = None
        with trio.move_on_after(0.5) as scope:
            async with client.stream(request) as outputs:
                counts_while_waiting = await client.get_request_counts()
                print(f"   while 'queued' waits, (waiting, running) = {counts_while_waiting}")
                async for output in outputs:
                    received += len(output.new_token_ids)
        print(f"   deadline hit: {scope.cancelled_caught}, after {received} tokens")
        check(counts_while_waiting == (1, 1), "the request waited in the engine's queue")
        check(scope.cancelled_caught and received == 0, "the deadline fired while it waited")

        # The ABORT reached the engine before this call: they share a socket, in order.
        counts = await client.get_request_counts()
        print(f"   afterwards, (waiting, running) = {counts}: only 'long' is left")
        check(counts == (0, 1), "the engine dropped the queued request")
        nursery.cancel_scope.cancel()  # leaving the stream of 'long' aborts it too
    await check_nothing_in_flight(client, "once 'long' is cancelled too")


async def failing_deadline(client: AsyncEngineCoreClient) -> None:
    print("3. fail_after(0.3): the same deadline, as an exception")
    request = EngineCoreRequest.for_tokens([1, 2, 3], request_id="failing", max_tokens=10_000)
    raised = False
    try:
        with trio.fail_after(0.3):
            async with client.stream(request) as outputs:
                async for _output in outputs:
                    pass
    except trio.TooSlowError:
        raised = True
    print(f"   raised TooSlowError: {raised}")
    check(raised, "fail_after raised TooSlowError")
    await check_nothing_in_flight(client)


async def main() -> None:
    async with open_engine_client(CONFIG) as client:
        # A guard for the whole program: the per-request deadlines nest inside it.
        with trio.fail_after(30):
            await running_request(client)
            await queued_request(client)
            await failing_deadline(client)


if __name__ == "__main__":
    trio.run(main)

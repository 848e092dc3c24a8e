"""Sync and in-process clients: the same engine from threads, and without a process."""

import threading

import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreClient,
    EngineCoreRequest,
    SyncMPClient,
    make_client,
    open_engine_client,
)
from trio_enginecore.engine import CounterModel

CONFIG = EngineConfig(model="counter")


def collect(client: EngineCoreClient, request_ids: set[str]) -> dict[str, list[int]]:
    """Read outputs with get_output() until these requests have finished."""
    token_ids: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    unfinished = set(request_ids)
    while unfinished:
        for output in client.get_output().outputs:
            token_ids[output.request_id].extend(output.new_token_ids)
            if output.finished:
                unfinished.discard(output.request_id)
    return token_ids


def sync_client_from_threads() -> None:
    print("1. SyncMPClient, called from plain threads")
    with SyncMPClient(CONFIG) as client:
        print(f"   engine pid {client.engine_pids[0]}")
        results: dict[str, list[int]] = {}

        def generate(thread_number: int) -> None:
            request = EngineCoreRequest.for_tokens(
                [100 * thread_number], request_id=f"thread-{thread_number}", max_tokens=4
            )
            token_ids: list[int] = []
            # Each thread streams its own request: its outputs, and only its.
            with client.stream(request) as outputs:
                for output in outputs:
                    token_ids.extend(output.new_token_ids)
            results[request.request_id] = token_ids

        threads = [threading.Thread(target=generate, args=(n,)) for n in (1, 2, 3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for request_id, tokens in sorted(results.items()):
            print(f"   {request_id}: {tokens}")

        # vLLM's batch API too: add_request, and one thread reading get_output().
        client.add_request(EngineCoreRequest.for_tokens([41], request_id="batch", max_tokens=3))
        print(f"   batch: {collect(client, {'batch'})['batch']}")
        print(f"   engine counts (waiting, running): {client.get_request_counts()}")


def blocking_in_process() -> None:
    print("2. make_client(multiprocess=False): InprocClient, no process, no thread")
    with make_client(CONFIG, multiprocess=False) as client:
        print(f"   client class: {type(client).__name__}")
        prompt = [7, 8, 9]
        client.add_request(EngineCoreRequest.for_tokens(prompt, request_id="inproc", max_tokens=5))
        # Each get_output() call runs one engine step in this thread.
        tokens = collect(client, {"inproc"})["inproc"]
        expected = CounterModel.expected_tokens(prompt, 5)
        print(f"   tokens {tokens}, as the counter model predicts: {tokens == expected}")
        print(f"   idle engine: get_output() returns {len(client.get_output().outputs)} outputs")


async def trio_in_process() -> None:
    print("3. open_engine_client(multiprocess=False): TrioInprocClient")
    async with open_engine_client(CONFIG, multiprocess=False) as client:
        print(f"   client class: {type(client).__name__}, engine pids: {client.engine_pids}")
        token_ids: list[int] = []
        async with client.stream(
            EngineCoreRequest.for_tokens([41], request_id="trio-inproc", max_tokens=3)
        ) as outputs:
            async for output in outputs:
                token_ids.extend(output.new_token_ids)
        print(f"   streamed {token_ids}")


if __name__ == "__main__":
    sync_client_from_threads()
    blocking_in_process()
    trio.run(trio_in_process)

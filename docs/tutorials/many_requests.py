"""Many requests at once: concurrent streams in a nursery, then the batch API."""

import trio

from trio_enginecore import (
    AsyncEngineCoreClient,
    EngineConfig,
    EngineCoreRequest,
    open_engine_client,
)
from trio_enginecore.engine import NgramModel

PROMPTS = ["The scheduler", "A good test", "The river", "Every request"]
tokenizer = NgramModel()


async def generate(
    client: AsyncEngineCoreClient, request: EngineCoreRequest, prompt: str, texts: dict[str, str]
) -> None:
    """One task per request: stream its tokens, keep the text."""
    token_ids: list[int] = []
    async with client.stream(request) as outputs:
        async for output in outputs:
            token_ids.extend(output.new_token_ids)
    texts[request.request_id] = prompt + tokenizer.detokenize(token_ids)


async def with_streams(client: AsyncEngineCoreClient) -> None:
    started = trio.current_time()
    texts: dict[str, str] = {}
    async with trio.open_nursery() as nursery:
        for i, prompt in enumerate(PROMPTS):
            request = EngineCoreRequest.for_tokens(
                tokenizer.tokenize(prompt),
                request_id=f"stream-{i}",
                max_tokens=40,
                temperature=0.5,
                seed=i,
            )
            nursery.start_soon(generate, client, request, prompt, texts)
    # The nursery block only ends when every task has finished.
    elapsed = trio.current_time() - started
    print(f"streams: {len(texts)} generations in {elapsed:.1f} s")
    for request_id in sorted(texts):
        print(f"  {request_id}: {texts[request_id]!r}")


async def with_batches(client: AsyncEngineCoreClient) -> None:
    token_ids: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        request = EngineCoreRequest.for_tokens(
            tokenizer.tokenize(prompt),
            request_id=f"batch-{i}",
            max_tokens=40,
            temperature=0.5,
            seed=i,
        )
        await client.add_request(request)
        token_ids[request.request_id] = []

    # One task reads every output: each message holds what one engine step
    # produced for all of our requests.
    unfinished = set(token_ids)
    messages = 0
    while unfinished:
        message = await client.get_output()
        messages += 1
        for output in message.outputs:
            token_ids[output.request_id].extend(output.new_token_ids)
            if output.finished:
                unfinished.discard(output.request_id)
    total = sum(len(ids) for ids in token_ids.values())
    print(f"batch API: {len(token_ids)} requests, {total} tokens in {messages} messages")


async def main() -> None:
    # step_time_s pretends that each model step takes 10 ms on an accelerator.
    config = EngineConfig(model="ngram", step_time_s=0.01)
    async with open_engine_client(config) as client:
        await with_streams(client)
        await with_batches(client)


if __name__ == "__main__":
    trio.run(main)

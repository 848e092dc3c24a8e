"""``trio-enginecore demo``: the whole stack on the built-in engine, in a minute."""

from __future__ import annotations

import sys
from typing import TextIO

import trio

from .client import TrioMPClient, open_engine_client
from .config import EngineConfig
from .engine import NgramModel
from .protocol import EngineCoreRequest

PROMPTS = [
    ("The scheduler", 1),
    ("A good test", 2),
    ("The river", 3),
]


async def _generate(
    client: TrioMPClient,
    model: NgramModel,
    request_id: str,
    prompt: str,
    seed: int,
    counts: dict[str, int],
) -> str:
    tokens: list[int] = []
    request = EngineCoreRequest.for_tokens(
        model.tokenize(prompt), request_id=request_id, max_tokens=160, seed=seed, temperature=0.7
    )
    async with client.stream(request) as outputs:
        async for output in outputs:
            tokens += output.new_token_ids
            counts[request_id] = len(tokens)
    return prompt + model.detokenize(tokens)


async def run_demo(out: TextIO = sys.stdout, *, step_time_s: float = 0.01) -> None:
    """Launch the engine, stream, cancel, call utilities, shut down."""
    tty = out.isatty()

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    model = NgramModel()
    config = EngineConfig(model="ngram", step_time_s=step_time_s)
    say("Starting the built-in engine (model 'ngram') as a child process...")
    started = trio.current_time()
    async with open_engine_client(config) as client:
        ready = client.engines[0]
        assert ready is not None
        say(
            f"Engine ready in {trio.current_time() - started:.2f} s "
            f"(pid {client.engine_pids[0]}, max_model_len {ready.max_model_len})."
        )

        say(f"\n1. Streaming {len(PROMPTS)} generations at once, one stream per task:")
        counts = {f"gen-{i}": 0 for i in range(len(PROMPTS))}
        texts: dict[int, str] = {}
        async with trio.open_nursery() as nursery:

            async def one(i: int, prompt: str, seed: int) -> None:
                texts[i] = await _generate(client, model, f"gen-{i}", prompt, seed, counts)

            for i, (prompt, seed) in enumerate(PROMPTS):
                nursery.start_soon(one, i, prompt, seed)
            if tty:
                while len(texts) < len(PROMPTS):
                    progress = "  ".join(f"[{i + 1}] {n:3d}" for i, n in enumerate(counts.values()))
                    print(f"\r   tokens so far: {progress}", end="", file=out, flush=True)
                    await trio.sleep(0.05)
                print("\r" + " " * 60 + "\r", end="", file=out, flush=True)
        for i in range(len(PROMPTS)):
            say(f"   [{i + 1}] (seed {PROMPTS[i][1]}) {texts[i]!r}")

        say("\n2. Cancelling a long generation after 0.3 s (move_on_after):")
        received = 0
        with trio.move_on_after(0.3):
            long = EngineCoreRequest.for_tokens(
                model.tokenize("Structured"), request_id="long", max_tokens=4000, seed=9
            )
            async with client.stream(long) as outputs:
                async for output in outputs:
                    received += len(output.new_token_ids)
        waiting, running = await client.get_request_counts()
        say(
            f"   received {received} tokens, then left the block: the client sent ABORT; "
            f"the engine now has {waiting} waiting and {running} running requests."
        )

        say("\n3. Utility calls:")
        say(f"   get_supported_tasks() -> {await client.get_supported_tasks()!r}")
        await client.sleep()
        say(f"   sleep(); is_sleeping() -> {await client.is_sleeping()!r}")
        await client.wake_up()
        say(f"   wake_up(); is_sleeping() -> {await client.is_sleeping()!r}")

        stats = client.statistics()
        say(
            f"\nStatistics: {stats.messages_received} messages, {stats.tokens_received} tokens "
            f"received; {stats.requests_in_flight} requests in flight."
        )
        say("Leaving the block: the engine is stopped and everything is cleaned up.")
    say("Done.")

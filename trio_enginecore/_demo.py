"""``trio-enginecore demo``: the whole stack on the built-in engine, in a minute.

Text in, text out: the built-in ``ngram`` engine with the tokenizer shipped for it
(:mod:`trio_enginecore.text`), then the token-level client underneath.
"""

from __future__ import annotations

import sys
from typing import TextIO

import trio

from .config import EngineConfig
from .protocol import RequestOutputKind

PROMPTS = [
    ("The scheduler", 1),
    ("A good test", 2),
    ("The river", 3),
]


async def run_demo(out: TextIO = sys.stdout, *, step_time_s: float = 0.01) -> None:
    """Launch the engine, stream text, stop on a string, cancel, call utilities, shut
    down."""
    try:
        from .text import AsyncLLM, open_llm
    except ImportError as exc:  # the text extra is missing
        raise SystemExit(
            f"the demo writes text and needs the 'text' extra: "
            f"pip install '/path/to/trio-enginecore[text]' ({exc})"
        ) from None
    tty = out.isatty()

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    config = EngineConfig(model="ngram", step_time_s=step_time_s)
    say("Starting the built-in engine (model 'ngram', its tokenizer shipped with the package)...")
    started = trio.current_time()
    async with open_llm(config) as llm:
        client = llm.client
        ready = client.engines[0]  # type: ignore[attr-defined]
        assert ready is not None
        say(
            f"Engine ready in {trio.current_time() - started:.2f} s "
            f"(pid {client.engine_pids[0]}, max_model_len {ready.max_model_len})."  # type: ignore[attr-defined]
        )

        say(f"\n1. Streaming {len(PROMPTS)} texts at once, one task each (text as it comes):")
        texts: dict[int, str] = dict.fromkeys(range(len(PROMPTS)), "")

        async def one(llm: AsyncLLM, i: int, prompt: str, seed: int) -> None:
            async with llm.generate(
                prompt,
                max_tokens=160,
                seed=seed,
                temperature=0.7,
                output_kind=RequestOutputKind.DELTA,
            ) as outputs:
                async for output in outputs:
                    texts[i] += output.outputs[0].text

        async with trio.open_nursery() as nursery:
            for i, (prompt, seed) in enumerate(PROMPTS):
                nursery.start_soon(one, llm, i, prompt, seed)
            if tty:
                while nursery.child_tasks:
                    progress = "  ".join(f"[{i + 1}] {len(t):3d}" for i, t in texts.items())
                    print(f"\r   characters so far: {progress}", end="", file=out, flush=True)
                    await trio.sleep(0.05)
                print("\r" + " " * 60 + "\r", end="", file=out, flush=True)
        for i, (prompt, seed) in enumerate(PROMPTS):
            say(f"   [{i + 1}] (seed {seed}) {prompt + texts[i]!r}")

        say("\n2. A stop string: the text ends before it, the engine is told to stop:")
        output = await llm.complete("Tea is", max_tokens=200, seed=4, stop=["."])
        completion = output.outputs[0]
        say(
            f"   {'Tea is' + completion.text!r} (finish_reason={completion.finish_reason!r}, "
            f"stop_reason={completion.stop_reason!r})"
        )

        say("\n3. Two samples of one prompt (n=2):")
        output = await llm.complete("The river", max_tokens=60, n=2, seed=8)
        for choice in output.outputs:
            say(f"   [{choice.index}] {'The river' + choice.text!r}")

        say("\n4. Cancelling a long generation after 0.3 s (move_on_after):")
        received = 0
        with trio.move_on_after(0.3):
            async with llm.generate("Structured", max_tokens=4000, seed=9) as outputs:
                async for output in outputs:
                    received = len(output.outputs[0].text)
        waiting, running = await client.get_request_counts()
        say(
            f"   received {received} characters, then left the block: the client sent "
            f"ABORT; the engine now has {waiting} waiting and {running} running requests."
        )

        say("\n5. Utility calls:")
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

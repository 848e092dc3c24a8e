"""Text in, text out: the built-in engine, its shipped tokenizer, and vLLM's text rules."""

import trio

from trio_enginecore import RequestOutputKind, SamplingParams
from trio_enginecore.errors import InvalidInputError
from trio_enginecore.text import open_llm


async def main() -> None:
    # No model directory: the built-in "ngram" engine and the tokenizer shipped for it.
    async with open_llm() as llm:
        # 1. The whole answer at once.
        output = await llm.complete("The river", max_tokens=60, seed=1, temperature=0.5)
        print("complete:", repr(output.prompt + output.outputs[0].text))

        # 2. Streaming: DELTA outputs carry the new text only (how much each carries
        # depends on how fast the engine and this reader are).
        params = SamplingParams(
            max_tokens=200, seed=4, stop=["."], output_kind=RequestOutputKind.DELTA
        )
        pieces = []
        async with llm.generate("Tea is", params) as outputs:
            async for output in outputs:
                pieces.append(output.outputs[0].text)
        print("stream:", repr("Tea is" + "".join(pieces)))
        choice = output.outputs[0]
        print(f"finished: {choice.finish_reason} on {choice.stop_reason!r}")

        # 3. Several samples of one prompt.
        output = await llm.complete("A good test", max_tokens=30, n=2, seed=3)
        for choice in output.outputs:
            print(f"sample {choice.index}: {choice.text!r}")

        # 4. A mistake is refused before anything is sent, naming the field.
        try:
            llm.generate("The river", stop=[42])  # type: ignore[list-item]
        except InvalidInputError as error:
            print(f"refused ({error.param}): {error}")


trio.run(main)

"""First steps: start the built-in engine, stream one generation, print the text."""

import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, RequestFailedError, open_engine_client
from trio_enginecore.engine import NgramModel


async def main() -> None:
    # The engine works on token ids, not text. The built-in "ngram" model is
    # byte-level, and its tokenizer is available in this process too.
    tokenizer = NgramModel()
    prompt = "The river"

    request = EngineCoreRequest.for_tokens(
        tokenizer.tokenize(prompt),
        request_id="first-steps-1",
        max_tokens=80,
        temperature=0.5,
        seed=1,
    )

    # Launch the engine as a child process and wait until it is ready.
    async with open_engine_client(EngineConfig(model="ngram")) as client:
        print(f"engine ready (pid {client.engine_pids[0]})")

        token_ids: list[int] = []
        finish_reason = None
        # Entering the block sends the request; the outputs arrive in order.
        async with client.stream(request) as outputs:
            async for output in outputs:
                token_ids.extend(output.new_token_ids)
                finish_reason = output.finish_reason

        print(f"generated {len(token_ids)} tokens, finish reason: {finish_reason}")
        print("text:", prompt + tokenizer.detokenize(token_ids))

        # A request the engine cannot serve makes its stream raise, with the reason.
        # The engine and the client go on serving everyone else.
        too_long = EngineCoreRequest.for_tokens(tokenizer.tokenize("la " * 2000))
        try:
            async with client.stream(too_long) as outputs:
                async for output in outputs:
                    token_ids.extend(output.new_token_ids)
        except RequestFailedError as exc:
            print("rejected:", exc.engine_message)
    # Leaving the block stopped the engine and cleaned everything up.
    print("engine stopped")


if __name__ == "__main__":
    trio.run(main)

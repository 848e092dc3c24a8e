"""First steps: start the built-in engine, stream one generation, print the text."""

import time

import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, SamplingParams, open_engine_client
from trio_enginecore.engine import NgramModel


async def main() -> None:
    # The engine works on token ids, not text. The built-in "ngram" model is
    # byte-level, and its tokenizer is available in this process too.
    tokenizer = NgramModel()
    prompt = "The river"

    request = EngineCoreRequest(
        request_id="first-steps-1",
        prompt_token_ids=tokenizer.tokenize(prompt),
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=80, temperature=0.5, seed=1),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
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
    # Leaving the block stopped the engine and cleaned everything up.
    print("engine stopped")


if __name__ == "__main__":
    trio.run(main)

"""Run text requests through vLLM's own ``AsyncLLM`` (the release installed), end to end.

Usage: ``async_llm_texts.py MODEL_DIR REQUESTS_JSON RESULTS_JSON``

``MODEL_DIR`` holds a ``config.json`` the counter executor can serve and a tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``). vLLM's
``AsyncLLM`` is built over it as ``vllm serve`` would build it, but with the interop
suite's settings (``common.engine_args``: dummy weights, float32, eager, the counter
executor) and with its tokenizer loaded (``skip_tokenizer_init=False``), so everything
from the prompt's token ids to the text is vLLM's: its input processor (which completes
the parameters from the tokenizer and ``generation_config.json``), its engine core
process, its output processor and detokenizer, and its per-request collector.

Each request of ``REQUESTS_JSON`` is ``{"id", "prompt_token_ids", "params"}``, the
parameters as ``SamplingParams`` keywords with ``output_kind`` by name (``"DELTA"``).
All requests run at once, each read by its own task that reads every output as it
comes. Writes ``{id: [output, ...]}`` to ``RESULTS_JSON``, each output
``{"finished", "outputs": [{"index", "text", "token_ids", "finish_reason",
"stop_reason"}]}``, and prints ``@{"event": "done", "requests": N, "vllm": version,
"ready_s": ..., "run_s": ...}``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

from common import exit_with_parent, say, vllm_config


def output_json(output: Any) -> dict[str, Any]:
    return {
        "finished": output.finished,
        "outputs": [
            {
                "index": completion.index,
                "text": completion.text,
                "token_ids": list(completion.token_ids),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            for completion in output.outputs
        ],
    }


async def run(model_dir: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.monotonic()
    # The tokenizer is vLLM's to load from the model directory; the engine core and its
    # executor are the suite's.
    config = vllm_config(model_dir, skip_tokenizer_init=False)
    llm = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
    ready_s = time.monotonic() - started

    async def read(llm: AsyncLLM, request: dict[str, Any]) -> list[dict[str, Any]]:
        # A reader that reads every output as it comes (what it misses, vLLM merges).
        params = dict(request["params"])
        params["output_kind"] = RequestOutputKind[params["output_kind"]]
        prompt = TokensPrompt(prompt_token_ids=list(request["prompt_token_ids"]))
        return [
            output_json(output)
            async for output in llm.generate(prompt, SamplingParams(**params), request["id"])
        ]

    try:
        running = time.monotonic()
        results = await asyncio.gather(*(read(llm, request) for request in requests))
        run_s = time.monotonic() - running
    finally:
        llm.shutdown()
        # Its __del__ shuts it down again: let that happen now, not at interpreter exit
        # (where it fails on a module already torn down, and logs a traceback).
        del llm
        gc.collect()
    return {
        "results": {request["id"]: seen for request, seen in zip(requests, results, strict=True)},
        "vllm": vllm.__version__,
        "ready_s": round(ready_s, 2),
        "run_s": round(run_s, 2),
    }


def main() -> int:
    model_dir, requests_path, results_path = sys.argv[1:4]
    exit_with_parent()
    requests = json.loads(Path(requests_path).read_text(encoding="utf-8"))
    outcome = asyncio.run(run(model_dir, requests))
    Path(results_path).write_text(json.dumps(outcome.pop("results")), encoding="utf-8")
    say(event="done", requests=len(requests), **outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())

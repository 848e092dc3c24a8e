"""Run text-layer cases through vLLM's own ``OutputProcessor`` (the release installed).

Usage: ``output_processor.py MODEL_DIR CASES_JSON RESULTS_JSON``

Each case (``tests/text/cases.py`` writes them) is registered as vLLM's ``AsyncLLM``
registers a request (with ``n > 1``: a ``ParentRequest`` and one child per sequence,
all sharing one ``RequestOutputCollector``), then its steps are fed to
``OutputProcessor.process_outputs`` one by one; after each step the collector is
drained, as a reader that keeps up would. The tokenizer is vLLM's (``get_tokenizer``
on the model directory: transformers' ``TokenizersBackend``, so the fast, DecodeStream
detokenizer). Writes, per case and step, the drained output and the engine requests
to abort, in the comparison form of ``tests/text/cases.py``; prints
``@{"event": "done", "cases": N, "vllm": version}``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import say


def main() -> None:
    model_dir, cases_path, results_path = sys.argv[1:4]
    import numpy as np
    import torch
    import vllm
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.detokenizer import uses_fast_detokenizer
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.engine.parallel_sampling import ParentRequest
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors

    tokenizer = get_tokenizer(model_dir)
    if not uses_fast_detokenizer(tokenizer):
        raise SystemExit(f"vLLM did not load a fast tokenizer: {type(tokenizer)}")
    cases = json.loads(Path(cases_path).read_text(encoding="utf-8"))

    def logprobs_json(positions: Any) -> Any:
        if positions is None:
            return None
        return [
            None
            if position is None
            else [[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in position.items()]
            for position in positions
        ]

    def output_json(output: Any) -> Any:
        if output is None:
            return None
        return {
            "finished": output.finished,
            "prompt_logprobs": logprobs_json(output.prompt_logprobs),
            "outputs": [
                {
                    "index": c.index,
                    "text": c.text,
                    "token_ids": list(c.token_ids),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "cumulative_logprob": c.cumulative_logprob,
                    "logprobs": logprobs_json(c.logprobs),
                }
                for c in output.outputs
            ],
        }

    def engine_output(request_id: str, raw: dict[str, Any]) -> Any:
        logprobs = raw.get("logprobs")
        prompt = raw.get("prompt_logprobs")
        finish = raw.get("finish_reason")
        return EngineCoreOutput(
            request_id=request_id,
            new_token_ids=list(raw["new_token_ids"]),
            new_logprobs=None
            if logprobs is None
            else LogprobsLists(
                np.array(logprobs["ids"], dtype=np.int32),
                np.array(logprobs["values"], dtype=np.float32),
                np.array(logprobs["ranks"], dtype=np.int32),
            ),
            new_prompt_logprobs_tensors=None
            if prompt is None
            else LogprobsTensors(
                torch.tensor(prompt["ids"], dtype=torch.int32),
                torch.tensor(prompt["values"], dtype=torch.float32),
                torch.tensor(prompt["ranks"], dtype=torch.int32),
            ),
            finish_reason=None if finish is None else FinishReason(finish),
            stop_reason=raw.get("stop_reason"),
        )

    started = time.monotonic()
    results = []
    for case in cases:
        params = dict(case["params"])
        params["output_kind"] = RequestOutputKind(params["output_kind"])
        sampling = SamplingParams(**params)
        request_id = f"case-{case['id']}"
        processor = OutputProcessor(tokenizer, log_stats=False)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(case["prompt_token_ids"]),
            mm_features=None,
            sampling_params=sampling,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=request_id,
        )
        queue = RequestOutputCollector(sampling.output_kind, request_id)
        if sampling.n == 1:
            ids = [request_id]
            processor.add_request(request, None, None, 0, queue)
        else:
            # As AsyncLLM fans out: the last child is the request itself.
            parent = ParentRequest(request)
            ids = []
            for index in range(sampling.n):
                child_id, child_params = parent.get_child_info(index)
                child = request if index == sampling.n - 1 else copy.copy(request)
                child.request_id = child_id
                child.sampling_params = child_params
                ids.append(child_id)
                processor.add_request(child, None, parent, index, queue)
        steps = []
        for step in case["steps"]:
            outcome = processor.process_outputs(
                [engine_output(ids[raw["index"]], raw) for raw in step]
            )
            steps.append(
                {
                    "output": output_json(queue.get_nowait()),
                    "abort": list(outcome.reqs_to_abort),
                }
            )
        results.append(steps)
    Path(results_path).write_text(json.dumps(results), encoding="utf-8")
    say(
        event="done",
        cases=len(cases),
        vllm=vllm.__version__,
        seconds=round(time.monotonic() - started, 2),
    )


if __name__ == "__main__":
    main()

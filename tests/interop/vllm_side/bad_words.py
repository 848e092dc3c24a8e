"""The token sequences vLLM's frontend makes of requests' ``bad_words`` (the release
installed). Usage: ``bad_words.py MODEL_DIR CASES_JSON RESULTS_JSON``

Each case is a list of words; vLLM's ``SamplingParams`` is made with them and updated
from vLLM's tokenizer of ``MODEL_DIR`` (``update_from_tokenizer``, as its
``InputProcessor`` does before sending a request). Writes, per case,
``{"ids": [[...], ...]}`` or ``{"error": "<the message>"}``; prints
``@{"event": "done", "cases": N}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import say


def main() -> None:
    model_dir, cases_path, results_path = sys.argv[1:4]
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(model_dir)
    results = []
    for words in json.loads(Path(cases_path).read_text(encoding="utf-8")):
        try:
            params = SamplingParams(bad_words=words)
            params.update_from_tokenizer(tokenizer)
        except (ValueError, VLLMValidationError) as exc:
            results.append({"error": str(exc)})
            continue
        results.append({"ids": params.bad_words_token_ids})
    Path(results_path).write_text(json.dumps(results), encoding="utf-8")
    say(event="done", cases=len(results))


if __name__ == "__main__":
    main()

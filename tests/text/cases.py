"""Random text-layer cases, run through our output processor (and, in the interop
session, through vLLM's own: ``tests/interop/vllm_side/output_processor.py``).

A case is plain JSON: a prompt (token ids), sampling parameters, and the engine's steps
(each a list of ``EngineCoreOutput`` s of the request's engine requests, with logprob
rows). Running a case gives, per step, what a reader that keeps up would receive (the
request's outputs of that step, merged as vLLM's one-slot collector merges them) and
the engine requests to abort. Both sides write that result in the same JSON form, so
the comparison is ``==``.

The streams are built to break things: text with multi-byte characters split across
tokens, lone byte pieces, special and added tokens, stop strings taken from the text
(spanning tokens, ending on a multi-byte character) and ones that never match, several
tokens per step (as speculative decoding sends), empty steps, outputs the engine sends
after the frontend found a stop string, every output kind, ``n > 1``, logprobs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from trio_enginecore.protocol import (
    EngineCoreOutput,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    RequestOutputKind,
    SamplingParams,
    Tensor,
)
from trio_enginecore.text import RequestOutput, TextRequestState, Tokenizer, load_tokenizer

from .tokenizers_for_tests import TRICKY_CORPUS

Case = dict[str, Any]

_EXTRA_TEXT = [
    "café ☕ naïve 🙂🙂 end.",
    "你好，世界！ 再见。",
    "### END ###",
    "stop! STOP. stop?",
    "🚀🚀🚀 launch 🚀",
    "ß ü ö ä Ü",
    " the the the ",
    "\n\n\t",
]


def _pieces(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    # Tokens whose text alone is a piece of a character (ends in U+FFFD), and the rest
    # of the ordinary vocabulary.
    added = set(tokenizer.added_tokens)
    pieces, plain = [], []
    for token_id in range(tokenizer.vocab_size):
        if token_id in added:
            continue
        (pieces if tokenizer.decode([token_id]).endswith("\ufffd") else plain).append(token_id)
    return pieces, plain


def _stream(
    rng: random.Random, tokenizer: Tokenizer, pools: tuple[list[int], list[int]]
) -> list[int]:
    pieces, plain = pools
    specials = sorted(tokenizer.added_tokens)
    tokens: list[int] = []
    target = rng.randint(1, 36)
    while len(tokens) < target:
        roll = rng.random()
        if roll < 0.6:
            text = rng.choice(TRICKY_CORPUS + _EXTRA_TEXT)
            start = rng.randrange(len(text))
            tokens += tokenizer.encode(
                text[start : start + rng.randint(1, 24)], add_special_tokens=False
            )
        elif roll < 0.75:
            tokens += rng.choices(pieces, k=rng.randint(1, 3))
        elif roll < 0.88:
            tokens.append(rng.choice(specials))
        else:
            tokens.append(rng.choice(plain))
    return tokens[: target + rng.randint(0, 4)]


def _stop_strings(rng: random.Random, text: str) -> list[str]:
    found: list[str] = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        roll = rng.random()
        if text and roll < 0.7:
            start = rng.randrange(len(text))
            candidate = text[start : start + rng.randint(1, 6)]
        elif roll < 0.85:
            candidate = rng.choice(["🙂", "é", "。", "##", "\n", "stop", " the", "<tool>", "</s>"])
        else:
            candidate = rng.choice(["never-there", "zzz", "Ω≈ç"])
        if candidate and candidate not in found:
            found.append(candidate)
    return found or ["never-there"]


def _logprob_rows(
    rng: random.Random, sampled: list[int], columns: int, vocab: int
) -> dict[str, Any]:
    ids, values, ranks = [], [], []
    for token_id in sampled:
        others = rng.sample(range(vocab), columns - 1)
        if rng.random() < 0.4 and columns > 1:
            others[0] = token_id  # the sampled token again, among the top-k
        ids.append([token_id, *others])
        values.append([round(-rng.random() * 8, 3) for _ in range(columns)])
        ranks.append(rng.randint(1, 50))
    return {"ids": ids, "values": values, "ranks": ranks}


def make_cases(tokenizer: Tokenizer, *, seed: int, count: int) -> list[Case]:
    """``count`` random cases over ``tokenizer``'s vocabulary, the same for a seed."""
    rng = random.Random(seed)
    pools = _pieces(tokenizer)
    vocab = tokenizer.vocab_size
    eos = tokenizer.eos_token_id
    assert eos is not None
    stop_id = tokenizer.generation_eos_token_ids[-1]
    cases: list[Case] = []
    for number in range(count):
        prompt = tokenizer.encode(rng.choice(TRICKY_CORPUS + _EXTRA_TEXT))
        if rng.random() < 0.25:
            # A prompt that ends inside a multi-byte character.
            prompt += rng.choices(pools[0], k=rng.randint(1, 2))
        n = rng.choice([1, 1, 1, 1, 2, 3])
        streams = [_stream(rng, tokenizer, pools) for _ in range(n)]
        whole_text = tokenizer.decode(streams[0], skip_special_tokens=rng.random() < 0.5)
        params: dict[str, Any] = {
            "n": n,
            "max_tokens": 64,
            "output_kind": rng.choice(list(RequestOutputKind)).value,
            "skip_special_tokens": rng.random() < 0.7,
            "spaces_between_special_tokens": rng.random() < 0.6,
            "include_stop_str_in_output": rng.random() < 0.3,
        }
        if rng.random() < 0.8:
            params["stop"] = _stop_strings(rng, whole_text)
        if rng.random() < 0.4:
            params["min_tokens"] = rng.randint(1, 8)
        if rng.random() < 0.35:
            params["logprobs"] = rng.choice([0, 1, 2, 3])
        if rng.random() < 0.15:
            params["prompt_logprobs"] = rng.choice([0, 1, 2])
        if rng.random() < 0.12:
            params["stream_interval"] = rng.choice([2, 3])
        if rng.random() < 0.15:
            params["stop_token_ids"] = [stop_id]
        ends = []
        for stream in streams:
            roll = rng.random()
            if roll < 0.35:
                stream.append(eos)
                ends.append((FinishReason.STOP.value, None))
            elif roll < 0.45 and params.get("stop_token_ids"):
                stream.append(stop_id)
                ends.append((FinishReason.STOP.value, stop_id))
            elif roll < 0.52:
                ends.append((FinishReason.ABORT.value, None))
            else:
                ends.append((FinishReason.LENGTH.value, None))
        # The engine's steps: each unfinished sequence gets 0 to 4 tokens per step.
        positions = [0] * n
        first = [True] * n
        steps: list[list[dict[str, Any]]] = []
        while any(pos <= len(s) for pos, s in zip(positions, streams, strict=True)):
            step: list[dict[str, Any]] = []
            for i, stream in enumerate(streams):
                if positions[i] > len(stream):
                    continue
                size = rng.choices([0, 1, 2, 3, 4], weights=[1, 14, 2, 1, 1])[0]
                new = stream[positions[i] : positions[i] + size]
                positions[i] += size
                output: dict[str, Any] = {"index": i, "new_token_ids": new}
                if positions[i] >= len(stream):
                    positions[i] = len(stream) + 1
                    output["finish_reason"], output["stop_reason"] = ends[i]
                if params.get("logprobs") is not None and new:
                    output["logprobs"] = _logprob_rows(rng, new, params["logprobs"] + 1, vocab)
                if first[i] and params.get("prompt_logprobs") is not None:
                    rows = _logprob_rows(rng, prompt[1:], params["prompt_logprobs"] + 1, vocab)
                    output["prompt_logprobs"] = rows
                first[i] = False
                step.append(output)
            rng.shuffle(step)
            steps.append(step)
        cases.append({"id": number, "prompt_token_ids": prompt, "params": params, "steps": steps})
    return cases


# ------------------------------------------------------------------ our side


def engine_output(request_id: str, raw: dict[str, Any]) -> EngineCoreOutput:
    """Our ``EngineCoreOutput`` of one case output."""
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
            Tensor("int32", np.array(prompt["ids"], dtype=np.int32)),
            Tensor("float32", np.array(prompt["values"], dtype=np.float32)),
            Tensor("int32", np.array(prompt["ranks"], dtype=np.int32)),
        ),
        finish_reason=None if finish is None else FinishReason(finish),
        stop_reason=raw.get("stop_reason"),
    )


def _logprobs_json(positions: Any) -> Any:
    if positions is None:
        return None
    return [
        None
        if position is None
        else [
            [token_id, lp.logprob, lp.rank, lp.decoded_token] for token_id, lp in position.items()
        ]
        for position in positions
    ]


def output_json(output: RequestOutput | None) -> Any:
    """One drained output in the comparison form (vLLM's side writes the same)."""
    if output is None:
        return None
    return {
        "finished": output.finished,
        "prompt_logprobs": _logprobs_json(output.prompt_logprobs),
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "cumulative_logprob": c.cumulative_logprob,
                "logprobs": _logprobs_json(c.logprobs),
            }
            for c in output.outputs
        ],
    }


def run_case(
    case: Case, tokenizer: Tokenizer, *, repair_text: bool = True, repairs: set[str] | None = None
) -> list[dict[str, Any]]:
    """Our output processor on ``case``: per step, the drained output and the aborts.

    ``repair_text=False`` reproduces vLLM's two text mistakes; ``repairs`` collects the
    names of the repairs that changed something (``"prompt_leak"``, ``"finish_flush"``).
    """
    kind = RequestOutputKind(case["params"]["output_kind"])
    params = SamplingParams(**{**case["params"], "output_kind": kind})
    request_id = f"case-{case['id']}"
    state = TextRequestState(
        request_id, None, list(case["prompt_token_ids"]), params, tokenizer, repair_text=repair_text
    )
    ids = state.engine_request_ids
    delta = params.output_kind is RequestOutputKind.DELTA
    results = []
    for step in case["steps"]:
        slot: RequestOutput | None = None
        aborts = []
        for raw in step:
            engine_id = ids[raw["index"]]
            if state.sequence(engine_id).finished:
                continue
            out, abort = state.process(engine_output(engine_id, raw))
            if abort:
                aborts.append(engine_id)
            if out is not None:
                if slot is None:
                    slot = out
                else:
                    slot.add(out, aggregate=delta)
        results.append({"output": output_json(slot), "abort": aborts})
    if repairs is not None:
        for engine_id in ids:
            detokenizer = state.sequence(engine_id).detokenizer
            if detokenizer.repaired_prompt_leak:
                repairs.add("prompt_leak")
            if detokenizer.flushed_at_finish:
                repairs.add("finish_flush")
    return results


def tokenizer_at(directory: Path) -> Tokenizer:
    return load_tokenizer(directory)

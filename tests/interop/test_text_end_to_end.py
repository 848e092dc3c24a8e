"""Our text layer over vLLM's real engine core writes the text vLLM's own AsyncLLM writes.

A differential test, end to end. The same text requests (prompt token ids and sampling
parameters) are served twice, each time by vLLM's ``EngineCoreProc`` with the interop
suite's counter executor (``vllm_side/fake_executor.py``: the next token is the last one
plus one, modulo the vocabulary):

- by vLLM's ``AsyncLLM``, in the vLLM environment (``vllm_side/async_llm_texts.py``):
  vLLM's input processor, engine core client, output processor, detokenizer and
  per-request collector, with the tokenizer vLLM loads from the model directory;
- by our :class:`trio_enginecore.text.AsyncLLM` over our client attached to a headless
  vLLM engine core (``engines.vllm_engine``), with the tokenizer we load from the same
  directory.

The model directory holds the suite's tiny llama with a tricky tokenizer
(``tests/text/tokenizers_for_tests.write_tricky_dir``: a trained byte-level BPE of 422
tokens, with pieces of multi-byte characters, special tokens and added tokens; EOS
``</s>`` is 1 and ``generation_config.json`` adds ``<|im_end|>``, 3, as a second EOS).
Its ``vocab_size`` is the tokenizer's, so the counter walks through split characters,
lone bytes, added tokens and, past the last id, the special tokens and EOS.

What is compared, per request and per sequence (``CompletionOutput.index``): the token
ids, ``finish_reason`` and ``stop_reason``, and the text. A reader that falls behind
gets outputs merged (both sides merge, each its own way), so the readers' outputs are
compared as what the reader knew: the text and token ids so far (the concatenation of
``DELTA`` outputs, the latest ``CUMULATIVE`` one), at the end and at every point (number
of tokens) both readers saw. A 20 ms model step lets both readers keep up, so most
points are seen on both sides. Every request also states what it finishes on, so that
a case cannot drift into one that tests nothing (the stop strings are read off the
counter's text, which is the tokenizer's decoding of consecutive ids).

Our text differs from vLLM's where vLLM 0.33 and 0.34 get it wrong, and only there
(``trio_enginecore/text/_detokenizer.py``):

- a prompt that ends inside a character: vLLM's first text repeats the prompt's text
  (``leaks``); ours is vLLM's without it;
- complete characters the decoder holds at the finish (a token that ends with the
  first bytes of a character): vLLM drops them (``held``); ours has them at the end.

What follows from them beyond the text is pinned too: a stop string found only in the
prompt text vLLM repeats ends vLLM's request at once (ours runs on), and a stop string
that the held characters complete ends ours on it (``our_finish``) where vLLM's ends on
its length.

Whose is a U+FFFD at the prompt's end? The prompt's, unless the output completes the
character it stands for: the output's text is what ``decode(prompt + output)`` adds to
what it has in common with ``decode(prompt)``. So a prompt that ends in a stray byte,
or in the first bytes of a character the output breaks (a space follows them), keeps
its U+FFFD, and the output starts after it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_enginecore import RequestOutputKind, SamplingParams
from trio_enginecore.text import AsyncLLM, RequestOutput, Tokenizer, load_tokenizer

from ..text.tokenizers_for_tests import write_tricky_dir
from .engines import vllm_engine
from .support import newest_release_only, require_vllm, trouble_lines, vllm_process

require_vllm()
newest_release_only("our text layer is held to vLLM's newest AsyncLLM")

STEP_S = 0.02
"""The counter model's step: slow enough for both readers to see (nearly) every step."""


@dataclass(frozen=True)
class Case:
    """One text request, what it finishes on, and where vLLM's text is wrong."""

    id: str
    prompt: list[int]
    params: dict[str, Any]
    """``SamplingParams`` keywords, ``output_kind`` by name."""
    finish: tuple[str, str | int | None]
    """``(finish_reason, stop_reason)`` of every sequence."""
    leaks: str = ""
    """The prompt's text, which vLLM's first text repeats (the prompt's text ends in
    U+FFFD: the prompt ends inside a character, or in a byte that is none)."""
    held: str = ""
    """The complete characters vLLM drops at the finish (held by its decoder)."""
    our_finish: tuple[str, str | int | None] | None = None
    """Ours, where our text changes it (default: :attr:`finish`, vLLM's)."""

    @property
    def kind(self) -> str:
        return str(self.params["output_kind"])


LENGTH = ("length", None)
EOS = ("stop", None)

# Token ids of the tricky tokenizer that the cases start from (the counter's next token
# is the last prompt token plus one):
# 313 ' hello' -> ' ca', 'и'+0xD1, ' do', ' la', ' the' (318), ' ≈', 'Line', 'stop', '字',
#     '本', ' ###', '15', '414', 'EN', 'Em', 'Gr'+0xC3 (329), 'Ma', 'Na', ...
# 270 'er' -> 'll', 'r'+0xC3, 0xCE 0xB1 (alpha), 'и', 0xE6 0x96, 0xEF 0xBC, ' b', ...
# 333 'The' -> 'TOP', 'ab', 'ag', 'ain', 'ber', 'ck', 'de', 'fé', 'ick', 'ji', 'ld', 'lé',
#     'me', 'mp', 'maß' (15th), 'nd', ..., 'raß' (24th), ...
# 395 'ïve' -> Greek and Cyrillic letters, some split across tokens ('λ' and 0xCE:
#     the 2nd), then '你', '好', 0xE6 0x97, 0xE7 0x95, '語', ...
# 410 '\n\n' -> ' 1', ' 3', ' e', ... ' n', '<tool>', '[[sep]]' (added, 420 and 421),
#     '<s>' (0), '</s>' (1, EOS), '<|im_start|>' (2), '<|im_end|>' (3, EOS too), '!', ...
# 260 is 0xF0 0x9F (an emoji's first two bytes), 259 is 0xAD (a continuation byte
# alone), 380 is 0xAE 0xE3 0x83 (a stray byte, then a Japanese character's first two).
CASES = [
    Case("cumulative", [333], {"max_tokens": 12, "output_kind": "CUMULATIVE"}, LENGTH),
    Case(
        "delta through split characters",
        [333, 270],
        {"max_tokens": 24, "output_kind": "DELTA"},
        LENGTH,
    ),
    Case(
        "stop string of one token",
        [313],
        {"max_tokens": 30, "stop": ["stop"], "output_kind": "CUMULATIVE"},
        ("stop", "stop"),
    ),
    Case(
        "stop string across two CJK tokens",
        [313],
        {"max_tokens": 30, "stop": ["字本"], "output_kind": "DELTA"},
        ("stop", "字本"),
    ),
    Case(
        "stop string across tokens, included",
        [313],
        {
            "max_tokens": 30,
            "stop": ["nestop"],
            "include_stop_str_in_output": True,
            "output_kind": "CUMULATIVE",
        },
        ("stop", "nestop"),
    ),
    Case(
        "stop string with a replacement character",
        [313],
        {"max_tokens": 30, "stop": ["\ufffdMa"], "output_kind": "FINAL_ONLY"},
        ("stop", "\ufffdMa"),
    ),
    Case(
        "the first stop string to appear",
        [333],
        {"max_tokens": 30, "stop": ["ß", "ckde"], "output_kind": "DELTA"},
        ("stop", "ckde"),
    ),
    Case(
        "a stop string that never matches is held back",
        [333],
        {"max_tokens": 10, "stop": ["zzzz"], "output_kind": "DELTA"},
        LENGTH,
    ),
    Case(
        "min_tokens passes a stop string",
        [333],
        {"max_tokens": 40, "stop": ["aß"], "min_tokens": 15, "output_kind": "DELTA"},
        ("stop", "aß"),
    ),
    Case(
        "min_tokens ends before the stop string",
        [333],
        {"max_tokens": 40, "stop": ["aß"], "min_tokens": 14, "output_kind": "CUMULATIVE"},
        ("stop", "aß"),
    ),
    Case("EOS", [410, 415], {"max_tokens": 20, "output_kind": "CUMULATIVE"}, EOS),
    Case(
        "EOS, special tokens in the text",
        [410, 415],
        {"max_tokens": 20, "skip_special_tokens": False, "output_kind": "DELTA"},
        EOS,
    ),
    Case(
        "ignore_eos runs through both EOS",
        [415],
        {
            "max_tokens": 16,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "output_kind": "FINAL_ONLY",
        },
        LENGTH,
    ),
    Case(
        "the second EOS is a stop token, included",
        [1],
        {
            "max_tokens": 10,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "output_kind": "CUMULATIVE",
        },
        ("stop", 3),
    ),
    # vLLM's scheduler stops on EOS whatever min_tokens says (its sampler keeps EOS out
    # until then; the counter has none): the stop string is not looked for yet.
    Case(
        "min_tokens passes a stop string, then EOS",
        [419],
        {
            "max_tokens": 20,
            "min_tokens": 5,
            "stop": ["[[sep]]"],
            "skip_special_tokens": False,
            "output_kind": "DELTA",
        },
        EOS,
    ),
    Case(
        "n=2 with a seed, deltas, a stop string",
        [333],
        {"max_tokens": 20, "n": 2, "seed": 7, "stop": ["ber"], "output_kind": "DELTA"},
        ("stop", "ber"),
    ),
    Case(
        "n=2, cumulative, through split characters",
        [395],
        {"max_tokens": 14, "n": 2, "seed": 1, "output_kind": "CUMULATIVE"},
        LENGTH,
    ),
    Case(
        "n=2, final only, EOS",
        [410, 415],
        {
            "max_tokens": 20,
            "n": 2,
            "seed": 3,
            "skip_special_tokens": False,
            "output_kind": "FINAL_ONLY",
        },
        EOS,
    ),
    # The last token is 'λ' and a character's first byte: vLLM drops the 'λ'.
    Case(
        "held at the finish",
        [395],
        {"max_tokens": 2, "output_kind": "CUMULATIVE"},
        LENGTH,
        held="λ",
    ),
    Case(
        "held at the finish, deltas",
        [270],
        {"max_tokens": 2, "output_kind": "DELTA"},
        LENGTH,
        held="r",
    ),
    Case(
        "held at the finish, final only",
        [318],
        {"max_tokens": 11, "output_kind": "FINAL_ONLY"},
        LENGTH,
        held="Gr",
    ),
    # The held characters complete a stop string: ours finishes on it, where vLLM (which
    # never has them) finishes on the length.
    Case(
        "held at the finish, a stop string",
        [318],
        {"max_tokens": 11, "stop": ["Gr"], "output_kind": "CUMULATIVE"},
        LENGTH,
        our_finish=("stop", "Gr"),
    ),
    # The output breaks the prompt's last character (a space follows its first bytes).
    Case(
        "prompt ends inside a character",
        [333, 260],
        {"max_tokens": 6, "output_kind": "DELTA"},
        LENGTH,
        leaks="The\ufffd",
    ),
    Case(
        "prompt ends inside a character the output completes",
        [333, 277, 380],
        {"max_tokens": 10, "output_kind": "CUMULATIVE"},
        LENGTH,
        leaks="The b\ufffd",
    ),
    # Not inside a character, but vLLM's decoder cannot tell: its text ends in U+FFFD.
    Case(
        "prompt ends in a stray byte",
        [333, 259],
        {"max_tokens": 5, "output_kind": "FINAL_ONLY"},
        LENGTH,
        leaks="The\ufffd",
    ),
]

# vLLM looks for stop strings in the prompt text its first text repeats, and stops there,
# at once; ours never sees that text.
STOP_IN_THE_PROMPT = Case(
    "a stop string in the prompt's text only",
    [333, 260],
    {"max_tokens": 6, "stop": ["The"], "output_kind": "DELTA"},
    ("stop", "The"),
    leaks="The\ufffd",
    our_finish=LENGTH,
)
SAME_WITHOUT_THE_STOP_STRING = "prompt ends inside a character"


def _tiny_llama(vocab_size: int) -> dict[str, Any]:
    # The interop suite's llama (vllm_side/common.py): what vLLM's config needs, and
    # the layers, heads and hidden size the counter executor sizes its KV cache from.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "num_hidden_layers": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


# ---------------------------------------------------------------------- the two runs

Outputs = list[dict[str, Any]]
"""A reader's outputs: ``{"finished", "outputs": [{"index", "text", "token_ids",
"finish_reason", "stop_reason"}]}`` each, as ``async_llm_texts.py`` writes them."""


@dataclass
class Runs:
    tokenizer: Tokenizer
    vllm: dict[str, Outputs]
    ours: dict[str, Outputs]
    seconds: dict[str, float] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)


def _as_json(output: RequestOutput) -> dict[str, Any]:
    return {
        "finished": output.finished,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ],
    }


def _params(case: Case) -> SamplingParams:
    return SamplingParams(
        **{**case.params, "output_kind": RequestOutputKind[case.params["output_kind"]]}
    )


async def _run_ours(model_dir: Path, tmp_path: Path, runs: Runs) -> None:
    start = time.monotonic()
    async with vllm_engine("headless", tmp_path, model_dir=model_dir) as engine:
        runs.seconds["our client: vLLM engine core ready"] = engine.ready_s
        await engine.rpc("set_step_delay", STEP_S)
        llm = AsyncLLM(engine.client, runs.tokenizer)

        async def read(case: Case) -> None:
            seen: Outputs = []
            async with llm.generate(case.prompt, _params(case), request_id=case.id) as outputs:
                async for output in outputs:
                    seen.append(_as_json(output))
            runs.ours[case.id] = seen

        running = time.monotonic()
        async with trio.open_nursery() as nursery:
            for case in [*CASES, STOP_IN_THE_PROMPT]:
                nursery.start_soon(read, case)
        runs.seconds["our client: the requests"] = time.monotonic() - running
    runs.logs["headless engine core"] = engine.launcher.log()
    runs.seconds["our client: in all"] = time.monotonic() - start


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp_path = tmp_path_factory.mktemp("text")
    model_dir = write_tricky_dir(tmp_path / "model")
    tokenizer = load_tokenizer(model_dir)
    (model_dir / "config.json").write_text(json.dumps(_tiny_llama(tokenizer.vocab_size)))
    requests = [
        {"id": case.id, "prompt_token_ids": case.prompt, "params": case.params}
        for case in [*CASES, STOP_IN_THE_PROMPT]
    ]
    (tmp_path / "requests.json").write_text(json.dumps(requests), encoding="utf-8")
    results = tmp_path / "results.json"
    runs = Runs(tokenizer, {}, {})
    # vLLM's AsyncLLM starts while our side starts its engine core: the two starts
    # (10-20 s each here) overlap.
    start = time.monotonic()
    with vllm_process(
        "async_llm_texts.py",
        [str(model_dir), str(tmp_path / "requests.json"), str(results)],
        tmp_path / "async-llm.log",
        TRIO_ENGINECORE_FAKE_STEP_S=str(STEP_S),
    ) as theirs:
        trio.run(_run_ours, model_dir, tmp_path, runs)
        done = theirs.next_report(120)
        assert done["event"] == "done", done
    runs.logs["vLLM's AsyncLLM"] = theirs.log()
    runs.vllm = json.loads(results.read_text(encoding="utf-8"))
    runs.seconds["vLLM's AsyncLLM: ready"] = done["ready_s"]
    runs.seconds["vLLM's AsyncLLM: the requests"] = done["run_s"]
    runs.seconds["both runs"] = time.monotonic() - start
    return runs


# ---------------------------------------------------------------------- what a reader knew


@dataclass(frozen=True)
class Known:
    """What a reader knew of one sequence after one output."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: str | int | None


def _known(outputs: Outputs, kind: str) -> dict[int, list[Known]]:
    """Per sequence, what the reader knew after each output that carried it: deltas
    add up, every other kind replaces."""
    history: dict[int, list[Known]] = {}
    for output in outputs:
        for completion in output["outputs"]:
            before = history.setdefault(completion["index"], [])
            text, token_ids = completion["text"], tuple(completion["token_ids"])
            if kind == "DELTA" and before:
                text, token_ids = before[-1].text + text, before[-1].token_ids + token_ids
            before.append(
                Known(text, token_ids, completion["finish_reason"], completion["stop_reason"])
            )
    return history


_KNOWN_BUGS: dict[str, str] = {}


def _params_of(cases: list[Case]) -> list[Any]:
    return [
        pytest.param(
            case,
            id=case.id,
            marks=[]
            if case.id not in _KNOWN_BUGS
            else [pytest.mark.xfail(strict=True, reason=_KNOWN_BUGS[case.id])],
        )
        for case in cases
    ]


# ---------------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])
def test_the_same_tokens_and_finish_as_vllm(case: Case, runs: Runs) -> None:
    theirs, ours = runs.vllm[case.id], runs.ours[case.id]
    for outputs in (theirs, ours):
        # Only the last output is finished; FINAL_ONLY has only that one.
        assert [o["finished"] for o in outputs] == [False] * (len(outputs) - 1) + [True]
        if case.kind == "FINAL_ONLY":
            assert len(outputs) == 1
    their_seqs, our_seqs = _known(theirs, case.kind), _known(ours, case.kind)
    assert sorted(our_seqs) == sorted(their_seqs) == list(range(case.params.get("n", 1)))
    for index, their_history in their_seqs.items():
        their_last, our_last = their_history[-1], our_seqs[index][-1]
        assert our_last.token_ids == their_last.token_ids
        assert (their_last.finish_reason, their_last.stop_reason) == case.finish
        assert (our_last.finish_reason, our_last.stop_reason) == (case.our_finish or case.finish)


@pytest.mark.parametrize("case", _params_of(CASES))
def test_the_same_text_as_vllm_but_for_its_two_mistakes(case: Case, runs: Runs) -> None:
    their_seqs = _known(runs.vllm[case.id], case.kind)
    our_seqs = _known(runs.ours[case.id], case.kind)

    def repaired(text: str) -> str:
        # vLLM's leak comes with its first text, whole.
        assert text == "" or text.startswith(case.leaks), (text, case.leaks)
        return text.removeprefix(case.leaks)

    for index, their_history in their_seqs.items():
        our_history = our_seqs[index]
        assert our_history[-1].text == repaired(their_history[-1].text) + case.held
        # At every point both readers saw before the finish, the same text (the
        # held-back end of a stop string included).
        theirs = {k.token_ids: k.text for k in their_history[:-1]}
        for known in our_history[:-1]:
            if known.token_ids in theirs:
                assert known.text == repaired(theirs[known.token_ids]), known.token_ids


def test_a_stop_string_in_the_prompts_text_ends_only_vllms_request(runs: Runs) -> None:
    case = STOP_IN_THE_PROMPT
    (theirs,) = _known(runs.vllm[case.id], case.kind).values()
    (ours,) = _known(runs.ours[case.id], case.kind).values()
    # vLLM: stopped by the prompt's "The" in its first text, cut to nothing.
    assert theirs[-1] == Known("", (261, 262), "stop", "The")
    # Ours: what the same request without the stop string gives.
    (same,) = _known(runs.ours[SAME_WITHOUT_THE_STOP_STRING], "DELTA").values()
    assert ours[-1] == same[-1]
    assert (ours[-1].finish_reason, ours[-1].stop_reason) == case.our_finish


def test_both_readers_kept_up(runs: Runs, timings: dict[str, float]) -> None:
    """Most points of the streamed requests were seen by both readers, so the
    comparison above is of the outputs one by one, not only of the final ones."""
    timings.update({f"text end to end: {k}": v for k, v in runs.seconds.items()})
    seen = both = 0
    for case in CASES:
        if case.kind == "FINAL_ONLY":
            continue
        their_points = {
            (i, k.token_ids) for i, h in _known(runs.vllm[case.id], case.kind).items() for k in h
        }
        our_points = {
            (i, k.token_ids) for i, h in _known(runs.ours[case.id], case.kind).items() for k in h
        }
        seen += len(their_points | our_points)
        both += len(their_points & our_points)
    assert both >= 0.8 * seen, (both, seen)


def test_no_trouble_in_vllms_logs(runs: Runs) -> None:
    for name, log in runs.logs.items():
        assert trouble_lines(log) == [], f"{name}:\n{log[-4000:]}"

"""Our text layer makes a request's ``bad_words`` into the token sequences vLLM's
frontend makes of them, case by case (vLLM's ``SamplingParams.update_from_tokenizer``
with vLLM's tokenizer of the same model directory, in the release's environment).

The engine bans what it is sent (``_bad_words_token_ids``): the words themselves never
reach it. The cases: words at random from the tokenizer's pieces, with multi-byte
characters, leading spaces, special tokens and repeats; a word of spaces only (no
token: refused); more than the 128 sequences the engine keeps (refused). Errors must
be vLLM's, word for word.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.text.tokenizers_for_tests import write_tricky_dir
from trio_enginecore.errors import InvalidInputError
from trio_enginecore.text import load_tokenizer
from trio_enginecore.text._inputs import bad_words_token_ids

from .support import newest_release_only, require_vllm, run_to_the_end

require_vllm()
newest_release_only("our text layer is held to vLLM's newest frontend")


def _cases(pieces: list[str], rng: random.Random) -> list[list[str]]:
    cases: list[list[str]] = []
    for _ in range(300):
        words = []
        for _ in range(rng.randint(1, 4)):
            word = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))
            words.append(rng.choice(["", " ", "  "]) + word)
        cases.append(words)
    cases += [
        ["   "],
        ["ok", " "],
        ["é", " é", "日本", "😀"],
        ["<|im_end|>", "x<|im_end|>"],
        ["same", "same"],
        [chr(0x4E00 + i) for i in range(129)],
        [f"w{i}" for i in range(64)],
        [f" w{i}" for i in range(70)],
    ]
    return cases


def test_bad_words_become_vllms_token_sequences(tmp_path: Path) -> None:
    model = write_tricky_dir(tmp_path / "model")
    tokenizer = load_tokenizer(model)
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    pieces = sorted(tokenizer.decode([i]) for i in vocab.values())
    cases = _cases([p for p in pieces if p.strip()], random.Random(20261207))
    cases_file, results_file = tmp_path / "cases.json", tmp_path / "results.json"
    cases_file.write_text(json.dumps(cases), encoding="utf-8")
    run_to_the_end(
        "bad_words.py", [str(model), str(cases_file), str(results_file)], tmp_path / "log", 300
    )
    theirs = json.loads(results_file.read_text(encoding="utf-8"))
    assert len(theirs) == len(cases)
    differences = []
    refused = 0
    for words, expected in zip(cases, theirs, strict=True):
        try:
            ours = {"ids": bad_words_token_ids(list(dict.fromkeys(words)), tokenizer)}
        except InvalidInputError as exc:
            ours = {"error": str(exc)}
            refused += 1
        if ours != expected:
            differences.append(f"{words!r}:\n  vLLM: {expected}\n  ours: {ours}")
    assert not differences, "\n".join(differences[:10])
    # Both refusals and long lists are among the cases.
    assert refused >= 3

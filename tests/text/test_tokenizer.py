"""A model directory's tokenizer: what is read, and the errors that name the file."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from trio_enginecore.errors import ModelDirectoryError
from trio_enginecore.text import (
    BUILTIN_TOKENIZER_DIR,
    Tokenizer,
    builtin_tokenizer,
    load_tokenizer,
)

from .tokenizers_for_tests import BYTE_EOS_ID, write_byte_level_dir


def test_the_shipped_ngram_tokenizer_is_what_the_generator_writes(tmp_path: Path) -> None:
    written = write_byte_level_dir(tmp_path / "ngram")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (BUILTIN_TOKENIZER_DIR / name).read_bytes() == (written / name).read_bytes(), name


def test_the_builtin_tokenizer_speaks_the_ngram_models_vocabulary() -> None:
    tokenizer = builtin_tokenizer()
    assert tokenizer.vocab_size == BYTE_EOS_ID + 1
    assert tokenizer.eos_token_id == BYTE_EOS_ID
    text = "Naïve café: 10 € 🙂"
    assert tokenizer.encode(text) == list(text.encode())
    assert tokenizer.decode([*text.encode(), BYTE_EOS_ID], skip_special_tokens=True) == text
    assert tokenizer.chat_template is not None
    assert builtin_tokenizer() is tokenizer  # read once per process


def test_a_directory_gives_eos_ids_template_and_limits(tricky_dir: Path) -> None:
    tokenizer = load_tokenizer(tricky_dir)
    assert tokenizer.eos_token == "</s>"
    assert tokenizer.eos_token_id == 1
    assert tokenizer.generation_eos_token_ids == (1, 3)
    assert tokenizer.model_max_length == 2048
    assert tokenizer.added_tokens[420] == "<tool>"


def copy_of(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def edit_json(path: Path, **changes: object) -> None:
    value = json.loads(path.read_text())
    value.update(changes)
    path.write_text(json.dumps(value))


def test_chat_template_jinja_is_read_when_the_config_has_none(
    tricky_dir: Path, tmp_path: Path
) -> None:
    model = copy_of(tricky_dir, tmp_path)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_tokenizer(model).chat_template == "{{ messages[0]['content'] }}"


def test_named_chat_templates_give_the_default(tricky_dir: Path, tmp_path: Path) -> None:
    model = copy_of(tricky_dir, tmp_path)
    edit_json(
        model / "tokenizer_config.json",
        chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    )
    assert load_tokenizer(model).chat_template == "D"


def test_only_the_tokenizer_file_is_required(tricky_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "bare"
    model.mkdir()
    shutil.copy(tricky_dir / "tokenizer.json", model)
    tokenizer = load_tokenizer(model)
    assert tokenizer.eos_token_id is None
    assert tokenizer.chat_template is None


@pytest.mark.parametrize(
    ("breakage", "file", "words"),
    [
        ("no directory", "", "does not exist"),
        ("no tokenizer.json", "tokenizer.json", "is missing"),
        ("tokenizer.json not a tokenizer", "tokenizer.json", "cannot be loaded"),
        ("config not JSON", "tokenizer_config.json", "not valid JSON"),
        ("config a list", "tokenizer_config.json", "JSON object"),
        ("eos not in the vocabulary", "tokenizer_config.json", "not a token"),
        ("template not a string", "tokenizer_config.json", "'chat_template' must be"),
        ("eos ids not ids", "generation_config.json", "'eos_token_id' must be"),
        ("generation config not UTF-8", "generation_config.json", "not UTF-8"),
    ],
)
def test_a_broken_directory_names_the_file_and_what_is_wrong(
    tricky_dir: Path, tmp_path: Path, breakage: str, file: str, words: str
) -> None:
    model = copy_of(tricky_dir, tmp_path)
    if breakage == "no directory":
        model = tmp_path / "nowhere"
    elif breakage == "no tokenizer.json":
        (model / "tokenizer.json").unlink()
    elif breakage == "tokenizer.json not a tokenizer":
        (model / "tokenizer.json").write_text('{"model": 3}')
    elif breakage == "config not JSON":
        (model / "tokenizer_config.json").write_text("{'single': quotes}")
    elif breakage == "config a list":
        (model / "tokenizer_config.json").write_text("[]")
    elif breakage == "eos not in the vocabulary":
        edit_json(model / "tokenizer_config.json", eos_token="<|no such token|>")
    elif breakage == "template not a string":
        edit_json(model / "tokenizer_config.json", chat_template=7)
    elif breakage == "eos ids not ids":
        edit_json(model / "generation_config.json", eos_token_id=["</s>"])
    elif breakage == "generation config not UTF-8":
        (model / "generation_config.json").write_bytes(b'{"eos_token_id": "\xff"}')
    with pytest.raises(ModelDirectoryError, match=words) as caught:
        load_tokenizer(model)
    assert str(caught.value.path).endswith(file or "nowhere")
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encoding_without_the_gil_gives_the_same_ids(
    tricky: Tokenizer, add_special_tokens: bool
) -> None:
    for text in ("", "hello", " spaced  out ", "é日本😀<|im_end|>x", "mixed " * 500):
        assert tricky.encode_without_gil(
            text, add_special_tokens=add_special_tokens
        ) == tricky.encode(text, add_special_tokens=add_special_tokens)


async def test_a_long_text_encoded_in_a_worker_thread_leaves_the_event_loop_running() -> None:
    # encode() holds the GIL through the whole text: from a worker thread, the loop
    # barely turns meanwhile. encode_without_gil() lets it run: measured side by side,
    # the other task turns many times more while the same amount of text is encoded.
    tokenizer = builtin_tokenizer()
    rng = random.Random()
    letters = "abcdefghijklmnopqrstuvwxyz"

    def fresh_text() -> str:
        # Words never seen before: the tokenizer caches the words it encoded.
        return " ".join("".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(80_000))

    async def turns_while(encode: Callable[[str], list[int]]) -> int:
        text = fresh_text()
        turns = 0
        done = False

        async def count_turns() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await trio.lowlevel.checkpoint()

        def run() -> tuple[list[int], int]:
            before = turns
            ids = encode(text)
            return ids, turns - before

        async with trio.open_nursery() as nursery:
            nursery.start_soon(count_turns)
            ids, counted = await trio.to_thread.run_sync(run)
            done = True
        assert ids == tokenizer.encode(text)
        return counted

    holding = await turns_while(tokenizer.encode)
    releasing = await turns_while(tokenizer.encode_without_gil)
    assert releasing > 10 * max(holding, 100), (releasing, holding)

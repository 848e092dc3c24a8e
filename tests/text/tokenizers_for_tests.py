"""Tokenizers built here, with the ``tokenizers`` package, for the text layer's tests.

* :func:`write_byte_level_dir`: the built-in ``ngram`` model's tokenizer (ids 0-255 are
  the bytes, 256 is ``<|endoftext|>``), which the package ships in
  ``trio_enginecore/text/_ngram_tokenizer``; a test checks the shipped files are what
  this writes.
* :func:`write_tricky_dir`: a small trained byte-level BPE whose vocabulary holds pieces
  of multi-byte characters (accents, CJK, emoji split across tokens) and several special
  tokens, for differential tests against vLLM's own output processor.

Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTE_EOS = "<|endoftext|>"
BYTE_EOS_ID = 256

NGRAM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _byte_symbols() -> dict[int, str]:
    # GPT-2's table: every byte as one printable character (printable bytes stand for
    # themselves, the rest are shifted above U+00FF in order).
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(256 + shifted)
            shifted += 1
    return symbols


def _dump(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_byte_level_dir(directory: Path) -> Path:
    """Write the ``ngram`` model's tokenizer directory; return it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    symbols = _byte_symbols()
    assert set(symbols.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={s: b for b, s in symbols.items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BYTE_EOS, special=True)])
    assert tokenizer.token_to_id(BYTE_EOS) == BYTE_EOS_ID
    # Sorted keys and fixed indentation: the shipped file is byte-for-byte reproducible.
    _dump(directory / "tokenizer.json", json.loads(tokenizer.to_str()))
    _dump(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": BYTE_EOS,
            "pad_token": BYTE_EOS,
            "model_max_length": 4096,
            "clean_up_tokenization_spaces": False,
            "chat_template": NGRAM_CHAT_TEMPLATE,
        },
    )
    _dump(directory / "generation_config.json", {"eos_token_id": BYTE_EOS_ID})
    return directory


TRICKY_SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TRICKY_ADDED_TOKENS = ["<tool>", "[[sep]]"]

TRICKY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Naïve café owners serve crème brûlée à la carte.",
    "Größe, Straße, Übermaß: ß und ü.",
    "日本語のテキストと漢字、そして絵文字。",
    "中文文本：你好，世界！",
    "Emoji: 🙂 🚀 👍🏽 🇫🇷 ❤️ 🧪",
    "Math: ∑ x² ≤ ∞, π ≈ 3.14159, √2 ≈ 1.414",
    "stop STOP stop! ### END ### done.",
    "Line one\nLine two\n\n  indented\ttab",
    "Ελληνικά γράμματα και Кириллица тоже.",
    "hello world hello there hello again",
    "a b c d e f g h i j k l m n o p",
]


def write_tricky_dir(directory: Path, *, vocab_size: int = 420) -> Path:
    """Write a trained byte-level BPE with multi-byte pieces and special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TRICKY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRICKY_CORPUS * 3, trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False) for token in TRICKY_ADDED_TOKENS])
    tokenizer.save(str(directory / "tokenizer.json"))
    _dump(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "</s>",
            "model_max_length": 2048,
            "clean_up_tokenization_spaces": False,
            "chat_template": NGRAM_CHAT_TEMPLATE,
        },
    )
    _dump(
        directory / "generation_config.json",
        {"eos_token_id": [tokenizer.token_to_id("</s>"), tokenizer.token_to_id("<|im_end|>")]},
    )
    return directory

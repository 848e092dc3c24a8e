"""Write a model directory for vLLM's Rust frontend whose tokens are our ngram model's.

Our engine's ``ngram`` model (``trio_enginecore/engine/_models.py``) is byte-level:
token ids 0-255 are the bytes 0-255 and 256 is EOS. This script builds the matching
Hugging Face ``tokenizer.json`` with the ``tokenizers`` package of the vLLM environment
(nothing is downloaded): a BPE model without merges over the 256 byte-level symbols
(GPT-2's byte-to-unicode alphabet, symbol of byte b = id b), the byte-level
pre-tokenizer and decoder, and ``<|endoftext|>`` as special token 256. Next to it a
``config.json`` (vllm-rs reads ``vocab_size`` and ``eos_token_id`` from it).

Prints ``@{"event": "written", "model_dir": ..., "vllm_rs": ..., ...}``: the directory,
the path of the ``vllm-rs`` binary of the installed vLLM wheel (found without importing
vLLM), and a round trip through the tokenizer as a self-check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import fail, say

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 256
VOCAB_SIZE = EOS_ID + 1


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte-to-unicode table: every byte as one printable character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(0xA1, 0xAC + 1),
        *range(0xAE, 0xFF + 1),
    ]
    symbols = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return symbols


def write_tokenizer(directory: Path) -> dict[str, object]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    symbols = byte_symbols()
    if set(symbols.values()) != set(pre_tokenizers.ByteLevel.alphabet()):
        fail("the byte-to-unicode table is not the tokenizers ByteLevel alphabet")
    tokenizer = Tokenizer(models.BPE(vocab={s: b for b, s in symbols.items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_ID:
        fail(f"{EOS_TOKEN} got id {tokenizer.token_to_id(EOS_TOKEN)}, not {EOS_ID}")
    tokenizer.save(str(directory / "tokenizer.json"))

    sample = "A nursery is a promise about time. Naïve café: 10 €"
    ids = tokenizer.encode(sample).ids
    return {
        "sample": sample,
        "ids_are_bytes": ids == list(sample.encode()),
        "decoded": tokenizer.decode([*ids, EOS_ID]),
        "vocab_size": tokenizer.get_vocab_size(),
    }


def write_model_dir(
    directory: Path, max_model_len: int = 4096
) -> tuple[Path, Path, dict[str, object]]:
    """Write the model to ``directory``; return it, the ``vllm-rs`` path and the check."""
    directory.mkdir(parents=True, exist_ok=True)
    check = write_tokenizer(directory)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "eos_token_id": EOS_ID,
        "max_position_embeddings": max_model_len,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    spec = importlib.util.find_spec("vllm")  # the package's location; vLLM not imported
    if spec is None or not spec.submodule_search_locations:
        fail("vllm is not installed in this environment")
    vllm_rs = Path(next(iter(spec.submodule_search_locations))) / "vllm-rs"
    if not vllm_rs.is_file():
        fail(f"this vLLM wheel has no {vllm_rs}")
    return directory, vllm_rs, check


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--directory", required=True)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    directory, vllm_rs, check = write_model_dir(Path(args.directory), args.max_model_len)
    say(event="written", model_dir=str(directory), vllm_rs=str(vllm_rs), check=check)
    return 0


if __name__ == "__main__":
    sys.exit(main())

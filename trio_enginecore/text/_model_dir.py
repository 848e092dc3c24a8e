"""A model's tokenizer, read from a local model directory (the text layer's only I/O).

What is read, and why each file:

* ``tokenizer.json``: the tokenizer itself, loaded with the ``tokenizers`` library (no
  ``transformers`` at run time). Required.
* ``tokenizer_config.json``: the special tokens by name (``eos_token``, ``bos_token``,
  ...), the chat template, ``model_max_length`` and ``clean_up_tokenization_spaces``.
  Optional; a file that is present must be valid.
* ``generation_config.json``: the model's extra EOS ids (``eos_token_id``, an int or a
  list), which vLLM's frontend adds to every request's stop tokens. Optional.
* ``chat_template.jinja`` and ``chat_templates/NAME.jinja``: the chat templates, in the
  layout transformers 5 writes; as in transformers 5, when any of these files exists
  they replace ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
  named templates). Optional.
* ``config.json``: only ``vocab_size`` (its ``text_config``'s for a multimodal model),
  the bound vLLM's frontend puts on the token ids of sampling parameters. Optional.

Nothing is ever downloaded: the argument is a path. A file that is missing (where it
is required) or malformed raises :class:`~trio_enginecore.errors.ModelDirectoryError`
naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Final, cast

from ..errors import ModelDirectoryError
from ._tokenizer import Tokenizer, as_json_list, as_json_object

__all__ = ["BUILTIN_TOKENIZER_DIR", "builtin_tokenizer", "load_tokenizer"]

BUILTIN_TOKENIZER_DIR: Final = Path(__file__).parent / "_ngram_tokenizer"
"""The tokenizer of the reference engine's ``ngram`` model, shipped in the package: its
vocabulary is the model's (ids 0-255 are the bytes, 256 is ``<|endoftext|>``)."""


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the text layer needs the 'tokenizers' package (the 'text' extra): "
            "pip install '/path/to/trio-enginecore[text]'"
        ) from exc
    return tokenizers


def _read_json(path: Path) -> dict[str, object]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ModelDirectoryError(path, f"is not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise ModelDirectoryError(path, f"cannot be read ({exc.strerror or exc})") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelDirectoryError(
            path, f"is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from exc
    if not isinstance(value, dict):
        raise ModelDirectoryError(path, f"must hold a JSON object, not {type(value).__name__}")
    return cast("dict[str, object]", value)


def _token_text(value: object, path: Path, key: str) -> str | None:
    # A special token is written either as its text or as an AddedToken object.
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = cast("dict[str, object]", value).get("content")
        if isinstance(content, str):
            return content
    raise ModelDirectoryError(path, f"{key!r} must be a string or an object with 'content'")


_SPECIAL_TOKEN_KEYS: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirectoryError(path, f"cannot be read ({exc})") from exc


def _chat_templates(root: Path, config: dict[str, object], config_file: Path) -> dict[str, str]:
    # As transformers 5 reads them (PreTrainedTokenizerBase.from_pretrained): the
    # template files, when there are any, replace the config's templates altogether.
    files: dict[str, str] = {}
    if (root / "chat_template.jinja").is_file():
        files["default"] = _read_template(root / "chat_template.jinja")
    if (root / "chat_templates").is_dir():
        for path in sorted((root / "chat_templates").glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = _read_template(path)
    if files:
        return files
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    entries = as_json_list(value)
    if entries is None:
        raise ModelDirectoryError(
            config_file, "'chat_template' must be a string or a list of named templates"
        )
    # The named-templates form: [{"name": "default", "template": "..."}, ...].
    named: dict[str, str] = {}
    for entry in entries:
        item = as_json_object(entry)
        name = None if item is None else item.get("name")
        template = None if item is None else item.get("template")
        if not isinstance(name, str) or not isinstance(template, str):
            raise ModelDirectoryError(
                config_file,
                "'chat_template' must be a string or a list of named templates "
                '({"name": ..., "template": ...}, both strings)',
            )
        named[name] = template
    return named


def _template_tokens(config: dict[str, object], special: dict[str, str | None]) -> dict[str, str]:
    # transformers' special_tokens_map, which apply_chat_template passes to the
    # template: the named special tokens, plus the model-specific ones (the config's
    # other "*_token" keys holding a string or an AddedToken, and the
    # "extra_special_tokens" object), which nothing checks against the vocabulary.
    def text(value: object) -> str | None:
        if isinstance(value, str):
            return value
        item = as_json_object(value)
        if item is not None and item.get("__type") == "AddedToken":
            content = item.get("content")
            return content if isinstance(content, str) else None
        return None

    tokens = {key: token for key, token in special.items() if token is not None}
    for key, value in config.items():
        if key.endswith("_token") and key not in _SPECIAL_TOKEN_KEYS:
            token = text(value)
            if token is not None:
                tokens[key] = token
    extra = as_json_object(config.get("extra_special_tokens"))
    for key, value in (extra or {}).items():
        token = text(value)
        if token is not None:
            tokens[key] = token
    return tokens


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Read the tokenizer of the model directory ``directory`` (a local path only).

    Blocking (it reads files and parses the tokenizer, a few ms to a second for large
    vocabularies); call it before ``trio.run``, or through ``trio.to_thread.run_sync``.

    Raises:
        ModelDirectoryError: the directory or its ``tokenizer.json`` is missing, or a
            file is malformed; the message names the file and what is wrong.
        ImportError: the ``tokenizers`` package is not installed.
    """
    tokenizers = _import_tokenizers()
    root = Path(directory)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise ModelDirectoryError(
            root, f"{what} (give the path of a local model directory; nothing is downloaded)"
        )
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelDirectoryError(
            tokenizer_file,
            "is missing: the text layer reads 'fast' tokenizers (tokenizer.json) only",
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises a plain Exception
        raise ModelDirectoryError(tokenizer_file, f"cannot be loaded: {exc}") from exc

    config_file = root / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    special: dict[str, str | None] = {
        key: _token_text(config.get(key), config_file, key) for key in _SPECIAL_TOKEN_KEYS
    }
    for key, token in special.items():
        if token is not None and backend.token_to_id(token) is None:
            raise ModelDirectoryError(
                config_file, f"{key} {token!r} is not a token of tokenizer.json"
            )
    templates = _chat_templates(root, config, config_file)
    max_length = config.get("model_max_length")
    if max_length is not None and (
        not isinstance(max_length, int | float) or isinstance(max_length, bool) or max_length < 1
    ):
        raise ModelDirectoryError(config_file, "'model_max_length' must be a positive number")
    clean_up = config.get("clean_up_tokenization_spaces", False)
    if not isinstance(clean_up, bool):
        raise ModelDirectoryError(config_file, "'clean_up_tokenization_spaces' must be a boolean")

    generation_file = root / "generation_config.json"
    eos_ids: list[int] = []
    if generation_file.is_file():
        value = _read_json(generation_file).get("eos_token_id")
        listed = as_json_list(value)
        values: list[object] = [] if value is None else [value] if listed is None else listed
        for item in values:
            if type(item) is not int or item < 0:
                raise ModelDirectoryError(
                    generation_file, "'eos_token_id' must be a token id or a list of token ids"
                )
            eos_ids.append(item)
    return Tokenizer(
        backend,
        model_vocab_size=_model_vocab_size(root / "config.json"),
        directory=root,
        special_tokens=special,
        generation_eos_token_ids=eos_ids,
        chat_template=templates.get("default"),
        chat_templates=templates,
        template_tokens=_template_tokens(config, special),
        # Huge sentinel values (1e30) mean "no limit" in transformers' configs.
        model_max_length=(
            int(max_length) if isinstance(max_length, int | float) and max_length < 1e12 else None
        ),
        clean_up_tokenization_spaces=clean_up,
    )


def _model_vocab_size(path: Path) -> int | None:
    # transformers' text config: a multimodal model's ``text_config``, else the file.
    if not path.is_file():
        return None
    config = _read_json(path)
    text_config = as_json_object(config.get("text_config"))
    value = (text_config if text_config is not None else config).get("vocab_size")
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise ModelDirectoryError(path, "'vocab_size' must be a positive integer")
    return value


@cache
def builtin_tokenizer() -> Tokenizer:
    """The tokenizer of the reference engine's ``ngram`` model (shipped in the package).

    Loaded once per process.
    """
    return load_tokenizer(BUILTIN_TOKENIZER_DIR)

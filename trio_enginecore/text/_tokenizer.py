"""A model's tokenizer, read from a local model directory (the text layer's only I/O).

What is read, and why each file:

* ``tokenizer.json``: the tokenizer itself, loaded with the ``tokenizers`` library (no
  ``transformers`` at run time). Required.
* ``tokenizer_config.json``: the special tokens by name (``eos_token``, ``bos_token``,
  ...), the chat template, ``model_max_length`` and ``clean_up_tokenization_spaces``.
  Optional; a file that is present must be valid.
* ``generation_config.json``: the model's extra EOS ids (``eos_token_id``, an int or a
  list), which vLLM's frontend adds to every request's stop tokens. Optional.
* ``chat_template.jinja``: the chat template, where ``tokenizer_config.json`` has none
  (the layout transformers 5 writes). Optional.

Nothing is ever downloaded: the argument is a path. A file that is missing (where it
is required) or malformed raises :class:`~trio_enginecore.errors.ModelDirectoryError`
naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast, final

from ..errors import ModelDirectoryError

if TYPE_CHECKING:
    import tokenizers

__all__ = ["BUILTIN_TOKENIZER_DIR", "Tokenizer", "builtin_tokenizer", "load_tokenizer"]

BUILTIN_TOKENIZER_DIR: Final = Path(__file__).parent / "_ngram_tokenizer"
"""The tokenizer of the reference engine's ``ngram`` model, shipped in the package: its
vocabulary is the model's (ids 0-255 are the bytes, 256 is ``<|endoftext|>``)."""

# transformers' cleanup of spaces before punctuation (WordPiece-era models), applied by
# its decode() when tokenizer_config.json asks for it and the model is not a BPE.
_CLEANUPS: Final = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


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


def _as_object(value: object) -> dict[str, object] | None:
    # A JSON object, typed for the checks that follow (None if it is not one).
    return cast("dict[str, object]", value) if isinstance(value, dict) else None


def _as_list(value: object) -> list[object] | None:
    return cast("list[object]", value) if isinstance(value, list) else None


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


@final
class Tokenizer:
    """A model's tokenizer: encoding, decoding, its special tokens and chat template.

    Made by :func:`load_tokenizer` (a model directory) or :func:`builtin_tokenizer`.
    Its methods are plain, blocking calls into the ``tokenizers`` library (Rust); they
    are safe to call from several threads at once.

    Attributes:
        backend: the ``tokenizers.Tokenizer``.
        directory: the directory it was read from.
        eos_token_id: the id of ``eos_token`` (``tokenizer_config.json``), else the
            first id of ``generation_config.json``'s ``eos_token_id``; ``None`` if
            neither names one. vLLM's frontend tells the engine this id.
        generation_eos_token_ids: every id of ``generation_config.json``'s
            ``eos_token_id`` (empty without the file).
        chat_template: the Jinja chat template, if the directory has one.
        model_max_length: ``tokenizer_config.json``'s ``model_max_length``, if set.
        vocab_size: how many ids the tokenizer knows, added tokens included.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        directory: Path,
        special_tokens: dict[str, str | None],
        generation_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        model_max_length: int | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.directory = directory
        self.special_tokens = dict(special_tokens)
        self.generation_eos_token_ids = tuple(generation_eos_token_ids)
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        eos_token = special_tokens.get("eos_token")
        eos_id = None if eos_token is None else backend.token_to_id(eos_token)
        if eos_id is None and self.generation_eos_token_ids:
            eos_id = self.generation_eos_token_ids[0]
        self.eos_token_id: int | None = eos_id
        self._added_tokens: dict[int, str] = {
            token_id: token.content
            for token_id, token in backend.get_added_tokens_decoder().items()
        }
        model_type = type(backend.model).__name__
        # transformers cleans up spaces only for non-BPE models (it would corrupt BPE
        # text), and only when the directory asks for it.
        self._clean_up = clean_up_tokenization_spaces and model_type != "BPE"
        self.leading_space_marker = _leading_space_marker(backend)

    def __repr__(self) -> str:
        return f"<Tokenizer {str(self.directory)!r}, {self.vocab_size} tokens>"

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text, if the directory names one."""
        return self.special_tokens.get("eos_token")

    @property
    def added_tokens(self) -> dict[int, str]:
        """The added (special and user-defined) tokens: id -> text."""
        return dict(self._added_tokens)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text`` (with the BOS the model adds, if any)."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``, as transformers' ``decode`` gives it."""
        text: str = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (its raw piece), or ``None``."""
        token: str | None = self.backend.id_to_token(token_id)
        return token


def _leading_space_marker(backend: tokenizers.Tokenizer) -> str | None:
    # SentencePiece-style (Metaspace) vocabularies write a leading space as a marker
    # that decode() strips from a lone token; logprob texts restore it.
    try:
        config = _as_object(json.loads(backend.to_str()))
    except (ValueError, TypeError):  # pragma: no cover - tokenizers always serialises
        return None
    pre = _as_object(config.get("pre_tokenizer")) if config is not None else None
    if pre is None:
        return None
    for candidate in [pre, *(_as_list(pre.get("pretokenizers")) or [])]:
        found = _as_object(candidate)
        if found is not None and found.get("type") == "Metaspace":
            marker = found.get("replacement", "\u2581")
            return marker if isinstance(marker, str) else None
    return None


_SPECIAL_TOKEN_KEYS: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


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
    template: object = config.get("chat_template")
    entries = _as_list(template)
    if entries is not None:
        # The named-templates form: [{"name": "default", "template": "..."}, ...].
        named = [_as_object(entry) for entry in entries]
        template = next(
            (e.get("template") for e in named if e is not None and e.get("name") == "default"),
            None,
        )
    if template is not None and not isinstance(template, str):
        raise ModelDirectoryError(config_file, "'chat_template' must be a string")
    template_file = root / "chat_template.jinja"
    if template is None and template_file.is_file():
        try:
            template = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelDirectoryError(template_file, f"cannot be read ({exc})") from exc
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
        listed = _as_list(value)
        values: list[object] = [] if value is None else [value] if listed is None else listed
        for item in values:
            if type(item) is not int or item < 0:
                raise ModelDirectoryError(
                    generation_file, "'eos_token_id' must be a token id or a list of token ids"
                )
            eos_ids.append(item)
    return Tokenizer(
        backend,
        directory=root,
        special_tokens=special,
        generation_eos_token_ids=eos_ids,
        chat_template=template,
        # Huge sentinel values (1e30) mean "no limit" in transformers' configs.
        model_max_length=(
            int(max_length) if isinstance(max_length, int | float) and max_length < 1e12 else None
        ),
        clean_up_tokenization_spaces=clean_up,
    )


@cache
def builtin_tokenizer() -> Tokenizer:
    """The tokenizer of the reference engine's ``ngram`` model (shipped in the package).

    Loaded once per process.
    """
    return load_tokenizer(BUILTIN_TOKENIZER_DIR)

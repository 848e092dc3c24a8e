"""A model's tokenizer: encoding, decoding, its special tokens and chat template (pure:
a wrapper of a loaded ``tokenizers.Tokenizer``; reading a model directory is
:mod:`._model_dir`'s)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast, final

if TYPE_CHECKING:
    import tokenizers

__all__ = ["Tokenizer"]

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


def as_json_object(value: object) -> dict[str, object] | None:
    # A JSON object, typed for the checks that follow (None if it is not one).
    return cast("dict[str, object]", value) if isinstance(value, dict) else None


def as_json_list(value: object) -> list[object] | None:
    return cast("list[object]", value) if isinstance(value, list) else None


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
        chat_template: the Jinja chat template, if the directory has one (the one named
            ``"default"`` where it has several).
        chat_templates: every chat template of the directory, by name (transformers'
            named templates: ``"default"``, ``"tool_use"``, ...; a single template is
            ``"default"``). Empty if it has none.
        template_tokens: the special tokens a chat template sees as variables
            (transformers' ``special_tokens_map``): the named ones that are set
            (``bos_token``, ``eos_token``, ...) and the model-specific ones
            (``tokenizer_config.json``'s other ``*_token`` keys, ``image_token`` say).
        model_max_length: ``tokenizer_config.json``'s ``model_max_length``, if set.
        vocab_size: how many ids the tokenizer knows, added tokens included.
        model_vocab_size: how many ids the model scores (``config.json``'s
            ``vocab_size``, or its ``text_config``'s), else :attr:`vocab_size`. vLLM's
            frontend bounds the token ids of ``logit_bias``, ``stop_token_ids`` and
            ``allowed_token_ids`` by it; models often round it up past the tokenizer's.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        directory: Path,
        special_tokens: dict[str, str | None],
        generation_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        chat_templates: Mapping[str, str] | None = None,
        template_tokens: Mapping[str, str] | None = None,
        model_max_length: int | None = None,
        clean_up_tokenization_spaces: bool = False,
        model_vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.directory = directory
        self.special_tokens = dict(special_tokens)
        self.generation_eos_token_ids = tuple(generation_eos_token_ids)
        self.chat_template = chat_template
        if chat_templates is None:
            chat_templates = {} if chat_template is None else {"default": chat_template}
        self.chat_templates: dict[str, str] = dict(chat_templates)
        self.template_tokens: dict[str, str] = (
            dict(template_tokens)
            if template_tokens is not None
            else {key: token for key, token in special_tokens.items() if token is not None}
        )
        self.model_max_length = model_max_length
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.model_vocab_size: int = (
            self.vocab_size if model_vocab_size is None else model_vocab_size
        )
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
        config = _config_of(backend)
        self.leading_space_marker = _leading_space_marker(config)
        decoder = as_json_object(config.get("decoder")) if config is not None else None
        self.byte_level: bool = decoder is not None and decoder.get("type") == "ByteLevel"
        """Whether the decoder is byte-level (GPT-2 style): its stream decodes several
        tokens in one step exactly as one at a time."""
        self._completes: dict[tuple[int, bool], bool] = {}

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

    def encode_without_gil(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode`'s ids, computed with Python's GIL released.

        For long texts, from a worker thread (``trio.to_thread.run_sync``): ``tokenizers``
        holds the GIL through a single text's encoding (about 1.5 s for 2 MB of text
        with the built-in tokenizer) but releases it through a batch's, so the event
        loop keeps serving meanwhile. Costs a little more than :meth:`encode` on short
        texts.
        """
        [encoding] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``, as transformers' ``decode`` gives it."""
        text: str = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def completes_characters(self, token_id: int, skip_special_tokens: bool) -> bool:
        """Whether any text that ends with this token ends on a character boundary:
        its own text is not empty and does not end inside a character. Memoised."""
        key = (token_id, skip_special_tokens)
        known = self._completes.get(key)
        if known is None:
            try:
                alone = self.decode([token_id], skip_special_tokens=skip_special_tokens)
            except (OverflowError, TypeError):
                alone = ""
            known = self._completes[key] = bool(alone) and not alone.endswith("\ufffd")
        return known

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (its raw piece), or ``None``."""
        token: str | None = self.backend.id_to_token(token_id)
        return token


def _config_of(backend: tokenizers.Tokenizer) -> dict[str, object] | None:
    # The tokenizer's own JSON: where its pre-tokenizer and decoder are described.
    try:
        return as_json_object(json.loads(backend.to_str()))
    except (ValueError, TypeError):  # pragma: no cover - tokenizers always serialises
        return None


def _leading_space_marker(config: dict[str, object] | None) -> str | None:
    # SentencePiece-style (Metaspace) vocabularies write a leading space as a marker
    # that decode() strips from a lone token; logprob texts restore it.
    pre = as_json_object(config.get("pre_tokenizer")) if config is not None else None
    if pre is None:
        return None
    for candidate in [pre, *(as_json_list(pre.get("pretokenizers")) or [])]:
        found = as_json_object(candidate)
        if found is not None and found.get("type") == "Metaspace":
            marker = found.get("replacement", "\u2581")
            return marker if isinstance(marker, str) else None
    return None

"""Sample and prompt logprobs, with each token's text (pure: no I/O, no Trio).

An engine sends, per position, the sampled (or prompt) token's id and logprob and
rank, followed by the top-k alternatives. :class:`LogprobsDecoder` turns those rows
into one ``{token_id: Logprob}`` map per position, in the order vLLM builds it (the
chosen token first, then the alternatives by rank), each token's text decoded on its
own. A token whose text alone ends in U+FFFD (a piece of a multi-byte character) gets
the text it completes, decoded with up to four preceding chosen tokens as context, and
``""`` while the character is still incomplete.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, final

import msgspec

from ..protocol import LogprobsLists, LogprobsTensors

if TYPE_CHECKING:
    from ._tokenizer import Tokenizer

__all__ = ["Logprob", "LogprobsDecoder", "PromptLogprobs", "SampleLogprobs"]

_REPLACEMENT: Final = "\ufffd"
_CONTEXT: Final = 4  # enough preceding tokens for any UTF-8 character


class Logprob(msgspec.Struct, gc=False):
    """The logprob of one token at one position.

    Attributes:
        logprob: the log-probability.
        rank: the token's rank in the model's distribution (1 is the most likely).
        decoded_token: the token's text (``None`` when the request asked for no text).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per output position: token id -> :class:`Logprob`, the sampled token first."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt position (``None`` for the first token, which has no logprob)."""


@final
class LogprobsDecoder:
    """The logprobs of one sequence, as they accumulate.

    Args:
        tokenizer: for the tokens' texts; ``None`` for none (``decoded_token=None``).
        num_logprobs: alternatives per output position (``SamplingParams.logprobs``;
            -1 for all the engine sends), or ``None`` when not asked for.
        num_prompt_logprobs: the same for prompt positions.
        prompt_logprob_start: prompt positions before this one are not scored (their
            entries are ``None``).
    """

    __slots__ = (
        "_tokenizer",
        "cumulative_logprob",
        "logprobs",
        "num_logprobs",
        "num_prompt_logprobs",
        "prompt_logprobs",
    )

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        *,
        num_logprobs: int | None,
        num_prompt_logprobs: int | None,
        prompt_logprob_start: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        self.prompt_logprobs: PromptLogprobs | None = None
        if num_prompt_logprobs is not None:
            unscored: PromptLogprobs = [None] * (1 + prompt_logprob_start)
            self.prompt_logprobs = unscored

    def update(self, sample: LogprobsLists | None, prompt: LogprobsTensors | None) -> None:
        """Take one step's logprob rows."""
        if sample is not None and self.logprobs is not None:
            self._add_sample(sample)
        if prompt is not None and self.prompt_logprobs is not None:
            self._add_prompt(prompt)

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs gathered so far, forgotten here (delta outputs hand
        them out once, at the end of the prefill)."""
        gathered = self.prompt_logprobs
        if gathered:
            self.prompt_logprobs = []
        return gathered

    # ------------------------------------------------------------------ rows

    def _add_sample(self, rows: LogprobsLists) -> None:
        logprobs = self.logprobs
        assert logprobs is not None
        assert self.num_logprobs is not None
        tokenizer = self._tokenizer
        for ranks_row, logprobs_row, ids_row in zip(
            rows.sampled_token_ranks, rows.logprobs, rows.logprob_token_ids, strict=False
        ):
            ids: list[int] = ids_row.tolist()
            values: list[float] = logprobs_row.tolist()
            texts: Iterable[str | None]
            if tokenizer is None:
                texts = itertools.repeat(None)
            else:
                texts = self._texts(tokenizer, ids, _chosen_ids(logprobs))
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += values[0]
            logprobs.append(_position(ids, values, int(ranks_row), texts, self.num_logprobs))

    def _add_prompt(self, tensors: LogprobsTensors) -> None:
        prompt_logprobs = self.prompt_logprobs
        assert prompt_logprobs is not None
        assert self.num_prompt_logprobs is not None
        tokenizer = self._tokenizer
        ids_rows: list[list[int]] = _values(tensors.logprob_token_ids).tolist()
        value_rows: list[list[float]] = _values(tensors.logprobs).tolist()
        ranks: list[int] = _values(tensors.selected_token_ranks).tolist()
        for ids, values, rank in zip(ids_rows, value_rows, ranks, strict=False):
            texts: Iterable[str | None]
            if tokenizer is None:
                texts = itertools.repeat(None)
            else:
                texts = self._texts(tokenizer, ids, _chosen_ids(prompt_logprobs))
            prompt_logprobs.append(_position(ids, values, rank, texts, self.num_prompt_logprobs))

    @staticmethod
    def _texts(tokenizer: Tokenizer, ids: Sequence[int], context: list[int]) -> list[str]:
        texts = [token_text(tokenizer, token_id) for token_id in ids]
        for i, text in enumerate(texts):
            if text.endswith(_REPLACEMENT):
                texts[i] = _completed_text(tokenizer, ids[i], context)
        return texts


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """The text of one token decoded alone, the leading spaces a SentencePiece
    vocabulary marks restored (a lone token's decode strips them)."""
    text = tokenizer.decode([token_id])
    marker = tokenizer.leading_space_marker
    if marker is None:
        return text
    raw = tokenizer.id_to_token(token_id) or ""
    markers = len(raw) - len(raw.lstrip(marker))
    if not markers:
        return text
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def _completed_text(tokenizer: Tokenizer, token_id: int, context: list[int]) -> str:
    # The text a piece of a multi-byte character completes, given the chosen tokens
    # before it; "" while the character is still incomplete.
    for size in range(1, min(len(context), _CONTEXT) + 1):
        before = context[-size:]
        together = tokenizer.decode([*before, token_id])
        if together.endswith(_REPLACEMENT):
            continue
        # Context tokens that were themselves pieces of this character gave "" when
        # they came: their bytes belong to this token's text.
        clean = len(before)
        while clean > 0 and tokenizer.decode([before[clean - 1]]).endswith(_REPLACEMENT):
            clean -= 1
        prefix = tokenizer.decode(before[:clean]) if clean else ""
        if together.startswith(prefix):
            return together[len(prefix) :]
        common = 0
        for a, b in zip(prefix, together, strict=False):
            if a != b:
                break
            common += 1
        return together[common:]
    return ""


def _chosen_ids(positions: Sequence[dict[int, Logprob] | None]) -> list[int]:
    # The chosen token of each of the last few positions (the first key of each map).
    return [next(iter(entry)) for entry in positions[-_CONTEXT:] if entry]


def _position(
    ids: list[int],
    values: list[float],
    rank: int,
    texts: Iterable[str | None],
    num_logprobs: int,
) -> dict[int, Logprob]:
    wanted = len(values) if num_logprobs == -1 else num_logprobs
    ranks = itertools.chain((rank,), range(1, wanted + 1))
    # A dict keeps the first position of a repeated id and the last value: the chosen
    # token found again among the top-k takes its top-k rank, as vLLM's map does.
    return {
        token_id: Logprob(value, token_rank, text)
        for token_id, value, token_rank, text in zip(ids, values, ranks, texts, strict=False)
    }


def _values(tensor: Any) -> Any:
    # Prompt logprobs come as Tensors (the wire's torch arrays) or numpy arrays.
    return getattr(tensor, "array", tensor)

"""The logprobs the reference engine sends, built as vLLM's model runner builds them
(pure: no I/O).

A request with ``SamplingParams.logprobs = k`` gets, on each output, one row per new
token (vLLM's ``LogprobsLists``): the sampled token first, with its logprob, then the
``k`` most likely tokens by rank; ``k = -1`` means the whole vocabulary. With
``logprob_token_ids`` the row holds those ids instead of the top ``k`` (after the
sampled token, as always). The sampled token's rank travels beside the row.

A request with ``prompt_logprobs = k`` gets, on its first output, one row per prompt
position after the first (vLLM's ``LogprobsTensors``): the prompt token there with
its logprob, then the top ``k``, each row scoring the token that follows the prompt up
to it. Rows before ``prompt_logprob_start`` are left out, and a prompt with nothing to
score gets none. With ``prompt_logprob_token_ids`` (vLLM 0.34's ``[rows, ids]`` array)
the first output also carries ``prompt_token_id_logprobs``: row ``i`` scores its ids as
the token after the prompt up to position ``prompt_logprob_start + i``; a ``-1`` id
(padding), and a row past the prompt's last, score ``-inf``.

The values are the model's raw logprobs (vLLM's default ``logprobs_mode``,
``raw_logprobs``): the log-softmax of its logits before temperature, penalties and
top-k/top-p/min-p, so the sampling parameters change none of them (see
:meth:`~trio_enginecore.engine.Model.logprobs`). A token's rank is 1 + the tokens
more likely + the equally likely ones of smaller id, and the top ``k`` come in that
order. vLLM ranks a token below every token as likely as itself (it counts them all);
the two agree unless tokens tie.

On the wire: token ids as int32, logprobs as float32 and ranks as int64, as vLLM's
GPU sampler sends them. Each request gets rows of its own width (``k + 1``); vLLM pads
every row of a step to the widest request of the batch, which a frontend cuts back to
``k + 1``, so both read the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Final, SupportsIndex, overload

import numpy as np
import numpy.typing as npt

from ..protocol import LogprobsLists, LogprobsTensors, SamplingParams, Tensor
from ._models import Model, Score

__all__ = [
    "MAX_LOGPROB_TOKEN_IDS",
    "logprobs_problem",
    "prompt_logprobs",
    "prompt_token_id_logprobs",
    "sample_logprobs",
]

MAX_LOGPROB_TOKEN_IDS: Final = 128
"""The most ``logprob_token_ids`` a request may give (vLLM's limit)."""


def logprobs_problem(
    params: SamplingParams, vocab_size: int, max_logprobs: int, max_model_len: int
) -> str | None:
    """Why the engine cannot give the logprobs ``params`` asks for, in vLLM's words, or
    None. ``max_logprobs`` is the engine's limit (-1: the whole vocabulary)."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name, what in (("logprobs", "sample logprobs"), ("prompt_logprobs", "prompt logprobs")):
        wanted: int | None = getattr(params, name)
        if wanted:
            count = vocab_size if wanted == -1 else wanted
            if count > limit:
                return f"Requested {what} of {count}, which is greater than max allowed: {limit}"
    ids = params.logprob_token_ids
    if ids is not None:
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            return (
                f"Requested logprob_token_ids of length {len(ids)}, which is greater "
                f"than max allowed: {MAX_LOGPROB_TOKEN_IDS}"
            )
        invalid = [token_id for token_id in ids if not 0 <= token_id < vocab_size]
        if invalid:
            return (
                f"token_id(s) {invalid} in logprob_token_ids contain out-of-vocab token "
                f"ids. Vocabulary size: {vocab_size}"
            )
        if params.logprobs is not None and params.logprobs != len(ids):
            return (
                "When both logprobs and logprob_token_ids are set, logprobs must equal "
                f"len(logprob_token_ids). Got logprobs={params.logprobs}, "
                f"len(logprob_token_ids)={len(ids)}."
            )
    table = params.prompt_logprob_token_ids
    if table is not None:
        if table.ndim != 2 or 0 in table.shape or table.dtype.kind not in "iu":
            return (
                "prompt_logprob_token_ids must be a non-empty integer array of shape "
                "[num_rows, num_ids]."
            )
        rows, columns = table.shape
        if rows > max_model_len - 1:
            return (
                f"prompt_logprob_token_ids has {rows} rows, but a prompt has at most "
                f"{max_model_len - 1} scored rows (max_model_len - 1)."
            )
        if columns > limit:
            return (
                f"Requested {columns} token ids per row in prompt_logprob_token_ids, "
                f"which is greater than max allowed: {limit}. Set max_logprobs "
                f"(--max-logprobs) to at least {columns}."
            )
        if int(table.min()) < -1 or int(table.max()) >= vocab_size:
            return (
                "prompt_logprob_token_ids contain out-of-vocab token ids (-1 pads a "
                f"row). Vocabulary size: {vocab_size}"
            )
    start = params.prompt_logprob_start
    if start is not None:
        if params.prompt_logprobs is None and params.prompt_logprob_token_ids is None:
            return "prompt_logprob_start requires prompt_logprobs or prompt_logprob_token_ids."
        if start < 0:
            return "prompt_logprob_start must be non-negative."
    return None


def sample_logprobs(
    model: Model,
    token_ids: Sequence[int],
    token: int,
    *,
    top: int,
    ids: Sequence[int] | None,
) -> LogprobsLists:
    """The row of one sampled ``token`` after ``token_ids``: the token, then the
    ``top`` most likely tokens (``-1``: every one), or ``ids`` instead when given."""
    score = model.score(token_ids, token, top=_width(model, top), ids=ids)
    row_ids = np.empty((1, 1 + score.ids.size), dtype=np.int32)
    row_ids[0, 0] = token
    row_ids[0, 1:] = score.ids
    values = np.empty((1, 1 + score.ids.size), dtype=np.float32)
    values[0, 0] = score.logprob
    values[0, 1:] = score.logprobs
    return LogprobsLists(row_ids, values, np.array([score.rank], dtype=np.int64))


def prompt_logprobs(
    model: Model, prompt: Sequence[int], *, top: int, start: int
) -> LogprobsTensors | None:
    """The rows of ``prompt``'s positions ``start`` up to the one before last, each
    scoring the prompt token after it, with the ``top`` most likely tokens (``-1``:
    every one); None when no position is scored."""
    positions = range(max(start, 0), len(prompt) - 1)
    if not positions:
        return None
    width = _width(model, top)
    scores: list[Score] = [
        model.score(_Prefix(prompt, end + 1), prompt[end + 1], top=width) for end in positions
    ]
    columns = 1 + width
    row_ids = np.empty((len(scores), columns), dtype=np.int32)
    values = np.empty((len(scores), columns), dtype=np.float32)
    ranks = np.empty(len(scores), dtype=np.int64)
    for row, (end, score) in enumerate(zip(positions, scores, strict=True)):
        row_ids[row, 0] = prompt[end + 1]
        row_ids[row, 1:] = score.ids
        values[row, 0] = score.logprob
        values[row, 1:] = score.logprobs
        ranks[row] = score.rank
    return LogprobsTensors(
        Tensor.from_numpy(row_ids), Tensor.from_numpy(values), Tensor.from_numpy(ranks)
    )


def prompt_token_id_logprobs(
    model: Model, prompt: Sequence[int], table: npt.NDArray[Any], *, start: int
) -> Tensor:
    """The scores of ``table``'s ids (``[rows, ids]``, -1 for padding), row ``i`` as
    the token after ``prompt`` up to position ``start + i``: float32, ``-inf`` for
    padding and for rows past the prompt's last (which scores the token after it)."""
    scores = np.full(table.shape, -np.inf, dtype=np.float32)
    for row in range(min(table.shape[0], len(prompt) - 1 - start)):
        end = start + row
        ids = table[row]
        score = model.score(
            _Prefix(prompt, end + 1), prompt[end + 1], ids=np.maximum(ids, 0).tolist()
        )
        scores[row] = np.where(ids >= 0, score.logprobs, -np.inf)
    return Tensor.from_numpy(scores)


def _width(model: Model, top: int) -> int:
    # -1 asks for the whole vocabulary; no request gets more than that.
    return model.vocab_size if top == -1 else min(top, model.vocab_size)


class _Prefix(Sequence[int]):
    """The first ``end`` tokens of a sequence, without copying them (a model reads
    only the last few tokens of each prompt prefix it scores)."""

    __slots__ = ("_end", "_tokens")

    def __init__(self, tokens: Sequence[int], end: int) -> None:
        self._tokens = tokens
        self._end = end

    def __len__(self) -> int:
        return self._end

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: SupportsIndex | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            chosen = range(self._end)[index]
            if chosen.step == 1:
                return self._tokens[chosen.start : chosen.stop]
            return [self._tokens[i] for i in chosen]
        position = index.__index__()
        if position < 0:
            position += self._end
        if not 0 <= position < self._end:
            raise IndexError("prefix index out of range")
        return self._tokens[position]

    def __iter__(self) -> Iterator[int]:
        tokens = self._tokens
        return (tokens[i] for i in range(self._end))

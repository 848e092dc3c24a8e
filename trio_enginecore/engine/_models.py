"""The built-in models and the small interface the scheduler drives them through.

A model only has to answer one question per step: given these sequences, what is the
next token of each? Everything else (batching, stopping, aborting) is the scheduler's.
A model that can also say how likely each token was (:meth:`Model.logprobs`) serves
requests that ask for logprobs.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from ..config import EngineConfig
from ._corpus import CORPUS

__all__ = [
    "CounterModel",
    "Model",
    "NgramModel",
    "SamplingState",
    "Score",
    "make_model",
    "rank_of",
    "top_ids",
]


class SamplingState(Protocol):
    """What a model may read about a sequence when choosing its next token."""

    @property
    def last_token_id(self) -> int: ...

    @property
    def token_ids(self) -> Sequence[int]:
        """Prompt and output tokens so far."""
        ...

    @property
    def temperature(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def top_p(self) -> float: ...

    @property
    def min_p(self) -> float: ...

    @property
    def rng(self) -> np.random.Generator:
        """The request's own generator if it has a seed, else the engine's."""
        ...


_SORT_UP_TO: Final = 4096
"""Vocabularies up to this size are ranked by a full sort (see :meth:`Model.score`)."""


class Score(NamedTuple):
    """What a model says about one token at one position (see :meth:`Model.score`)."""

    logprob: float
    """The token's raw logprob."""
    rank: int
    """Its rank: 1 + the tokens more likely, + the equally likely ones of smaller id."""
    ids: npt.NDArray[np.int64]
    """The alternatives: the ``top`` most likely tokens by rank, or the ids asked for."""
    logprobs: npt.NDArray[np.float64]
    """Their raw logprobs."""


class Model(abc.ABC):
    """A model the reference engine can serve."""

    name: str
    vocab_size: int
    eos_token_id: int | None

    @abc.abstractmethod
    def next_tokens(self, batch: Sequence[SamplingState]) -> list[int]:
        """One new token for every sequence of the batch, in order."""

    def logprobs(self, token_ids: Sequence[int]) -> npt.NDArray[np.float64]:
        """The raw log-probability of every vocabulary id being the token after
        ``token_ids``: the log-softmax of the model's logits before temperature,
        penalties or truncation (what vLLM returns in its default ``logprobs_mode``,
        ``raw_logprobs``), so the sampling parameters change none of them.

        A model without it serves no request that asks for logprobs (the engine
        rejects those).
        """
        raise NotImplementedError(f"the {self.name} model computes no logprobs")

    @property
    def has_logprobs(self) -> bool:
        """Whether the model implements :meth:`logprobs` (or :meth:`score`)."""
        cls = type(self)
        return cls.logprobs is not Model.logprobs or cls.score is not Model.score

    def score(
        self,
        token_ids: Sequence[int],
        token: int,
        *,
        top: int = 0,
        ids: Sequence[int] | None = None,
    ) -> Score:
        """``token``'s logprob and rank as the token after ``token_ids``, with the
        ``top`` most likely tokens (by rank) and their logprobs, or instead those of
        ``ids`` when given.

        Computed from :meth:`logprobs`; a model with a cheaper closed form overrides
        it with the same results.
        """
        row = self.logprobs(token_ids)
        if ids is None and row.size <= _SORT_UP_TO:
            # A small vocabulary is ranked whole faster than partitioned.
            order = np.argsort(-row, kind="stable")
            rank = int(np.flatnonzero(order == token)[0]) + 1
            chosen = order[: max(top, 0)]
        else:
            chosen = np.asarray(ids, dtype=np.int64) if ids is not None else top_ids(row, top)
            rank = rank_of(row, token)
        return Score(float(row[token]), rank, chosen, row[chosen])

    def tokenize(self, text: str) -> list[int]:
        """Text to token ids (for demos and tutorials)."""
        raise NotImplementedError(f"the {self.name} model has no tokenizer")

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Token ids to text (for demos and tutorials)."""
        return " ".join(map(str, token_ids))


class CounterModel(Model):
    """Each new token is the previous token plus one, modulo the vocabulary.

    Deterministic and cheap: a test can predict every token of every request and so
    check that none was lost, duplicated or reordered. It has no EOS token of its own;
    requests stop on ``max_tokens``, ``stop_token_ids`` or a frontend-provided EOS.
    """

    name = "counter"

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = None

    def next_tokens(self, batch: Sequence[SamplingState]) -> list[int]:
        if len(batch) < 32:
            return [(s.last_token_id + 1) % self.vocab_size for s in batch]
        # Vectorised for large batches: the engine must never be the bottleneck of a
        # client benchmark.
        last = np.fromiter((s.last_token_id for s in batch), dtype=np.int64, count=len(batch))
        result: list[int] = ((last + 1) % self.vocab_size).tolist()
        return result

    @staticmethod
    def expected_tokens(prompt: Sequence[int], count: int, vocab_size: int = 32000) -> list[int]:
        """The tokens the counter model generates after ``prompt`` (for tests)."""
        last = prompt[-1]
        return [(last + i) % vocab_size for i in range(1, count + 1)]

    def logprobs(self, token_ids: Sequence[int]) -> npt.NDArray[np.float64]:
        """The counter's fixed scores: the token it produces (the last one plus one)
        has logprob 0.0, and each id ``d`` steps further on (modulo the vocabulary)
        has logprob ``-d``: ``last + 2`` has -1.0, ``last + 3`` has -2.0, and so on.

        So the produced token has rank 1, ``last + 1 + d`` has rank ``d + 1``, and no
        two ids tie. The model is certain of its token, so these are ranking scores
        rather than a distribution: they do not add up to 1.
        """
        return _negated(self._distance(token_ids, np.arange(self.vocab_size)))

    def score(
        self,
        token_ids: Sequence[int],
        token: int,
        *,
        top: int = 0,
        ids: Sequence[int] | None = None,
    ) -> Score:
        # The closed form of logprobs(): O(top) instead of O(vocabulary).
        vocab = self.vocab_size
        produced = (token_ids[-1] + 1) % vocab
        distance = (token - produced) % vocab
        if ids is None:
            count = max(min(top, vocab), 0)
            chosen = np.arange(produced, produced + count, dtype=np.int64)
            if produced + count > vocab:
                chosen %= vocab
            values = _negated(np.arange(count))
        else:
            chosen = np.asarray(ids, dtype=np.int64)
            values = _negated(self._distance(token_ids, chosen))
        return Score(0.0 - distance, distance + 1, chosen, values)

    def _distance(self, token_ids: Sequence[int], ids: Any) -> Any:
        # How many steps past the produced token each id is.
        return (ids - (token_ids[-1] + 1)) % self.vocab_size


def _negated(distances: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    # 0.0 - d rather than -d: the produced token's logprob is 0.0, not -0.0.
    result: npt.NDArray[np.float64] = 0.0 - distances.astype(np.float64)
    return result


_EOS: Final = 256
_ORDER: Final = 4
# Weights of the context lengths 0..ORDER-1 when they are all known; missing (unseen)
# contexts give their weight to the shorter ones.
_WEIGHTS: Final = (0.02, 0.08, 0.3, 0.6)
# Probabilities are floored here before their log is taken: a token the model has
# never seen gets a finite logit (about -690.8) rather than -inf.
_FLOOR: Final = 1e-300


class NgramModel(Model):
    """A byte-level interpolated n-gram language model, built at start-up.

    Small enough to build in a few milliseconds from the text bundled with the package,
    real enough that temperature, top-k, top-p, min-p and seeds change what it writes
    (and the same seed writes the same text). Tokens 0-255 are bytes; 256 is EOS.
    """

    name = "ngram"

    def __init__(self, corpus: str = CORPUS, vocab_size: int = _EOS + 1) -> None:
        if vocab_size <= _EOS:
            raise ValueError(f"the ngram model needs a vocabulary of at least {_EOS + 1}")
        self.vocab_size = vocab_size
        self.eos_token_id = _EOS
        self._tables: list[dict[bytes, npt.NDArray[np.float64]]] = [{} for _ in range(_ORDER)]
        for paragraph in corpus.split("\n\n"):
            self._learn(paragraph.strip().encode("utf-8"))
        for table in self._tables:
            for context, counts in table.items():
                table[context] = counts / counts.sum()

    def _learn(self, text: bytes) -> None:
        tokens = [*text, _EOS]
        for i, token in enumerate(tokens):
            for n in range(_ORDER):
                if n > i:
                    break
                context = bytes(text[i - n : i])
                counts = self._tables[n].get(context)
                if counts is None:
                    counts = self._tables[n][context] = np.zeros(self.vocab_size)
                counts[token] += 1.0

    def distribution(self, token_ids: Sequence[int]) -> npt.NDArray[np.float64]:
        """The model's next-token probabilities after ``token_ids``."""
        history = bytes(t for t in token_ids[-(_ORDER - 1) :] if t < _EOS)
        probs = np.zeros(self.vocab_size)
        total = 0.0
        for n in range(_ORDER):
            if n > len(history):
                break
            table = self._tables[n].get(history[len(history) - n :] if n else b"")
            if table is not None:
                probs += _WEIGHTS[n] * table
                total += _WEIGHTS[n]
        result: npt.NDArray[np.float64] = probs / total
        return result

    def next_tokens(self, batch: Sequence[SamplingState]) -> list[int]:
        return [self._sample(state) for state in batch]

    def logprobs(self, token_ids: Sequence[int]) -> npt.NDArray[np.float64]:
        """The log-softmax of the model's logits, the log of :meth:`distribution`
        (floored at 1e-300, about -690.8, for tokens the model has never seen there)."""
        # The floored probabilities are exp(logits): their softmax is them, normalised.
        floored = np.maximum(self.distribution(token_ids), _FLOOR)
        result: npt.NDArray[np.float64] = np.log(floored / floored.sum())
        return result

    def _sample(self, state: SamplingState) -> int:
        probs = self.distribution(state.token_ids)
        if state.temperature < 1e-5:
            return int(np.argmax(probs))
        logits = np.log(np.maximum(probs, _FLOOR)) / state.temperature
        logits -= logits.max()
        weights = np.exp(logits)
        weights /= weights.sum()
        weights = _truncate(weights, top_k=state.top_k, top_p=state.top_p, min_p=state.min_p)
        return int(state.rng.choice(self.vocab_size, p=weights))

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < _EOS).decode("utf-8", errors="replace")


def rank_of(row: npt.NDArray[np.float64], token: int) -> int:
    """``token``'s rank in ``row`` (logprobs by token id): 1 + the ids more likely, +
    the equally likely ids smaller than ``token`` (ties are broken by id)."""
    value = row[token]
    return 1 + int(np.count_nonzero(row > value)) + int(np.count_nonzero(row[:token] == value))


def top_ids(row: npt.NDArray[np.float64], k: int) -> npt.NDArray[np.int64]:
    """The ``k`` most likely ids of ``row`` (logprobs by token id), by rank: most
    likely first, equally likely ones by id (all of them if ``k`` is the vocabulary)."""
    size = row.size
    k = min(k, size)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k == size:
        every: npt.NDArray[np.int64] = np.argsort(-row, kind="stable")
        return every
    # Partition instead of a full sort: the k-th largest value is the threshold, and
    # of the ids tied at it, the smallest ones make up the count.
    threshold = np.partition(row, size - k)[size - k]
    above = np.flatnonzero(row > threshold)
    tied = np.flatnonzero(row == threshold)[: k - above.size]
    chosen = np.concatenate((above, tied))
    ordered: npt.NDArray[np.int64] = chosen[np.argsort(-row[chosen], kind="stable")]
    return ordered


def _truncate(
    probs: npt.NDArray[np.float64], *, top_k: int, top_p: float, min_p: float
) -> npt.NDArray[np.float64]:
    """Zero out tokens outside top-k / top-p / min-p, then renormalise."""
    keep = np.ones(probs.shape, dtype=bool)
    if top_k > 0 and top_k < probs.size:
        threshold = np.partition(probs, -top_k)[-top_k]
        keep &= probs >= threshold
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cutoff = int(np.searchsorted(cumulative, top_p)) + 1
        nucleus = np.zeros(probs.shape, dtype=bool)
        nucleus[order[:cutoff]] = True
        keep &= nucleus
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    result = np.where(keep, probs, 0.0)
    total = result.sum()
    if not math.isfinite(total) or total <= 0.0:
        result = np.zeros(probs.shape)
        result[int(np.argmax(probs))] = 1.0
        return result
    normalised: npt.NDArray[np.float64] = result / total
    return normalised


def make_model(config: EngineConfig) -> Model:
    """The built-in model named by ``config.model``."""
    kwargs: dict[str, Any] = {}
    if config.vocab_size is not None:
        kwargs["vocab_size"] = config.vocab_size
    if config.model == "counter":
        return CounterModel(**kwargs)
    if config.model == "ngram":
        return NgramModel(**kwargs)
    raise ValueError(f"unknown model {config.model!r}")  # pragma: no cover - config validates

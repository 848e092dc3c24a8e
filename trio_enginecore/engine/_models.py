"""The built-in models and the small interface the scheduler drives them through.

A model only has to answer one question per step: given these sequences, what is the
next token of each? Everything else (batching, stopping, aborting) is the scheduler's.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from ..config import EngineConfig
from ._corpus import CORPUS

__all__ = ["CounterModel", "Model", "NgramModel", "SamplingState", "make_model"]


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


class Model(abc.ABC):
    """A model the reference engine can serve."""

    name: str
    vocab_size: int
    eos_token_id: int | None

    @abc.abstractmethod
    def next_tokens(self, batch: Sequence[SamplingState]) -> list[int]:
        """One new token for every sequence of the batch, in order."""

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


_EOS: Final = 256
_ORDER: Final = 4
# Weights of the context lengths 0..ORDER-1 when they are all known; missing (unseen)
# contexts give their weight to the shorter ones.
_WEIGHTS: Final = (0.02, 0.08, 0.3, 0.6)


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

    def _sample(self, state: SamplingState) -> int:
        probs = self.distribution(state.token_ids)
        if state.temperature < 1e-5:
            return int(np.argmax(probs))
        logits = np.log(np.maximum(probs, 1e-300)) / state.temperature
        logits -= logits.max()
        weights = np.exp(logits)
        weights /= weights.sum()
        weights = _truncate(weights, top_k=state.top_k, top_p=state.top_p, min_p=state.min_p)
        return int(state.rng.choice(self.vocab_size, p=weights))

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < _EOS).decode("utf-8", errors="replace")


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

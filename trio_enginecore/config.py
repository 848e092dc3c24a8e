"""Configuration of the reference engine (and, later, of the clients that launch it)."""

from __future__ import annotations

import math
from typing import Any, Final

import attrs

from .dialects import DIALECTS, NEWEST, choose_dialect

__all__ = ["MODELS", "EngineConfig"]

MODELS: Final = ("counter", "ngram")
"""Names of the built-in models."""


def _positive_int(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"EngineConfig.{attribute.name} must be a positive integer, got {value!r}")


def _non_negative_int(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(
            f"EngineConfig.{attribute.name} must be a non-negative integer, got {value!r}"
        )


def _optional_positive_int(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _positive_int(instance, attribute, value)


def _non_negative_seconds(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"EngineConfig.{attribute.name} must be a finite number of seconds >= 0, got {value!r}"
        )


def _boolean(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"EngineConfig.{attribute.name} must be True or False, got {value!r}")


def _known_vllm_version(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    known = ", ".join(dialect.tested_version for dialect in DIALECTS)
    try:
        choice = choose_dialect(value) if isinstance(value, str) else None
    except ValueError:
        choice = None
    if choice is None or choice.untested:
        raise ValueError(
            f"EngineConfig.vllm_version must be a supported vLLM release ({known}), got {value!r}"
        )


def _model_name(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in MODELS:
        raise ValueError(f"EngineConfig.model must be one of {', '.join(MODELS)}; got {value!r}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything an engine needs to know to start, validated on construction.

    Every field has a working default, so ``EngineConfig()`` is an engine running the
    ``counter`` model. Bad values raise :class:`ValueError` naming the field.
    """

    model: str = attrs.field(default="counter", validator=_model_name)
    """Which built-in model to serve, ``"counter"`` (each token is the previous one plus
    one, modulo the vocabulary; for tests) or ``"ngram"`` (a small byte-level language
    model whose sampling parameters have real, seeded effects; for demos)."""

    vocab_size: int | None = attrs.field(default=None, validator=_optional_positive_int)
    """Vocabulary size; ``None`` uses the model's own (32000 for counter, 257 for ngram)."""

    max_num_seqs: int = attrs.field(default=256, validator=_positive_int)
    """How many requests run in one step; the rest wait their turn."""

    max_model_len: int = attrs.field(default=4096, validator=_positive_int)
    """Maximum prompt plus output length of one request, in tokens."""

    max_loras: int = attrs.field(default=4, validator=_non_negative_int)
    """How many LoRA adapters can be registered at once."""

    step_time_s: float = attrs.field(default=0.0, validator=_non_negative_seconds)
    """Simulated accelerator time per model step. The engine keeps serving I/O while it
    "computes", as a real engine overlaps I/O with the GPU."""

    seed: int = attrs.field(default=0, validator=_non_negative_int)
    """Seed of the engine's sampler for requests that do not bring their own seed."""

    log_stats: bool = attrs.field(default=False, validator=_boolean)
    """Attach scheduler statistics and request events (QUEUED, SCHEDULED) to outputs, as
    vLLM does when stats logging is on."""

    drain_timeout_s: float = attrs.field(default=30.0, validator=_non_negative_seconds)
    """On SIGTERM/SIGINT, how long in-flight requests may run before they are aborted."""

    data_parallel_size: int = attrs.field(default=1, validator=_positive_int)
    """Number of data-parallel engines (ranks)."""

    data_parallel_external_lb: bool = attrs.field(default=False, validator=_boolean)
    """With several ranks: an external load balancer picks the rank for each client
    (each client then owns one rank) instead of one client balancing over all."""

    data_parallel_rank: int = attrs.field(default=0, validator=_non_negative_int)
    """This engine's rank; its DEALER identity is ``rank.to_bytes(2, "little")``."""

    vllm_version: str = attrs.field(default=NEWEST.tested_version, validator=_known_vllm_version)
    """The vLLM release the engine presents itself as: the version in its ready
    message, which tells clients what form to write requests in, and the form of its
    outputs and ready message. It reads requests in every supported release's form
    either way, so vLLM clients of each release can use it."""

    enable_fault_injection: bool = attrs.field(default=False, validator=_boolean)
    """Enable the utilities that make the engine fail or stall on purpose, for tests of
    a client's failure handling: ``inject_fault`` (the next step fails fatally),
    ``stall(seconds)`` (a utility that holds the engine's thread) and
    ``stall_steps(seconds)`` (every step holds it: slow, or with a long time hung).
    Never enable it in production."""

    def __attrs_post_init__(self) -> None:
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"EngineConfig.data_parallel_rank ({self.data_parallel_rank}) must be "
                f"smaller than data_parallel_size ({self.data_parallel_size})"
            )
        if self.data_parallel_rank > 0xFFFF:
            raise ValueError("EngineConfig.data_parallel_rank must fit in two bytes")
        if self.model == "ngram" and self.vocab_size is not None and self.vocab_size < 257:
            # Bytes 0-255 and EOS (256); otherwise the engine would only fail at start-up.
            raise ValueError(
                f"EngineConfig.vocab_size must be at least 257 for the ngram model, "
                f"got {self.vocab_size}"
            )

    def evolve(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed (and validated again)."""
        return attrs.evolve(self, **changes)

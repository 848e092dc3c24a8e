"""Configuration of the reference engine, and how each setting is given on its command
line.

:class:`EngineConfig` is the one source of the engine's settings: each field carries,
in its metadata, the ``trio-enginecore serve`` flag that sets it (a ``Flag``). From
that table come the serve command's engine options (``add_engine_flags``), the
configuration it builds from them (``config_from_flags``), and the flags a client
passes to an engine it launches (``engine_flags``), so the three cannot drift apart.
Client settings are :class:`~trio_enginecore.client.ClientOptions`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

from ._keywords import suggest_keywords
from .dialects import DIALECTS, NEWEST, Dialect, parse_release

__all__ = ["MODELS", "EngineConfig"]

MODELS: Final = ("counter", "ngram")
"""Names of the built-in models."""


@attrs.frozen
class Flag:
    """How one :class:`EngineConfig` field is given to ``trio-enginecore serve``.

    A ``switch`` is a flag without a value, present when the field is True; any other
    flag takes ``type(text)``, and is left out when the field is None. In ``help``,
    ``%(default)s`` is the field's default.
    """

    name: str
    help: str
    type: Callable[[str], Any] = str
    choices: Sequence[str] | None = None
    switch: bool = False


FLAG: Final = "trio_enginecore.flag"
"""The metadata key of an :class:`EngineConfig` field's :class:`Flag`; its value is
None for a field that is not a setting of the engine process."""


def _flag(name: str, help: str, **kwargs: Any) -> dict[str, Flag]:
    return {FLAG: Flag(name, help, **kwargs)}


def _positive_int(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"EngineConfig.{attribute.name} must be a positive integer, got {value!r}")


def _non_negative_int(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(
            f"EngineConfig.{attribute.name} must be a non-negative integer, got {value!r}"
        )


def _logprobs_limit(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or value < -1:
        raise ValueError(
            f"EngineConfig.{attribute.name} must be an integer >= 0, or -1 for the whole "
            f"vocabulary, got {value!r}"
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


def _known_dialect(version: str) -> Dialect | None:
    """The dialect of the release ``version`` names, if it is a supported one."""
    try:
        release = parse_release(version)
    except ValueError:
        return None
    return next((dialect for dialect in DIALECTS if dialect.release == release), None)


def _known_vllm_version(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, str) and value.strip():
        try:
            parse_release(value)
        except ValueError:
            return  # names no release ("dev"): it speaks as wire_release says
        if _known_dialect(value) is not None:
            return
    known = ", ".join(dialect.tested_version for dialect in DIALECTS)
    raise ValueError(
        f"EngineConfig.vllm_version must be a supported vLLM release ({known}) or a "
        f"version that names no release (such as 'dev'), got {value!r}"
    )


def _known_release(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None or (isinstance(value, str) and _known_dialect(value) is not None):
        return
    known = ", ".join(f"{d.release[0]}.{d.release[1]}" for d in DIALECTS)
    raise ValueError(
        f"EngineConfig.wire_release must be None or a supported vLLM release ({known}), "
        f"got {value!r}"
    )


def _model_name(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in MODELS:
        raise ValueError(f"EngineConfig.model must be one of {', '.join(MODELS)}; got {value!r}")


@suggest_keywords
@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything an engine needs to know to start, validated on construction.

    Every field has a working default, so ``EngineConfig()`` is an engine running the
    ``counter`` model. Bad values raise :class:`ValueError` naming the field, and an
    unknown keyword a :class:`TypeError` naming the nearest field.

    It describes the engines a client launches. For engines started elsewhere
    (attached with ``input_address``/``output_address``, or joining with
    ``remote=RemoteEngines(...)``), which run their own settings, a client reads only
    the group's shape: :attr:`data_parallel_size` (how many engines to wait for),
    :attr:`data_parallel_external_lb` and, with it, :attr:`data_parallel_rank` (the one
    rank the client serves). The other fields are ignored there: give
    ``EngineConfig(data_parallel_size=N)``, or nothing for one engine.
    """

    model: str = attrs.field(
        default="counter",
        validator=_model_name,
        metadata=_flag(
            "--model",
            "built-in model: 'counter' (each token is the previous one + 1; for tests) or "
            "'ngram' (a small byte-level language model; for demos) (default: %(default)s)",
            choices=MODELS,
        ),
    )
    """Which built-in model to serve, ``"counter"`` (each token is the previous one plus
    one, modulo the vocabulary; for tests) or ``"ngram"`` (a small byte-level language
    model whose sampling parameters have real, seeded effects; for demos)."""

    vocab_size: int | None = attrs.field(
        default=None,
        validator=_optional_positive_int,
        metadata=_flag(
            "--vocab-size",
            "vocabulary size (default: the model's own: counter 32000, ngram 257)",
            type=int,
        ),
    )
    """Vocabulary size; ``None`` uses the model's own (32000 for counter, 257 for ngram)."""

    max_num_seqs: int = attrs.field(
        default=256,
        validator=_positive_int,
        metadata=_flag(
            "--max-num-seqs", "requests per step; the rest wait (default: %(default)s)", type=int
        ),
    )
    """How many requests run in one step; the rest wait their turn."""

    max_model_len: int = attrs.field(
        default=4096,
        validator=_positive_int,
        metadata=_flag(
            "--max-model-len",
            "maximum prompt + output tokens of a request (default: %(default)s)",
            type=int,
        ),
    )
    """Maximum prompt plus output length of one request, in tokens."""

    max_loras: int = attrs.field(
        default=4,
        validator=_non_negative_int,
        metadata=_flag(
            "--max-loras",
            "LoRA adapters that can be registered at once (default: %(default)s)",
            type=int,
        ),
    )
    """How many LoRA adapters can be registered at once."""

    max_logprobs: int = attrs.field(
        default=20,
        validator=_logprobs_limit,
        metadata=_flag(
            "--max-logprobs",
            "most logprobs (and prompt logprobs) a request may ask for per position; -1: "
            "the whole vocabulary (default: %(default)s)",
            type=int,
        ),
    )
    """The most alternatives a request may ask for per position with
    ``SamplingParams.logprobs`` or ``prompt_logprobs`` (``-1``, all of them, counts as
    the whole vocabulary); a request asking for more fails with the error vLLM gives.
    ``-1`` allows the whole vocabulary. vLLM's ``--max-logprobs``, with its default."""

    step_time_s: float = attrs.field(
        default=0.0,
        validator=_non_negative_seconds,
        metadata=_flag(
            "--step-time-s",
            "simulated accelerator time per step, in seconds (default: %(default)s)",
            type=float,
        ),
    )
    """Simulated accelerator time per model step. The engine keeps serving I/O while it
    "computes", as a real engine overlaps I/O with the GPU."""

    seed: int = attrs.field(
        default=0,
        validator=_non_negative_int,
        metadata=_flag(
            "--seed",
            "sampling seed for requests without their own (default: %(default)s)",
            type=int,
        ),
    )
    """Seed of the engine's sampler for requests that do not bring their own seed."""

    log_stats: bool = attrs.field(
        default=False,
        validator=_boolean,
        metadata=_flag(
            "--log-stats", "attach scheduler stats and request events to outputs", switch=True
        ),
    )
    """Attach scheduler statistics and request events (QUEUED, SCHEDULED) to outputs, as
    vLLM does when stats logging is on."""

    drain_timeout_s: float = attrs.field(
        default=30.0,
        validator=_non_negative_seconds,
        metadata=_flag(
            "--drain-timeout-s",
            "on SIGTERM/SIGINT, how long in-flight requests may finish (default: %(default)s)",
            type=float,
        ),
    )
    """On SIGTERM/SIGINT, how long in-flight requests may run before they are aborted."""

    data_parallel_size: int = attrs.field(
        default=1,
        validator=_positive_int,
        metadata=_flag(
            "--data-parallel-size", "number of data-parallel ranks (default: %(default)s)", type=int
        ),
    )
    """Number of data-parallel engines (ranks)."""

    # Decided by the clients (which client owns which rank): the engine process has no
    # use for it, so it has no flag and launched engines are not told.
    data_parallel_external_lb: bool = attrs.field(
        default=False, validator=_boolean, metadata={FLAG: None}
    )
    """With several ranks: an external load balancer picks the rank for each client
    (each client then owns one rank) instead of one client balancing over all."""

    data_parallel_rank: int = attrs.field(
        default=0,
        validator=_non_negative_int,
        metadata=_flag(
            "--rank",
            "data-parallel rank; the DEALER identity is rank.to_bytes(2, 'little') "
            "(default: %(default)s)",
            type=int,
        ),
    )
    """This engine's rank; its DEALER identity is ``rank.to_bytes(2, "little")``."""

    vllm_version: str = attrs.field(
        default=NEWEST.tested_version,
        validator=_known_vllm_version,
        metadata=_flag(
            "--vllm-version",
            "the vLLM release the engine presents itself as; it reads requests of every "
            "supported release (default: %(default)s)",
        ),
    )
    """The vLLM release the engine presents itself as: the version in its ready
    message, which tells clients what form to write requests in, and the form of its
    outputs and ready message. It reads requests in every supported release's form
    either way, so vLLM clients of each release can use it.

    A version that names no release (``"dev"``, as vLLM run from a source tree
    announces it) is allowed too: the engine then speaks the release
    :attr:`wire_release` names, and clients recognise it from its ready message's
    keys."""

    wire_release: str | None = attrs.field(
        default=None,
        validator=_known_release,
        metadata=_flag(
            "--wire-release",
            "with a --vllm-version that names no release (dev): the release whose wire "
            "format the engine speaks (default: the newest supported)",
        ),
    )
    """The release whose wire format the engine speaks (``"0.33"``) when
    :attr:`vllm_version` names none; None: the newest supported one. With a
    ``vllm_version`` that names a release, None or that release."""

    enable_fault_injection: bool = attrs.field(
        default=False,
        validator=_boolean,
        metadata=_flag(
            "--enable-fault-injection",
            "enable the utilities that make the engine fail or stall on purpose "
            "(inject_fault, stall, stall_steps; tests only)",
            switch=True,
        ),
    )
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
        named = _known_dialect(self.vllm_version)
        wire = self.wire_release
        if named is not None and wire is not None and parse_release(wire) != named.release:
            raise ValueError(
                f"EngineConfig.wire_release ({wire}) contradicts vllm_version "
                f"({self.vllm_version}): it is only for a version that names no release"
            )

    @property
    def dialect(self) -> Dialect:
        """The release whose wire format the engine speaks: the one
        :attr:`vllm_version` names, else :attr:`wire_release`'s, else the newest."""
        named = _known_dialect(self.vllm_version)
        if named is not None:
            return named
        if self.wire_release is not None:
            wire = _known_dialect(self.wire_release)
            assert wire is not None  # validated
            return wire
        return NEWEST

    def evolve(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed (and validated again)."""
        return attrs.evolve(self, **changes)


# ------------------------------------------------------------------ the command line


def _flagged() -> list[tuple[attrs.Attribute[Any], Flag]]:
    """The fields that are settings of the engine process, with their flags."""
    return [
        (field, flag)
        for field in attrs.fields(EngineConfig)
        if (flag := field.metadata[FLAG]) is not None
    ]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add the group of engine settings to ``parser`` (``trio-enginecore serve``): one
    option per flagged :class:`EngineConfig` field, defaulting to the field's default."""
    group = parser.add_argument_group("engine configuration")
    for field, flag in _flagged():
        if flag.switch:
            group.add_argument(flag.name, dest=field.name, action="store_true", help=flag.help)
            continue
        group.add_argument(
            flag.name,
            dest=field.name,
            # What argparse shows without a dest of its own: the choices, or the flag's
            # name (--rank RANK, not DATA_PARALLEL_RANK).
            metavar=None if flag.choices else flag.name[2:].replace("-", "_").upper(),
            type=flag.type,
            choices=flag.choices,
            default=field.default,
            help=flag.help,
        )


def config_from_flags(args: argparse.Namespace) -> EngineConfig:
    """The configuration the options of :func:`add_engine_flags` give.

    Raises:
        ValueError: a setting is out of range (naming the field).
    """
    return EngineConfig(**{field.name: getattr(args, field.name) for field, _ in _flagged()})


def engine_flags(config: EngineConfig) -> list[str]:
    """The ``trio-enginecore serve`` flags that reproduce ``config``."""
    arguments: list[str] = []
    for field, flag in _flagged():
        value = getattr(config, field.name)
        if flag.switch:
            if value:
                arguments.append(flag.name)
        elif value is not None:  # None: the flag's default
            arguments += [flag.name, str(value)]
    return arguments

"""What each vLLM release speaks at the engine-core boundary, in one table.

vLLM changes its wire format between releases (0.34 packs every ADD's prompt as an
int32 array where 0.33 sent a list of ints, and appends fields to requests, outputs
and the ready response). A client talking to engines of several releases, and an
engine serving clients of several, must know which release's form to write. Each
:class:`Dialect` says that for one release, and nothing else in the package hard-codes
a release's differences: the codec (:mod:`trio_enginecore.serial`), the clients (which
dialect to write to an engine, decided from its ready message) and the reference
engine (which release it announces) all read this table.

An engine's ready message names its version. A version that names a release decides;
one that names none (``"dev"``: vLLM run from a source tree, or another engine
speaking the protocol) is given the release whose ready message has the same keys
(:attr:`Dialect.ready_keys_added`), with a warning.

Supporting the next vLLM release is a new entry in :data:`DIALECTS`, its golden frames
in ``tests/data/vllm-<version>/``, and an interop run against it.

Pure: no I/O, unit-tested synchronously.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Final, final

import attrs

__all__ = [
    "DIALECTS",
    "NEWEST",
    "OLDEST",
    "VLLM_0_33",
    "VLLM_0_34",
    "Dialect",
    "DialectChoice",
    "UtilityParameters",
    "choose_dialect",
    "choose_group_dialects",
    "dialect_of_ready",
    "parse_release",
]

_RELEASE: Final = re.compile(r"^\s*v?(\d+)\.(\d+)(?:[.+\-a-z]|$)")


def parse_release(version: str) -> tuple[int, int]:
    """The ``(major, minor)`` release of a vLLM version string.

    Patch numbers, pre-releases and local parts do not matter to the wire format:
    ``"0.34.0"``, ``"0.34.1rc2"`` and ``"0.34.0+cpu"`` are all release ``(0, 34)``.

    Raises:
        ValueError: the string does not start with ``MAJOR.MINOR``.
    """
    match = _RELEASE.match(version)
    if match is None:
        raise ValueError(f"not a vLLM version: {version!r} (expected MAJOR.MINOR...)")
    return int(match.group(1)), int(match.group(2))


@final
@attrs.frozen
class UtilityParameters:
    """The parameters of one engine utility in one release, as its engines declare them.

    Only utilities whose signature differs between supported releases are listed in a
    dialect; any other utility is passed through as the caller wrote it.
    """

    names: tuple[str, ...]
    """Every parameter, in order."""
    required: int = 0
    """How many of them have no default."""

    def accepts(self, count: int) -> bool:
        """Whether a call with ``count`` positional arguments fits."""
        return self.required <= count <= len(self.names)


@final
@attrs.frozen(repr=False)
class Dialect:
    """The wire form of one vLLM release (see the module docstring)."""

    release: tuple[int, int]
    """``(major, minor)``: every patch release of it speaks the same."""
    tested_version: str
    """The version whose golden frames and interop run back this entry."""
    packed_prompts: bool
    """Whether ``EngineCoreRequest.prompt_token_ids`` travels as an int32 array
    (``["<i4", [n], data]``); a list of ints otherwise."""
    request_fields: int
    """Positions of ``EngineCoreRequest`` (an ``array_like`` struct)."""
    output_fields: int
    """Positions of ``EngineCoreOutput``."""
    ready_keys: int
    """Keys of the ready response (a map with every field)."""
    ready_keys_added: tuple[str, ...]
    """The keys of the ready response new in this release, in order (for the oldest
    supported release, every key it sends). An engine whose version names no release
    (``"dev"``) is recognised by them: see :func:`dialect_of_ready`."""
    utilities: Mapping[str, UtilityParameters]
    """Utilities new in this release or whose parameters changed (by name)."""

    @property
    def name(self) -> str:
        """``"vLLM 0.34"``."""
        return f"vLLM {self.release[0]}.{self.release[1]}"

    def __repr__(self) -> str:
        # The name of its entry in this module, not the whole table.
        return f"VLLM_{self.release[0]}_{self.release[1]}"

    def utility_problem(self, method: str, count: int) -> str | None:
        """Why an engine of this release cannot take ``method`` with ``count``
        arguments (``"vLLM 0.33, which has no utility ..."``), or None if it can (or
        the table does not know the utility)."""
        parameters = self.utilities.get(method)
        if parameters is None:
            introduced = _introduced_in(method)
            if introduced is not None and introduced.release > self.release:
                return f"{self.name}, which has no utility {method!r} (new in {introduced.name})"
            return None
        if parameters.accepts(count):
            return None
        signature = ", ".join(parameters.names)
        return f"{self.name}, whose {method}({signature}) does not take {count} argument(s)"


_UTILITIES_0_33: Final[Mapping[str, UtilityParameters]] = {
    "sleep": UtilityParameters(("level", "mode")),
    "release_kv_cache_memory": UtilityParameters(()),
    "pause_scheduler": UtilityParameters(("mode", "clear_cache")),
}

VLLM_0_33: Final[Dialect] = Dialect(
    release=(0, 33),
    tested_version="0.33.0",
    packed_prompts=False,
    request_fields=22,
    output_fields=19,
    ready_keys=28,
    ready_keys_added=(
        "max_model_len",
        "num_gpu_blocks",
        "block_size",
        "dp_stats_address",
        "dtype",
        "vllm_version",
        "world_size",
        "data_parallel_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "decode_context_parallel_size",
        "data_parallel_rank",
        "max_num_seqs",
        "max_num_batched_tokens",
        "instance_id",
        "supports_lora",
        "max_loras",
        "mamba_block_size",
        "kv_cache_size_tokens",
        "kv_cache_max_concurrency",
        "kv_events_config",
        "weight_transfer_backend",
        "enable_sleep_mode",
        "supports_draft_weight_updates",
        "effective_attention_block_size",
        "coord_store_port",
        "coordinator_input_address",
        "coordinator_output_address",
    ),
    utilities=_UTILITIES_0_33,
)
"""vLLM 0.33: prompts as lists of ints."""

VLLM_0_34: Final[Dialect] = Dialect(
    release=(0, 34),
    tested_version="0.34.0",
    packed_prompts=True,
    request_fields=23,  # + block_hashes
    output_fields=20,  # + watermarking
    ready_keys=33,
    ready_keys_added=(
        "vllm_config",
        "prefix_hash_config",
        "cache_config_info",
        "config_hash",
        "enable_expert_parallel",
    ),
    utilities={
        "sleep": UtilityParameters(("level", "mode", "reset_connector")),
        "release_kv_cache_memory": UtilityParameters(("reset_connector",)),
        "pause_scheduler": UtilityParameters(("mode", "clear_cache", "reset_connector")),
        "is_inference_ready": UtilityParameters(()),
        "checkpoint_prepare": UtilityParameters(("mode",)),
        "checkpoint_restore": UtilityParameters(()),
        "checkpoint_state": UtilityParameters(()),
    },
)
"""vLLM 0.34: prompts packed as int32 arrays; ``block_hashes`` and ``watermarking``."""

DIALECTS: Final[tuple[Dialect, ...]] = (VLLM_0_33, VLLM_0_34)
"""Every supported release, oldest first."""
OLDEST: Final[Dialect] = DIALECTS[0]
"""The oldest supported release's dialect (an engine whose ready message names no
version is spoken to in it)."""
NEWEST: Final[Dialect] = DIALECTS[-1]
"""The newest supported release's dialect (releases newer than every known one are
spoken to in it, with a warning)."""


def _introduced_in(method: str) -> Dialect | None:
    for dialect in DIALECTS:
        if method in dialect.utilities:
            return dialect
    return None


def _ready_keys_through(dialect: Dialect) -> tuple[str, ...]:
    """Every key of ``dialect``'s ready response, in order."""
    return tuple(
        key for d in DIALECTS if d.release <= dialect.release for key in d.ready_keys_added
    )


_KNOWN_READY_KEYS: Final = frozenset(key for d in DIALECTS for key in d.ready_keys_added)


def _listed(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown if len(keys) <= limit else f"{shown} and {len(keys) - limit} more"


def _fit(dialect: Dialect, keys: Collection[str]) -> tuple[list[str], list[str]]:
    """The keys of ``dialect``'s ready response missing from ``keys``, and the keys
    of ``keys`` that a later release added."""
    missing = [key for key in _ready_keys_through(dialect) if key not in keys]
    later = [
        key
        for d in DIALECTS
        if d.release > dialect.release
        for key in d.ready_keys_added
        if key in keys
    ]
    return missing, later


def dialect_of_ready(keys: Collection[str]) -> Dialect | None:
    """The release whose ready response has these keys, or None if none has.

    A release's ready response has every key of its own and of the releases before
    it, and none that a later release added (:attr:`Dialect.ready_keys_added`).
    Keys no release in the table has do not count against it: a build newer than the
    table (vLLM's main branch, say) appends keys and keeps what came before.
    """
    for dialect in DIALECTS:
        missing, later = _fit(dialect, keys)
        if not missing and not later:
            return dialect
    return None


def _describe_fit(dialect: Dialect, keys: Collection[str]) -> str:
    """How a ready message with ``keys`` has ``dialect``'s shape (for the warning)."""
    text = f"its ready message has {dialect.name}'s {dialect.ready_keys} keys"
    later = [key for d in DIALECTS if d.release > dialect.release for key in d.ready_keys_added]
    if dialect is not OLDEST:
        added = dialect.ready_keys_added
        text += f", the {len(added)} new in {dialect.name} included ({_listed(added)})"
    if later:
        text += f", and none of the {len(later)} later releases added ({_listed(later)})"
    unknown = sorted(key for key in keys if key not in _KNOWN_READY_KEYS)
    if unknown:
        text += f", plus {len(unknown)} that no release in the table has ({_listed(unknown)})"
    return text


def _describe_misfit(dialect: Dialect, keys: Collection[str]) -> str:
    """Why a ready message with ``keys`` is not ``dialect``'s (for the refusal)."""
    missing, later = _fit(dialect, keys)
    why: list[str] = []
    if missing:
        why.append(f"lacks {len(missing)} of them ({_listed(missing)})")
    if later:
        why.append(f"has {len(later)} that a later release added ({_listed(later)})")
    return f"not {dialect.name}'s ({dialect.ready_keys} keys): it " + " and ".join(why)


@final
@attrs.frozen
class DialectChoice:
    """What :func:`choose_dialect` decided for one engine's version."""

    dialect: Dialect
    version: str
    """The version the engine announced."""
    untested: bool
    """The release is not in the table (newer than every known one): ``dialect`` is
    the newest known one before it, which may not be all it speaks."""
    shape: str | None = None
    """How the engine's ready message has ``dialect``'s keys, when its version names
    no release (``"dev"``) and the keys decided; None when the version decided."""

    def warning(self) -> str | None:
        """The warning to log once for an untested release or an engine whose
        version names no release, else None."""
        if self.shape is not None:
            return (
                f"engine announced vLLM version {self.version!r}, which names no release: "
                f"speaking {self.dialect.name}'s wire format to it, since {self.shape}"
            )
        if not self.untested:
            return None
        tested = ", ".join(d.tested_version for d in DIALECTS)
        return (
            f"engine runs vLLM {self.version}, newer than any release trio-enginecore was "
            f"tested with ({tested}); speaking {self.dialect.name}'s wire format to it"
        )

    def describe(self) -> str:
        """What the engine runs, for a message naming several engines
        (``"vLLM 0.34.0"``, ``"'dev' with vLLM 0.33's ready message"``)."""
        if self.shape is None:
            return f"vLLM {self.version}"
        return f"{self.version!r} with {self.dialect.name}'s ready message"


def choose_dialect(version: str, ready_keys: Collection[str] | None = None) -> DialectChoice:
    """The dialect to speak to an engine that announced ``version`` in its ready
    message, whose keys were ``ready_keys``.

    A version that names a release decides (the keys are not looked at). One that
    names none (``"dev"``, as vLLM run from a source tree announces, or another
    engine's own string) is given the release whose ready message has ``ready_keys``
    (:func:`dialect_of_ready`), and the choice's :meth:`~DialectChoice.warning` says
    so.

    Raises:
        ValueError: the version is older than every supported release (the message
            names the supported ones), or names no release and the ready message
            (or no ``ready_keys``) has the keys of none (the message says what it
            had, and why each release's does not fit).
    """
    try:
        release = parse_release(version)
    except ValueError:
        if ready_keys is None:
            raise
        return _choose_by_shape(version, ready_keys)
    if release < OLDEST.release:
        supported = ", ".join(d.name for d in DIALECTS)
        raise ValueError(
            f"vLLM {version} is older than any release trio-enginecore speaks ({supported})"
        )
    # A release the table skips or does not know yet speaks as the newest known one
    # before it: releases append to the format and keep what came before.
    dialect = [d for d in DIALECTS if d.release <= release][-1]
    return DialectChoice(dialect, version, untested=dialect.release != release)


def _choose_by_shape(version: str, ready_keys: Collection[str]) -> DialectChoice:
    dialect = dialect_of_ready(ready_keys)
    if dialect is None:
        tried = "; ".join(_describe_misfit(d, ready_keys) for d in DIALECTS)
        raise ValueError(
            f"vLLM version {version!r} names no release, and its ready message "
            f"({len(ready_keys)} keys) is that of no release trio-enginecore speaks: {tried}"
        )
    return DialectChoice(dialect, version, untested=False, shape=_describe_fit(dialect, ready_keys))


def choose_group_dialects(
    engines: Sequence[tuple[str, str, Collection[str] | None]],
) -> list[DialectChoice]:
    """Each engine's dialect, from its ``(name, version, ready keys)`` (see
    :func:`choose_dialect`), in order.

    A client sends each engine its own release's form, but the engines of one group
    (one model, one data-parallel group) come from one deployment: a group that mixes
    releases is a mistake, refused before it serves anything. An engine whose version
    names no release belongs with the others if its ready message is their release's.

    Raises:
        ValueError: ``engines`` is empty, an engine is refused (see
            :func:`choose_dialect`; the message names it), or the engines' releases
            differ (the message names each engine's).
    """
    if not engines:
        raise ValueError("no engine versions to choose a dialect from")
    choices: list[DialectChoice] = []
    for name, version, ready_keys in engines:
        try:
            choices.append(choose_dialect(version, ready_keys))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    releases = {parse_release(choice.version) for choice in choices if choice.shape is None}
    dialects = {choice.dialect.release for choice in choices}
    if len(releases) > 1 or len(dialects) > 1:
        each = ", ".join(
            f"{name} runs {choice.describe()}"
            for (name, _, _), choice in zip(engines, choices, strict=True)
        )
        raise ValueError(
            f"the engines of one group run different vLLM releases ({each}); start every "
            "engine of a group from the same release"
        )
    return choices

"""What each vLLM release speaks at the engine-core boundary, in one table.

vLLM changes its wire format between releases (0.34 packs every ADD's prompt as an
int32 array where 0.33 sent a list of ints, and appends fields to requests, outputs
and the ready response). A client talking to engines of several releases, and an
engine serving clients of several, must know which release's form to write. Each
:class:`Dialect` says that for one release, and nothing else in the package hard-codes
a release's differences: the codec (:mod:`trio_enginecore.serial`), the clients (which
dialect to write to an engine, decided from its ready message) and the reference
engine (which release it announces) all read this table.

Supporting the next vLLM release is a new entry in :data:`DIALECTS`, its golden frames
in ``tests/data/vllm-<version>/``, and an interop run against it.

Pure: no I/O, unit-tested synchronously.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
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
    "choose_group_dialect",
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
    utilities=_UTILITIES_0_33,
)
"""vLLM 0.33: prompts as lists of ints."""

VLLM_0_34: Final[Dialect] = Dialect(
    release=(0, 34),
    tested_version="0.34.0",
    packed_prompts=True,
    request_fields=23,  # + block_hashes
    output_fields=20,  # + watermarking
    ready_keys=33,  # + vllm_config, prefix_hash_config, cache_config_info, config_hash,
    # enable_expert_parallel
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

    def warning(self) -> str | None:
        """The warning to log once for an untested release, else None."""
        if not self.untested:
            return None
        tested = ", ".join(d.tested_version for d in DIALECTS)
        return (
            f"engine runs vLLM {self.version}, newer than any release trio-enginecore was "
            f"tested with ({tested}); speaking {self.dialect.name}'s wire format to it"
        )


def choose_dialect(version: str) -> DialectChoice:
    """The dialect to speak to an engine that announced ``version`` in its ready
    message.

    Raises:
        ValueError: the version is not a vLLM version, or is older than every
            supported release (the message names the supported ones).
    """
    release = parse_release(version)
    if release < OLDEST.release:
        supported = ", ".join(d.name for d in DIALECTS)
        raise ValueError(
            f"vLLM {version} is older than any release trio-enginecore speaks ({supported})"
        )
    # A release the table skips or does not know yet speaks as the newest known one
    # before it: releases append to the format and keep what came before.
    dialect = [d for d in DIALECTS if d.release <= release][-1]
    return DialectChoice(dialect, version, untested=dialect.release != release)


def choose_group_dialect(versions: Sequence[tuple[str, str]]) -> DialectChoice:
    """The dialect of an engine group, from each engine's ``(name, version)``.

    A client sends each engine its own release's form, but the engines of one group
    (one model, one data-parallel group) come from one deployment: a group that mixes
    releases is a mistake, refused before it serves anything.

    Raises:
        ValueError: ``versions`` is empty, a version is unsupported (see
            :func:`choose_dialect`), or the engines' releases differ (the message
            names each engine's version).
    """
    if not versions:
        raise ValueError("no engine versions to choose a dialect from")
    choices: list[DialectChoice] = []
    for name, version in versions:
        try:
            choices.append(choose_dialect(version))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    releases = {parse_release(choice.version) for choice in choices}
    if len(releases) > 1:
        each = ", ".join(f"{name} runs vLLM {version}" for name, version in versions)
        raise ValueError(
            f"the engines of one group run different vLLM releases ({each}); start every "
            "engine of a group from the same release"
        )
    return choices[0]

"""The typed utility wrappers, as one table both client faces read.

Each :class:`UtilitySpec` says what a wrapper such as ``is_sleeping()`` means: which
engine method it calls (its own name), what type each engine's answer is converted to,
and how the answers of several engines combine into the one the caller gets. The Trio
interface (:class:`~trio_enginecore.AsyncEngineCoreClient`) and the blocking one
(:class:`~trio_enginecore.EngineCoreClient`) both route every wrapper through
:func:`combine` over ``call_utility_all``, so with several engines they cannot answer
differently (they once did: the blocking ``sleep()`` slept rank 0 only).

Sans-IO: nothing here waits or touches a socket, so it is unit-tested synchronously.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, final, overload

import attrs
import msgspec

from ...errors import ProtocolError
from ...protocol import CheckpointState
from ._lb import consensus

__all__ = [
    "UTILITIES",
    "UtilitySpec",
    "UtilityTable",
    "agree",
    "all_ready",
    "combine",
    "convert_each",
    "convert_result",
    "first_refusal",
    "merge_checkpoint_states",
    "sleep_arguments",
    "sum_counts",
    "trailing_given",
]

T = TypeVar("T")
R = TypeVar("R")


def agree(method: str, results: Sequence[R]) -> R:
    """The answer every engine gave (``consensus``).

    Raises:
        EngineConsensusError: the engines disagree; names each engine's answer.
    """
    agreed: R = consensus(method, results)
    return agreed


def sum_counts(method: str, results: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """``(waiting, running)`` pairs summed over the engines."""
    return sum(w for w, _ in results), sum(r for _, r in results)


def all_ready(method: str, results: Sequence[bool]) -> bool:
    """Ready only if every engine is."""
    return all(results)


def first_refusal(method: str, results: Sequence[str | None]) -> str | None:
    """The first engine's reason for refusing (by rank), or None if none refused."""
    return next((reason for reason in results if reason is not None), None)


def merge_checkpoint_states(
    method: str, results: Sequence[tuple[CheckpointState, str | None]]
) -> tuple[CheckpointState, str | None]:
    """One ``(state, error)`` for engines that move through a checkpoint
    independently, as vLLM 0.34's data-parallel client merges them: ``failed`` if
    any failed (with the first failed engine's error), else the state they share, else
    the transition under way (``preparing`` if any engine is, else ``restoring``)."""
    first: dict[CheckpointState, str | None] = {}
    for state, error in results:
        first.setdefault(state, error)
    if "failed" in first:
        return "failed", first["failed"]
    if len(first) == 1:
        (state,) = first
        return state, None
    return ("preparing" if "preparing" in first else "restoring"), None


def trailing_given(*args: Any) -> tuple[Any, ...]:
    """``args`` without their trailing Nones: the arguments the caller gave, so an
    engine of a release whose utility has fewer parameters still takes the call."""
    end = len(args)
    while end and args[end - 1] is None:
        end -= 1
    return args[:end]


def sleep_arguments(level: int, mode: str | None, reset_connector: bool | None) -> tuple[Any, ...]:
    """What ``sleep()`` sends: the level, and the mode and ``reset_connector`` given.

    Raises:
        ValueError: ``reset_connector`` without ``mode`` (vLLM's engines would take
            a missing mode as an invalid one).
    """
    if reset_connector is not None and mode is None:
        raise ValueError("sleep(): give mode too when giving reset_connector")
    return trailing_given(level, mode, reset_connector)


def _none_is_awake(awake: bool | None) -> bool:
    # vLLM 0.33's engines answer whether they are fully awake; older ones answer None.
    return awake is not False


@final
@attrs.frozen
class UtilitySpec(Generic[R]):
    """One typed utility wrapper: the engine method, its result type and its rule."""

    name: str
    """The engine method, which is also the wrapper's name on both client faces."""
    result_type: Any
    """The type (for :func:`msgspec.convert`) of each engine's answer."""
    rule: Callable[[str, Sequence[R]], R] = agree
    """How the engines' converted answers combine into one (called with ``name``)."""
    after: Callable[[Any], R] | None = None
    """Applied to each engine's converted answer before the rule (e.g. None -> True)."""


@final
@attrs.frozen
class UtilityTable:
    """Every typed utility wrapper (iterate for the specs, in declaration order)."""

    is_sleeping: UtilitySpec[bool] = UtilitySpec("is_sleeping", bool)
    sleep: UtilitySpec[None] = UtilitySpec("sleep", None)
    wake_up: UtilitySpec[bool] = UtilitySpec("wake_up", bool | None, after=_none_is_awake)
    reset_prefix_cache: UtilitySpec[bool] = UtilitySpec("reset_prefix_cache", bool)
    profile: UtilitySpec[None] = UtilitySpec("profile", None)
    add_lora: UtilitySpec[bool] = UtilitySpec("add_lora", bool)
    remove_lora: UtilitySpec[bool] = UtilitySpec("remove_lora", bool)
    list_loras: UtilitySpec[set[int]] = UtilitySpec("list_loras", set[int])
    pin_lora: UtilitySpec[bool] = UtilitySpec("pin_lora", bool)
    get_supported_tasks: UtilitySpec[tuple[str, ...]] = UtilitySpec(
        "get_supported_tasks", tuple[str, ...]
    )
    execute_dummy_batch: UtilitySpec[None] = UtilitySpec("execute_dummy_batch", None)
    set_weight_version: UtilitySpec[None] = UtilitySpec("set_weight_version", None)
    get_weight_version: UtilitySpec[str | None] = UtilitySpec("get_weight_version", str | None)
    pause_scheduler: UtilitySpec[None] = UtilitySpec("pause_scheduler", None)
    resume_scheduler: UtilitySpec[None] = UtilitySpec("resume_scheduler", None)
    is_scheduler_paused: UtilitySpec[bool] = UtilitySpec("is_scheduler_paused", bool)
    get_request_counts: UtilitySpec[tuple[int, int]] = UtilitySpec(
        "get_request_counts", tuple[int, int], rule=sum_counts
    )
    release_kv_cache_memory: UtilitySpec[None] = UtilitySpec("release_kv_cache_memory", None)
    is_inference_ready: UtilitySpec[bool] = UtilitySpec("is_inference_ready", bool, rule=all_ready)
    checkpoint_prepare: UtilitySpec[str | None] = UtilitySpec(
        "checkpoint_prepare", str | None, rule=first_refusal
    )
    checkpoint_restore: UtilitySpec[None] = UtilitySpec("checkpoint_restore", None)
    checkpoint_state: UtilitySpec[tuple[CheckpointState, str | None]] = UtilitySpec(
        "checkpoint_state", tuple[CheckpointState, str | None], rule=merge_checkpoint_states
    )

    def __iter__(self) -> Iterator[UtilitySpec[Any]]:
        return iter(attrs.astuple(self, recurse=False))


UTILITIES: UtilityTable = UtilityTable()
"""The table: ``UTILITIES.is_sleeping`` is the spec of ``is_sleeping()``."""


@overload
def convert_result(method: str, result: Any, result_type: type[T]) -> T: ...
@overload
def convert_result(method: str, result: Any, result_type: Any) -> Any: ...
def convert_result(method: str, result: Any, result_type: Any) -> Any:
    """A utility's untyped result as ``result_type``, or ProtocolError."""
    try:
        return msgspec.convert(result, result_type, strict=False)
    except msgspec.ValidationError as exc:
        raise ProtocolError(
            f"utility {method!r} returned {result!r}, expected {result_type}: {exc}"
        ) from exc


def convert_each(spec: UtilitySpec[R], results: Sequence[Any]) -> list[R]:
    """Each engine's untyped answer converted (and post-processed) as ``spec`` says.

    Raises:
        ProtocolError: an answer is not of the spec's result type.
    """
    converted = [convert_result(spec.name, result, spec.result_type) for result in results]
    if spec.after is not None:
        return [spec.after(value) for value in converted]
    return converted


def combine(spec: UtilitySpec[R], results: Sequence[Any]) -> R:
    """The wrapper's answer from every engine's untyped one (by rank).

    Raises:
        ProtocolError: an answer is not of the spec's result type.
        EngineConsensusError: engines that must agree disagree.
    """
    return spec.rule(spec.name, convert_each(spec, results))

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

from ..errors import ProtocolError
from ._lb import consensus

__all__ = [
    "UTILITIES",
    "UtilitySpec",
    "UtilityTable",
    "agree",
    "combine",
    "convert_each",
    "convert_result",
    "sum_counts",
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

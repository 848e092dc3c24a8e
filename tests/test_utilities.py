"""The utility table both client faces are built on, and that they cannot drift.

Sans-IO: ``combine`` is tested synchronously, and the faces through small recording
subclasses that answer ``call_utility_all`` themselves (no engine, no socket).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import pytest

from trio_enginecore import AsyncEngineCoreClient, EngineCoreClient, ProtocolError
from trio_enginecore.client._core._stream import RequestStream
from trio_enginecore.client._core._utilities import (
    UTILITIES,
    UtilitySpec,
    UtilityTable,
    agree,
    combine,
    convert_each,
    sleep_arguments,
    sum_counts,
    trailing_given,
)
from trio_enginecore.client._interface import ClientStatistics
from trio_enginecore.engine import EngineCore
from trio_enginecore.errors import EngineConsensusError
from trio_enginecore.protocol import EngineCoreOutputs, EngineCoreRequest
from trio_enginecore.testing import FakeEngine

FACES: tuple[type[Any], ...] = (AsyncEngineCoreClient, EngineCoreClient)

# The public methods of each face that are not typed utility wrappers. A new public
# method is either a wrapper (a spec in the table) or joins this list on purpose.
NOT_WRAPPERS: dict[type[Any], set[str]] = {
    AsyncEngineCoreClient: {
        "add_request",
        "add_requests",
        "get_output",
        "abort_requests",
        "stream",
        "call_utility",
        "call_utility_all",
        "get_request_counts_per_engine",
        "statistics",
        "aclose",
    },
    EngineCoreClient: {
        "add_request",
        "get_output",
        "abort_requests",
        "call_utility",
        "call_utility_all",
        "get_request_counts_per_engine",
        "statistics",
        "close",
        "shutdown",
    },
}

# What two engines answer (untyped, as on the wire) and what the wrapper then returns.
TWO_ENGINES: dict[str, tuple[list[Any], Any]] = {
    "is_sleeping": ([True, True], True),
    "sleep": ([None, None], None),
    "wake_up": ([None, True], True),
    "reset_prefix_cache": ([False, False], False),
    "profile": ([None, None], None),
    "add_lora": ([True, True], True),
    "remove_lora": ([False, False], False),
    "list_loras": ([[3, 4], [4, 3]], {3, 4}),
    "pin_lora": ([True, True], True),
    "get_supported_tasks": ([["generate"], ["generate"]], ("generate",)),
    "execute_dummy_batch": ([None, None], None),
    "set_weight_version": ([None, None], None),
    "get_weight_version": ([None, None], None),
    "pause_scheduler": ([None, None], None),
    "resume_scheduler": ([None, None], None),
    "is_scheduler_paused": ([False, False], False),
    "get_request_counts": ([[1, 2], [3, 4]], (4, 6)),
    "release_kv_cache_memory": ([None, None], None),
    "is_inference_ready": ([True, False], False),
    "checkpoint_prepare": ([None, "Cannot prepare: asleep"], "Cannot prepare: asleep"),
    "checkpoint_restore": ([None, None], None),
    "checkpoint_state": ([["prepared", None], ["preparing", None]], ("preparing", None)),
}

SPECS = list(UTILITIES)
SPEC_IDS = [spec.name for spec in SPECS]


def _placeholders(spec: UtilitySpec[Any]) -> tuple[dict[str, str], tuple[str, ...]]:
    """Arguments for every parameter of the wrapper (the keyword-only ones as keywords),
    and what the engine then receives: one distinct value per parameter, in order."""
    parameters = list(inspect.signature(getattr(EngineCoreClient, spec.name)).parameters.values())
    values = {p.name: f"<{p.name}>" for p in parameters[1:]}
    return values, tuple(values.values())


def _call(face: Any, spec: UtilitySpec[Any]) -> Any:
    values, _ = _placeholders(spec)
    parameters = list(inspect.signature(getattr(EngineCoreClient, spec.name)).parameters.values())
    args = [values[p.name] for p in parameters[1:] if p.kind is not p.KEYWORD_ONLY]
    keywords = {p.name: values[p.name] for p in parameters if p.kind is p.KEYWORD_ONLY}
    return getattr(face, spec.name)(*args, **keywords)


# ------------------------------------------------------------------- the table


def test_every_spec_is_named_after_its_table_entry_and_is_listed_once() -> None:
    fields = [field.name for field in attrs.fields(UtilityTable)]
    assert [spec.name for spec in UTILITIES] == fields
    assert all(getattr(UTILITIES, name).name == name for name in fields)
    assert len(set(fields)) == len(fields)
    assert set(TWO_ENGINES) == set(fields), "give every new spec an example below"


# A typed utility is one spec (client/_core/_utilities.py), one method per face
# (client/_interface.py), the reference engine's @utility method (engine/_core.py) and
# the fake engine's handler (testing.py): these tests fail until all four are there.


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_the_reference_engine_has_a_utility_method_for_every_spec(spec: UtilitySpec[Any]) -> None:
    assert spec.name in EngineCore.utility_names(), f"engine/_core.py: no @utility {spec.name}"
    _, sent = _placeholders(spec)
    # It takes whatever the wrappers send (a wrapper sends at most every parameter).
    # Its keyword-only parameters are the engine's own (a deferred utility's caller).
    signature = inspect.signature(getattr(EngineCore, spec.name))
    own = {p.name: None for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY}
    signature.bind(None, *sent, **own)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_the_fake_engine_answers_every_spec(spec: UtilitySpec[Any]) -> None:
    handler = FakeEngine().utility_handler(spec.name)
    assert handler is not None, f"testing.py: FakeEngine has no handler for {spec.name}"
    _, sent = _placeholders(spec)
    inspect.signature(handler).bind(*sent)


# ------------------------------------------------------------------- combine


def test_agreeing_engines_give_their_common_answer() -> None:
    assert combine(UTILITIES.is_sleeping, [True, True, True]) is True
    assert combine(UTILITIES.is_sleeping, [False]) is False
    assert combine(UTILITIES.sleep, [None, None]) is None
    assert combine(UTILITIES.list_loras, [[1, 2], [2, 1]]) == {1, 2}
    assert combine(UTILITIES.get_supported_tasks, [["generate"]] * 2) == ("generate",)


def test_disagreeing_engines_raise_naming_each_answer() -> None:
    with pytest.raises(EngineConsensusError) as info:
        combine(UTILITIES.is_sleeping, [True, False])
    message = str(info.value)
    assert "is_sleeping" in message
    assert "engine 0: True" in message
    assert "engine 1: False" in message
    with pytest.raises(EngineConsensusError, match=r"engine 1: 'w2'"):
        combine(UTILITIES.get_weight_version, ["w1", "w2"])


def test_request_counts_are_summed_over_the_engines() -> None:
    assert combine(UTILITIES.get_request_counts, [[1, 2], [3, 4], [0, 5]]) == (4, 11)
    assert combine(UTILITIES.get_request_counts, [[0, 0]]) == (0, 0)
    assert sum_counts("get_request_counts", []) == (0, 0)
    # Per engine: converted, not combined.
    assert convert_each(UTILITIES.get_request_counts, [[1, 2], [3, 4]]) == [(1, 2), (3, 4)]


@pytest.mark.parametrize(
    ("spec", "answer"),
    [
        (UTILITIES.is_sleeping, "perhaps"),
        (UTILITIES.sleep, 1),
        (UTILITIES.list_loras, "3"),
        (UTILITIES.get_request_counts, [1, 2, 3]),
        (UTILITIES.get_weight_version, 7),
    ],
    ids=lambda value: value.name if isinstance(value, UtilitySpec) else repr(value),
)
def test_an_answer_of_the_wrong_type_raises_protocol_error(
    spec: UtilitySpec[Any], answer: object
) -> None:
    with pytest.raises(ProtocolError, match=rf"utility {spec.name!r} returned"):
        combine(spec, [answer])
    # One bad engine among good ones is enough.
    good = TWO_ENGINES[spec.name][0][0]
    with pytest.raises(ProtocolError):
        combine(spec, [good, answer])


def test_wake_up_counts_no_answer_as_fully_awake() -> None:
    assert combine(UTILITIES.wake_up, [None]) is True
    assert combine(UTILITIES.wake_up, [None, True]) is True  # an old engine and a new one
    assert combine(UTILITIES.wake_up, [False, False]) is False
    with pytest.raises(EngineConsensusError, match="engine 0: True, engine 1: False"):
        combine(UTILITIES.wake_up, [None, False])


def test_there_is_nothing_to_agree_on_without_engines() -> None:
    with pytest.raises(ValueError, match="no results"):
        agree("is_sleeping", [])


# --------------------------------------------------------- the faces cannot drift


def _public_methods(face: type[Any]) -> set[str]:
    return {name for name in dir(face) if not name.startswith("_")}


@pytest.mark.parametrize("face", FACES, ids=lambda face: face.__name__)
def test_every_public_method_of_a_face_is_in_the_table_or_known_not_to_be(
    face: type[Any],
) -> None:
    wrappers = _public_methods(face) - NOT_WRAPPERS[face]
    assert wrappers == {spec.name for spec in UTILITIES}


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_both_faces_declare_the_wrapper_with_the_same_signature(spec: UtilitySpec[Any]) -> None:
    trio_wrapper = getattr(AsyncEngineCoreClient, spec.name)
    blocking_wrapper = getattr(EngineCoreClient, spec.name)
    assert inspect.iscoroutinefunction(trio_wrapper)
    assert not inspect.iscoroutinefunction(blocking_wrapper)
    trio_signature = inspect.signature(trio_wrapper)
    blocking_signature = inspect.signature(blocking_wrapper)
    assert list(trio_signature.parameters.values()) == list(blocking_signature.parameters.values())
    assert trio_signature.return_annotation == blocking_signature.return_annotation
    assert trio_wrapper.__doc__
    assert blocking_wrapper.__doc__


def test_the_per_engine_counts_have_the_same_signature_on_both_faces() -> None:
    trio_method = AsyncEngineCoreClient.get_request_counts_per_engine
    blocking_method = EngineCoreClient.get_request_counts_per_engine
    assert inspect.iscoroutinefunction(trio_method)
    assert inspect.signature(trio_method) == inspect.signature(blocking_method)
    assert inspect.signature(AsyncEngineCoreClient.call_utility_all) == inspect.signature(
        EngineCoreClient.call_utility_all
    )


class _TrioFace(AsyncEngineCoreClient):
    """The Trio interface over scripted engines: only the utility calls answer."""

    def __init__(self, answers: dict[str, list[Any]] | None = None) -> None:
        self.answers = answers or {}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, args))
        return list(self.answers[method])

    async def call_utility(self, method: str, *args: Any) -> Any:
        raise AssertionError("the wrappers ask every engine")

    async def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        raise NotImplementedError

    async def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def abort_requests(self, request_ids: Iterable[str]) -> None:
        raise NotImplementedError

    def stream(self, request: EngineCoreRequest) -> AbstractAsyncContextManager[RequestStream]:
        raise NotImplementedError

    def statistics(self) -> ClientStatistics:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class _BlockingFace(EngineCoreClient):
    """The blocking interface over the same scripted engines."""

    def __init__(self, answers: dict[str, list[Any]] | None = None) -> None:
        self.answers = answers or {}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, args))
        return list(self.answers[method])

    def call_utility(self, method: str, *args: Any) -> Any:
        raise AssertionError("the wrappers ask every engine")

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        raise NotImplementedError

    def statistics(self) -> ClientStatistics:
        raise NotImplementedError

    def close(self) -> None:
        pass


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
async def test_both_faces_ask_every_engine_and_answer_alike(spec: UtilitySpec[Any]) -> None:
    answers, expected = TWO_ENGINES[spec.name]
    trio_face = _TrioFace({spec.name: answers})
    blocking_face = _BlockingFace({spec.name: answers})
    trio_result = await _call(trio_face, spec)
    blocking_result = _call(blocking_face, spec)
    assert trio_result == blocking_result == expected == combine(spec, answers)
    assert type(trio_result) is type(blocking_result) is type(expected)
    _, sent = _placeholders(spec)
    assert trio_face.calls == blocking_face.calls == [(spec.name, sent)]


@pytest.mark.parametrize(
    ("states", "merged"),
    [
        ([("running", None), ("running", None)], ("running", None)),
        ([("prepared", None), ("prepared", None)], ("prepared", None)),
        ([("prepared", None), ("preparing", None)], ("preparing", None)),
        ([("running", None), ("preparing", None)], ("preparing", None)),
        ([("running", None), ("restoring", None)], ("restoring", None)),
        ([("prepared", None), ("running", None)], ("restoring", None)),
        ([("running", None), ("failed", "e1"), ("failed", "e2")], ("failed", "e1")),
    ],
)
def test_checkpoint_states_merge_as_vllms_client_merges_them(
    states: list[tuple[str, str | None]], merged: tuple[str, str | None]
) -> None:
    assert combine(UTILITIES.checkpoint_state, [list(s) for s in states]) == merged


def test_an_unknown_checkpoint_state_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="checkpoint_state"):
        combine(UTILITIES.checkpoint_state, [["sleeping", None]])


def test_sleep_sends_only_the_arguments_given() -> None:
    assert sleep_arguments(1, None, None) == (1,)
    assert sleep_arguments(2, "abort", None) == (2, "abort")
    assert sleep_arguments(1, "keep", False) == (1, "keep", False)
    with pytest.raises(ValueError, match="give mode too"):
        sleep_arguments(1, None, True)
    assert trailing_given("abort", True, None) == ("abort", True)


async def test_both_faces_give_the_counts_of_each_engine() -> None:
    answers = {"get_request_counts": [[1, 2], [3, 4]]}
    trio_face, blocking_face = _TrioFace(answers), _BlockingFace(answers)
    assert await trio_face.get_request_counts_per_engine() == [(1, 2), (3, 4)]
    assert blocking_face.get_request_counts_per_engine() == [(1, 2), (3, 4)]
    assert trio_face.calls == blocking_face.calls == [("get_request_counts", ())]


async def test_both_faces_raise_when_the_engines_disagree() -> None:
    answers = {"is_sleeping": [True, False]}
    with pytest.raises(EngineConsensusError, match="engine 1: False"):
        await _TrioFace(answers).is_sleeping()
    with pytest.raises(EngineConsensusError, match="engine 1: False"):
        _BlockingFace(answers).is_sleeping()


class _OneTrioEngine(_TrioFace):
    # A one-engine client: it implements call_utility only (as InprocClient does).
    call_utility_all = AsyncEngineCoreClient.call_utility_all

    async def call_utility(self, method: str, *args: Any) -> Any:
        self.calls.append((method, args))
        return self.answers[method][0]


class _OneBlockingEngine(_BlockingFace):
    call_utility_all = EngineCoreClient.call_utility_all

    def call_utility(self, method: str, *args: Any) -> Any:
        self.calls.append((method, args))
        return self.answers[method][0]


async def test_a_one_engine_client_answers_for_all_engines_with_call_utility() -> None:
    answers: dict[str, list[Any]] = {"get_request_counts": [[2, 3]], "sleep": [None]}
    trio_face, blocking_face = _OneTrioEngine(answers), _OneBlockingEngine(answers)
    assert await trio_face.call_utility_all("get_request_counts") == [[2, 3]]
    assert blocking_face.call_utility_all("get_request_counts") == [[2, 3]]
    assert await trio_face.get_request_counts() == blocking_face.get_request_counts() == (2, 3)
    await trio_face.sleep(2)
    blocking_face.sleep(2)
    assert trio_face.calls == blocking_face.calls
    assert trio_face.calls[-1] == ("sleep", (2,))

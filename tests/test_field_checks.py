"""Every field of the request's parameters is checked where it is set, naming it.

* Building ``SamplingParams``, ``PoolingParams`` or ``LoRARequest`` with a value of the
  wrong type raises ``TypeError`` naming the class, the field, what it takes and what
  it got; an int that msgpack cannot carry raises ``ValueError``.
* ``SamplingParams.check()`` (which every client runs on every request) finds the same
  mistakes in parameters changed after they were built.
* The check learns the combinations of value types it has seen, and that never lets a
  wrong value through: the items of a list and the range of an int are still looked at.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import pytest

from trio_enginecore._field_checks import FieldCheck, describe
from trio_enginecore.protocol import (
    LoRARequest,
    PoolingParams,
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"temperature": "hot"}, "SamplingParams.temperature must be a float, got str 'hot'"),
        ({"max_tokens": "5"}, "SamplingParams.max_tokens must be an int or None, got str '5'"),
        ({"max_tokens": 4.0}, "SamplingParams.max_tokens must be an int or None, got float 4.0"),
        ({"max_tokens": True}, "SamplingParams.max_tokens must be an int or None, got bool True"),
        ({"seed": "1"}, "SamplingParams.seed must be an int or None, got str '1'"),
        (
            {"stop_token_ids": [1, "a"]},
            "SamplingParams.stop_token_ids must be a list of int or None, got list [1, 'a'] "
            "(item 1 is str 'a')",
        ),
        ({"ignore_eos": "yes"}, "SamplingParams.ignore_eos must be a bool, got str 'yes'"),
        ({"n": 2.5}, "SamplingParams.n must be an int, got float 2.5"),
        (
            {"logit_bias": {"5": 1.0}},
            "SamplingParams.logit_bias must be a dict of int to float or None, got dict",
        ),
        (
            {"output_kind": "delta"},
            "SamplingParams.output_kind must be a RequestOutputKind (or one of the ints "
            "[0, 1, 2]), got str 'delta'",
        ),
        (
            {"structured_outputs": {"regex": "a+"}},
            "SamplingParams.structured_outputs must be a StructuredOutputsParams or None",
        ),
    ],
)
def test_a_wrong_type_is_named_when_sampling_params_are_built(
    keywords: dict[str, Any], message: str
) -> None:
    with pytest.raises(TypeError) as raised:
        SamplingParams(**keywords)
    assert str(raised.value).startswith(message)


def test_an_int_msgpack_cannot_carry_is_refused_with_the_range() -> None:
    with pytest.raises(
        ValueError, match=r"SamplingParams\.seed is 18446744073709551616: .*64 bits"
    ):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match=r"SamplingParams\.max_tokens is -9223372036854775809"):
        SamplingParams(max_tokens=-(2**63) - 1)
    # The extremes themselves travel.
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_what_a_user_really_writes_is_accepted() -> None:
    params = SamplingParams(
        temperature=1,  # an int where a float is due
        top_p=0.9,
        seed=-5,
        stop="end",
        stop_token_ids=[2, 2, 7],
        logit_bias={5: -1, 6: 0.5},
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=StructuredOutputsParams(choice=["a", "b"]),
        repetition_detection=RepetitionDetectionParams(min_count=3),
        extra_args={"anything": [object()]},
        prompt_logprob_token_ids=np.array([1, 2]),
    )
    assert params.stop == ["end"]
    assert params.stop_token_ids == [2, 7]
    assert SamplingParams(output_kind=1).output_kind == 1  # the IntEnum's int value


def test_nested_parameters_check_their_own_fields() -> None:
    with pytest.raises(TypeError, match=r"StructuredOutputsParams\.choice must be a list of str"):
        StructuredOutputsParams(choice="a")
    with pytest.raises(TypeError, match=r"RepetitionDetectionParams\.min_count must be an int"):
        RepetitionDetectionParams(min_count="3")  # type: ignore[arg-type]
    nested = StructuredOutputsParams()
    nested.regex = 5  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"SamplingParams\.structured_outputs must be"):
        SamplingParams(structured_outputs=nested)


def test_pooling_parameters_and_lora_requests_are_checked_too() -> None:
    with pytest.raises(TypeError, match=r"PoolingParams\.dimensions must be an int or None"):
        PoolingParams(dimensions="3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"LoRARequest\.lora_int_id must be an int, got str"):
        LoRARequest("adapter", "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"LoRARequest\.lora_name must be a str, got NoneType"):
        LoRARequest(None, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value", "error", "message"),
    [
        ("seed", "1", TypeError, r"SamplingParams\.seed must be an int or None, got str '1'"),
        ("stop_token_ids", ["a"], TypeError, r"item 0 is str 'a'"),
        ("stop", 5, TypeError, r"stop must be a str or a list of str or None, got int 5"),
        ("temperature", 5.0, ValueError, r"temperature must be in \[0, 2\], got 5.0"),
        ("stop", "", ValueError, r"stop cannot contain an empty string"),
        ("max_tokens", 2**70, ValueError, r"max_tokens is 1180591620717411303424"),
    ],
)
def test_check_finds_a_field_changed_after_the_parameters_were_built(
    name: str, value: object, error: type[Exception], message: str
) -> None:
    params = SamplingParams(max_tokens=4)
    params.check()
    setattr(params, name, value)
    with pytest.raises(error, match=message):
        params.check()
    assert getattr(params, name) == value  # checking changes nothing


def test_a_copy_made_with_replace_is_checked_as_it_is_built() -> None:
    with pytest.raises(TypeError, match=r"seed must be an int or None"):
        msgspec.structs.replace(SamplingParams(), seed="1")


def test_a_learned_combination_of_types_still_checks_items_and_ranges() -> None:
    params = SamplingParams(stop_token_ids=[1, 2], seed=3)
    params.check()  # this combination of types is now known
    params.stop_token_ids = [1, "2"]  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"item 1 is str '2'"):
        params.check()
    params.stop_token_ids = [1, 2]
    params.seed = 2**64
    with pytest.raises(ValueError, match=r"seed is 18446744073709551616"):
        params.check()
    params.seed = 3
    params.check()


def test_decoding_still_normalises_and_checks() -> None:
    params = SamplingParams(temperature=0.5, stop=["x"], seed=9)
    frame = MsgpackEncoder().encode(params)[0]
    assert MsgpackDecoder(SamplingParams).decode(frame) == params


# --------------------------------------------------- the checker on any Struct


class Example(msgspec.Struct):
    small: Annotated[int, msgspec.Meta(ge=0, le=10)] = 0
    mode: Literal["a", "b"] = "a"
    pairs: dict[str, list[int]] | None = None
    anything: Any = None
    names: frozenset[str] = frozenset()
    share: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.5
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"small": 11}, TypeError, r"Example\.small must be an int in \[0, 10\], got int 11"),
        ({"small": 0.0}, TypeError, r"Example\.small must be an int in \[0, 10\], got float"),
        ({"mode": "c"}, TypeError, r"Example\.mode must be 'a' or 'b', got str 'c'"),
        ({"share": 1.0}, TypeError, r"Example\.share must be a float in \[0, 1\), got float 1\.0"),
        ({"weight": 0}, TypeError, r"Example\.weight must be a float > 0, got int 0"),
        ({"pairs": {"k": [1, None]}}, TypeError, r"Example\.pairs must be a dict of str to"),
        ({"names": {"x"}}, TypeError, r"Example\.names must be a frozenset of str, got set"),
    ],
)
def test_constraints_literals_and_containers_of_any_struct(
    changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    check = FieldCheck(Example)
    check.check(Example())
    value = Example(**changes)
    with pytest.raises(error, match=message):
        check.check(value)


def test_a_value_of_zero_under_a_constraint_is_still_checked() -> None:
    check = FieldCheck(Example)
    check.check(Example(small=0))
    check.check(Example(small=0))  # from the learned plan
    with pytest.raises(TypeError):
        check.check(Example(small=-1))


def test_describe_shortens_long_values() -> None:
    assert describe("1") == "str '1'"
    assert len(describe(list(range(1000)))) == 120

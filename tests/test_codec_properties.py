"""Property tests of the codec: whatever we encode, we decode back unchanged.

Hypothesis builds random wire messages (requests, engine outputs, sampling parameters,
numpy arrays and torch tensors of many dtypes and layouts) and checks that
``MsgpackDecoder(T).decode(MsgpackEncoder().encode(value))`` gives back ``value``,
field by field, with arrays equal in dtype, shape and bits. It also pins down the
transport rules of arrays: small and 0-d arrays travel inline in the payload, the others
in their own aux frame, without being copied on either side unless they have to be.
"""

from __future__ import annotations

import copy
import enum
import math
import time
from typing import Any

import hypothesis.extra.numpy as hnp
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trio_enginecore.errors import ProtocolError
from trio_enginecore.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    LoRARequest,
    PoolingParams,
    PrefillStats,
    RepetitionDetectionParams,
    RequestError,
    RequestOutputKind,
    SamplingParams,
    SchedulerStats,
    StructuredOutputsParams,
    Tensor,
    UtilityOutput,
    UtilityResult,
)
from trio_enginecore.serial import DEFAULT_SIZE_THRESHOLD, MsgpackDecoder, MsgpackEncoder

THRESHOLD = DEFAULT_SIZE_THRESHOLD
assert THRESHOLD == 256, "vLLM 0.33's VLLM_MSGPACK_ZERO_COPY_THRESHOLD"

# --------------------------------------------------------------------- comparison


def assert_same_array(actual: Any, expected: np.ndarray[Any, Any], where: str) -> None:
    """Same dtype (byte order included), same shape, same values, same bits."""
    assert isinstance(actual, np.ndarray), f"{where}: expected an ndarray, got {actual!r}"
    assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.dtype.str == expected.dtype.str, f"{where}: {actual.dtype.str!r}"
    assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
    kind = expected.dtype.kind
    if kind in "mM":  # NaT never compares equal, even to itself
        assert np.array_equal(np.isnat(actual), np.isnat(expected)), where
        ok = ~np.isnat(expected)
        assert np.array_equal(actual[ok], expected[ok]), where
    else:
        assert np.array_equal(actual, expected, equal_nan=kind in "fc"), f"{where}: values differ"
    # Bit-exact as well: NaN payloads, -0.0 and padding bytes of strings included.
    assert actual.tobytes() == expected.tobytes(), f"{where}: bytes differ"


def assert_same(actual: Any, expected: Any, where: str = "$") -> None:
    """Strict structural equality: same types (bool is not int), same values, arrays by bits."""
    if isinstance(expected, np.ndarray):
        assert_same_array(actual, expected, where)
        return
    assert type(actual) is type(expected), (
        f"{where}: {type(actual).__name__} != {type(expected).__name__} "
        f"({actual!r} vs {expected!r})"
    )
    if isinstance(expected, Tensor):
        assert actual.dtype == expected.dtype, f"{where}: tensor dtype {actual.dtype!r}"
        assert_same_array(actual.array, expected.array, f"{where}.array")
    elif isinstance(expected, msgspec.Struct):
        for name in expected.__struct_fields__:
            assert_same(getattr(actual, name), getattr(expected, name), f"{where}.{name}")
    elif isinstance(expected, tuple) and hasattr(expected, "_fields"):  # NamedTuple
        for name in expected._fields:
            assert_same(getattr(actual, name), getattr(expected, name), f"{where}.{name}")
    elif isinstance(expected, UtilityResult):
        assert_same(actual.result, expected.result, f"{where}.result")
        assert_same(actual.type_info, expected.type_info, f"{where}.type_info")
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key, value in expected.items():
            assert_same(actual[key], value, f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        if math.isnan(expected):
            assert math.isnan(actual), f"{where}: {actual!r} is not NaN"
        else:
            assert actual == expected, f"{where}: {actual!r} != {expected!r}"
            assert math.copysign(1, actual) == math.copysign(1, expected), f"{where}: sign"
    elif isinstance(expected, enum.Enum):
        assert actual is expected, f"{where}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def contains_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, dict):
        return any(contains_nan(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(contains_nan(v) for v in value)
    return False


def as_received(frames: list[Any]) -> list[bytes]:
    """The frames as a receiver gets them: fresh immutable byte strings."""
    return [bytes(f) for f in frames]


def roundtrip(value: Any, type_: Any, **decoder_kwargs: Any) -> tuple[Any, list[bytes]]:
    frames = as_received(MsgpackEncoder().encode(value))
    return MsgpackDecoder(type_, **decoder_kwargs).decode(frames), frames


# --------------------------------------------------------------------- strategies

MIN_INT = -(2**63)
INT64 = st.integers(MIN_INT, 2**64 - 1)  # what msgpack can carry
SMALL_INT = st.integers(-(2**31), 2**31)
TOKEN = st.integers(0, 2**31 - 1)
TOKENS = st.lists(TOKEN, max_size=20)
TEXT = st.text(max_size=12)
OPT_TEXT = st.none() | TEXT
ANY_FLOAT = st.floats()  # NaN and infinities included
FINITE = st.floats(allow_nan=False, allow_infinity=False)

# Untyped msgpack values that decode to exactly what was encoded (lists, str-keyed maps).
PLAIN_SCALARS = st.none() | st.booleans() | INT64 | ANY_FLOAT | TEXT | st.binary(max_size=12)
PLAIN = st.recursive(
    PLAIN_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
PLAIN_MAP = st.dictionaries(TEXT, PLAIN, max_size=4)

# The same plus tuples and sets, which msgpack turns into arrays.
HASHABLE = INT64 | TEXT
LOOSE = st.recursive(
    PLAIN_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.sets(HASHABLE, max_size=4)
        | st.frozensets(HASHABLE, max_size=4)
        | st.dictionaries(TEXT, inner, max_size=4)
    ),
    max_leaves=12,
)


def wire_form(value: Any) -> Any:
    """What an untyped msgpack value decodes to: tuples and sets become lists."""
    if isinstance(value, list | tuple):
        return [wire_form(v) for v in value]
    if isinstance(value, set | frozenset):
        return [wire_form(v) for v in value]  # in the set's iteration order, as encoded
    if isinstance(value, dict):
        return {k: wire_form(v) for k, v in value.items()}
    return value


# numpy dtypes the codec must carry: every numeric kind, both byte orders, datetimes,
# fixed-width strings (including one whose single element is over the threshold).
ARRAY_DTYPES = [
    "|b1",
    "|i1",
    "<i2",
    "<i4",
    "<i8",
    "|u1",
    "<u2",
    "<u4",
    "<u8",
    "<f2",
    "<f4",
    "<f8",
    "<c8",
    "<c16",
    ">i2",
    ">i4",
    ">i8",
    ">u8",
    ">f4",
    ">f8",
    ">c16",
    "<M8[ns]",
    "<M8[D]",
    ">M8[us]",
    "<m8[s]",
    ">m8[ms]",
    "|S1",
    "|S7",
    "<U1",
    "<U5",
    ">U3",
    "<U70",
]
MAX_ARRAY_BYTES = 2048
LAYOUTS = ["C", "fortran", "transposed", "strided", "reversed"]


@st.composite
def shapes_for(draw: st.DrawFn, dtype: np.dtype[Any]) -> tuple[int, ...]:
    """0 to 5 dims, empty dims included, at most MAX_ARRAY_BYTES of data."""
    ndim = draw(st.integers(0, 5))
    side = st.integers(0, 300) if ndim == 1 else st.integers(0, 9)
    dims = draw(st.lists(side, min_size=ndim, max_size=ndim))
    while math.prod(dims) * dtype.itemsize > MAX_ARRAY_BYTES:
        biggest = dims.index(max(dims))
        dims[biggest] //= 2
    return tuple(dims)


def with_layout(array: np.ndarray[Any, Any], layout: str) -> np.ndarray[Any, Any]:
    """An array equal to ``array`` with another memory layout (mostly non-contiguous)."""
    if layout == "fortran":
        return np.asfortranarray(array)
    if layout == "transposed":
        return np.ascontiguousarray(array.T).T
    if array.ndim == 0:
        return array
    if layout == "strided":
        base = np.zeros((array.shape[0] * 2, *array.shape[1:]), dtype=array.dtype)
        base[::2] = array
        return base[::2]
    if layout == "reversed":
        return np.ascontiguousarray(array[::-1])[::-1]
    return array


@st.composite
def arrays(
    draw: st.DrawFn, dtypes: list[str] = ARRAY_DTYPES, layouts: list[str] = LAYOUTS
) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    array = draw(hnp.arrays(dtype, shapes_for(dtype)))
    result = with_layout(array, draw(st.sampled_from(layouts)))
    assert result.dtype.str == dtype.str
    return result


SMALL_ARRAYS = hnp.arrays(
    st.sampled_from(["<i4", "<f4", "<i8", "|u1"]),
    hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=80),
)

TORCH_DTYPES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
]
BITS_ONLY = {name for name in TORCH_DTYPES if "float8" in name or name == "bfloat16"}


@st.composite
def tensors(draw: st.DrawFn, names: list[str] = TORCH_DTYPES) -> Tensor:
    name = draw(st.sampled_from(names))
    numpy_name = Tensor.numpy_dtype_for(name)
    assert numpy_name is not None, name
    dtype = np.dtype(numpy_name)
    array = draw(hnp.arrays(dtype, shapes_for(dtype)))
    return Tensor(name, with_layout(array, draw(st.sampled_from(LAYOUTS))))


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


@st.composite
def sampling_params_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    """Keyword arguments of a valid SamplingParams (any subset of its fields)."""
    nonempty_words = st.lists(st.text(min_size=1, max_size=6), max_size=3)
    kwargs: dict[str, Any] = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "n": st.integers(1, 2**40),
                "presence_penalty": st.floats(-2.0, 2.0),
                "frequency_penalty": st.floats(-2.0, 2.0),
                "repetition_penalty": st.floats(
                    min_value=0.0, exclude_min=True, allow_infinity=False
                ),
                "temperature": st.floats(0.0, 2.0),
                "watermarking": optional(st.booleans()),
                "top_p": st.floats(0.0, 1.0, exclude_min=True),
                "top_k": st.integers(-1, 2**40),
                "min_p": st.floats(0.0, 1.0),
                "seed": optional(INT64.filter(lambda s: s < 2**63)),
                "stop": st.none() | st.text(min_size=1, max_size=6) | nonempty_words,
                "stop_token_ids": optional(TOKENS),
                "ignore_eos": st.booleans(),
                "max_tokens": optional(st.integers(1, 2**40)),
                "logprobs": optional(st.integers(-1, 100)),
                "prompt_logprobs": optional(st.integers(-1, 100)),
                "prompt_logprob_token_ids": optional(SMALL_ARRAYS),
                "prompt_logprob_start": optional(SMALL_INT),
                "logprob_token_ids": optional(TOKENS),
                "flat_logprobs": st.booleans(),
                "detokenize": st.booleans(),
                "skip_special_tokens": st.booleans(),
                "spaces_between_special_tokens": st.booleans(),
                "include_stop_str_in_output": st.booleans(),
                "output_kind": st.sampled_from(RequestOutputKind),
                "stream_interval": optional(st.integers(1, 1000)),
                "skip_clone": st.booleans(),
                "output_text_buffer_length": st.integers(0, 100),
                "_eos_token_id": optional(TOKEN),
                "_all_stop_token_ids": st.sets(TOKEN, max_size=5),
                "_watermarking_skipped": st.booleans(),
                "structured_outputs": optional(
                    st.builds(
                        StructuredOutputsParams,
                        json=st.none() | TEXT | PLAIN_MAP,
                        regex=OPT_TEXT,
                        choice=optional(st.lists(TEXT, max_size=3)),
                        grammar=OPT_TEXT,
                        json_object=optional(st.booleans()),
                        disable_any_whitespace=st.booleans(),
                        whitespace_pattern=OPT_TEXT,
                        _backend=OPT_TEXT,
                        _backend_was_auto=st.booleans(),
                    )
                ),
                "logit_bias": optional(st.dictionaries(TOKEN, st.floats(-100, 100), max_size=4)),
                "allowed_token_ids": optional(TOKENS),
                "extra_args": optional(PLAIN_MAP),
                "bad_words": optional(nonempty_words),
                "_bad_words_token_ids": optional(st.lists(TOKENS, max_size=3)),
                "skip_reading_prefix_cache": optional(st.booleans()),
                "thinking_token_budget": optional(st.integers(0, 10**6)),
                "repetition_detection": optional(
                    st.builds(
                        RepetitionDetectionParams,
                        st.integers(0, 64),
                        st.integers(0, 64),
                        st.integers(0, 64),
                    )
                ),
                "routed_experts_prompt_start": st.integers(0, 10**6),
                "trace_decode_token_ids": optional(TOKENS),
            },
        )
    )
    # Cross-field rules: min_tokens <= max_tokens, stop strings need detokenize.
    max_tokens = kwargs.get("max_tokens", 16)
    if draw(st.booleans()):
        kwargs["min_tokens"] = draw(st.integers(0, max_tokens if max_tokens is not None else 10**6))
    if kwargs.get("stop"):
        kwargs["detokenize"] = True
    return kwargs


SAMPLING_PARAMS = sampling_params_kwargs().map(lambda kw: SamplingParams(**kw))

LORA_REQUESTS = st.builds(
    LoRARequest,
    lora_name=TEXT,
    lora_int_id=st.integers(1, 2**31),
    lora_path=TEXT,
    base_model_name=OPT_TEXT,
    load_inplace=st.booleans(),
    is_3d_lora_weight=st.booleans(),
)

POOLING_PARAMS = st.builds(
    PoolingParams,
    use_activation=optional(st.booleans()),
    dimensions=optional(st.integers(1, 4096)),
    step_tag_id=optional(TOKEN),
    returned_token_ids=optional(TOKENS),
    task=OPT_TEXT,
    requires_token_ids=st.booleans(),
    skip_reading_prefix_cache=optional(st.booleans()),
    late_interaction_params=PLAIN,
    extra_kwargs=optional(PLAIN_MAP),
    output_kind=st.sampled_from(RequestOutputKind),
    late_chunking_params=PLAIN,
)


@st.composite
def engine_core_requests(draw: st.DrawFn) -> EngineCoreRequest:
    optional_fields = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "prompt_embeds": optional(tensors()),
                "prompt_is_token_ids": optional(st.lists(st.booleans(), max_size=8)),
                "client_index": st.integers(0, 2**16),
                "current_wave": st.integers(0, 2**32),
                "priority": SMALL_INT,
                "trace_headers": optional(st.dictionaries(TEXT, TEXT, max_size=3)),
                "resumable": st.booleans(),
                "external_req_id": OPT_TEXT,
                "reasoning_ended": optional(st.booleans()),
                "reasoning_parser_kwargs": optional(PLAIN_MAP),
                "abort_immediately": st.booleans(),
                "session_id": OPT_TEXT,
                "kv_hints": PLAIN,
            },
        )
    )
    return EngineCoreRequest(
        request_id=draw(st.text(max_size=40)),
        prompt_token_ids=draw(optional(st.lists(TOKEN, max_size=50))),
        mm_features=draw(optional(st.lists(PLAIN, max_size=3))),
        sampling_params=draw(optional(SAMPLING_PARAMS)),
        pooling_params=draw(optional(POOLING_PARAMS)),
        arrival_time=draw(ANY_FLOAT),
        lora_request=draw(optional(LORA_REQUESTS)),
        cache_salt=draw(OPT_TEXT),
        data_parallel_rank=draw(optional(st.integers(0, 1024))),
        **optional_fields,
    )


def logprobs_lists(arrays_: st.SearchStrategy[Any]) -> st.SearchStrategy[LogprobsLists]:
    return st.builds(
        LogprobsLists,
        arrays_,
        arrays_,
        arrays_,
        optional(st.lists(st.integers(0, 2**20), max_size=5)),
    )


NONZERO_TIMESTAMP = ANY_FLOAT.filter(lambda t: t != 0.0)

ENGINE_CORE_OUTPUT = st.builds(
    EngineCoreOutput,
    request_id=TEXT,
    new_token_ids=TOKENS,
    new_logprobs=optional(logprobs_lists(SMALL_ARRAYS)),
    new_prompt_logprobs_tensors=optional(
        st.builds(
            LogprobsTensors,
            tensors(),
            tensors(),
            tensors(),
            optional(st.lists(st.integers(0, 100), max_size=3)),
            optional(tensors()),
        )
    ),
    pooling_output=optional(tensors()),
    finish_reason=optional(st.sampled_from(FinishReason)),
    stop_reason=st.none() | INT64 | TEXT,
    events=optional(
        st.lists(
            st.builds(EngineCoreEvent, st.sampled_from(EngineCoreEventType), ANY_FLOAT),
            max_size=3,
        )
    ),
    kv_transfer_params=optional(PLAIN_MAP),
    ec_transfer_params=optional(PLAIN_MAP),
    trace_headers=optional(st.dictionaries(TEXT, TEXT, max_size=3)),
    prefill_stats=optional(
        st.builds(PrefillStats, *[st.integers(0, 2**32) for _ in range(6)]),
    ),
    routed_experts=optional(arrays()),
    num_nans_in_logits=st.integers(0, 2**32),
    mm_cache_miss_hashes=optional(st.lists(TEXT, max_size=3)),
    new_sampling_mask=PLAIN,
    spec_decode_metrics=PLAIN,
    prompt_token_id_logprobs=optional(tensors()),
    error=optional(st.builds(RequestError, TEXT, TEXT, st.booleans())),
)

SCHEDULER_STATS = st.builds(
    SchedulerStats,
    num_running_reqs=st.integers(0, 10**6),
    num_waiting_reqs=st.integers(0, 10**6),
    num_skipped_waiting_reqs=st.integers(0, 10**6),
    num_kv_fetch_reqs_by_stage=st.dictionaries(TEXT, st.integers(0, 100), max_size=3),
    step_counter=st.integers(0, 2**40),
    current_wave=st.integers(0, 2**32),
    kv_cache_usage=st.floats(0.0, 1.0),
    iteration_details=PLAIN,
    prefix_cache_stats=PLAIN_MAP,
    connector_prefix_cache_stats=optional(PLAIN_MAP),
    kv_cache_eviction_events=st.lists(PLAIN, max_size=3),
    spec_decoding_stats=PLAIN,
    kv_connector_stats=optional(PLAIN_MAP),
    ec_connector_stats=optional(PLAIN_MAP),
    waiting_lora_adapters=st.dictionaries(TEXT, st.integers(0, 100), max_size=3),
    running_lora_adapters=st.dictionaries(TEXT, st.integers(0, 100), max_size=3),
    cudagraph_stats=PLAIN,
    perf_stats=PLAIN,
)

UTILITY_OUTPUT = st.builds(
    UtilityOutput,
    call_id=INT64,
    failure_message=OPT_TEXT,
    result=optional(st.builds(UtilityResult, LOOSE, PLAIN)),
)

ENGINE_CORE_OUTPUTS = st.builds(
    EngineCoreOutputs,
    engine_index=st.integers(0, 1024),
    outputs=st.lists(ENGINE_CORE_OUTPUT, max_size=4),
    scheduler_stats=optional(SCHEDULER_STATS),
    timestamp=NONZERO_TIMESTAMP,
    utility_output=optional(UTILITY_OUTPUT),
    finished_requests=optional(st.sets(TEXT, max_size=4)),
    wave_complete=optional(st.integers(0, 2**32)),
    start_wave=optional(st.integers(0, 2**32)),
    weight_version=OPT_TEXT,
)


def expected_after_wire(outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    """``outputs`` as a receiver sees it: utility results' tuples and sets are lists."""
    utility = outputs.utility_output
    if utility is None or utility.result is None:
        return outputs
    result = UtilityResult(wire_form(utility.result.result), utility.result.type_info)
    return msgspec.structs.replace(
        outputs, utility_output=msgspec.structs.replace(utility, result=result)
    )


# ------------------------------------------------------------ message round trips


@settings(max_examples=150, deadline=None)
@given(engine_core_requests())
def test_engine_core_request_survives_a_round_trip(request_: EngineCoreRequest) -> None:
    decoded, _ = roundtrip(request_, EngineCoreRequest)
    assert_same(decoded, request_)


@settings(max_examples=100, deadline=None)
@given(ENGINE_CORE_OUTPUTS)
def test_engine_core_outputs_survive_a_round_trip(outputs: EngineCoreOutputs) -> None:
    decoded, _ = roundtrip(outputs, EngineCoreOutputs)
    assert_same(decoded, expected_after_wire(outputs))


@settings(max_examples=150, deadline=None)
@given(LOOSE)
def test_utility_results_arrive_with_tuples_and_sets_as_lists(result: Any) -> None:
    outputs = EngineCoreOutputs(
        timestamp=1.0, utility_output=UtilityOutput(7, result=UtilityResult(result))
    )
    decoded, _ = roundtrip(outputs, EngineCoreOutputs)
    assert decoded.utility_output is not None
    assert decoded.utility_output.result is not None
    assert_same(decoded.utility_output.result.result, wire_form(result))


def test_tuples_and_sets_in_a_utility_result_become_lists() -> None:
    result = {"pair": (1, "a"), "ids": {3}, "nested": [(True, frozenset({"x"}))]}
    outputs = EngineCoreOutputs(
        timestamp=1.0, utility_output=UtilityOutput(1, result=UtilityResult(result))
    )
    decoded, _ = roundtrip(outputs, EngineCoreOutputs)
    assert decoded.utility_output.result.result == {
        "pair": [1, "a"],
        "ids": [3],
        "nested": [[True, ["x"]]],
    }


def test_a_zero_timestamp_is_replaced_by_the_receivers_monotonic_clock() -> None:
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1])], timestamp=5.0)
    outputs.timestamp = 0.0  # as a sender that leaves it unset puts it on the wire
    frames = as_received(MsgpackEncoder().encode(outputs))
    assert MsgpackDecoder().decode(frames)[3] == 0.0, "the wire carries 0.0"
    before = time.monotonic()
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    after = time.monotonic()
    assert before <= decoded.timestamp <= after
    # Omitted entirely (an array too short to reach the field): the same.
    short = MsgpackDecoder(EngineCoreOutputs).decode(msgspec.msgpack.encode([3, []]))
    assert short.engine_index == 3
    assert before <= short.timestamp <= time.monotonic()


@settings(max_examples=100, deadline=None)
@given(NONZERO_TIMESTAMP)
def test_a_nonzero_timestamp_is_kept_exactly(timestamp: float) -> None:
    decoded, _ = roundtrip(EngineCoreOutputs(timestamp=timestamp), EngineCoreOutputs)
    assert_same(decoded.timestamp, timestamp)


# ------------------------------------------------------------------ SamplingParams


def is_default(value: Any, field: msgspec.structs.FieldInfo) -> bool:
    """msgspec's omit_defaults rule: identical to the default, or an empty factory value.

    Floats are compared by identity, so ``temperature=1.0`` spelled out by a caller is
    sent even though it equals the default; vLLM behaves the same way.
    """
    if field.default_factory is not msgspec.NODEFAULT:
        return type(value) is type(field.default_factory()) and not value
    return value is field.default


@settings(max_examples=200, deadline=None)
@given(sampling_params_kwargs())
def test_sampling_params_travel_as_a_map_without_defaults(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    payload = MsgpackEncoder().encode(params)[0]  # aux frames, if any, hold arrays
    wire = MsgpackDecoder().decode(bytes(payload))
    assert isinstance(wire, dict)
    for field in msgspec.structs.fields(SamplingParams):
        value = getattr(params, field.name)
        if is_default(value, field):
            assert field.name not in wire, f"{field.name} equals its default but was sent"
        else:
            assert field.name in wire, f"{field.name}={value!r} differs from default, not sent"
    assert list(wire) == [f for f in SamplingParams.__struct_fields__ if f in wire], "order"


@settings(max_examples=200, deadline=None)
@given(sampling_params_kwargs())
def test_sampling_params_survive_a_round_trip(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    decoded, _ = roundtrip(params, SamplingParams)
    assert_same(decoded, params)
    # Plain `==` agrees, unless an array (no truth-valued `==`) or a NaN is involved.
    structured = params.structured_outputs
    if (
        params.prompt_logprob_token_ids is None
        and not contains_nan(params.extra_args)
        and not (structured is not None and contains_nan(structured.json))
    ):
        assert decoded == params


@settings(max_examples=150, deadline=None)
@given(sampling_params_kwargs())
def test_sampling_params_encoding_is_deterministic(kwargs: dict[str, Any]) -> None:
    # Deep copies: construction normalises (and fills `_all_stop_token_ids` in place),
    # and a set's iteration order depends on its insertion history, not just its items.
    params = SamplingParams(**copy.deepcopy(kwargs))
    encoder = MsgpackEncoder()
    first = as_received(encoder.encode(params))
    assert as_received(encoder.encode(params)) == first
    assert as_received(MsgpackEncoder().encode(params)) == first
    # Constructing again from the same arguments gives the same bytes too.
    again = SamplingParams(**copy.deepcopy(kwargs))
    assert as_received(MsgpackEncoder().encode(again)) == first


def outside(low: float, high: float) -> st.SearchStrategy[float]:
    return (
        st.floats(max_value=low, exclude_max=True)
        | st.floats(min_value=high, exclude_min=True)
        | st.just(math.nan)
    )


WORDS = st.lists(st.text(max_size=3), max_size=3)
WORDS_WITH_AN_EMPTY_ONE = st.tuples(WORDS, WORDS).map(lambda ab: [*ab[0], "", *ab[1]])

# (field, strategy of values the field rejects)
INVALID_SAMPLING_VALUES: list[tuple[str, st.SearchStrategy[Any]]] = [
    ("n", st.integers(MIN_INT, 0)),
    ("presence_penalty", outside(-2.0, 2.0)),
    ("frequency_penalty", outside(-2.0, 2.0)),
    ("repetition_penalty", st.floats(max_value=0.0) | st.sampled_from([math.inf, math.nan])),
    ("temperature", outside(0.0, 2.0)),
    ("top_p", st.floats(max_value=0.0) | st.floats(min_value=1.0, exclude_min=True)),
    ("top_k", st.integers(MIN_INT, -2)),
    ("min_p", outside(0.0, 1.0)),
    ("max_tokens", st.integers(MIN_INT, 0)),
    ("min_tokens", st.integers(MIN_INT, -1)),
    ("stream_interval", st.integers(MIN_INT, 0)),
    ("logprobs", st.integers(MIN_INT, -2)),
    ("prompt_logprobs", st.integers(MIN_INT, -2)),
    ("stop", st.just("") | WORDS_WITH_AN_EMPTY_ONE),
    ("bad_words", WORDS_WITH_AN_EMPTY_ONE),
]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(INVALID_SAMPLING_VALUES).flatmap(lambda fs: st.tuples(st.just(fs[0]), fs[1]))
)
def test_invalid_sampling_params_are_rejected_naming_the_field(case: tuple[str, Any]) -> None:
    name, value = case
    names_the_field = rf"SamplingParams: .*\b{name}\b"
    with pytest.raises(ValueError, match=names_the_field):
        SamplingParams(**{name: value})
    # The same value arriving from the wire is a protocol error naming the field.
    payload = msgspec.msgpack.encode({name: value})
    with pytest.raises(ProtocolError, match=names_the_field):
        MsgpackDecoder(SamplingParams).decode(payload)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"min_tokens": 17}, ["min_tokens", "max_tokens"]),
        ({"min_tokens": 5, "max_tokens": 4}, ["min_tokens", "max_tokens"]),
        ({"stop": ["x"], "detokenize": False}, ["stop", "detokenize"]),
        ({"stop": "x", "detokenize": False}, ["stop", "detokenize"]),
    ],
)
def test_cross_field_sampling_rules_name_both_fields(
    kwargs: dict[str, Any], names: list[str]
) -> None:
    with pytest.raises(ValueError, match="SamplingParams") as info:
        SamplingParams(**kwargs)
    for name in names:
        assert name in str(info.value)


# ------------------------------------------------------------------- numpy arrays


def in_routed_experts(array: Any) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [1], routed_experts=array)], timestamp=1.0
    )


def in_sampling_params(array: Any) -> EngineCoreRequest:
    return EngineCoreRequest(
        "r", [1], None, SamplingParams(prompt_logprob_token_ids=array), None, 1.0, None, None, None
    )


def in_logprobs_lists(array: Any) -> EngineCoreOutputs:
    empty = np.zeros(0, np.int32)
    lists = LogprobsLists(empty, array, empty, [0])
    return EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [1], new_logprobs=lists)], timestamp=1.0
    )


# carrier -> (message builder, decode type, how to find the array in the decoded message)
CARRIERS: dict[str, tuple[Any, Any, Any]] = {
    "EngineCoreOutput.routed_experts": (
        in_routed_experts,
        EngineCoreOutputs,
        lambda m: m.outputs[0].routed_experts,
    ),
    "SamplingParams.prompt_logprob_token_ids": (
        in_sampling_params,
        EngineCoreRequest,
        lambda m: m.sampling_params.prompt_logprob_token_ids,
    ),
    "LogprobsLists.logprobs": (
        in_logprobs_lists,
        EngineCoreOutputs,
        lambda m: m.outputs[0].new_logprobs.logprobs,
    ),
}


def goes_in_aux_frame(array: np.ndarray[Any, Any], threshold: int = THRESHOLD) -> bool:
    """The documented rule: not 0-d and at least ``threshold`` bytes."""
    return array.ndim > 0 and array.nbytes >= threshold


def uint8_view(frame: Any) -> np.ndarray[Any, Any]:
    return np.frombuffer(frame, np.uint8)


@pytest.mark.parametrize("carrier", list(CARRIERS))
@settings(max_examples=150, deadline=None)
@given(array=arrays())
def test_arrays_of_any_dtype_and_layout_survive_a_round_trip(carrier: str, array: Any) -> None:
    build, type_, find = CARRIERS[carrier]
    decoded, frames = roundtrip(build(array), type_)
    result = find(decoded)
    assert_same_array(result, array, carrier)
    assert len(frames) == (2 if goes_in_aux_frame(array) else 1)


@settings(max_examples=200, deadline=None)
@given(array=arrays())
def test_decoded_arrays_view_the_received_frames_without_copying(array: Any) -> None:
    frames = as_received(MsgpackEncoder().encode(in_routed_experts(array)))
    result = MsgpackDecoder(EngineCoreOutputs).decode(frames).outputs[0].routed_experts
    assert result is not None
    assert_same_array(result, array, "routed_experts")
    if goes_in_aux_frame(array):
        assert len(frames) == 2
        assert np.shares_memory(result, uint8_view(frames[1])), "aux array was copied"
    else:
        assert len(frames) == 1
        if array.nbytes:
            assert np.shares_memory(result, uint8_view(frames[0])), "inline array was copied"
    assert not result.flags.writeable, "a view of an immutable received frame is read-only"


@settings(max_examples=150, deadline=None)
@given(array=arrays())
def test_copy_true_gives_private_writable_arrays(array: Any) -> None:
    frames = as_received(MsgpackEncoder().encode(in_routed_experts(array)))
    # Mutable receive buffers: a view would be writable too, so only a copy passes.
    received = [bytearray(f) for f in frames]
    decoder = MsgpackDecoder(EngineCoreOutputs, copy=True)
    result = decoder.decode(received).outputs[0].routed_experts
    assert result is not None
    assert_same_array(result, array, "routed_experts")
    assert result.flags.writeable
    assert result.flags.owndata
    for frame in received:
        assert not np.may_share_memory(result, uint8_view(frame))
    result[...] = np.ones((), result.dtype)
    assert [bytes(f) for f in received] == frames, "writing the copy changed a frame"


@settings(max_examples=150, deadline=None)
@given(array=arrays())
def test_encoder_sends_contiguous_arrays_without_copying_them(array: Any) -> None:
    frames = MsgpackEncoder().encode(in_routed_experts(array))
    if not goes_in_aux_frame(array):
        assert len(frames) == 1
        return
    assert len(frames) == 2
    aux = uint8_view(frames[1])
    assert aux.nbytes == array.nbytes
    if array.flags.c_contiguous:
        assert np.shares_memory(aux, array), "a C-contiguous array must not be copied"
    else:
        assert not np.may_share_memory(aux, array), "a strided array is sent as a C copy"
    assert aux.tobytes() == array.tobytes()


@pytest.mark.parametrize(
    ("dtype", "length", "in_aux"),
    [
        ("|u1", 255, False),
        ("|u1", 256, True),
        ("|u1", 257, True),
        ("<i4", 63, False),
        ("<i4", 64, True),
        ("<c16", 15, False),
        ("<c16", 16, True),
        ("<U70", 0, False),
        ("<U70", 1, True),
    ],
)
def test_the_256_byte_threshold_decides_inline_or_aux(
    dtype: str, length: int, in_aux: bool
) -> None:
    array = np.zeros(length, dtype)
    frames = MsgpackEncoder().encode(in_routed_experts(array))
    assert len(frames) == (2 if in_aux else 1)
    wire = MsgpackDecoder().decode(as_received(frames)[0])
    data = wire[1][0][12][2]
    assert (data == 1) if in_aux else isinstance(data, memoryview), data


def test_a_zero_dimensional_array_is_inline_whatever_its_size() -> None:
    array = np.array("x" * 70, dtype="<U70")  # 280 bytes, over the threshold
    assert array.ndim == 0
    assert array.nbytes >= THRESHOLD
    frames = MsgpackEncoder().encode(in_routed_experts(array))
    assert len(frames) == 1
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(as_received(frames))
    assert_same_array(decoded.outputs[0].routed_experts, array, "0-d")


def test_array_wire_form_is_dtype_shape_data() -> None:
    array = np.arange(6, dtype=">i2").reshape(2, 3)
    (payload,) = MsgpackEncoder().encode(in_routed_experts(array))
    dtype, shape, data = MsgpackDecoder().decode(bytes(payload))[1][0][12]
    assert (dtype, shape, bytes(data)) == (">i2", [2, 3], array.tobytes())


@settings(max_examples=150, deadline=None)
@given(
    array=arrays(),
    threshold=st.sampled_from([0, 1, 255, 257, 10**9]) | st.integers(0, MAX_ARRAY_BYTES),
)
def test_a_custom_size_threshold_moves_arrays_between_inline_and_aux(
    array: Any, threshold: int
) -> None:
    frames = as_received(MsgpackEncoder(size_threshold=threshold).encode(in_routed_experts(array)))
    assert len(frames) == (2 if goes_in_aux_frame(array, threshold) else 1)
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert_same_array(decoded.outputs[0].routed_experts, array, "routed_experts")


def test_size_threshold_zero_sends_even_empty_arrays_in_aux_frames() -> None:
    arrays_: list[np.ndarray[Any, Any]] = [
        np.zeros(0, np.int32),
        np.zeros((3, 0, 2), np.float64),
        np.array(5),
    ]
    lists = LogprobsLists(arrays_[0], arrays_[1], arrays_[2])
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [], new_logprobs=lists)])
    frames = as_received(MsgpackEncoder(size_threshold=0).encode(outputs))
    assert [len(f) for f in frames[1:]] == [0, 0], "two empty aux frames; the 0-d one inline"
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames).outputs[0].new_logprobs
    assert decoded is not None
    for got, want in zip(decoded[:3], arrays_, strict=True):
        assert_same_array(got, want, "new_logprobs")


def test_a_huge_size_threshold_inlines_everything() -> None:
    big = np.arange(10_000, dtype=np.int64)
    frames = MsgpackEncoder(size_threshold=10**9).encode(in_routed_experts(big))
    assert len(frames) == 1
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(as_received(frames))
    assert_same_array(decoded.outputs[0].routed_experts, big, "routed_experts")


def test_a_negative_size_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="size_threshold"):
        MsgpackEncoder(size_threshold=-1)


# -------------------------------------------------------------------- torch tensors


@settings(max_examples=150, deadline=None)
@given(tensor=tensors())
def test_tensors_keep_their_torch_dtype_name_and_bits(tensor: Tensor) -> None:
    request_ = EngineCoreRequest("r", None, None, None, None, 0.0, None, None, None, tensor)
    frames = as_received(MsgpackEncoder().encode(request_))
    assert len(frames) == (2 if goes_in_aux_frame(tensor.array) else 1)
    assert MsgpackDecoder().decode(frames[0])[9][0] == tensor.dtype, "torch name on the wire"
    decoded = MsgpackDecoder(EngineCoreRequest).decode(frames).prompt_embeds
    assert isinstance(decoded, Tensor)
    assert decoded.dtype == tensor.dtype
    assert decoded.array.dtype.str == Tensor.numpy_dtype_for(tensor.dtype)
    assert decoded.shape == tensor.shape
    assert decoded.array.tobytes() == tensor.array.tobytes()
    assert decoded.is_exact == (tensor.dtype not in BITS_ONLY)
    assert decoded == tensor or tensor.array.dtype.kind in "fc"  # NaN != NaN


def test_bfloat16_travels_as_its_raw_16_bit_patterns() -> None:
    bits = np.array([0x3F80, 0xC000, 0x7FC0, 0x0000, 0x8000, 0xFFFF], dtype="<u2")  # 1, -2, nan
    tensor = Tensor("bfloat16", bits)
    output = EngineCoreOutput("r", [], pooling_output=tensor)
    frames = as_received(MsgpackEncoder().encode(EngineCoreOutputs(outputs=[output])))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames).outputs[0].pooling_output
    assert decoded is not None
    assert decoded.dtype == "bfloat16"
    assert not decoded.is_exact
    assert decoded.array.tolist() == bits.tolist()
    # A uint16 tensor with the same bits is a different tensor.
    assert decoded != Tensor("uint16", bits)

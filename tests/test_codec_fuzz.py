"""Fuzzing the decoders: hostile or broken frames are a ProtocolError, and nothing else.

A peer can send anything. Whatever arrives, ``MsgpackDecoder.decode`` either returns a
value of the expected type or raises :class:`~trio_enginecore.errors.ProtocolError` with
a message saying what was wrong; any other exception (or a crash, a hang, a huge
allocation) is a bug. Pickled objects (msgpack extension types 1 and 2) are refused
and never unpickled. A failed decode leaves nothing behind: the same decoder object
decodes the next valid message correctly.
"""

from __future__ import annotations

import gc
import os
import pickle
import weakref
from pathlib import Path
from typing import Any

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
    EngineCoreReadyResponse,
    EngineCoreRequest,
    FinishReason,
    HandshakeHello,
    HandshakeMessage,
    HandshakeReady,
    LogprobsLists,
    LoRARequest,
    PrefillStats,
    RequestError,
    SamplingParams,
    SchedulerStats,
    Tensor,
    UtilityOutput,
    UtilityRequest,
    UtilityResult,
)
from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder

Ext = msgspec.msgpack.Ext

# ------------------------------------------------------------------ valid messages


def _outputs() -> EngineCoreOutputs:
    ids = np.arange(100, dtype=np.int32).reshape(10, 10)  # 400 bytes: aux frame
    lists = LogprobsLists(
        np.arange(6, dtype=np.int32).reshape(2, 3),  # small: inline
        np.linspace(-3, 0, 6, dtype=np.float32).reshape(2, 3),
        np.array([0, 1], dtype=np.int32),
        [0, 1, 2],
    )
    first = EngineCoreOutput(
        "req-1",
        [11, 12],
        new_logprobs=lists,
        pooling_output=Tensor("bfloat16", np.arange(200, dtype="<u2")),  # aux frame
        finish_reason=FinishReason.STOP,
        stop_reason="</s>",
        events=[EngineCoreEvent(EngineCoreEventType.QUEUED, 1.5)],
        kv_transfer_params={"remote": [1, 2], "host": "h"},
        prefill_stats=PrefillStats(num_prompt_tokens=4),
        routed_experts=ids,
        error=RequestError("oops", "it broke", retryable=True),
    )
    second = EngineCoreOutput("req-2", [], finish_reason=FinishReason.LENGTH, stop_reason=7)
    return EngineCoreOutputs(
        engine_index=1,
        outputs=[first, second],
        scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25),
        timestamp=123.5,
        utility_output=UtilityOutput(9, result=UtilityResult({"ok": [1, "two"]})),
        finished_requests={"req-2"},
        wave_complete=3,
    )


def _request() -> EngineCoreRequest:
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        stop=["\n\n"],
        stop_token_ids=[2],
        logit_bias={5: -1.5},
        prompt_logprob_token_ids=np.array([1, 2, 3], dtype=np.int64),
        extra_args={"k": [1, None]},
    )
    return EngineCoreRequest(
        "req-1",
        [1, 2, 3, 4],
        None,
        params,
        None,
        1712345678.25,
        LoRARequest("adapter", 3, "/tmp/adapter"),
        "salt",
        0,
        prompt_embeds=Tensor("float32", np.ones((4, 32), dtype=np.float32)),  # aux frame
        priority=-2,
        trace_headers={"traceparent": "00-abc"},
        kv_hints={"blocks": [1, 2]},
    )


def _ready() -> EngineCoreReadyResponse:
    return EngineCoreReadyResponse(
        max_model_len=4096,
        num_gpu_blocks=1000,
        block_size=16,
        dp_stats_address=None,
        dtype="bfloat16",
        vllm_version="0.33.0",
        world_size=1,
        data_parallel_size=1,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        data_parallel_rank=0,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        instance_id="abc",
        supports_lora=True,
        max_loras=4,
    )


# name -> (decode type, value)
VALID: dict[str, tuple[Any, Any]] = {
    "EngineCoreOutputs": (EngineCoreOutputs, _outputs()),
    "EngineCoreRequest": (EngineCoreRequest, _request()),
    "list[str]": (list[str], ["a", "bb", ""]),
    "UtilityRequest": (UtilityRequest, UtilityRequest(0, 2**64 - 1, "rpc", ("x", 1, [2.5]))),
    "EngineCoreReadyResponse": (EngineCoreReadyResponse, _ready()),
    "HandshakeHello": (HandshakeMessage, HandshakeHello(local=True, headless=False)),
    "HandshakeReady": (HandshakeMessage, HandshakeReady(True, False, "hash", 1234)),
}
NAMES = list(VALID)
WITH_AUX = ["EngineCoreOutputs", "EngineCoreRequest"]

FRAMES: dict[str, list[bytes]] = {
    name: [bytes(f) for f in MsgpackEncoder().encode(value)] for name, (_, value) in VALID.items()
}
assert len(FRAMES["EngineCoreOutputs"]) == 3
assert len(FRAMES["EngineCoreRequest"]) == 2

# One long-lived decoder per message type and copy mode: every fuzz case runs through
# these same objects, and each case checks they still decode a valid message.
DECODERS: dict[tuple[str, bool], MsgpackDecoder[Any]] = {
    (name, copy): MsgpackDecoder(type_, copy=copy)
    for name, (type_, _) in VALID.items()
    for copy in (False, True)
}
UNTYPED = MsgpackDecoder()
UNTYPED_VIEW: dict[str, Any] = {name: UNTYPED.decode(frames) for name, frames in FRAMES.items()}

ALL_DECODERS = [*DECODERS.values(), UNTYPED]


def assert_still_decodes_valid_messages(*decoders: MsgpackDecoder[Any]) -> None:
    """Each decoder turns each valid message of its type back into the original."""
    for decoder in decoders:
        if decoder is UNTYPED:
            for name, frames in FRAMES.items():
                assert UNTYPED.decode(frames) == UNTYPED_VIEW[name]
            continue
        for name, (type_, _) in VALID.items():
            if type_ is decoder.type:
                decoded = decoder.decode(FRAMES[name])
                # Re-encoding what we decoded gives back the very same frames.
                assert [bytes(f) for f in MsgpackEncoder().encode(decoded)] == FRAMES[name]


def test_valid_messages_round_trip_through_every_decoder() -> None:
    assert_still_decodes_valid_messages(*ALL_DECODERS)


FAILED = object()


def decode_or_protocol_error(decoder: MsgpackDecoder[Any], frames: Any) -> Any:
    """Decode; a ProtocolError (with a message) is fine, anything else fails the test."""
    try:
        return decoder.decode(frames)
    except ProtocolError as exc:
        error = exc
    assert str(error).strip(), "a ProtocolError must say what was wrong"
    return FAILED


def protocol_error(decoder: MsgpackDecoder[Any], frames: Any, match: str | None = None) -> str:
    """Decoding must fail with a ProtocolError; returns its message."""
    with pytest.raises(ProtocolError, match=match) as info:
        decoder.decode(frames)
    message = str(info.value)
    assert message.strip()
    return message


# --------------------------------------------------------------- truncated frames


@pytest.mark.parametrize("name", NAMES)
def test_every_truncated_payload_is_a_protocol_error(name: str) -> None:
    payload, *aux = FRAMES[name]
    typed = DECODERS[name, False]
    for cut in range(len(payload)):
        protocol_error(typed, [payload[:cut], *aux])
        protocol_error(UNTYPED, [payload[:cut], *aux])
    assert_still_decodes_valid_messages(typed, UNTYPED)


@pytest.mark.parametrize("name", NAMES)
def test_trailing_bytes_after_a_payload_are_a_protocol_error(name: str) -> None:
    payload, *aux = FRAMES[name]
    for extra in (b"\x00", b"\xc0", payload):
        protocol_error(DECODERS[name, False], [payload + extra, *aux])


@pytest.mark.parametrize("name", WITH_AUX)
def test_missing_aux_frames_are_a_protocol_error_naming_the_frame(name: str) -> None:
    payload, *aux = FRAMES[name]
    decoder = DECODERS[name, False]
    message = protocol_error(decoder, [payload], match="frame")
    assert "no aux frames" in message
    protocol_error(decoder, payload)  # a lone payload buffer is the same thing
    for dropped in range(len(aux)):
        protocol_error(decoder, [payload, *aux[:dropped], *aux[dropped + 1 :]])
    assert_still_decodes_valid_messages(decoder)


@pytest.mark.parametrize("name", WITH_AUX)
@pytest.mark.parametrize("copy", [False, True])
def test_truncated_or_padded_aux_frames_are_a_protocol_error_about_bytes(
    name: str, copy: bool
) -> None:
    payload, *aux = FRAMES[name]
    decoder = DECODERS[name, copy]
    for index, frame in enumerate(aux, start=1):
        variants = [frame[:cut] for cut in range(len(frame))]
        variants += [frame + b"\x00", frame + frame]
        for bad in variants:
            frames = [payload, *aux]
            frames[index] = bad
            message = protocol_error(decoder, frames, match="bytes")
            assert f"its buffer has {len(bad)}" in message
    assert_still_decodes_valid_messages(decoder)


def test_an_empty_frame_list_is_a_protocol_error() -> None:
    for decoder in ALL_DECODERS:
        protocol_error(decoder, [], match="empty message")
        protocol_error(decoder, (), match="empty message")
        protocol_error(decoder, b"", match="truncated")
        protocol_error(decoder, [b""], match="truncated")
        protocol_error(decoder, bytearray(), match="truncated")
    assert_still_decodes_valid_messages(*ALL_DECODERS)


@pytest.mark.parametrize("bad", [None, 5, "x" * 400, [b"x" * 400]])
def test_an_aux_frame_that_is_not_a_buffer_is_a_protocol_error(bad: Any) -> None:
    payload, _, tensor = FRAMES["EngineCoreOutputs"]
    protocol_error(DECODERS["EngineCoreOutputs", False], [payload, bad, tensor])


def test_a_non_contiguous_aux_frame_is_a_protocol_error() -> None:
    payload, ids, tensor = FRAMES["EngineCoreOutputs"]
    strided = np.frombuffer(ids * 2, np.uint8)[::2]
    protocol_error(DECODERS["EngineCoreOutputs", False], [payload, strided, tensor])


def test_any_contiguous_buffer_can_be_an_aux_frame() -> None:
    payload, ids, tensor = FRAMES["EngineCoreOutputs"]
    as_floats_2d = np.frombuffer(ids, "<f4").reshape(10, 10).data  # format "f", 2-d
    frames: list[Any] = [memoryview(payload), as_floats_2d, bytearray(tensor)]
    decoded = DECODERS["EngineCoreOutputs", False].decode(frames)
    assert np.array_equal(decoded.outputs[0].routed_experts, np.arange(100).reshape(10, 10))


class _Frame(bytearray):
    """A received frame we can hold a weak reference to."""


def _frames_and_refs(frames: list[bytes]) -> tuple[list[_Frame], list[weakref.ref[_Frame]]]:
    held = [_Frame(f) for f in frames]
    return held, [weakref.ref(f) for f in held]


@pytest.mark.parametrize("copy", [False, True])
def test_a_failed_decode_keeps_no_reference_to_the_frames(copy: bool) -> None:
    payload, ids, tensor = FRAMES["EngineCoreOutputs"]
    decoder = DECODERS["EngineCoreOutputs", copy]
    frames, refs = _frames_and_refs([payload, ids[:-1], tensor])  # fails on the 2nd array
    with pytest.raises(ProtocolError):
        decoder.decode(frames)
    del frames
    gc.collect()
    assert [r() for r in refs] == [None, None, None], "the decoder kept a frame alive"


def test_decoded_views_keep_their_frames_alive_and_copies_do_not() -> None:
    frames, refs = _frames_and_refs(FRAMES["EngineCoreOutputs"])
    viewed = DECODERS["EngineCoreOutputs", False].decode(frames)
    copied = DECODERS["EngineCoreOutputs", True].decode(list(frames))
    del frames
    gc.collect()
    assert all(r() is not None for r in refs[1:]), "views must keep their aux frames alive"
    del viewed
    gc.collect()
    assert [r() for r in refs] == [None, None, None], "copies must not hold the frames"
    assert np.array_equal(copied.outputs[0].routed_experts, np.arange(100).reshape(10, 10))


@pytest.mark.parametrize("payload", [b"not msgpack", "a str payload", b"ENGINE_CORE_DEAD"])
def test_a_payload_that_is_not_msgpack_is_a_protocol_error(payload: Any) -> None:
    for decoder in ALL_DECODERS:
        protocol_error(decoder, [payload])


# --------------------------------------------------------- byte-level mutations


@st.composite
def mutated_frames(draw: st.DrawFn) -> tuple[str, list[Any]]:
    """A valid message with some bytes flipped, inserted, deleted or frames reshuffled."""
    name = draw(st.sampled_from(NAMES + WITH_AUX * 3))  # mostly the big messages
    frames: list[Any] = list(FRAMES[name])
    for _ in range(draw(st.integers(1, 3))):
        if not frames:
            break
        index = draw(st.integers(0, len(frames) - 1))
        frame = bytes(frames[index])
        at = draw(st.integers(0, len(frame)))
        op = draw(st.sampled_from(["flip", "insert", "delete", "overwrite", "frames"]))
        if op == "flip" and frame:
            at = min(at, len(frame) - 1)
            frame = frame[:at] + bytes([frame[at] ^ draw(st.integers(1, 255))]) + frame[at + 1 :]
        elif op == "insert":
            frame = frame[:at] + draw(st.binary(min_size=1, max_size=8)) + frame[at:]
        elif op == "delete":
            frame = frame[:at] + frame[at + draw(st.integers(1, 8)) :]
        elif op == "overwrite":
            junk = draw(st.binary(min_size=1, max_size=8))
            frame = frame[:at] + junk + frame[at + len(junk) :]
        elif op == "frames":
            frames = draw(st.permutations(frames)) + draw(st.lists(st.binary(), max_size=2))
            frames = frames[: draw(st.integers(1, len(frames)))]  # [] is tested on its own
            continue
        frames[index] = frame
    return name, frames


@settings(max_examples=1000, deadline=None)
@given(mutated_frames(), st.booleans())
def test_mutated_messages_decode_or_raise_protocol_error(
    mutated: tuple[str, list[Any]], copy: bool
) -> None:
    name, frames = mutated
    decoder = DECODERS[name, copy]
    decode_or_protocol_error(decoder, frames)
    decode_or_protocol_error(UNTYPED, frames)
    assert_still_decodes_valid_messages(decoder, UNTYPED)


@settings(max_examples=1000, deadline=None)
@given(st.sampled_from(ALL_DECODERS), st.binary(max_size=200), st.lists(st.binary(), max_size=3))
def test_random_bytes_decode_or_raise_protocol_error(
    decoder: MsgpackDecoder[Any], payload: bytes, aux: list[bytes]
) -> None:
    decode_or_protocol_error(decoder, [payload, *aux])
    assert_still_decodes_valid_messages(decoder)


# ------------------------------------------------- well-formed msgpack, wrong shape

EDGE_INTS = st.sampled_from([0, 1, -1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 2**64 - 1])
MSGPACK_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | EDGE_INTS
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10)
    | st.builds(Ext, st.sampled_from([3, 3, 0, 4, 127, -2]), st.binary(max_size=8))
)
MSGPACK_VALUES = st.recursive(
    MSGPACK_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=25,
)


@settings(max_examples=800, deadline=None)
@given(st.sampled_from(ALL_DECODERS), MSGPACK_VALUES, st.lists(st.binary(), max_size=2))
def test_arbitrary_msgpack_values_decode_or_raise_protocol_error(
    decoder: MsgpackDecoder[Any], value: Any, aux: list[bytes]
) -> None:
    decode_or_protocol_error(decoder, [msgspec.msgpack.encode(value), *aux])
    assert_still_decodes_valid_messages(decoder)


_KEEP_EXT = msgspec.msgpack.Decoder(ext_hook=lambda code, data: Ext(code, bytes(data)))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in a generic msgpack tree (the root is ``()``)."""
    found = [prefix]
    if isinstance(node, list):
        for i, child in enumerate(node):
            found += _paths(child, (*prefix, i))
    elif isinstance(node, dict):
        for key, child in node.items():
            found += _paths(child, (*prefix, key))
    return found


def _replace(node: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    copy = list(node) if isinstance(node, list) else dict(node)
    copy[head] = _replace(node[head], tuple(rest), new)
    return copy


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


@st.composite
def structurally_mutated(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """A valid message with one value swapped for garbage, or one array cut or padded."""
    name = draw(st.sampled_from(NAMES + WITH_AUX * 3))  # mostly the big messages
    payload, *aux = FRAMES[name]
    tree = _KEEP_EXT.decode(payload)
    path = draw(st.sampled_from(_paths(tree)))
    old = _get(tree, path)
    choices = ["garbage", "int"]
    if isinstance(old, list):
        choices += ["shorten", "extend"]
    how = draw(st.sampled_from(choices))
    if how == "garbage":
        new = draw(MSGPACK_VALUES)
    elif how == "int":
        new = draw(EDGE_INTS | st.integers(-(2**63), 2**64 - 1) | st.booleans())
    elif how == "shorten":
        new = old[: draw(st.integers(0, max(len(old) - 1, 0)))]
    else:
        new = old + draw(st.lists(MSGPACK_VALUES, min_size=1, max_size=3))
    return name, [msgspec.msgpack.encode(_replace(tree, path, new)), *aux]


@settings(max_examples=1000, deadline=None)
@given(structurally_mutated(), st.booleans())
def test_valid_messages_with_a_wrong_value_decode_or_raise_protocol_error(
    mutated: tuple[str, list[bytes]], copy: bool
) -> None:
    name, frames = mutated
    decoder = DECODERS[name, copy]
    decode_or_protocol_error(decoder, frames)
    assert_still_decodes_valid_messages(decoder)


@pytest.mark.parametrize(
    ("type_", "value", "match"),
    [
        (list[str], ["a", 1], "Expected `str`"),
        (list[str], {"a": 1}, "Expected `array`"),
        (UtilityRequest, [0, 1], "at least length 3"),
        (UtilityRequest, [0, 1, "m", "args"], r"Expected `array`, got `str` - at `\$\[3\]`"),
        (UtilityRequest, [0, 2**64 - 1, 5, []], "Expected `str`"),
        (EngineCoreRequest, ["r", [1], None, None, None, 0.0, None, None], "at least length 9"),
        (EngineCoreRequest, ["r", ["x"], None, None, None, 0.0, None, None, None], r"\$\[1\]"),
        (EngineCoreRequest, ["r", None, None, {"n": 0}, None, 0.0, None, None, None], "n must"),
        (
            EngineCoreRequest,
            ["r", None, None, {"temperature": 3.0}, None, 0.0, None, None, None],
            "temperature",
        ),
        (EngineCoreOutputs, [0, [["r", [1], None, None, None, 99]]], "FinishReason|99|enum"),
        (EngineCoreOutputs, [0, [["r", [True]]]], "Expected `int`"),
        (EngineCoreOutputs, [0, [], None, 1.0, [7, None, [None]]], "utility result"),
        (EngineCoreOutputs, [-(2**63), [], None, "now"], "Expected `float`"),
        (EngineCoreReadyResponse, {"max_model_len": 1}, "missing required field"),
        (HandshakeMessage, {"status": "BOGUS", "local": True, "headless": True}, "BOGUS"),
        (HandshakeMessage, {"local": True, "headless": True}, "status"),
    ],
)
def test_wrong_shaped_messages_are_a_protocol_error_that_says_why(
    type_: Any, value: Any, match: str
) -> None:
    decoder = MsgpackDecoder(type_)
    protocol_error(decoder, msgspec.msgpack.encode(value), match=match)


# -------------------------------------------------------------- array headers


def outputs_with_array(array: Any, *, tensor: bool = False) -> bytes:
    """An EngineCoreOutputs payload whose routed_experts (or pooling_output) is ``array``."""
    output: list[Any] = ["r", [1], None, None, None, None, None, None, None, None, None, None, None]
    output[4 if tensor else 12] = array
    return msgspec.msgpack.encode([0, [output], None, 1.0])


def inline(data: bytes) -> Ext:
    return Ext(3, data)


ARRAY_DECODER = DECODERS["EngineCoreOutputs", False]
AUX_400 = b"\x00" * 400


@pytest.mark.parametrize(
    ("header", "aux", "match"),
    [
        # shapes that do not match the buffer
        (["<i4", [3], inline(b"\x00" * 8)], [], "needs 12 bytes, its buffer has 8"),
        (["<i4", [2], inline(b"\x00" * 12)], [], "bytes"),
        (["<i4", [10, 10], 1], [AUX_400[:-4]], "bytes"),
        (["<i4", [], inline(b"")], [], "bytes"),  # 0-d needs one element
        (["<i4", [2**40, 2**40], inline(b"")], [], "bytes"),
        (["<i4", [2**32] * 32, inline(b"\x00" * 4)], [], "bytes"),  # product overflows int64
        (["<i4", [0, 2**63], inline(b"")], [], "dimension"),  # numpy refuses the dim
        (["<i4", [0, 2**64 - 1, 2**64 - 1], inline(b"")], [], "dimension"),
        # dims that are not non-negative integers
        (["<i4", [-1], inline(b"")], [], "non-negative"),
        (["<i4", [-4, -1], inline(b"\x00" * 16)], [], "non-negative"),
        (["<i4", [True], inline(b"\x00" * 4)], [], "non-negative"),
        (["<i4", [1.0], inline(b"\x00" * 4)], [], "non-negative"),
        (["<i4", ["1"], inline(b"\x00" * 4)], [], "non-negative"),
        (["<i4", [None], inline(b"\x00" * 4)], [], "non-negative"),
        (["<i4", 4, inline(b"\x00" * 4)], [], "shape must be a list"),
        (["<i4", {"0": 1}, inline(b"\x00" * 4)], [], "shape must be a list"),
        (["|u1", [1] * 33, inline(b"\x00")], [], "33 dimensions"),
        (["|u1", [1] * 10_000, inline(b"\x00")], [], "dimensions"),
        # aux indices
        (["<i4", [100], 0], [AUX_400], "frame 0"),
        (["<i4", [100], -1], [AUX_400], "frame -1"),
        (["<i4", [100], 2], [AUX_400], "frame 2"),
        (["<i4", [100], 2**64 - 1], [AUX_400], "frame"),
        (["<i4", [100], 1], [], "no aux frames"),
        (["<i4", [100], True], [AUX_400], "aux frame index"),
        (["<i4", [100], 1.0], [AUX_400], "aux frame index"),
        (["<i4", [1], None], [], "aux frame index"),
        (["<i4", [1], "\x00\x00\x00\x00"], [], "aux frame index"),
        (["<i4", [1], [0, 0, 0, 0]], [], "aux frame index"),
        # dtypes
        (["O", [1], inline(b"\x00" * 8)], [], "dtype 'O' is not allowed"),
        (["|O", [50], 1], [AUX_400], "not allowed"),
        (["V8", [1], inline(b"\x00" * 8)], [], "dtype 'V8' is not allowed"),
        (["|V4", [1], inline(b"\x00" * 4)], [], "not allowed"),
        (["i4,i4", [1], inline(b"\x00" * 8)], [], "not allowed"),
        (["(2,)i4", [1], inline(b"\x00" * 8)], [], "not allowed"),
        (["U0", [1], inline(b"")], [], "not allowed"),
        (["S0", [1], inline(b"")], [], "not allowed"),
        (["float32", [1], inline(b"\x00" * 4)], [], None),  # a valid numpy name
        (["not a dtype", [1], inline(b"\x00" * 4)], [], "invalid array dtype"),
        (["", [1], inline(b"\x00" * 4)], [], "dtype"),
        (["<i4\x00", [1], inline(b"\x00" * 4)], [], "dtype"),
        (["M8[99999999999999999999s]", [1], inline(b"\x00" * 8)], [], "dtype"),
        (["S99999999999999999999", [0], inline(b"")], [], "dtype"),
        (["[('a', '<i4')]", [1], inline(b"\x00" * 4)], [], "dtype"),
        (["__import__('os')", [1], inline(b"\x00" * 4)], [], "dtype"),
        ([4, [1], inline(b"\x00" * 4)], [], "dtype must be a string"),
        ([None, [1], inline(b"\x00" * 4)], [], "dtype must be a string"),
        # not [dtype, shape, data]
        (["<i4", [1]], [], r"\[dtype, shape, data\]"),
        (["<i4", [1], inline(b"\x00" * 4), 0], [], r"\[dtype, shape, data\]"),
        ({"dtype": "<i4"}, [], r"\[dtype, shape, data\]"),
        ("<i4", [], r"\[dtype, shape, data\]"),
        (7, [], r"\[dtype, shape, data\]"),
    ],
)
def test_contradictory_array_headers_are_a_protocol_error(
    header: Any, aux: list[bytes], match: str | None
) -> None:
    frames = [outputs_with_array(header), *aux]
    if match is None:  # the control case: a well-formed header decodes
        decoded = ARRAY_DECODER.decode(frames).outputs[0].routed_experts
        assert decoded.dtype == np.float32
        return
    protocol_error(ARRAY_DECODER, frames, match=match)
    assert_still_decodes_valid_messages(ARRAY_DECODER)


@pytest.mark.parametrize(
    "name",
    [
        "float128",
        "torch.float32",
        "Float32",
        "qint8",
        "complex32",
        "<f4",  # a numpy name is not a torch name
        "",
        "bfloat16 ",
    ],
)
def test_unknown_torch_dtype_names_are_a_protocol_error(name: str) -> None:
    frames = [outputs_with_array([name, [1], inline(b"\x00" * 4)], tensor=True)]
    protocol_error(ARRAY_DECODER, frames, match="unknown tensor dtype")
    # The control: a real torch name in the same place decodes.
    good = [outputs_with_array(["float32", [1], inline(b"\x00" * 4)], tensor=True)]
    assert ARRAY_DECODER.decode(good).outputs[0].pooling_output.dtype == "float32"


ARRAY_DTYPE_NAMES = st.sampled_from(
    [
        *("<i4", ">f8", "|u1", "|b1", "<U3", "|S2", "<M8[s]", "<c8", "float32", "bfloat16"),
        *("O", "V2", "i4,i4", "<f16", "|i0", "?", "e", "<m8[Y]", "S", "U", "M8"),
    ]
)


@settings(max_examples=500, deadline=None)
@given(
    dtype=ARRAY_DTYPE_NAMES | st.text(max_size=6),
    shape=st.lists(EDGE_INTS | st.integers(-3, 40) | st.booleans(), max_size=5) | MSGPACK_SCALARS,
    data=st.builds(inline, st.binary(max_size=64))
    | st.integers(-2, 4)
    | EDGE_INTS
    | MSGPACK_SCALARS,
    aux=st.lists(st.binary(max_size=64), max_size=3),
    tensor=st.booleans(),
    copy=st.booleans(),
)
def test_random_array_headers_decode_consistently_or_raise_protocol_error(
    dtype: Any, shape: Any, data: Any, aux: list[bytes], tensor: bool, copy: bool
) -> None:
    decoder = DECODERS["EngineCoreOutputs", copy]
    frames = [outputs_with_array([dtype, shape, data], tensor=tensor), *aux]
    decoded = decode_or_protocol_error(decoder, frames)
    if decoded is not FAILED:
        output = decoded.outputs[0]
        array = output.pooling_output.array if tensor else output.routed_experts
        # Whatever was accepted adds up: declared shape, and exactly the buffer's bytes.
        assert list(array.shape) == shape
        if isinstance(data, Ext):
            buffer = data.data
        elif isinstance(data, bytes):  # msgpack bin: accepted like extension 3, as vLLM does
            buffer = data
        else:
            buffer = aux[data - 1]
        assert array.tobytes() == bytes(buffer)
        assert array.flags.writeable == copy
    assert_still_decodes_valid_messages(decoder)


# --------------------------------------------------------- extension types, pickle


class _LeaveAMark:
    """Unpickling this creates a directory: the visible side effect we watch for."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.path,))


def _with_value_inside(value: Any) -> list[tuple[Any, bytes, bool]]:
    """``value`` placed deep inside messages of each type.

    Returns ``(decode type, payload, plain)``: where ``plain`` is true the position is
    typed ``Any``, so the message is valid when ``value`` is a plain msgpack value; the
    other positions are an array header, an array's data, and a message missing its
    required fields.
    """
    output = ["r", [1], None, None, None, None, None, None, None, None, None, None, value]
    request_fields = ["r", None, None, None, None, 0.0, None, None, None, None]
    request_fields += [None, 0, 0, 0, None, False, None, None, None, False, None, value]
    encode = msgspec.msgpack.encode
    return [
        (Any, encode(value), True),
        (Any, encode({"nested": [1, value]}), True),
        (UtilityRequest, encode([0, 1, "method", [value]]), True),
        (EngineCoreRequest, encode(request_fields), True),  # kv_hints
        (
            EngineCoreRequest,
            encode(["r", None, None, {"extra_args": {"x": value}}, None, 0.0, None, None, None]),
            True,
        ),
        (EngineCoreOutputs, encode([0, [], None, 1.0, [1, None, [None, value]]]), True),
        (EngineCoreOutputs, encode([0, [output], None, 1.0]), False),  # as an array
        (
            EngineCoreOutputs,  # as an array's data
            encode([0, [[*output[:12], ["<i4", [1], value]]], None, 1.0]),
            False,
        ),
        (EngineCoreReadyResponse, encode({"kv_events_config": value}), False),
    ]


@pytest.mark.parametrize("code", [1, 2], ids=["pickle", "cloudpickle"])
def test_pickled_objects_are_refused_and_never_unpickled(
    code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The payload is live: unpickling it really does leave a mark.
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_LeaveAMark(control)))
    assert control.is_dir()

    mark = tmp_path / "unpickled"
    trap = Ext(code, pickle.dumps(_LeaveAMark(mark)))

    def tripwire(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the decoder called pickle")

    monkeypatch.setattr(pickle, "loads", tripwire)
    monkeypatch.setattr(pickle, "load", tripwire)
    monkeypatch.setattr(pickle, "Unpickler", tripwire)
    for type_, payload, _ in _with_value_inside(trap):
        message = protocol_error(MsgpackDecoder(type_), [payload])
        assert not mark.exists(), "a pickled payload was unpickled"
        if type_ is not EngineCoreReadyResponse:  # that one may first miss its fields
            assert "pickle" in message
            assert f"extension type {code}" in message
    assert not mark.exists()


@pytest.mark.parametrize("code", [0, 4, 5, 42, 127, -2, -128])
def test_unknown_extension_types_are_a_protocol_error(code: int) -> None:
    for type_, payload, _ in _with_value_inside(Ext(code, b"\x01\x02\x03")):
        message = protocol_error(MsgpackDecoder(type_), [payload])
        if type_ is not EngineCoreReadyResponse:
            assert f"unknown msgpack extension type {code}" in message


def test_a_malformed_msgpack_timestamp_extension_is_a_protocol_error() -> None:
    # Extension -1 is msgpack's standard timestamp, handled by msgspec itself.
    for type_, payload, _ in _with_value_inside(Ext(-1, b"\x01\x02\x03")):
        protocol_error(MsgpackDecoder(type_), [payload])


def test_raw_view_extension_bytes_are_not_accepted_where_text_is_expected() -> None:
    payload = msgspec.msgpack.encode([inline(b"a"), "b"])
    protocol_error(DECODERS["list[str]", False], [payload], match=r"\$\[0\]")


# ------------------------------------------------------------------ deep nesting

DEPTH = 100_000
DEEP_ARRAYS = b"\x91" * DEPTH + b"\xc0"  # [[[[...[nil]...]]]]
DEEP_MAPS = b"\x81\xa1k" * DEPTH + b"\xc0"  # {"k": {"k": ... nil}}
DEEP_MIXED = b"\x81\xa1k\x91" * (DEPTH // 2) + b"\xc0"
PLACEHOLDER = "\x00placeholder\x00"


@pytest.mark.parametrize(
    "deep", [DEEP_ARRAYS, DEEP_MAPS, DEEP_MIXED], ids=["arrays", "maps", "mixed"]
)
def test_deeply_nested_msgpack_is_a_protocol_error(deep: bytes) -> None:
    for decoder in ALL_DECODERS:
        protocol_error(decoder, [deep])
    marker = msgspec.msgpack.encode(PLACEHOLDER)
    for type_, payload, plain in _with_value_inside(PLACEHOLDER):
        assert payload.count(marker) == 1
        decoder = MsgpackDecoder(type_)
        protocol_error(decoder, [payload.replace(marker, deep)])
        if plain:
            assert decoder.decode(payload) is not None, "the same decoder works afterwards"
    assert_still_decodes_valid_messages(*ALL_DECODERS)


def test_moderately_nested_data_in_an_any_field_still_decodes() -> None:
    payload = msgspec.msgpack.encode([0, 1, "m", [[[[[[[[[[1]]]]]]]]]]])
    assert MsgpackDecoder(UtilityRequest).decode(payload).args == ([[[[[[[[[1]]]]]]]]],)


NUMPY_NAMES = [
    *("|b1", "|i1", "<i2", ">i4", "<i8", "|u1", "<u2", ">u4", "<u8", "<f2", "<f4", ">f8"),
    *("<c8", ">c16", "<M8[s]", ">m8[ns]", "|S3", "<U2", ">U1", "float32", "int64", "bool", "d"),
]
TORCH_NAMES = ["float32", "bfloat16", "float16", "int64", "uint8", "bool", "float8_e4m3fn"]


@st.composite
def nearly_valid_arrays(
    draw: st.DrawFn,
) -> tuple[list[Any], list[bytes], bool, bool, bytes]:
    """An array header with a valid dtype and shape, and data that fits, or misses by a bit.

    Returns ``(header, aux frames, tensor, fits, data bytes)``.
    """
    tensor = draw(st.booleans())
    name = draw(st.sampled_from(TORCH_NAMES if tensor else NUMPY_NAMES))
    numpy_name = Tensor.numpy_dtype_for(name) if tensor else name
    assert numpy_name is not None
    itemsize = np.dtype(numpy_name).itemsize
    shape = draw(st.lists(st.integers(0, 6), max_size=4))
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    delta = draw(st.sampled_from([0, 0, 0, 0, -1, 1, -itemsize, itemsize]))
    data = draw(st.binary(min_size=max(nbytes + delta, 0), max_size=max(nbytes + delta, 0)))
    fits = len(data) == nbytes
    where = draw(st.sampled_from(["ext", "bin", "aux"]))
    aux = draw(st.lists(st.binary(max_size=16), max_size=2))
    if where == "aux":
        index = draw(st.integers(1, len(aux) + 1))
        aux.insert(index - 1, data)
        return [name, shape, index], aux, tensor, fits, data
    return [name, shape, inline(data) if where == "ext" else data], aux, tensor, fits, data


@settings(max_examples=800, deadline=None)
@given(nearly_valid_arrays(), st.booleans())
def test_array_headers_are_accepted_exactly_when_the_data_fits(
    case: tuple[list[Any], list[bytes], bool, bool, bytes], copy: bool
) -> None:
    header, aux, tensor, fits, data = case
    decoder = DECODERS["EngineCoreOutputs", copy]
    frames = [outputs_with_array(header, tensor=tensor), *aux]
    if not fits:
        message = protocol_error(decoder, frames, match="bytes")
        assert f"its buffer has {len(data)}" in message
    else:
        output = decoder.decode(frames).outputs[0]
        if tensor:
            assert output.pooling_output.dtype == header[0]
            array = output.pooling_output.array
        else:
            array = output.routed_experts
            assert array.dtype == np.dtype(header[0])
        assert list(array.shape) == header[1]
        assert array.tobytes() == data
        assert array.flags.writeable == copy
    assert_still_decodes_valid_messages(decoder)

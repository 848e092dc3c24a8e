"""Our codec against the golden frames of every supported vLLM release.

For every case in ``tests/data/vllm-<version>/index.json``:

* our typed decoder reads the frames to exactly the values vLLM encoded (the index's
  ``python_value``), arrays included, byte for byte and without copying aux frames;
  a prompt packed as an int32 array (vLLM 0.34) reads as the list of its values, and
  fields a release does not have read as their defaults;
* our encoder, given those values and that release's dialect, produces the same frames
  byte for byte (0.34's packed prompts and trailing nils included);
* an untyped decode gives the index's generic msgpack view.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np
import pytest

from trio_enginecore import protocol
from trio_enginecore.dialects import Dialect
from trio_enginecore.errors import ProtocolError
from trio_enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreRequestType,
    HandshakeMessage,
    StartDPWave,
    Tensor,
    UtilityRequest,
    UtilityResult,
)
from trio_enginecore.serial import (
    MsgpackDecoder,
    MsgpackEncoder,
    outputs_for,
    ready_for,
    request_for,
)

from .vectors import RELEASES, Case, case_ids, index, load_case

# What each case's msg_type decodes to with our schema.
DECODE_TYPES: dict[str, Any] = {
    "EngineCoreRequest": protocol.EngineCoreRequest,
    "EngineCoreOutputs": protocol.EngineCoreOutputs,
    "EngineCoreReadyResponse (dataclass)": protocol.EngineCoreReadyResponse,
    "EngineHandshakeMetadata (dataclass)": protocol.EngineHandshakeMetadata,
    "dict": HandshakeMessage,
    "list[str]": list[str],
    "tuple[int client_index, int call_id, str method, tuple args]": UtilityRequest,
    "tuple[int, int, str, tuple]": UtilityRequest,
    "tuple[int wave, int|None exclude_engine_index]": StartDPWave,
}

# Positional payloads that vLLM sends as bare tuples and we model as array_like structs.
POSITIONAL = (UtilityRequest, StartDPWave)


# ----------------------------------------------------------------- index value form


def release_fields(value: msgspec.Struct, dialect: Dialect) -> tuple[str, ...]:
    """The fields of ``value`` that ``dialect``'s release has (ours are the newest's)."""
    fields = value.__struct_fields__
    count = {
        protocol.EngineCoreRequest: dialect.request_fields,
        protocol.EngineCoreOutput: dialect.output_fields,
        protocol.EngineCoreReadyResponse: dialect.ready_keys,
    }.get(type(value), len(fields))
    return fields[:count]


def as_index_value(value: Any, dialect: Dialect) -> Any:
    """Render one of our decoded values the way index.json writes the values of
    ``dialect``'s release (fields that release does not have must be defaults)."""
    if isinstance(value, POSITIONAL):
        return [as_index_value(getattr(value, f), dialect) for f in value.__struct_fields__]
    if isinstance(value, protocol.HandshakeHello | protocol.HandshakeReady):
        return msgspec.to_builtins(value)
    if isinstance(value, msgspec.Struct):
        out: dict[str, Any] = {"$type": type(value).__name__}
        kept = release_fields(value, dialect)
        for name in value.__struct_fields__[len(kept) :]:
            assert getattr(value, name) in (None, False), f"{name} is not its default"
        for name in kept:
            out[name] = as_index_value(getattr(value, name), dialect)
        return out
    if isinstance(value, UtilityResult):
        return {"$type": "UtilityResult", "result": as_index_value(value.result, dialect)}
    if isinstance(value, enum.Enum):
        return {"$enum": f"{type(value).__name__}.{value.name}", "value": value.value}
    if isinstance(value, set | frozenset):
        return {"$set": sorted(value)}
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, np.ndarray):
        return {"$ndarray": value.dtype.str, "shape": list(value.shape), "nbytes": value.nbytes}
    if isinstance(value, Tensor):
        return {
            "$tensor": f"torch.{value.dtype}",
            "shape": list(value.shape),
            "nbytes": value.array.nbytes,
        }
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        out = {"$namedtuple": type(value).__name__}
        for name in value._fields:
            out[name] = as_index_value(getattr(value, name), dialect)
        return out
    if isinstance(value, list | tuple):
        return [as_index_value(v, dialect) for v in value]
    if isinstance(value, dict):
        return {k: as_index_value(v, dialect) for k, v in value.items()}
    return value


def normalise_expected(value: Any) -> Any:
    """index.json's value with sets sorted (set order is not part of the comparison),
    and a packed prompt as the list of its token ids (how we decode it)."""
    if isinstance(value, dict):
        if "$set" in value:
            return {"$set": sorted(value["$set"])}
        if value.get("$type") == "EngineCoreRequest" and isinstance(
            value.get("prompt_token_ids"), dict
        ):
            value = {**value, "prompt_token_ids": value["prompt_token_ids"]["values"]}
        if "$enum" in value and isinstance(value["value"], str):
            return value["value"]  # a StrEnum travels as its string, and decodes as one
        if "$ndarray" in value or "$tensor" in value:
            # 0.34's index lists an array's values too; its bytes are compared apart.
            value = {k: v for k, v in value.items() if k != "values"}
        return {k: normalise_expected(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise_expected(v) for v in value]
    return value


def generic_view(value: Any) -> Any:
    """Render an untyped decode the way index.json writes ``msgpack_generic`` (which
    shows at most 64 bytes of an inline array)."""
    if isinstance(value, memoryview):
        shown = value[:64].hex()
        return {"$ext": 3, "$ext_name": "RAW_VIEW", "len": value.nbytes, "hex": shown}
    if isinstance(value, bytes):
        return {"$bytes": len(value), "hex": value.hex()}
    if isinstance(value, list):
        return [generic_view(v) for v in value]
    if isinstance(value, dict):
        return {k: generic_view(v) for k, v in value.items()}
    return value


# ------------------------------------------------- building values from index.json


def array_payloads(case: Case, *, with_prompt: bool = True) -> list[bytes]:
    """The raw bytes of every array in the message, in encoding order (without a
    packed prompt's if ``with_prompt`` is false: it decodes to a list).

    ``msgpack_generic`` shows each array as ``[dtype, shape, data]`` with ``data`` either
    an inline extension (hex) or an aux frame index; the frames hold the rest.
    """
    found: list[bytes] = []
    frames = case.message_frames
    generic = case.spec.get("msgpack_generic")
    if not with_prompt and case.msg_type == "EngineCoreRequest":
        generic = [item for position, item in enumerate(generic) if position != 1]

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            if (
                len(node) == 3
                and isinstance(node[0], str)
                and isinstance(node[1], list)
                and (isinstance(node[2], int) or (isinstance(node[2], dict) and "$ext" in node[2]))
                and not isinstance(node[2], bool)
            ):
                data = node[2]
                found.append(bytes.fromhex(data["hex"]) if isinstance(data, dict) else frames[data])
                return
            for v in node:
                walk(v)

    walk(generic)
    return found


def without_defaults(cls: type[msgspec.Struct], fields: dict[str, Any]) -> dict[str, Any]:
    """Drop arguments equal to their defaults, as a caller writing the call by hand would.

    msgspec's ``omit_defaults`` compares floats by identity, so ``temperature=1.0``
    spelled out is sent while the implicit default is not, in vLLM exactly as here.
    """
    info = msgspec.structs.fields(cls)
    kept = {}
    for field in info:
        if field.name not in fields:  # a field the vector's release does not have
            continue
        value = fields[field.name]
        if isinstance(value, np.ndarray | Tensor | tuple):  # no meaningful `==`
            kept[field.name] = value
            continue
        if field.default is not msgspec.NODEFAULT and value == field.default:
            continue
        if field.default_factory is not msgspec.NODEFAULT and value == field.default_factory():
            continue
        kept[field.name] = value
    return kept


def build_value(case: Case) -> Any:
    """Our protocol objects equal to the case's ``python_value``."""
    arrays = iter(array_payloads(case))

    def build(node: Any, *, prompt: bool = False) -> Any:
        if isinstance(node, list):
            return [build(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "$enum" in node:
            return node["value"]
        if "$set" in node:
            return set(node["$set"])
        if "$bytes" in node:
            return bytes.fromhex(node["$bytes"])
        if "$ndarray" in node:
            raw = next(arrays)
            if prompt:
                # A packed prompt: ours are lists of ints. (The index shows at most 64
                # bytes of an inline array.)
                packed = np.array(node["values"], dtype="<i4").tobytes()
                assert len(packed) == node["nbytes"]
                assert packed.startswith(raw)
                return node["values"]
            assert len(raw) == node["nbytes"]
            return np.frombuffer(raw, dtype=node["$ndarray"]).reshape(node["shape"])
        if "$tensor" in node:
            raw = next(arrays)
            name = node["$tensor"].removeprefix("torch.")
            dtype = Tensor.numpy_dtype_for(name)
            assert dtype is not None
            return Tensor(name, np.frombuffer(raw, dtype=dtype).reshape(node["shape"]))
        if "$namedtuple" in node:
            cls = getattr(protocol, node["$namedtuple"])
            return cls(**{k: build(v) for k, v in node.items() if k != "$namedtuple"})
        if "$type" in node:
            cls = getattr(protocol, node["$type"])
            fields = {
                k: build(v, prompt=k == "prompt_token_ids") for k, v in node.items() if k != "$type"
            }
            if cls is UtilityResult:
                return UtilityResult(fields["result"])
            return cls(**without_defaults(cls, fields))
        return {k: build(v) for k, v in node.items()}

    decode_type = DECODE_TYPES[case.msg_type]
    value = build(case.python_value)
    if decode_type is HandshakeMessage:
        cls = {"HELLO": protocol.HandshakeHello, "READY": protocol.HandshakeReady}
        return cls[value.pop("status")](**value)
    if decode_type in POSITIONAL:
        return decode_type(*value)
    return value


# --------------------------------------------------------------------------- tests


def for_wire(dialect: Dialect, value: Any) -> Any:
    """What the codec encodes for ``value`` in ``dialect``'s release."""
    if isinstance(value, protocol.EngineCoreRequest):
        return request_for(dialect, value)
    if isinstance(value, protocol.EngineCoreOutputs):
        return outputs_for(dialect, value)
    if isinstance(value, protocol.EngineCoreReadyResponse):
        return ready_for(dialect, value)
    return value


@pytest.fixture(params=case_ids())
def case(request: pytest.FixtureRequest) -> Case:
    return load_case(request.param)


@pytest.mark.parametrize("release", RELEASES)
def test_vectors_folder_is_present_and_complete(release: str) -> None:
    data = index(release)
    assert data["vllm_version"] == release
    assert data["VLLM_MSGPACK_ZERO_COPY_THRESHOLD"] == 256
    assert {c["msg_type"] for c in data["cases"]} <= {*DECODE_TYPES, "sentinel"}
    assert len(data["cases"]) >= 20


@pytest.mark.parametrize("release", RELEASES)
def test_field_order_matches_vllm(release: str) -> None:
    dialect = load_case(f"{release}/abort_requests").dialect
    counts = {
        "EngineCoreRequest": dialect.request_fields,
        "EngineCoreOutput": dialect.output_fields,
    }
    for name, fields in index(release)["field_order"].items():
        ours = getattr(protocol, name).__struct_fields__
        # Our structs have the newest release's fields; an older release's are a prefix.
        assert list(ours[: counts.get(name, len(ours))]) == fields, name


def test_ready_response_keys_match_each_release() -> None:
    for release in RELEASES:
        case = load_case(f"{release}/engine_ready_response")
        keys = [k for k in case.python_value if k != "$type"]
        assert len(keys) == case.dialect.ready_keys
        assert list(protocol.EngineCoreReadyResponse.__struct_fields__[: len(keys)]) == keys


@pytest.mark.parametrize("release", RELEASES)
def test_request_type_bytes_match_vllm(release: str) -> None:
    for name, hex_byte in index(release)["request_type_bytes"].items():
        assert EngineCoreRequestType[name].value == bytes.fromhex(hex_byte)


def test_routing_frames_match(case: Case) -> None:
    if case.identity is not None:
        assert case.identity == (0).to_bytes(2, "little")
    if case.request_type is not None:
        name, byte = case.request_type
        assert EngineCoreRequestType[name].value == byte


def test_decodes_to_vllm_values(case: Case) -> None:
    if case.msg_type == "sentinel":
        assert case.message_frames == [ENGINE_CORE_DEAD]
        # Not msgpack: a client must recognise it before decoding, and a decoder that
        # is handed it anyway reports a protocol error rather than a bogus message.
        with pytest.raises(ProtocolError):
            MsgpackDecoder(protocol.EngineCoreOutputs).decode(case.message_frames)
        return
    frames = case.message_frames
    decoded = MsgpackDecoder(DECODE_TYPES[case.msg_type]).decode(frames)
    assert as_index_value(decoded, case.dialect) == normalise_expected(case.python_value)
    # vLLM's decoder read the same values back (the index records its view too).
    assert as_index_value(decoded, case.dialect) == normalise_expected(
        case.spec["decoded_with_vllm"]
    )


def test_decoded_arrays_hold_vllms_bytes_without_copying_aux_frames(case: Case) -> None:
    if case.msg_type == "sentinel":
        return
    frames = case.message_frames
    decoded = MsgpackDecoder(DECODE_TYPES[case.msg_type]).decode(frames)
    arrays: list[np.ndarray[Any, Any]] = []

    def collect(node: Any) -> None:
        if isinstance(node, np.ndarray):
            arrays.append(node)
        elif isinstance(node, Tensor):
            arrays.append(node.array)
        elif isinstance(node, msgspec.Struct):
            for f in node.__struct_fields__:
                collect(getattr(node, f))
        elif isinstance(node, list | tuple):
            for v in node:
                collect(v)

    collect(decoded)
    expected = array_payloads(case, with_prompt=False)
    assert [a.tobytes() for a in arrays] == expected
    for array in arrays:
        in_aux = [f for f in frames[1:] if np.shares_memory(array, np.frombuffer(f, np.uint8))]
        if array.nbytes >= 256 and array.ndim > 0:
            assert in_aux, "an aux-frame array must view its frame, not a copy"


def test_encoder_reproduces_vllm_frames(case: Case) -> None:
    if case.msg_type == "sentinel":
        return
    value = build_value(case)
    frames = MsgpackEncoder().encode(for_wire(case.dialect, value))
    assert [bytes(f) for f in frames] == case.message_frames


def test_encode_into_reuses_a_buffer_and_gives_the_same_frames(case: Case) -> None:
    if case.msg_type == "sentinel":
        return
    buffer = bytearray(b"stale content that must be overwritten" * 10)
    frames = MsgpackEncoder().encode_into(for_wire(case.dialect, build_value(case)), buffer)
    assert frames[0] is buffer
    assert [bytes(f) for f in frames] == case.message_frames


def test_untyped_decode_gives_the_generic_msgpack_view(case: Case) -> None:
    if "msgpack_generic" not in case.spec:
        return
    payload = case.message_frames[0]
    assert generic_view(MsgpackDecoder().decode(payload)) == case.spec["msgpack_generic"]

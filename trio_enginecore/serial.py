"""msgpack encoding and decoding of wire messages, with zero-copy numpy arrays.

A message is a list of frames: frame 0 is the msgpack payload, any further frames are
raw array buffers ("aux frames"). An array (or torch tensor) inside a message is encoded
as ``[dtype, shape, data]``, where ``data`` is either

* the raw bytes, inline, as msgpack extension type 3, when the array is smaller than
  the threshold (256 bytes by default) or is 0-dimensional; or
* the integer index of the aux frame that holds the bytes (the payload is index 0, so
  aux indices start at 1), sent without copying the array.

This is vLLM's format (``vllm/v1/serial_utils.py``, the same in 0.33 and 0.34), minus
its insecure pickle/cloudpickle fallbacks: extension types 1 and 2 are refused, never
unpickled, and every decode is typed by the schema in :mod:`trio_enginecore.protocol`.

What differs between vLLM releases is written by :func:`request_for`,
:func:`outputs_for` and :func:`ready_for`, which give the value to encode for one
release's :class:`~trio_enginecore.dialects.Dialect`. Decoding needs no dialect: a
decoder reads a prompt in either release's form, and missing trailing fields take
their defaults.

Encoders and decoders are cheap to keep and not thread-safe: give each task or thread
its own.
"""

from __future__ import annotations

import math
import struct
import typing
import warnings
from collections.abc import Sequence
from typing import Any, Final, Generic, TypeVar, cast, overload

import msgspec
import numpy as np
import numpy.typing as npt

from .dialects import Dialect
from .errors import ProtocolError
from .protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    Tensor,
    UtilityResult,
)

__all__ = [
    "DEFAULT_SIZE_THRESHOLD",
    "EXT_CLOUDPICKLE",
    "EXT_PICKLE",
    "EXT_RAW_VIEW",
    "Buffer",
    "MsgpackDecoder",
    "MsgpackEncoder",
    "outputs_for",
    "ready_for",
    "request_for",
]

T = TypeVar("T")

Buffer = bytes | bytearray | memoryview
"""Anything that can be a frame (``bytes``, ``bytearray`` or a ``memoryview``)."""

DEFAULT_SIZE_THRESHOLD: Final = 256
"""Arrays with fewer bytes than this are inlined in the payload (vLLM's default)."""

EXT_PICKLE: Final = 1
EXT_CLOUDPICKLE: Final = 2
EXT_RAW_VIEW: Final = 3

_MAX_NDIM: Final = 32
_FORBIDDEN_DTYPE_KINDS: Final = frozenset("OV")
_TOKEN_IDS: Final = list[int]


def request_for(dialect: Dialect, request: EngineCoreRequest) -> object:
    """What to encode for ``request`` so that an engine of ``dialect`` reads it.

    For a release that packs prompts, ``prompt_token_ids`` becomes an int32 array,
    inline below vLLM's 256 bytes (whatever the encoder's own threshold), else in an
    aux frame, as vLLM's clients send it; fields the release does not have are left
    out (an engine of that release would ignore them).

    Raises:
        ValueError: a token id does not fit in int32 (the clients check this first).
    """
    fields = dialect.request_fields
    prompt = request.prompt_token_ids
    if not dialect.packed_prompts or prompt is None:
        if fields == len(EngineCoreRequest.__struct_fields__):
            return request
        return msgspec.structs.astuple(request)[:fields]
    values = list(msgspec.structs.astuple(request)[:fields])
    try:
        # struct packs a list of ints twice as fast as numpy converts one (6 µs
        # against 14 for 1024 tokens).
        packed = struct.pack(f"<{len(prompt)}i", *prompt)
    except struct.error:
        raise ValueError(
            f"EngineCoreRequest.prompt_token_ids holds a token id out of int32 range "
            f"({dialect.name} engines take int32 token ids)"
        ) from None
    if len(packed) < DEFAULT_SIZE_THRESHOLD:
        # Inline, as vLLM's clients send it, written here rather than by the encoder's
        # array hook: a third of the cost of a short prompt.
        values[1] = ("<i4", (len(prompt),), msgspec.msgpack.Ext(EXT_RAW_VIEW, packed))
    else:
        values[1] = _AuxFrame("<i4", len(prompt), packed)
    return values


class _AuxFrame:
    """Bytes ready to go as one aux frame of a 1-d array (see ``request_for``): the
    encoder's hook sends them as they are, with no array view to build."""

    __slots__ = ("count", "data", "dtype")

    def __init__(self, dtype: str, count: int, data: bytes) -> None:
        self.dtype = dtype
        self.count = count
        self.data = data


def outputs_for(dialect: Dialect, outputs: EngineCoreOutputs) -> object:
    """What to encode for ``outputs`` in ``dialect``'s form (each output with the
    fields of that release only)."""
    fields = dialect.output_fields
    if fields == len(EngineCoreOutput.__struct_fields__) or not outputs.outputs:
        return outputs
    values = list(msgspec.structs.astuple(outputs))
    values[1] = [msgspec.structs.astuple(output)[:fields] for output in outputs.outputs]
    return values


def ready_for(dialect: Dialect, ready: EngineCoreReadyResponse) -> object:
    """What to encode for a ready response in ``dialect``'s form (its keys only)."""
    if dialect.ready_keys == len(EngineCoreReadyResponse.__struct_fields__):
        return ready
    return dict(list(msgspec.structs.asdict(ready).items())[: dialect.ready_keys])


def _array_wire_bytes(array: npt.NDArray[Any]) -> memoryview:
    """A flat byte view of ``array``'s elements, copying only if it is not C-contiguous."""
    contiguous = np.ascontiguousarray(array)
    # Viewing as uint8 works for every dtype (datetime, float16, ...) where a plain
    # memoryview of the array would reject the buffer format.
    return contiguous.reshape(-1).view(np.uint8).data


class MsgpackEncoder:
    """Encodes wire messages into a list of frames.

    Args:
        size_threshold: arrays of at least this many bytes (and not 0-d) go in their own
            zero-copy aux frame; smaller ones are inlined in the payload.

    The returned aux frames are views of the caller's arrays: do not modify an array
    until the frames that view it have been sent.
    """

    def __init__(self, *, size_threshold: int = DEFAULT_SIZE_THRESHOLD) -> None:
        if size_threshold < 0:
            raise ValueError(f"size_threshold must be >= 0, got {size_threshold}")
        self.size_threshold = size_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Buffer] | None = None

    def encode(self, obj: object) -> list[Buffer]:
        """Encode ``obj`` into ``[payload, aux1, aux2, ...]``.

        Raises:
            TypeError: ``obj`` holds a value the wire format cannot carry (an arbitrary
                Python object, an object-dtype array, ...). Nothing is ever pickled.
        """
        frames: list[Buffer] = [b""]
        self._frames = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = None
        return frames

    def encode_into(self, obj: object, buffer: bytearray) -> list[Buffer]:
        """Like :meth:`encode`, but writes the payload into ``buffer`` (resized to fit).

        Reusing one ``bytearray`` saves an allocation per message on hot paths; the
        buffer must not be reused until the frames have been sent.
        """
        frames: list[Buffer] = [buffer]
        self._frames = frames
        try:
            self._encoder.encode_into(obj, buffer)
        finally:
            self._frames = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            array = cast("npt.NDArray[Any]", obj)
            return self._encode_array(array.dtype.str, array)
        if isinstance(obj, Tensor):
            return self._encode_array(obj.dtype, obj.array)
        if isinstance(obj, _AuxFrame):
            frames = self._frames
            assert frames is not None, "the hook only runs inside encode()"
            frames.append(obj.data)
            return obj.dtype, (obj.count,), len(frames) - 1
        if isinstance(obj, UtilityResult):
            return (obj.type_info, obj.result)
        raise TypeError(
            f"cannot encode an object of type {type(obj).__qualname__}: the wire format "
            "carries msgpack values, protocol structs and numpy arrays only"
        )

    def _encode_array(
        self, dtype_name: str, array: npt.NDArray[Any]
    ) -> tuple[str, tuple[int, ...], int | msgspec.msgpack.Ext]:
        if array.dtype.kind in _FORBIDDEN_DTYPE_KINDS or array.dtype.hasobject:
            raise TypeError(f"arrays of dtype {array.dtype} cannot be sent (object/void)")
        data: int | msgspec.msgpack.Ext
        if array.ndim == 0 or array.nbytes < self.size_threshold:
            data = msgspec.msgpack.Ext(EXT_RAW_VIEW, _array_wire_bytes(array))
        else:
            frames = self._frames
            assert frames is not None, "the hook only runs inside encode()"
            data = len(frames)
            frames.append(_array_wire_bytes(array))
        return dtype_name, array.shape, data


class MsgpackDecoder(Generic[T]):
    """Decodes frames into a typed wire message.

    Args:
        type: the expected message type, e.g. ``EngineCoreOutputs``; ``Any`` decodes
            untyped msgpack (arrays then stay as ``[dtype, shape, data]`` lists).
        copy: if false (the default), decoded arrays are views of the received
            frames (read-only for immutable frames: ``bytes`` and zmq frames), which
            stay alive as long as the arrays do. If true, arrays are private writable
            copies.

    Decoding never runs code named by the data: it only builds the types of the schema.
    """

    @overload
    def __init__(self: MsgpackDecoder[Any], *, copy: bool = ...) -> None: ...

    @overload
    def __init__(self, type: type[T], *, copy: bool = ...) -> None: ...

    @overload
    def __init__(self, type: Any, *, copy: bool = ...) -> None: ...

    def __init__(self, type: Any = Any, *, copy: bool = False) -> None:
        self.type = type
        self.copy = copy
        self._decoder = msgspec.msgpack.Decoder(
            type, dec_hook=self._dec_hook, ext_hook=self._ext_hook
        )
        self._frames: Sequence[Buffer] = ()
        self._settle = self._settle_prompt if type is EngineCoreRequest else None

    def decode(self, frames: Buffer | Sequence[Buffer]) -> T:
        """Decode one message from its frames (or from a lone payload buffer).

        Raises:
            ProtocolError: the frames are not a valid message of the expected type:
                malformed or truncated msgpack, wrong types or missing fields, an
                unknown or refused (pickle) extension type, an array whose dtype, shape
                or buffer does not add up, or an aux index with no frame. The message
                says what was wrong and where (``$[1][0]`` is field 1, element 0).
        """
        message: Sequence[Buffer]
        if isinstance(frames, bytes | bytearray | memoryview):
            message = [cast("Buffer", frames)]
        else:
            message = frames
        if not message:
            raise ProtocolError("empty message: expected at least a payload frame")
        self._frames = message
        try:
            value = self._decoder.decode(message[0])
            if self._settle is not None:
                self._settle(value)
            return cast("T", value)
        except ProtocolError:
            raise
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"invalid {self._type_name()} message: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"malformed msgpack payload: {exc}") from exc
        except Exception as exc:
            # Anything a hook or a __post_init__ raised that msgspec did not wrap:
            # callers always get one exception type.
            raise ProtocolError(f"invalid {self._type_name()} message: {exc}") from exc
        finally:
            self._frames = ()

    def _type_name(self) -> str:
        return getattr(self.type, "__name__", None) or str(self.type)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == EXT_RAW_VIEW:
            return bytes(data) if self.copy else data
        if code in (EXT_PICKLE, EXT_CLOUDPICKLE):
            raise ValueError(
                f"msgpack extension type {code} (pickled Python object) refused: "
                "trio-enginecore never unpickles data from the wire (is the peer running "
                "with VLLM_ALLOW_INSECURE_SERIALIZATION=1?)"
            )
        raise ValueError(f"unknown msgpack extension type {code}")

    def _dec_hook(self, type_: Any, obj: Any) -> Any:
        origin = typing.get_origin(type_) or type_
        if origin is np.ndarray:
            dtype_name, array = self._decode_array(obj, numpy_names=True)
            return array
        if origin is Tensor:
            dtype_name, array = self._decode_array(obj, numpy_names=False)
            return Tensor(dtype_name, array)
        if origin is UtilityResult:
            pair = cast("list[Any]", obj) if isinstance(obj, list) else None
            if pair is None or len(pair) != 2:
                raise TypeError("expected a utility result `[type_info, result]`")
            return UtilityResult(pair[1], type_info=pair[0])
        raise TypeError(f"no decoder for type {type_!r}")

    def _settle_prompt(self, request: EngineCoreRequest) -> None:
        # `prompt_token_ids` arrives untyped (see protocol.PromptTokenIds). A list of
        # token ids (vLLM 0.33) never starts with a string; an array (`[dtype, shape,
        # data]`, vLLM 0.34) always does.
        raw: Any = request.prompt_token_ids
        if raw is None:
            return
        if isinstance(raw, list) and raw and isinstance(raw[0], str):
            try:
                dtype_name, array = self._decode_array(raw, numpy_names=True)
            except (TypeError, ValueError) as exc:
                raise ProtocolError(
                    f"invalid EngineCoreRequest message: {exc} - at `$[1]` (prompt_token_ids)"
                ) from None
            if array.ndim != 1 or array.dtype.kind not in "iu":
                raise ProtocolError(
                    "invalid EngineCoreRequest message: a prompt must be a 1-d integer "
                    f"array, got dtype {dtype_name} and shape {tuple(array.shape)} - at "
                    "`$[1]` (prompt_token_ids)"
                )
            request.prompt_token_ids = array.tolist()
            return
        try:
            request.prompt_token_ids = msgspec.convert(raw, _TOKEN_IDS)
        except msgspec.ValidationError as exc:
            message = str(exc)
            where = (
                message.replace("`$", "`$[1]", 1)
                if " - at `$" in message
                else f"{message} - at `$[1]`"
            )
            raise ProtocolError(
                f"invalid EngineCoreRequest message: {where} (prompt_token_ids)"
            ) from None

    def _decode_array(self, obj: Any, *, numpy_names: bool) -> tuple[str, npt.NDArray[Any]]:
        items = cast("list[Any]", obj) if isinstance(obj, list) else None
        if items is None or len(items) != 3:
            raise TypeError("expected an array as `[dtype, shape, data]`")
        dtype_name, shape, data = items
        if not isinstance(dtype_name, str):
            raise TypeError(f"array dtype must be a string, got {type(dtype_name).__name__}")
        dtype = self._parse_dtype(dtype_name, numpy_names=numpy_names)
        dims = self._parse_shape(shape)
        buffer = self._array_buffer(data)
        expected = math.prod(dims) * dtype.itemsize
        if buffer.nbytes != expected:
            raise ValueError(
                f"array of dtype {dtype_name} and shape {tuple(dims)} needs {expected} "
                f"bytes, its buffer has {buffer.nbytes}"
            )
        array = np.frombuffer(buffer, dtype=dtype).reshape(dims)
        if self.copy:
            array = array.copy()
        return dtype_name, array

    @staticmethod
    def _parse_dtype(name: str, *, numpy_names: bool) -> np.dtype[Any]:
        if not numpy_names:
            numpy_name = Tensor.numpy_dtype_for(name)
            if numpy_name is None:
                raise ValueError(f"unknown tensor dtype {name!r}")
            name = numpy_name
        try:
            with warnings.catch_warnings():
                # A deprecated alias ("a") is refused, not merely warned about.
                warnings.simplefilter("error")
                dtype = np.dtype(name)
        except (TypeError, ValueError, SyntaxError, Warning) as exc:
            raise ValueError(f"invalid array dtype {name!r}") from exc
        if dtype.kind in _FORBIDDEN_DTYPE_KINDS or dtype.hasobject or dtype.itemsize == 0:
            raise ValueError(f"array dtype {name!r} is not allowed on the wire")
        return dtype

    @staticmethod
    def _parse_shape(shape: Any) -> list[int]:
        if not isinstance(shape, list):
            raise TypeError(f"array shape must be a list, got {type(shape).__name__}")
        dims = cast("list[Any]", shape)
        if len(dims) > _MAX_NDIM:
            raise ValueError(f"array has {len(dims)} dimensions, at most {_MAX_NDIM} allowed")
        for dim in dims:
            if type(dim) is not int or dim < 0:
                raise ValueError(f"array shape {dims!r} must hold non-negative integers")
        return cast("list[int]", dims)

    def _array_buffer(self, data: Any) -> memoryview:
        if isinstance(data, bytes | memoryview):
            return memoryview(cast("bytes", data))
        if type(data) is not int:
            raise TypeError(
                "array data must be inline bytes (extension type 3) or an aux frame index"
            )
        frames = self._frames
        if not 1 <= data < len(frames):
            raise ValueError(
                f"array refers to frame {data}, but the message has aux frames 1..{len(frames) - 1}"
                if len(frames) > 1
                else f"array refers to frame {data}, but the message has no aux frames"
            )
        frame = memoryview(frames[data])
        return frame.cast("B") if frame.format != "B" or frame.ndim != 1 else frame

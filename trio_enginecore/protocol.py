"""The EngineCore wire protocol, as spoken by vLLM 0.33 and 0.34.

Every message that crosses the sockets between a client and an engine is defined
here as a :class:`msgspec.Struct` with the same field names, field order, defaults and
encoding as vLLM (the newest supported release's fields), so a trio-enginecore client
can talk to a vLLM engine and a vLLM frontend can talk to our reference engine. What
differs between releases (a prompt's form, how many trailing fields are written) is
in :mod:`trio_enginecore.dialects`. The golden frames in ``tests/data/vllm-0.33.0``
and ``tests/data/vllm-0.34.0`` (produced by vLLM's own encoders) are the executable
form of this module: the test suite decodes each of them with our decoder and
re-encodes them byte for byte in their release's dialect.

Encodings
---------

* ``array_like`` structs (:class:`EngineCoreRequest`, :class:`EngineCoreOutputs`,
  :class:`EngineCoreOutput`, :class:`UtilityOutput`, :class:`LoRARequest`,
  :class:`PoolingParams`) travel as a msgpack *array* holding every field in
  declaration order: the position is the wire format.
* :class:`SamplingParams` travels as a map keyed by field name with fields equal to
  their default left out. Its ``__post_init__`` applies vLLM's normalisations (``stop``,
  ``stop_token_ids`` and ``bad_words`` become lists, ``_all_stop_token_ids`` collects the
  stop token ids, ...) so the same arguments produce the same bytes as vLLM.
* Messages that vLLM declares as dataclasses (:class:`EngineCoreReadyResponse`,
  :class:`SchedulerStats`, the handshake metadata, ...) travel as a map with *every*
  field present, in declaration order.
* numpy arrays travel as ``[dtype.str, shape, data]`` and torch tensors as
  ``[torch_dtype_name, shape, data]``; ``data`` is the raw bytes inline (msgpack
  extension type 3) for small arrays, or the index of an extra zero-copy frame. See
  :mod:`trio_enginecore.serial`.

Fields we cannot model without torch or vLLM (multimodal features, KV-transfer hints,
speculative-decoding metrics, ...) are typed ``Any``: they decode to plain msgpack
values (lists, maps, numbers, strings, raw extension bytes) and never crash the decoder.
Torch tensors decode to :class:`Tensor`, which keeps the torch dtype name so the value
re-encodes exactly as vLLM sent it.

Schema evolution
----------------

The wire format is append-only. Any change to this module must follow these rules,
which are msgspec's and vLLM's:

1. A new field must have a default value.
2. In an ``array_like`` struct, never reorder fields; new fields go at the end.
   Decoders accept shorter arrays (missing trailing fields take their defaults) and
   ignore extra trailing elements, which is how an older peer stays compatible.
3. Never change the type of an existing field, and never reuse a removed field's
   position or name for something else.
4. Never change the meaning of a request-type byte, an enum value or an extension code.

Leading-underscore fields (``SamplingParams._eos_token_id`` and friends) are part of the
wire format: vLLM's engine reads them. They keep their vLLM names here; public
read-only properties (:attr:`SamplingParams.all_stop_token_ids`, ...) give access to
them without touching private names.
"""

from __future__ import annotations

import enum
import functools
import math
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    ClassVar,
    Final,
    Literal,
    NamedTuple,
    TypeAlias,
    TypedDict,
    Unpack,
)

import msgspec
import numpy as np
import numpy.typing as npt

from ._field_checks import FieldCheck
from ._keywords import check_keywords, known_keywords

__all__ = [
    "COORDINATOR_READY",
    "COORDINATOR_SUBSCRIBE",
    "COORDINATOR_UNSUBSCRIBE",
    "ENGINE_CORE_DEAD",
    "REPORTS_OWN_WAVES",
    "SCALE_ELASTIC_EP",
    "CheckpointState",
    "CoordinatorPublication",
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreReadyResponse",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "EngineHandshakeMetadata",
    "EngineZmqAddresses",
    "FinishReason",
    "HandshakeHello",
    "HandshakeMessage",
    "HandshakeReady",
    "LoRARequest",
    "LogprobsLists",
    "LogprobsTensors",
    "PauseMode",
    "PoolingParams",
    "PrefillStats",
    "PrefixHashConfig",
    "PromptTokenIds",
    "RepetitionDetectionParams",
    "RequestError",
    "RequestOutputKind",
    "SamplingKeywords",
    "SamplingParams",
    "ScaleElasticEP",
    "SchedulerStats",
    "StartDPWave",
    "StructuredOutputsParams",
    "Tensor",
    "UtilityOutput",
    "UtilityRequest",
    "UtilityResult",
    "identity_for_rank",
]

ENGINE_CORE_DEAD: Final = b"ENGINE_CORE_DEAD"
"""The single raw frame (not msgpack) an engine sends on its output socket when it dies."""

EEP_NOTIFICATION_CALL_ID: Final = -1
"""``UtilityOutput.call_id`` of elastic-EP notifications (not replies to a call)."""

FT_STATUS_CALL_ID: Final = -2
"""``UtilityOutput.call_id`` of fault-tolerance engine-status notifications."""

COORDINATOR_SUBSCRIBE: Final = b"\x01"
"""What a subscriber (an engine, or a front-end) sends a coordinator's XPUB socket first:
XSUB's subscription to every topic."""

COORDINATOR_UNSUBSCRIBE: Final = b"\x00"
"""What ZeroMQ sends for a subscriber that leaves."""

COORDINATOR_READY: Final = b"READY"
"""The single frame a coordinator sends engines once every engine has subscribed."""

SCALE_ELASTIC_EP: Final = "SCALE_ELASTIC_EP"
"""The tag of :class:`ScaleElasticEP`, the only message a front-end sends a coordinator."""

REPORTS_OWN_WAVES: Final = -1
"""``EngineCoreOutputs.wave_complete`` a reference engine sends its coordinator once, when
it connects, to say that it reports the completion of each wave itself (it has no
collective through which rank 0 could speak for it, as vLLM's rank 0 does). vLLM's
coordinator ignores it: no wave is numbered below 0."""


# --------------------------------------------------------------------------- enums


class EngineCoreRequestType(enum.Enum):
    """The one-byte type frame that precedes every client-to-engine payload."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    # Engine-internal queue markers in vLLM; they never travel on the wire, and an
    # engine receiving them from a client must reject them.
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"


class FinishReason(enum.IntEnum):
    """Why a request finished. Encoded as its integer value."""

    STOP = 0
    """A stop string, a stop token or EOS was produced."""
    LENGTH = 1
    """``max_tokens`` or the model's maximum length was reached."""
    ABORT = 2
    """The request was aborted (by the client, or by the engine while draining)."""
    ERROR = 3
    """The engine failed to process the request; ``EngineCoreOutput.error`` says why."""
    REPETITION = 4
    """Repetition detection ended the request."""

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    """Request lifecycle events reported by the engine when asked to."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


CheckpointState = Literal["running", "preparing", "prepared", "restoring", "failed"]
"""A vLLM 0.34 engine's process-checkpoint state (``checkpoint_state()``; vLLM's
``StrEnum`` travels as its string). An engine serves only while ``running``."""

PauseMode = Literal["abort", "wait", "keep"]
"""What pausing the scheduler does with the requests in flight: abort them, wait for
them to finish, or keep them paused where they are (vLLM's ``PauseMode``)."""


class RequestOutputKind(enum.IntEnum):
    """How the frontend should turn engine outputs into user-visible outputs."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# ------------------------------------------------------------------ tensor carrier

# torch dtype names (as vLLM writes them on the wire) -> numpy dtype strings. Dtypes
# numpy lacks (bfloat16, the float8 family) are carried as unsigned integers of the
# same width, which preserves their bits exactly.
_TORCH_TO_NUMPY: Final[dict[str, str]] = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "complex128": "<c16",
    "complex64": "<c8",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "|i1",
    "uint64": "<u8",
    "uint32": "<u4",
    "uint16": "<u2",
    "uint8": "|u1",
    "bool": "|b1",
    "float8_e4m3fn": "|u1",
    "float8_e4m3fnuz": "|u1",
    "float8_e5m2": "|u1",
    "float8_e5m2fnuz": "|u1",
    "float8_e8m0fnu": "|u1",
}
_NUMPY_TO_TORCH: Final[dict[str, str]] = {
    "<f8": "float64",
    "<f4": "float32",
    "<f2": "float16",
    "<c16": "complex128",
    "<c8": "complex64",
    "<i8": "int64",
    "<i4": "int32",
    "<i2": "int16",
    "|i1": "int8",
    "<u8": "uint64",
    "<u4": "uint32",
    "<u2": "uint16",
    "|u1": "uint8",
    "|b1": "bool",
}
_BITS_ONLY: Final = frozenset(
    {"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"}
    | {"float8_e8m0fnu"}
)


class Tensor:
    """A torch tensor as it travels on the wire, held without torch.

    vLLM writes tensors as ``[dtype_name, shape, data]`` with torch's dtype names
    (``"float32"``, ``"bfloat16"``), which differ from numpy's (``"<f4"``). A
    :class:`Tensor` keeps that name so it re-encodes exactly as it arrived, and holds
    the elements in a numpy array that views the received frame (no copy).

    Attributes:
        dtype: the torch dtype name, without the ``torch.`` prefix.
        array: the elements. For dtypes numpy has no type for (``bfloat16``, the
            ``float8`` family) this is an unsigned-integer array of the same width
            holding the raw bits; :attr:`is_exact` tells which case applies.
    """

    __slots__ = ("array", "dtype")

    def __init__(self, dtype: str, array: npt.NDArray[Any]) -> None:
        expected = _TORCH_TO_NUMPY.get(dtype)
        if expected is None:
            raise ValueError(f"unsupported torch dtype name {dtype!r}")
        if array.dtype.str != expected:
            raise ValueError(
                f"a {dtype} tensor needs a numpy array of dtype {expected!r}, "
                f"got {array.dtype.str!r}"
            )
        self.dtype = dtype
        self.array = array

    @classmethod
    def from_numpy(cls, array: npt.NDArray[Any]) -> Tensor:
        """Wrap a numpy array, naming its dtype the way torch does.

        Raises:
            ValueError: the dtype has no torch equivalent (e.g. big-endian or strings).
        """
        name = _NUMPY_TO_TORCH.get(array.dtype.str)
        if name is None:
            raise ValueError(f"numpy dtype {array.dtype.str!r} has no torch equivalent")
        return cls(name, array)

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return tuple(self.array.shape)

    @property
    def is_exact(self) -> bool:
        """True when :attr:`array` holds the values themselves, not just their bits."""
        return self.dtype not in _BITS_ONLY

    @staticmethod
    def numpy_dtype_for(dtype: str) -> str | None:
        """The numpy dtype string used to hold a torch dtype, or None if unknown."""
        return _TORCH_TO_NUMPY.get(dtype)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tensor):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.array.shape == other.array.shape
            and bool(np.array_equal(self.array, other.array))
        )

    __hash__: ClassVar[None] = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Tensor(dtype={self.dtype!r}, shape={self.shape!r})"


class UtilityResult:
    """The result of a utility call, wrapped as vLLM wraps it.

    On the wire it is ``[type_info, result]``. ``type_info`` is nil unless the engine
    runs with vLLM's insecure serialization, in which case it names Python types for
    the receiver to rebuild; we keep it as plain data and never import or unpickle
    anything it names. ``result`` is plain msgpack data (tuples and sets arrive as
    lists); the typed client wrappers convert it.
    """

    __slots__ = ("result", "type_info")

    def __init__(self, result: Any = None, type_info: Any = None) -> None:
        self.result = result
        self.type_info = type_info

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UtilityResult):
            return NotImplemented
        return bool(self.result == other.result and self.type_info == other.type_info)

    __hash__: ClassVar[None] = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"UtilityResult({self.result!r})"


class LogprobsLists(NamedTuple):
    """Sampled-token logprobs of one step (numpy arrays), as vLLM sends them."""

    logprob_token_ids: npt.NDArray[Any]
    logprobs: npt.NDArray[Any]
    sampled_token_ranks: npt.NDArray[Any]
    cu_num_generated_tokens: list[int] | None = None


class LogprobsTensors(NamedTuple):
    """Prompt logprobs (torch tensors on the vLLM side), as vLLM sends them.

    vLLM 0.33 and 0.34 both send all five fields (the last two are None in a prompt's
    logprobs), so a four-field form would refuse what their engines send.
    """

    logprob_token_ids: Tensor
    logprobs: Tensor
    selected_token_ranks: Tensor
    cu_num_generated_tokens: list[int] | None = None
    cu_num_generated_tokens_tensor: Tensor | None = None


# ------------------------------------------------------------ request-side structs


if TYPE_CHECKING:
    PromptTokenIds: TypeAlias = list[int]
else:
    # vLLM 0.33 sends a prompt as a list of ints and 0.34 as an int32 array
    # (`["<i4", [n], data]`): both msgpack arrays, which no msgspec type can tell
    # apart. msgspec decodes the field untyped, and MsgpackDecoder then reads either
    # form into a checked list of ints.
    PromptTokenIds = Any
"""A prompt's token ids: a ``list[int]`` in Python, whichever form it travelled in
(see :mod:`trio_enginecore.dialects`)."""


class StructuredOutputsParams(msgspec.Struct, gc=False):
    """Constraints for structured (guided) decoding. A map with every field present."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    _backend: str | None = None
    _backend_was_auto: bool = False

    def __post_init__(self) -> None:
        field_check(StructuredOutputsParams).check(self)


class RepetitionDetectionParams(msgspec.Struct, gc=False):
    """Parameters of n-gram repetition detection. A map with every field present."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        field_check(RepetitionDetectionParams).check(self)


_SAMPLING_EPS: Final = 1e-5
_MIN_TEMPERATURE: Final = 1e-2


@functools.cache
def field_check(cls: type[msgspec.Struct]) -> FieldCheck:
    """The check of ``cls``'s fields against its annotations, built on first use."""
    return FieldCheck(cls)


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """How to sample the tokens of one request (vLLM's ``SamplingParams``).

    On the wire, a map of the fields that differ from their defaults. Construction
    (and decoding, since msgspec runs ``__post_init__`` on decode) normalises the same
    way vLLM does, so equal arguments give equal bytes, and validates the values.

    Every field is checked against its annotation (``SamplingParams.seed must be an
    int or None, got str '1'``), before any normalising; a field set after
    construction is checked again by :meth:`check`, which every client calls.

    Raises:
        TypeError: a value of the wrong type (the message names the field).
        ValueError: a value out of range, or an int beyond the 64 bits msgpack
            carries (the message names the field). When this happens while decoding,
            the decoder reports it as a :class:`~trio_enginecore.errors.ProtocolError`.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: npt.NDArray[Any] | None = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int | None = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    _eos_token_id: int | None = None
    # The bare `set` factory matters: omit_defaults recognises an empty builtin
    # collection as the default, not a `set[int]()` one.
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)  # pyright: ignore[reportUnknownVariableType]
    _watermarking_skipped: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    _bad_words_token_ids: list[list[int]] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        _SAMPLING_FIELDS.check(self)
        if 0 < self.temperature < _MIN_TEMPERATURE:
            # Tiny temperatures overflow the softmax; vLLM raises them to a floor.
            self.temperature = _MIN_TEMPERATURE
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        # Deduplicate keeping first occurrences: order matters for byte equality.
        self.stop_token_ids = (
            [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        )
        self.bad_words = [] if self.bad_words is None else list(dict.fromkeys(self.bad_words))
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.stop and not self.include_stop_str_in_output:
            # Characters the detokenizer holds back until no stop string can match.
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        self._validate()
        if self.temperature < _SAMPLING_EPS:
            # Greedy sampling: the truncation knobs are meaningless, reset them.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        self._all_stop_token_ids.update(self.stop_token_ids)
        if self.skip_reading_prefix_cache is None:
            # Prompt logprobs need every prompt token computed, not read from cache.
            self.skip_reading_prefix_cache = (
                self.prompt_logprobs is not None or self.prompt_logprob_token_ids is not None
            )

    def check(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the field if one is wrong.

        Construction checks every field; this checks them again, for parameters
        changed since (``params.seed = "1"``). Changes nothing. The clients call it on
        every request they send, and the reference engine on every request it gets.
        """
        _SAMPLING_FIELDS.check(self)
        self._validate()

    def _validate(self) -> None:
        max_tokens = self.max_tokens
        if (
            # The common case in one expression; the checks below name the culprit.
            self.n >= 1
            and -2.0 <= self.presence_penalty <= 2.0
            and -2.0 <= self.frequency_penalty <= 2.0
            and 0.0 < self.repetition_penalty < math.inf
            and 0.0 <= self.temperature <= 2.0
            and 0.0 < self.top_p <= 1.0
            and self.top_k >= -1
            and 0.0 <= self.min_p <= 1.0
            and 0 <= self.min_tokens <= (max_tokens if max_tokens is not None else math.inf)
            and (max_tokens is None or max_tokens >= 1)
            and (self.stream_interval is None or self.stream_interval >= 1)
            and (self.logprobs is None or self.logprobs >= -1)
            and (self.prompt_logprobs is None or self.prompt_logprobs >= -1)
        ):
            stop: object = self.stop
            if type(stop) is list:
                if not stop and not self.bad_words:
                    return
                if all(stop) and (self.detokenize or not stop) and all(self.bad_words or ()):
                    return
        self._find_invalid()

    def _find_invalid(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"SamplingParams: {what}")

        if self.n < 1:
            raise bad(f"n must be at least 1, got {self.n}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise bad(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            raise bad(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise bad(f"stream_interval must be at least 1, got {self.stream_interval}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                raise bad(f"{name} must be >= 0 or -1 (all), got {value}")
        # Lists once built; a str or None only if set since (check()).
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(not s for s in stop):
            raise bad("stop cannot contain an empty string")
        if stop and not self.detokenize:
            raise bad("stop strings need detokenize=True")
        if any(not w for w in self.bad_words or ()):
            raise bad("bad_words cannot contain an empty string")

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per output position, or None for no sample logprobs (vLLM's
        ``num_logprobs``): :attr:`logprobs`, or when unset the number of
        :attr:`logprob_token_ids` (if any)."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    @property
    def eos_token_id(self) -> int | None:
        """The model's EOS token id, as filled in by the frontend (``_eos_token_id``)."""
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Every token id that stops this request (``_all_stop_token_ids``)."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """Token sequences that must not be produced (``_bad_words_token_ids``)."""
        return self._bad_words_token_ids


_SAMPLING_FIELDS: Final = field_check(SamplingParams)


class SamplingKeywords(TypedDict, total=False):
    """The :class:`SamplingParams` fields :meth:`EngineCoreRequest.for_tokens` accepts
    as keywords. Each has the same meaning and default as in :class:`SamplingParams`."""

    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool
    max_tokens: int | None
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    detokenize: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    output_kind: RequestOutputKind
    stream_interval: int | None
    structured_outputs: StructuredOutputsParams | None
    logit_bias: dict[int, float] | None
    allowed_token_ids: list[int] | None
    extra_args: dict[str, Any] | None
    bad_words: list[str] | None


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Which LoRA adapter a request uses (vLLM's ``LoRARequest``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False

    def __post_init__(self) -> None:
        field_check(LoRARequest).check(self)


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Parameters of a pooling (embedding, classification) request."""

    use_activation: bool | None = None
    dimensions: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None
    task: str | None = None
    requires_token_ids: bool = False
    skip_reading_prefix_cache: bool | None = None
    late_interaction_params: Any = None
    extra_kwargs: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    late_chunking_params: Any = None

    def __post_init__(self) -> None:
        field_check(PoolingParams).check(self)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request submitted to an engine (payload of an ``ADD`` message).

    ``mm_features`` and ``kv_hints`` are carried as plain msgpack data: we cannot
    model vLLM's multimodal and KV-hint types without torch.

    ``prompt_token_ids`` is always a list of ints here; on the wire it takes the form
    of the receiving engine's vLLM release (:mod:`trio_enginecore.dialects`), and a
    decoder reads either form. ``block_hashes`` (vLLM 0.34 on) are prompt block hashes
    a frontend computed from the engine's :class:`PrefixHashConfig`; an engine of an
    older release never receives them. The reference engine ignores them and hashes
    the prompt itself (a forged hash could alias another prompt's cached prefix).
    """

    request_id: str
    prompt_token_ids: PromptTokenIds | None
    mm_features: list[Any] | None
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    arrival_time: float
    lora_request: LoRARequest | None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: Tensor | None = None
    prompt_is_token_ids: list[bool] | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    resumable: bool = False
    external_req_id: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    abort_immediately: bool = False
    session_id: str | None = None
    kv_hints: Any = None
    block_hashes: list[bytes] | None = None

    @classmethod
    def for_tokens(
        cls,
        prompt_token_ids: Iterable[int],
        *,
        request_id: str | None = None,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        data_parallel_rank: int | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        **sampling: Unpack[SamplingKeywords],
    ) -> EngineCoreRequest:
        """A generation request for a tokenized prompt, every other field defaulted.

        ::

            request = EngineCoreRequest.for_tokens([1, 2, 3], max_tokens=8, seed=1)

        Args:
            prompt_token_ids: the prompt's token ids (a list, any iterable of ints, or
                a 1-d numpy integer array).
            request_id: the request's id; by default a new unique one (``req-`` and
                32 hex digits). Give your own to find the request in logs; it must
                not be in flight on the same client.
            sampling_params: the whole :class:`SamplingParams`; or give its fields as
                keywords instead (``max_tokens=8, temperature=0.7, ...``; see
                :class:`SamplingKeywords`), not both. With neither, vLLM's defaults
                (16 tokens at most, temperature 1).
            arrival_time: wall-clock time of arrival (``time.time()``); now by default.
            data_parallel_rank: with several engines, the rank that must serve it.
            priority: lower values are scheduled first by priority schedulers.
            lora_request: the LoRA adapter to use.
            cache_salt: isolates this request's prefix-cache entries.

        Raises:
            TypeError: ``prompt_token_ids`` is a string, or both ``sampling_params`` and
                sampling keywords were given.
            ValueError: a sampling value is out of range (from :class:`SamplingParams`).

        The wire format is the same as with the positional constructor. Field types
        are checked when the request is submitted (``add_request``, ``stream``).
        """
        if isinstance(prompt_token_ids, str | bytes):
            raise TypeError(
                "prompt_token_ids must be token ids (ints), not a string: tokenize the prompt first"
            )
        if isinstance(prompt_token_ids, np.ndarray):
            prompt: list[int] = prompt_token_ids.tolist()
        else:
            prompt = list(prompt_token_ids)
        if sampling_params is None:
            try:
                sampling_params = SamplingParams(**sampling)
            except TypeError:
                _check_sampling_keywords(sampling)
                raise
        elif sampling:
            raise TypeError(
                "give either sampling_params or sampling keywords, not both "
                f"(got sampling_params and {', '.join(sorted(sampling))})"
            )
        return cls(
            request_id=f"req-{uuid.uuid4().hex}" if request_id is None else request_id,
            prompt_token_ids=prompt,
            mm_features=None,
            sampling_params=sampling_params,
            pooling_params=None,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            lora_request=lora_request,
            cache_salt=cache_salt,
            data_parallel_rank=data_parallel_rank,
            priority=priority,
        )


def _check_sampling_keywords(sampling: Mapping[str, object]) -> None:
    """Refuse a keyword of :meth:`EngineCoreRequest.for_tokens` that is neither a
    :class:`SamplingParams` field nor one of its own, naming the nearest (``max_token``:
    ``did you mean 'max_tokens'?``). Called once a construction failed."""
    known = {*SamplingParams.__struct_fields__, *known_keywords(EngineCoreRequest.for_tokens)}
    check_keywords("EngineCoreRequest.for_tokens", sampling, known)


class UtilityRequest(msgspec.Struct, array_like=True, gc=False):
    """Payload of a ``UTILITY`` message: call ``method(*args)`` on the engine.

    ``call_id`` is an integer chosen by the client (vLLM's clients use an unsigned
    64-bit one); the reply's :attr:`UtilityOutput.call_id` repeats it.
    """

    client_index: int
    call_id: int
    method: str
    args: tuple[Any, ...] = ()


class StartDPWave(msgspec.Struct, array_like=True, gc=False):
    """Payload of a ``START_DP_WAVE`` message from the data-parallel coordinator."""

    wave: int
    exclude_engine_index: int | None = None


class CoordinatorPublication(msgspec.Struct, array_like=True, gc=False):
    """What a data-parallel coordinator publishes to front-ends: ``(counts, wave,
    running)``.

    ``counts`` holds one ``[waiting, running, kv_cache_usage]`` per engine, or is
    ``None`` in the publication vLLM's coordinator sends at once when the wave or the
    running state changes (only those two are news then).
    """

    counts: list[tuple[int, int, float]] | None
    current_wave: int
    engines_running: bool


class ScaleElasticEP(msgspec.Struct, array_like=True, gc=False):
    """``("SCALE_ELASTIC_EP", n)``: a front-end tells the coordinator that the group
    now has ``new_engine_count`` engines (vLLM's elastic expert parallelism).

    Decoding refuses any other tag, and a group of fewer than one engine.
    """

    tag: Literal["SCALE_ELASTIC_EP"]
    new_engine_count: Annotated[int, msgspec.Meta(ge=1)]


# ------------------------------------------------------------- output-side structs


class EngineCoreEvent(msgspec.Struct, gc=False):
    """A timestamped lifecycle event of a request (a map, always both fields)."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType) -> EngineCoreEvent:
        """An event of the given type stamped with ``time.monotonic()`` now."""
        return cls(event_type, time.monotonic())


class PrefillStats(msgspec.Struct, gc=False):
    """Prompt-processing statistics of a request."""

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0


class RequestError(msgspec.Struct, gc=False):
    """Why the engine failed a request (sent with ``FinishReason.ERROR``)."""

    code: str
    message: str
    retryable: bool = False


class SchedulerStats(msgspec.Struct, gc=False):
    """Scheduler statistics an engine attaches to its outputs when stats are on.

    Nested vLLM statistics we do not model (prefix-cache, spec-decode, KV-connector,
    CUDA-graph and performance stats) are plain maps.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict[str, int] = msgspec.field(default_factory=dict[str, int])
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    iteration_details: Any = None
    prefix_cache_stats: dict[str, Any] = msgspec.field(default_factory=dict[str, Any])
    connector_prefix_cache_stats: dict[str, Any] | None = None
    kv_cache_eviction_events: list[Any] = msgspec.field(default_factory=list[Any])
    spec_decoding_stats: Any = None
    kv_connector_stats: dict[str, Any] | None = None
    ec_connector_stats: dict[str, Any] | None = None
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict[str, int])
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict[str, int])
    cudagraph_stats: Any = None
    perf_stats: Any = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    pooling_output: Tensor | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    trace_headers: dict[str, str] | None = None
    prefill_stats: PrefillStats | None = None
    routed_experts: npt.NDArray[Any] | None = None
    num_nans_in_logits: int = 0
    mm_cache_miss_hashes: list[str] | None = None
    new_sampling_mask: Any = None
    spec_decode_metrics: Any = None
    prompt_token_id_logprobs: Tensor | None = None
    error: RequestError | None = None
    watermarking: bool | None = None

    @property
    def finished(self) -> bool:
        """True if this is the request's last output."""
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """The reply to one utility call: a result, or the engine's failure message."""

    call_id: int
    failure_message: str | None = None
    result: UtilityResult | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine sends a client in one message (output socket payload).

    A step's outputs, a utility reply, or a data-parallel wave notification. As in
    vLLM, a zero ``timestamp`` is replaced by the decoding process's
    ``time.monotonic()`` (msgspec runs ``__post_init__`` on decode too).
    """

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list[EngineCoreOutput])
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: set[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None

    def __post_init__(self) -> None:
        if self.timestamp == 0.0:
            self.timestamp = time.monotonic()


# ------------------------------------------------------------- startup handshake


def identity_for_rank(rank: int) -> bytes:
    """The ZeroMQ identity of data-parallel rank ``rank``'s DEALER sockets (handshake
    and inputs), by which a client's ROUTER tells its engines apart, as vLLM defines
    it: the rank as two little-endian bytes."""
    return rank.to_bytes(2, "little")


class PrefixHashConfig(msgspec.Struct, gc=False):
    """How an engine hashes prompt blocks for its prefix cache (vLLM 0.34 on), as
    its ready message tells a frontend that wants to send ``block_hashes``."""

    hash_algo: str
    hash_block_size: int
    none_hash: bytes
    num_lookahead_tokens: int = 0


class EngineCoreReadyResponse(msgspec.Struct, gc=False):
    """The first message an engine sends on each input socket after connecting.

    Receiving it is what lets the client's ROUTER route requests to that engine. A map
    with every field present.
    """

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    dp_stats_address: str | None
    dtype: str
    vllm_version: str
    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    data_parallel_rank: int
    max_num_seqs: int
    max_num_batched_tokens: int
    instance_id: str
    supports_lora: bool
    max_loras: int
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_events_config: Any = None
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False
    effective_attention_block_size: int | None = None
    coord_store_port: int = 0
    coordinator_input_address: str | None = None
    coordinator_output_address: str | None = None
    # vLLM 0.34 on (a 0.33 engine's ready message ends above).
    vllm_config: dict[str, Any] | None = None
    prefix_hash_config: PrefixHashConfig | None = None
    cache_config_info: dict[str, Any] | None = None
    config_hash: str | None = None
    enable_expert_parallel: bool = False


class EngineZmqAddresses(msgspec.Struct, gc=False):
    """The addresses an engine must connect to, sent in the handshake."""

    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


class EngineHandshakeMetadata(msgspec.Struct, gc=False):
    """The frontend's reply to an engine's HELLO."""

    addresses: EngineZmqAddresses
    parallel_config: dict[str, int | str | list[int]] = msgspec.field(
        default_factory=dict[str, int | str | list[int]]
    )


class HandshakeHello(msgspec.Struct, tag_field="status", tag="HELLO", omit_defaults=True, gc=False):
    """An engine's first message on the handshake socket."""

    local: bool
    headless: bool


class HandshakeReady(msgspec.Struct, tag_field="status", tag="READY", omit_defaults=True, gc=False):
    """An engine's last handshake message: it is up and serving.

    The optional fields are only present in data-parallel (and elastic EP) setups.
    """

    local: bool
    headless: bool
    parallel_config_hash: str | None = None
    coord_store_port: int | None = None
    elastic_ep_max_dp_size: int | None = None
    num_redundant_experts: int | None = None


HandshakeMessage = HandshakeHello | HandshakeReady
"""What an engine may send on the handshake socket (tagged by its ``status`` key)."""

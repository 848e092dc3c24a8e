"""trio-enginecore: a Trio-native engine-core client for vLLM-compatible LLM engines."""

from __future__ import annotations

import logging as _logging

from . import errors as errors, protocol as protocol, serial as serial
from ._curve import (
    CurveClient as CurveClient,
    CurveKeyPair as CurveKeyPair,
    CurveServer as CurveServer,
    write_key_pair as write_key_pair,
)
from ._listeners import ListenerFd as ListenerFd
from .client import (
    AsyncEngineCoreClient as AsyncEngineCoreClient,
    ClientStatistics as ClientStatistics,
    EngineCoreClient as EngineCoreClient,
    InprocClient as InprocClient,
    Liveness as Liveness,
    RemoteEngines as RemoteEngines,
    RequestStream as RequestStream,
    SyncMPClient as SyncMPClient,
    TrioInprocClient as TrioInprocClient,
    TrioMPClient as TrioMPClient,
    connect_engine_client as connect_engine_client,
    make_client as make_client,
    open_engine_client as open_engine_client,
)
from .config import EngineConfig as EngineConfig
from .coordinator import (
    CoordinatorAddresses as CoordinatorAddresses,
    open_coordinator as open_coordinator,
)
from .errors import (
    AddressError as AddressError,
    EngineCoreError as EngineCoreError,
    EngineDeadError as EngineDeadError,
    EngineStartupError as EngineStartupError,
    ProtocolError as ProtocolError,
    RequestFailedError as RequestFailedError,
    UtilityCallError as UtilityCallError,
)
from .protocol import (
    ENGINE_CORE_DEAD as ENGINE_CORE_DEAD,
    EngineCoreEvent as EngineCoreEvent,
    EngineCoreEventType as EngineCoreEventType,
    EngineCoreOutput as EngineCoreOutput,
    EngineCoreOutputs as EngineCoreOutputs,
    EngineCoreReadyResponse as EngineCoreReadyResponse,
    EngineCoreRequest as EngineCoreRequest,
    EngineCoreRequestType as EngineCoreRequestType,
    EngineHandshakeMetadata as EngineHandshakeMetadata,
    EngineZmqAddresses as EngineZmqAddresses,
    FinishReason as FinishReason,
    HandshakeHello as HandshakeHello,
    HandshakeMessage as HandshakeMessage,
    HandshakeReady as HandshakeReady,
    LoRARequest as LoRARequest,
    PoolingParams as PoolingParams,
    RequestOutputKind as RequestOutputKind,
    SamplingKeywords as SamplingKeywords,
    SamplingParams as SamplingParams,
    SchedulerStats as SchedulerStats,
    Tensor as Tensor,
    UtilityOutput as UtilityOutput,
    UtilityResult as UtilityResult,
)
from .serial import MsgpackDecoder as MsgpackDecoder, MsgpackEncoder as MsgpackEncoder

__all__ = [
    "ENGINE_CORE_DEAD",
    "AddressError",
    "AsyncEngineCoreClient",
    "ClientStatistics",
    "CoordinatorAddresses",
    "CurveClient",
    "CurveKeyPair",
    "CurveServer",
    "EngineConfig",
    "EngineCoreClient",
    "EngineCoreError",
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreReadyResponse",
    "EngineCoreRequest",
    "EngineCoreRequestType",
    "EngineDeadError",
    "EngineHandshakeMetadata",
    "EngineStartupError",
    "EngineZmqAddresses",
    "FinishReason",
    "HandshakeHello",
    "HandshakeMessage",
    "HandshakeReady",
    "InprocClient",
    "ListenerFd",
    "Liveness",
    "LoRARequest",
    "MsgpackDecoder",
    "MsgpackEncoder",
    "PoolingParams",
    "ProtocolError",
    "RemoteEngines",
    "RequestFailedError",
    "RequestOutputKind",
    "RequestStream",
    "SamplingKeywords",
    "SamplingParams",
    "SchedulerStats",
    "SyncMPClient",
    "Tensor",
    "TrioInprocClient",
    "TrioMPClient",
    "UtilityCallError",
    "UtilityOutput",
    "UtilityResult",
    "connect_engine_client",
    "errors",
    "make_client",
    "open_coordinator",
    "open_engine_client",
    "protocol",
    "serial",
    "write_key_pair",
]

__version__ = "0.1.0.dev0"

# Logging is the application's to configure: without a handler here, Python's
# last-resort handler would print our warnings to stderr in programs that set up none.
_logging.getLogger("trio_enginecore").addHandler(_logging.NullHandler())

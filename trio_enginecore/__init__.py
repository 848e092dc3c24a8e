"""trio-enginecore: a Trio-native engine-core client for vLLM-compatible LLM engines."""

from __future__ import annotations

from . import errors as errors, protocol as protocol, serial as serial
from .client import (
    AsyncEngineCoreClient as AsyncEngineCoreClient,
    ClientStatistics as ClientStatistics,
    EngineCoreClient as EngineCoreClient,
    InprocClient as InprocClient,
    RequestStream as RequestStream,
    SyncMPClient as SyncMPClient,
    TrioInprocClient as TrioInprocClient,
    TrioMPClient as TrioMPClient,
    connect_engine_client as connect_engine_client,
    make_client as make_client,
    open_engine_client as open_engine_client,
)
from .config import EngineConfig as EngineConfig
from .errors import (
    EngineCoreError as EngineCoreError,
    EngineDeadError as EngineDeadError,
    EngineStartupError as EngineStartupError,
    ProtocolError as ProtocolError,
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
    SamplingParams as SamplingParams,
    SchedulerStats as SchedulerStats,
    Tensor as Tensor,
    UtilityOutput as UtilityOutput,
    UtilityResult as UtilityResult,
)
from .serial import MsgpackDecoder as MsgpackDecoder, MsgpackEncoder as MsgpackEncoder

__version__ = "0.1.0.dev0"

"""trio-enginecore: a Trio-native engine-core client for vLLM-compatible LLM engines."""

from __future__ import annotations

import logging as _logging

from . import (
    curve as curve,
    dialects as dialects,
    errors as errors,
    protocol as protocol,
    serial as serial,
)
from ._listeners import ListenerFd as ListenerFd
from .client import (
    AsyncEngineCoreClient as AsyncEngineCoreClient,
    ClientStatistics as ClientStatistics,
    DPLBTrioMPClient as DPLBTrioMPClient,
    DPTrioMPClient as DPTrioMPClient,
    EngineCoreClient as EngineCoreClient,
    InprocClient as InprocClient,
    LeastLoaded as LeastLoaded,
    Liveness as Liveness,
    LoadBalancer as LoadBalancer,
    PowerOfTwoChoices as PowerOfTwoChoices,
    RemoteEngines as RemoteEngines,
    RequestStream as RequestStream,
    SyncMPClient as SyncMPClient,
    SyncRequestStream as SyncRequestStream,
    TrioInprocClient as TrioInprocClient,
    TrioMPClient as TrioMPClient,
    VllmEngines as VllmEngines,
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
    EngineConsensusError as EngineConsensusError,
    EngineCoreError as EngineCoreError,
    EngineDeadError as EngineDeadError,
    EngineStartupError as EngineStartupError,
    ProtocolError as ProtocolError,
    RequestFailedError as RequestFailedError,
    UtilityCallError as UtilityCallError,
)

# The request/output model. The rest of the wire protocol (handshake and utility
# messages, events, request types) is in trio_enginecore.protocol, the codec in
# trio_enginecore.serial.
from .protocol import (
    EngineCoreOutput as EngineCoreOutput,
    EngineCoreOutputs as EngineCoreOutputs,
    EngineCoreRequest as EngineCoreRequest,
    FinishReason as FinishReason,
    LoRARequest as LoRARequest,
    PoolingParams as PoolingParams,
    RequestOutputKind as RequestOutputKind,
    SamplingKeywords as SamplingKeywords,
    SamplingParams as SamplingParams,
    SchedulerStats as SchedulerStats,
)

__all__ = [
    "AddressError",
    "AsyncEngineCoreClient",
    "ClientStatistics",
    "CoordinatorAddresses",
    "DPLBTrioMPClient",
    "DPTrioMPClient",
    "EngineConfig",
    "EngineConsensusError",
    "EngineCoreClient",
    "EngineCoreError",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineDeadError",
    "EngineStartupError",
    "FinishReason",
    "InprocClient",
    "LeastLoaded",
    "ListenerFd",
    "Liveness",
    "LoRARequest",
    "LoadBalancer",
    "PoolingParams",
    "PowerOfTwoChoices",
    "ProtocolError",
    "RemoteEngines",
    "RequestFailedError",
    "RequestOutputKind",
    "RequestStream",
    "SamplingKeywords",
    "SamplingParams",
    "SchedulerStats",
    "SyncMPClient",
    "SyncRequestStream",
    "TrioInprocClient",
    "TrioMPClient",
    "UtilityCallError",
    "VllmEngines",
    "connect_engine_client",
    "curve",
    "errors",
    "make_client",
    "open_coordinator",
    "open_engine_client",
    "protocol",
    "serial",
]

__version__ = "0.1.0.dev0"

# Logging is the application's to configure: without a handler here, Python's
# last-resort handler would print our warnings to stderr in programs that set up none.
_logging.getLogger("trio_enginecore").addHandler(_logging.NullHandler())

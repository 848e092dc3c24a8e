"""Engine-core clients: Trio and blocking, multiprocess and in-process."""

from __future__ import annotations

from ._client import TrioEngineClient as TrioEngineClient
from ._collector import BatchCollector as BatchCollector, merge_outputs as merge_outputs
from ._engines import EngineHandle as EngineHandle
from ._factory import (
    ClientKind as ClientKind,
    make_client as make_client,
    open_engine_client as open_engine_client,
    select_client_kind as select_client_kind,
)
from ._inproc import (
    InprocClient as InprocClient,
    InprocTransport as InprocTransport,
    TrioInprocClient as TrioInprocClient,
)
from ._interface import (
    AsyncEngineCoreClient as AsyncEngineCoreClient,
    ClientStatistics as ClientStatistics,
    EngineState as EngineState,
    EngineStatus as EngineStatus,
)
from ._lb import (
    EngineConsensusError as EngineConsensusError,
    EngineLoad as EngineLoad,
    LeastLoaded as LeastLoaded,
    LoadBalancer as LoadBalancer,
    PowerOfTwoChoices as PowerOfTwoChoices,
)
from ._liveness_rules import Liveness as Liveness
from ._mp import (
    DPLBTrioMPClient as DPLBTrioMPClient,
    DPTrioMPClient as DPTrioMPClient,
    TrioMPClient as TrioMPClient,
    connect_engine_client as connect_engine_client,
)
from ._options import ClientOptions as ClientOptions, FailurePolicy as FailurePolicy
from ._policy import Restart as Restart
from ._ray import open_ray_engine_client as open_ray_engine_client
from ._ray_engines import PlacementStrategy as PlacementStrategy, RayEngines as RayEngines
from ._remote import (
    EngineRestarter as EngineRestarter,
    RemoteEngines as RemoteEngines,
    RestartedEngine as RestartedEngine,
)
from ._running import run_client as run_client
from ._stream import RequestStream as RequestStream
from ._sync import (
    EngineCoreClient as EngineCoreClient,
    SyncMPClient as SyncMPClient,
    SyncRequestStream as SyncRequestStream,
)
from ._transport import ClientLink as ClientLink, Transport as Transport
from ._zmq_transport import ZmqTransport as ZmqTransport

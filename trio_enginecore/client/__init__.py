"""Engine-core clients: Trio and blocking, multiprocess and in-process.

The public names, by what they are for:

* the two interfaces every client implements: :class:`AsyncEngineCoreClient` (Trio)
  and :class:`EngineCoreClient` (blocking);
* opening a client: :func:`open_engine_client`, :func:`connect_engine_client`,
  :func:`open_ray_engine_client`, :func:`make_client`, :func:`run_client`;
* the clients, with vLLM's names for code ported from vLLM: :class:`TrioEngineClient`,
  :class:`TrioMPClient`, :class:`DPTrioMPClient`, :class:`DPLBTrioMPClient`,
  :class:`TrioInprocClient`, :class:`SyncMPClient`, :class:`InprocClient`;
* what a client hands back: :class:`RequestStream`, :class:`SyncRequestStream`,
  :class:`ClientStatistics`, :class:`EngineStatus`;
* settings: :class:`ClientOptions`, :data:`FailurePolicy` and :class:`Restart`,
  :class:`Liveness`, :class:`RemoteEngines` with :class:`EngineRestarter` and
  :class:`RestartedEngine`, :class:`RayEngines`, :class:`VllmEngines` (vLLM's own
  engine cores, launched by the client), and load balancing
  (:class:`LoadBalancer`, :class:`LeastLoaded`, :class:`PowerOfTwoChoices`,
  :class:`EngineLoad`);
* the transport seam (provisional): :class:`Transport`, :class:`ClientLink`,
  :class:`EngineHandle`, what :mod:`trio_enginecore.testing`'s fake engine implements.

The folder shows the architecture: this face (the interfaces, the client classes, the
openers, the options), the pure core every client shares (``_core/``), the engines in
other processes reached over ZeroMQ (``_multiprocess/``) and the engines Ray places
(``_ray/``). ``docs/guide/architecture.md`` walks one request through them.
"""

from __future__ import annotations

from ._client import TrioEngineClient as TrioEngineClient
from ._core._engines import EngineHandle as EngineHandle
from ._core._lb import (
    EngineLoad as EngineLoad,
    LeastLoaded as LeastLoaded,
    LoadBalancer as LoadBalancer,
    PowerOfTwoChoices as PowerOfTwoChoices,
)
from ._core._liveness_rules import Liveness as Liveness
from ._core._policy import FailurePolicy as FailurePolicy, Restart as Restart
from ._core._statistics import ClientStatistics as ClientStatistics, EngineStatus as EngineStatus
from ._core._stream import RequestStream as RequestStream
from ._factory import make_client as make_client, open_engine_client as open_engine_client
from ._inproc import InprocClient as InprocClient, TrioInprocClient as TrioInprocClient
from ._interface import (
    AsyncEngineCoreClient as AsyncEngineCoreClient,
    EngineCoreClient as EngineCoreClient,
)
from ._mp import (
    DPLBTrioMPClient as DPLBTrioMPClient,
    DPTrioMPClient as DPTrioMPClient,
    TrioMPClient as TrioMPClient,
    connect_engine_client as connect_engine_client,
)
from ._multiprocess._remote import (
    EngineRestarter as EngineRestarter,
    RemoteEngines as RemoteEngines,
    RestartedEngine as RestartedEngine,
)
from ._multiprocess._vllm import VllmEngines as VllmEngines
from ._options import ClientOptions as ClientOptions
from ._ray._session import open_ray_engine_client as open_ray_engine_client
from ._ray._settings import RayEngines as RayEngines
from ._running import run_client as run_client
from ._sync import SyncMPClient as SyncMPClient, SyncRequestStream as SyncRequestStream
from ._transport import ClientLink as ClientLink, Transport as Transport

__all__ = [
    "AsyncEngineCoreClient",
    "ClientLink",
    "ClientOptions",
    "ClientStatistics",
    "DPLBTrioMPClient",
    "DPTrioMPClient",
    "EngineCoreClient",
    "EngineHandle",
    "EngineLoad",
    "EngineRestarter",
    "EngineStatus",
    "FailurePolicy",
    "InprocClient",
    "LeastLoaded",
    "Liveness",
    "LoadBalancer",
    "PowerOfTwoChoices",
    "RayEngines",
    "RemoteEngines",
    "RequestStream",
    "Restart",
    "RestartedEngine",
    "SyncMPClient",
    "SyncRequestStream",
    "Transport",
    "TrioEngineClient",
    "TrioInprocClient",
    "TrioMPClient",
    "VllmEngines",
    "connect_engine_client",
    "make_client",
    "open_engine_client",
    "open_ray_engine_client",
    "run_client",
]

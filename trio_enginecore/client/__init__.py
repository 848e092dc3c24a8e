"""Engine-core clients: the Trio multiprocess client and its per-request streams."""

from __future__ import annotations

from ._base import (
    AsyncEngineCoreClient as AsyncEngineCoreClient,
    ClientStatistics as ClientStatistics,
)
from ._collector import BatchCollector as BatchCollector, merge_outputs as merge_outputs
from ._factory import open_engine_client as open_engine_client
from ._mp import TrioMPClient as TrioMPClient
from ._stream import RequestStream as RequestStream

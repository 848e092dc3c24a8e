"""The data-parallel coordinator: engines' request counts and the request wave.

Three sockets, as vLLM 0.33's ``DPCoordinator`` has them:

* **stats** (PULL, bound): engines PUSH ``EngineCoreOutputs`` carrying their
  ``scheduler_stats`` (waiting and running counts, KV-cache usage), ``wave_complete``
  or ``start_wave``;
* **engine publish** (XPUB, bound): engines subscribe (XSUB,
  :data:`~trio_enginecore.protocol.COORDINATOR_SUBSCRIBE`); once all of them have, the
  coordinator sends :data:`~trio_enginecore.protocol.COORDINATOR_READY`, and later
  broadcasts START_DP_WAVE (a :class:`~trio_enginecore.protocol.StartDPWave`) when an
  engine asks for a wave to start;
* **publish** (XPUB, bound): front-ends subscribe and receive a
  :class:`~trio_enginecore.protocol.CoordinatorPublication`, ``(counts, current_wave,
  engines_running)``, with ``counts`` one ``[waiting, running, kv_usage]`` per engine:
  when the counts changed, at most every ``min_interval_s``, at once for a new
  subscriber, and at least every ``heartbeat_s``; and at once, with ``counts`` None,
  when the wave or the running state changes. Front-ends send nothing but
  :class:`~trio_enginecore.protocol.ScaleElasticEP`: only engines start waves.

Engines that run no waves (vLLM's dense, non-MoE data parallelism: independent
``EngineCoreProc`` ranks) never send ``start_wave``, so the coordinator never sends them
START_DP_WAVE and publishes wave 0, not running, as vLLM's does for them.

The rules are :class:`CoordinatorState`'s (no I/O); :func:`serve_coordinator` is the
Trio task around them; :func:`~trio_enginecore.open_coordinator` runs one for a group
of clients.
"""

from __future__ import annotations

from ._addresses import CoordinatorAddresses as CoordinatorAddresses
from ._open import open_coordinator as open_coordinator
from ._serve import serve_coordinator as serve_coordinator
from ._state import CoordinatorState as CoordinatorState, start_wave_frames as start_wave_frames

__all__ = [
    "CoordinatorAddresses",
    "CoordinatorState",
    "open_coordinator",
    "serve_coordinator",
    "start_wave_frames",
]

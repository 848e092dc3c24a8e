"""The clients the Trio client is compared with.

* :mod:`benchmarks.baselines.asyncio_vllm`: an asyncio client built the way vLLM
  0.33's ``AsyncMPClient`` is (``zmq.asyncio``, a background receive task, an
  unbounded ``asyncio.Queue``), using our codec so that only the concurrency design
  differs.
* :mod:`benchmarks.baselines.asyncio_stream`: per-request streams on that client,
  served the way vLLM's ``AsyncLLM`` serves them (one output-handler task, a
  per-request collector merging unread outputs and waking the request's own task
  through an ``asyncio.Event``): the baseline the Trio streams are compared with.
* :mod:`benchmarks.baselines.blocking`: blocking pyzmq with the same decoding and
  dispatch and no event loop at all: the practical limit for one Python thread.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["recv_summary"]


def recv_summary(wall: float, cpu: float, messages: int, outputs: int) -> dict[str, Any]:
    """The figures of the ``recv`` workload, the same for every client.

    Args:
        wall: seconds from the requests sent to the last request finished.
        cpu: this process's CPU seconds over the same interval.
        messages: engine messages received (decoded) meanwhile.
        outputs: per-request outputs consumed meanwhile.
    """
    return {
        "wall_s": wall,
        "client_cpu_s": cpu,
        "messages": messages,
        "outputs": outputs,
        "messages_per_s": messages / wall if wall else math.nan,
        "outputs_per_s": outputs / wall if wall else math.nan,
        "cpu_us_per_message": 1e6 * cpu / messages if messages else math.nan,
    }

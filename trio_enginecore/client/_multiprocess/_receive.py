"""The receive task of the ZeroMQ pipe: engine messages into the client's state.

It drains the PULL socket in batches, decodes each message once and feeds it to the
state, with no checkpoint between taking a message off the socket and handing it over:
cancellation cannot lose one. A message that does not decode is counted and logged by
the state, and the task goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import trio

from ..._zmq import TrioSocket
from ...errors import ProtocolError
from ...protocol import ENGINE_CORE_DEAD, EngineCoreOutputs
from ...serial import MsgpackDecoder
from .._core._state import ClientState

__all__ = ["receive_outputs"]

MAX_DRAIN_MESSAGES: Final = 256
"""The most messages taken off the socket between two schedule points."""
DRAIN_OUTPUTS: Final = 2048
"""About how many outputs for ``get_output()`` one batch should bring."""


async def receive_outputs(
    sock: TrioSocket,
    state: ClientState,
    decoder: MsgpackDecoder[EngineCoreOutputs],
    reported_dead: Callable[[], None],
) -> None:
    """Feed ``state`` every message ``sock`` brings until the client closes it;
    ``reported_dead()`` for each ENGINE_CORE_DEAD.

    Raises:
        trio.ClosedResourceError: the socket was closed while the client is open.
    """
    decode = decoder.decode
    handle = state.handle_outputs
    budget = MAX_DRAIN_MESSAGES
    while True:
        try:
            batch = await sock.drain(budget)
        except trio.ClosedResourceError:
            if state.closing:
                return  # aclose() closed the socket under us: the normal way out
            raise
        before = state.batched_outputs
        for frames in batch:
            if len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD:
                reported_dead()
                continue
            try:
                message = decode(frames)
            except ProtocolError as exc:
                state.undecodable(exc)
                continue
            handle(message)
        # Outputs for get_output() wait in the batch buffer as decoded objects, so
        # decoding far ahead of its reader keeps many young objects alive and costs
        # more in garbage collection than batching saves (measured: 3.4k -> 8k
        # messages/s of 256 outputs): drain about DRAIN_OUTPUTS of them per batch.
        # Stream outputs are merged into their streams as they arrive, so for them
        # the bigger the batch the fewer reader wake-ups: drain all that is there.
        per_message = max(1, (state.batched_outputs - before) // len(batch))
        budget = max(1, min(MAX_DRAIN_MESSAGES, DRAIN_OUTPUTS // per_message))

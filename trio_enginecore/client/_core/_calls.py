"""The utility calls a client is waiting on, and the round trip of one.

:class:`UtilityCalls` is plain state, no I/O: each call is registered under a fresh,
unguessable 64-bit id, resolved by the reply that carries it, and failed when the
client, or the engine it asked, is gone. Setting its :class:`trio.Event` needs no
running event loop, so the rules are unit-tested synchronously. :func:`call_engines`
is the round trip: register, send, wait, unregister, read the replies.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any, Final, final

import attrs
import trio

from ...errors import UtilityCallError
from ...protocol import (
    EEP_NOTIFICATION_CALL_ID,
    FT_STATUS_CALL_ID,
    UtilityOutput,
    UtilityRequest,
)
from ._engines import DeathNotice, EngineHandle

__all__ = ["UtilityCall", "UtilityCalls", "call_engines"]

logger = logging.getLogger("trio_enginecore.client")

_NOTIFICATION_CALL_IDS: Final = (EEP_NOTIFICATION_CALL_ID, FT_STATUS_CALL_ID)


@attrs.define(eq=False)
class UtilityCall:
    """One pending utility call: set ``done`` once ``reply`` or ``failure`` is known."""

    method: str
    engine: EngineHandle
    """The engine asked."""
    internal: bool = False
    """The client's own call (its liveness call), not counted among the pending calls
    of ``statistics()``."""
    done: trio.Event = attrs.field(factory=trio.Event)
    reply: UtilityOutput | None = None
    failure: DeathNotice | None = None


@final
class UtilityCalls:
    """The pending calls, by call id."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: dict[int, UtilityCall] = {}

    def __len__(self) -> int:
        """The callers' calls pending (the client's own not counted)."""
        return sum(1 for call in self.pending.values() if not call.internal)

    def new(
        self, method: str, engine: EngineHandle, *, internal: bool = False
    ) -> tuple[int, UtilityCall]:
        """Register a call to ``engine`` under a fresh, unguessable call id."""
        while True:
            call_id = secrets.randbits(64)
            if call_id not in self.pending:
                break
        call = self.pending[call_id] = UtilityCall(method, engine, internal)
        return call_id, call

    def end(self, call_id: int) -> bool:
        """Unregister a call; False if it had not been answered (a late reply is
        then dropped)."""
        call = self.pending.pop(call_id, None)
        return call is None or call.done.is_set()

    def resolve(self, reply: UtilityOutput) -> None:
        """Hand a reply to its call; notifications and late replies are logged."""
        if reply.call_id in _NOTIFICATION_CALL_IDS:
            logger.info("engine notification (call id %d): %r", reply.call_id, reply.result)
            return
        call = self.pending.get(reply.call_id)
        if call is None:
            logger.debug("dropping a late or unknown utility reply (call id %d)", reply.call_id)
            return
        call.reply = reply
        call.done.set()

    def waiting_on(self, engine: EngineHandle) -> tuple[int, int]:
        """The unanswered calls to ``engine``: the client's own, and its callers'."""
        own = callers = 0
        for call in self.pending.values():
            if call.engine is engine and not call.done.is_set():
                if call.internal:
                    own += 1
                else:
                    callers += 1
        return own, callers

    def fail(self, notice: DeathNotice, *, engine: EngineHandle | None = None) -> None:
        """Fail every unanswered call (to ``engine`` only, if given) with ``notice``."""
        for call in self.pending.values():
            if not call.done.is_set() and (engine is None or call.engine is engine):
                call.failure = notice
                call.done.set()


async def call_engines(
    calls: UtilityCalls,
    send: Callable[[EngineHandle, UtilityRequest], None],
    client_index: int,
    engines: list[EngineHandle],
    method: str,
    args: tuple[Any, ...],
    *,
    internal: bool = False,
) -> list[Any]:
    """Call ``method(*args)`` on each of ``engines`` at once; their results, in order.

    Cancellation unregisters every call (a late reply is then dropped); the engines may
    still run the method.

    Raises:
        EngineDeadError: an engine is dead, or died before replying.
        UtilityCallError: the method raised on an engine (its rank named when several
            were asked); or an engine's vLLM release lacks the method, or takes other
            arguments (refused before anything is sent, with the reason, rather than
            failing on the engine).
    """
    for engine in engines:
        if not engine.alive:
            raise engine.death_notice(
                f"{engine.describe()} died: {engine.death}", retryable=engine.restarting
            ).error()
        problem = engine.dialect.utility_problem(method, len(args))
        if problem is not None:
            raise UtilityCallError(
                method, f"not sent: {engine.describe()} runs {problem}", rank=engine.rank
            )
    pending: list[tuple[int, UtilityCall]] = []
    try:
        for engine in engines:
            call_id, call = calls.new(method, engine, internal=internal)
            pending.append((call_id, call))
            send(engine, UtilityRequest(client_index, call_id, method, tuple(args)))
        for _, call in pending:
            await call.done.wait()
    finally:
        for call_id, _ in pending:
            if not calls.end(call_id):
                logger.debug(
                    "utility call %s (%d) abandoned; a late reply is dropped", method, call_id
                )
    results: list[Any] = []
    for engine, (_, call) in zip(engines, pending, strict=True):
        if call.failure is not None:
            raise call.failure.error()
        reply = call.reply
        assert reply is not None
        if reply.failure_message is not None:
            rank = engine.rank if len(engines) > 1 else None
            raise UtilityCallError(method, reply.failure_message, rank=rank)
        results.append(reply.result.result if reply.result is not None else None)
    return results

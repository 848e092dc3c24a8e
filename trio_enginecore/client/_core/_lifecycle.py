"""What an engine's death, silence, return or restart does to a client: plain state,
no I/O.

:class:`EngineLifecycle` is the one writer of :attr:`EngineHandle.state
<._engines.EngineHandle.state>`: what notices a death, a silence or a recovery (the
transport, the liveness checks, the restarter) reports it here, the failure policy
(:mod:`._policy`) gives the verdict, and this fails exactly what depended on the
engine: its requests, the utility calls it owed, and the whole client when the
verdict says so. It works on the client's :class:`~._state.ClientState`, of which it
is a part (``state.lifecycle``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, final

from ...protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, RequestError
from ._engines import EngineHandle
from ._policy import Fail

if TYPE_CHECKING:
    from ._state import ClientState

__all__ = ["EngineLifecycle"]

logger = logging.getLogger("trio_enginecore.client")


@final
class EngineLifecycle:
    """The engines' states, and what a change of one does (see the module docstring)."""

    __slots__ = ("_state",)

    def __init__(self, state: ClientState) -> None:
        self._state = state

    def engine_died(self, engine: EngineHandle, reason: str) -> bool:
        """Record an engine's death and fail every waiter that depends on it.

        Its in-flight requests fail: their streams raise ``EngineDeadError``, and each
        of its requests added with ``add_request`` gets a local ``FinishReason.ERROR``
        output through ``get_output()`` (code ``"engine_dead"``, retryable) unless the
        client failed as a whole. The client fails (every pending utility call fails,
        ``get_output()`` waiters wake up, every later call raises) on the first death,
        or under ``route_around`` when no engine is left (none alive, none
        restarting); otherwise only the utility calls that engine owed fail, and
        under ``restart`` the engine is marked restarting. Returns whether this was
        news (an engine in service, the client open).
        """
        state = self._state
        if not engine.alive:
            return False
        engine.state = "dead"
        engine.death = reason
        engine.suspicion = None
        if state.closing:
            return False
        logger.error("%s died: %s", engine.describe(), reason)
        verdict = state.policy.on_death(others_in_service=self._others_in_service(engine))
        if verdict == "restart":
            engine.state = "restarting"
        self._fail_engine(
            engine, f"{engine.describe()} died: {reason}", whole=verdict == "fail_client"
        )
        return True

    def _others_in_service(self, engine: EngineHandle) -> int:
        """Engines other than ``engine`` in service or being restarted."""
        return sum(1 for e in self._state.engines if e is not engine and (e.alive or e.restarting))

    def engine_suspect(self, engine: EngineHandle, reason: str) -> bool:
        """An engine in service may be gone or stuck (``reason`` says why): it stays in
        service, shown ``suspect``, until it shows life (:meth:`engine_cleared`) or is
        declared dead. Returns whether this was news."""
        if engine.state != "alive" or self._state.closing:
            return False
        engine.state = "suspect"
        engine.suspicion = reason
        logger.warning("%s is suspect: %s", engine.describe(), reason)
        return True

    def engine_cleared(self, engine: EngineHandle) -> None:
        """A suspect engine showed life: ``alive`` again."""
        if engine.state == "suspect":
            logger.warning(
                "%s shows life again (it was suspect: %s)", engine.describe(), engine.suspicion
            )
            engine.state = "alive"
            engine.suspicion = None

    def engine_back(self, engine: EngineHandle) -> None:
        """A restarted engine is ready: back in service, and waiters for an engine
        wake up."""
        engine.state = "alive"
        engine.death = None
        engine.suspicion = None
        engine.restarts += 1
        engine.load.waiting = engine.load.running = 0
        logger.warning("%s is back in service (restart %d)", engine.describe(), engine.restarts)
        self._state.wake_engine_waiters()

    def restart_failed(self, engine: EngineHandle, reason: str) -> None:
        """An attempt to restart ``engine`` failed; it stays ``restarting`` (the
        restarter tries again, as the policy allows), and this is its death now."""
        if engine.restarting:
            engine.death = f"its restart failed: {reason}"

    def engine_given_up(self, engine: EngineHandle, reason: str) -> None:
        """A restarting engine will not be restarted again: it is dead for good, and
        the client fails if no engine is left."""
        state = self._state
        if not engine.restarting:
            return
        engine.state = "dead"
        engine.death = reason
        if not state.closing:
            logger.error("%s: %s", engine.describe(), reason)
            self._fail_engine(
                engine,
                f"{engine.describe()}: {reason}",
                whole=not self._others_in_service(engine),
            )
        state.wake_engine_waiters()  # they look again, and raise

    def engines_stopped(self) -> None:
        """The client closed and its transport stopped: no engine is in service."""
        for engine in self._state.engines:
            if engine.state != "dead":
                engine.state = "dead"
                engine.death = engine.death or "stopped with the client"
                engine.suspicion = None

    def requests_lost(self, engine: EngineHandle, reason: str) -> None:
        """A live engine lost this client's requests (it restarted, or reconnected,
        behind the client's back): fail them, and the calls it owed, as if it had
        died; the engine stays in service."""
        if engine.alive and not self._state.closing:
            logger.error("%s lost this client's requests: %s", engine.describe(), reason)
            self._fail_engine(engine, f"{engine.describe()} {reason}", whole=False, in_service=True)

    def _fail_engine(
        self, engine: EngineHandle, message: str, *, whole: bool, in_service: bool = False
    ) -> None:
        """Fail what depends on ``engine``, and the client too if ``whole`` (the
        policy's verdict). Requests lost by an engine in service (``in_service``) fail
        alone, whatever the policy."""
        state = self._state
        if whole and state.failure is None:
            first = isinstance(state.policy, Fail)
            state.failure = message if first else f"no engine is left: {message}"
            state.failure_notice = engine.death_notice(state.failure, retryable=False)
            state.ended.set()
        elif not whole and not in_service and not engine.restarting:
            # A restart is logged once, by what restarts the engine (with its delay).
            serving = [e.rank for e in state.engines if e.alive]
            logger.warning("routing around %s; engine(s) %s in service", engine.describe(), serving)
        # Sending again is worth it while an engine is (or will be) in service.
        notice = engine.death_notice(message, retryable=not whole)
        orphans: list[EngineCoreOutput] = []
        orphaned_ids: list[str] = []
        for wire_id, owner in list(state.inflight.items()):
            if owner is engine:
                stream = state.streams.get(wire_id)
                user_id = state.user_id(wire_id)
                orphaned_ids.append(wire_id)
                if not whole:
                    # A retry under the same id must not meet this request's late
                    # outputs, should the engine come back (an attached engine cut
                    # off by the network, say): it is sent under a fresh wire id.
                    state.bury(user_id)
                state.forget(wire_id)
                if stream is not None:
                    stream.fail(message, notice=notice)
                elif not whole:
                    orphans.append(
                        EngineCoreOutput(
                            user_id,
                            [],
                            finish_reason=FinishReason.ERROR,
                            error=RequestError("engine_dead", message, retryable=True),
                        )
                    )
        state.calls.fail(notice, engine=None if whole else engine)
        if orphaned_ids and not whole:
            # Best effort, for an engine that may still be running; one that is gone
            # never reads it.
            state.send_abort(engine, orphaned_ids)
        if orphans:
            state.batched_outputs += len(orphans)
            state.batches.put(EngineCoreOutputs(engine_index=engine.rank, outputs=orphans))
        state.wake_batch_readers()

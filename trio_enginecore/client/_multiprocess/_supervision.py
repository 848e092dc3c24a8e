"""After the startup: engines that come back, on their own or restarted by the client.

Two tasks of a multiprocess client, once every engine is ready:

* the **input watch** reads the ready messages the message pipe brings (the client's
  input ROUTER, with ZeroMQ, on which engines send nothing else). A ready message from
  an engine in service means it restarted or reconnected on its own (a TCP connection
  cut and re-made: the reference engine then drops the requests of the connection it
  lost), so this client's requests on it are failed instead of hanging; one from an
  engine being restarted completes that restart.
* the **restarter** (the ``restart`` policy) starts a dead engine again: after the
  back-off its :class:`~trio_enginecore.client._core._policy.RestartBudget` gives, the same
  rank, the same handshake (the client keeps its handshake socket for this), then back
  into service; one engine at a time, since they share the handshake socket. How an
  engine is started again is a :class:`Relaunch`: a new process for an engine the
  client launched (:class:`ProcessRelaunch`), the user's
  :class:`~trio_enginecore.client.EngineRestarter` for a remote one
  (:class:`RemoteRelaunch`, Ray's among them).

While no engine is in service, callers wait (bounded) for one to be back: that wait is
the client's (``TrioEngineClient``), which sees only the engines' states.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Protocol, final

import trio

from ..._curve import load_public_key
from ..._zmq import TrioSocket
from ...errors import EngineStartupError, ProtocolError
from ...serial import Buffer
from .._core._engines import EngineHandle
from .._core._policy import Restart, RestartBudget
from .._transport import ClientLink
from ._launch import LaunchedProcesses
from ._pipe import MessagePipe
from ._remote import EngineRestarter
from ._startup import EngineDialects, ReadyDecoder, StartupProgress

__all__ = [
    "EngineSupervisor",
    "ProcessRelaunch",
    "Relaunch",
    "RelaunchByRank",
    "RemoteRelaunch",
]

logger = logging.getLogger("trio_enginecore.client")


class Relaunch(Protocol):
    """How the restarter starts one dead engine again."""

    async def start(self, engine: EngineHandle) -> None:
        """Remove what is left of the dead engine; start a new one that joins the
        handshake. Raises ``EngineStartupError`` or ``OSError`` if it cannot."""
        ...

    async def ended(self, engine: EngineHandle) -> None:
        """Return when the new engine has ended (never, for one that cannot be
        watched): its restart then fails at once instead of timing out."""
        ...

    async def discard(self, engine: EngineHandle) -> str | None:
        """Stop the new engine (not ready in time); how it ended, if known."""
        ...


@final
class ProcessRelaunch:
    """A new process for an engine this client launched.

    Args:
        processes: the client's launched processes (the dead one is removed from them).
        launch: launches ``engine``'s process, pointed at the handshake, and watches it.
    """

    def __init__(
        self, processes: LaunchedProcesses, launch: Callable[[EngineHandle], Awaitable[None]]
    ) -> None:
        self.processes = processes
        self.launch = launch

    async def start(self, engine: EngineHandle) -> None:
        # Declared dead but maybe still running (it reported a fatal error and has not
        # exited yet, say): it goes before its rank is launched again.
        await self.processes.forget(engine)
        engine.forget_instance()
        await self.launch(engine)

    async def ended(self, engine: EngineHandle) -> None:
        launched = self.processes.get(engine)
        assert launched is not None
        await launched.process.wait()

    async def discard(self, engine: EngineHandle) -> str | None:
        launched = self.processes.get(engine)
        if launched is None:
            return None
        if launched.kill_if_running():  # the next attempt starts clean
            await launched.process.wait()
        return self.processes.describe_exit(engine, with_name=False)


@final
class RemoteRelaunch:
    """A remote engine started again by the user's restarter.

    Args:
        restarter: what started the engine in the first place, or can.
        admit: adds a CURVE public key to those the client admits.
    """

    def __init__(self, restarter: EngineRestarter, admit: Callable[[bytes], None]) -> None:
        self.restarter = restarter
        self.admit = admit

    async def start(self, engine: EngineHandle) -> None:
        engine.forget_instance()
        try:
            started = await self.restarter.restart_engine(engine.rank)
        except (EngineStartupError, OSError):
            raise
        except Exception as exc:  # theirs to raise: it becomes this restart's failure
            raise EngineStartupError(f"the engine restarter failed: {exc!r}") from exc
        if started.location is not None:
            engine.location = started.location
        if started.public_key is not None:
            self.admit(load_public_key(started.public_key))

    async def ended(self, engine: EngineHandle) -> None:
        await trio.sleep_forever()  # no process of ours: only the ready wait can tell

    async def discard(self, engine: EngineHandle) -> str | None:
        try:
            await self.restarter.stop_engine(engine.rank)
        except Exception as exc:
            logger.warning("stopping %s failed: %r", engine.describe(), exc)
        return None


@final
class RelaunchByRank:
    """Each engine restarted the way it was started: a process for the ranks this
    client launched, the remote relaunch for the others."""

    def __init__(
        self, launched: Collection[int], process: Relaunch, remote: Relaunch | None
    ) -> None:
        self.launched = launched
        self.process = process
        self.remote = remote

    def _for(self, engine: EngineHandle) -> Relaunch:
        if engine.rank in self.launched:
            return self.process
        assert self.remote is not None, "a remote engine with no restarter was restarted"
        return self.remote

    async def start(self, engine: EngineHandle) -> None:
        await self._for(engine).start(engine)

    async def ended(self, engine: EngineHandle) -> None:
        await self._for(engine).ended(engine)

    async def discard(self, engine: EngineHandle) -> str | None:
        return await self._for(engine).discard(engine)


@final
class EngineSupervisor:
    """The input watch and, with a ``restart`` policy, the restarter.

    Args:
        link: the client's link.
        pipe: the client's message pipe (only this task waits for its ready messages).
        input_address: where ready messages arrive, for error messages.
        restart: the policy, or None (then only the input watch runs).
        handshake: the handshake ROUTER, kept open for restarts.
        handshake_address: its address (what restarted engines connect to).
        metadata: the encoded handshake answer (the same for every restart).
        relaunch: starts a dead engine again (see :class:`Relaunch`).
        back_in_service: starts what watches an engine that is ready again.
        ready_timeout_s: how long one restart may take to be ready.
        came_on: told which connection each ready message came on.
        dialects: gives an engine that is ready again its dialect (the client's,
            from its startup).
    """

    def __init__(
        self,
        link: ClientLink,
        pipe: MessagePipe,
        input_address: str,
        *,
        restart: Restart | None = None,
        handshake: TrioSocket | None = None,
        handshake_address: str | None = None,
        metadata: Sequence[Buffer] = (),
        relaunch: Relaunch | None = None,
        back_in_service: Callable[[EngineHandle], None] | None = None,
        ready_timeout_s: float = 60.0,
        came_on: Callable[[int, EngineHandle], None] | None = None,
        dialects: EngineDialects | None = None,
    ) -> None:
        self.link = link
        self.pipe = pipe
        self.input_address = input_address
        self.restart = restart
        self.handshake = handshake
        self.handshake_address = handshake_address
        self.metadata = metadata
        self.relaunch = relaunch
        self.back_in_service = back_in_service
        self.ready_timeout_s = ready_timeout_s
        self.came_on = came_on
        self.dialects = dialects if dialects is not None else EngineDialects()
        self._budgets: dict[int, RestartBudget] = {}
        self._awaiting: dict[bytes, trio.Event] = {}
        self._to_restart, self._queue = trio.open_memory_channel[EngineHandle](float("inf"))
        self._scope = trio.CancelScope()
        self._stopped: trio.Event | None = None

    async def run(self) -> None:
        """Run the input watch (and the restarter) until :meth:`stop`."""
        self._stopped = stopped = trio.Event()
        try:
            with self._scope:
                async with trio.open_nursery() as tasks:
                    tasks.start_soon(self._watch_input)
                    if self.restart is not None:
                        tasks.start_soon(self._restarter)
        finally:
            stopped.set()

    async def stop(self) -> None:
        """Stop the tasks and wait until they ended: no restart begins after this.
        Not a checkpoint if :meth:`run` never started."""
        self._scope.cancel()
        if self._stopped is not None:
            await self._stopped.wait()

    def restart_later(self, engine: EngineHandle) -> None:
        """Queue a dead engine for restarting (its state says ``restarting``), and log
        the restart's one line, right after the engine's death."""
        if self.restart is not None:
            budget = self._budgets.setdefault(engine.rank, RestartBudget(self.restart))
            delay = budget.peek_delay(trio.current_time())
            if delay is not None:  # else it is given up, which is logged then
                self._log_restart(engine, delay)
            self._to_restart.send_nowait(engine)

    def _log_restart(self, engine: EngineHandle, delay: float) -> None:
        serving = [e.rank for e in self.link.state.engines if e.alive]
        logger.warning(
            "restarting %s in %.2g s; engine(s) %s in service", engine.describe(), delay, serving
        )

    # -------------------------------------------------------------- input watch

    async def _watch_input(self) -> None:
        decoder = ReadyDecoder()
        by_identity = {engine.identity: engine for engine in self.link.state.engines}
        while True:
            try:
                frames, fd = await self.pipe.next_ready()
            except trio.ClosedResourceError:
                return  # the client closed the pipe: the normal way out
            engine = by_identity.get(bytes(frames[0])) if len(frames) == 2 else None
            if engine is None:
                logger.warning("ignoring a message of %d frame(s) on the input socket", len(frames))
                continue
            if self.came_on is not None:
                self.came_on(fd, engine)
            awaited = self._awaiting.pop(engine.identity, None)
            if awaited is not None:
                if len(frames[1]):
                    try:
                        decoder.decode_into(engine, frames[1])
                    except ProtocolError as exc:
                        logger.error("%s sent an invalid ready message: %s", engine.describe(), exc)
                    else:
                        self.dialects.adopt(engine)
                awaited.set()
            elif engine.alive:
                self.link.requests_lost(
                    engine,
                    "sent a second ready message (it restarted, or reconnected, on its "
                    "own), so this client's requests on it were lost",
                )

    # ---------------------------------------------------------------- restarter

    async def _restarter(self) -> None:
        async for engine in self._queue:
            await self._restart(engine)

    async def _restart(self, engine: EngineHandle) -> None:
        restart = self.restart
        assert restart is not None
        budget = self._budgets.setdefault(engine.rank, RestartBudget(restart))
        announced = True  # by restart_later, when the engine died
        while engine.restarting:
            delay = budget.next_delay(trio.current_time())
            if delay is None:
                self.link.engine_given_up(
                    engine,
                    f"not restarted again: it needed {restart.max_restarts} restart(s) "
                    f"within {restart.window_s:g} s; the last death: {engine.death}",
                )
                return
            if not announced:  # another attempt, after a failed one
                self._log_restart(engine, delay)
            announced = False
            await trio.sleep(delay)
            failure = await self._attempt(engine)
            if failure is None:
                self.link.engine_back(engine)
                assert self.back_in_service is not None
                self.back_in_service(engine)
                return
            logger.error("restarting %s failed: %s", engine.describe(), failure)
            self.link.state.lifecycle.restart_failed(engine, failure)

    async def _attempt(self, engine: EngineHandle) -> str | None:
        """Start the engine again and wait until it is ready: None, or why not."""
        relaunch = self.relaunch
        assert relaunch is not None
        assert self.handshake is not None
        ready = self._awaiting[engine.identity] = trio.Event()
        progress = StartupProgress([engine], self.input_address, self.handshake_address)
        handshake = self.handshake
        outcome: str | None = f"not ready within {self.ready_timeout_s:g} s"
        with trio.move_on_after(self.ready_timeout_s):
            try:
                await relaunch.start(engine)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_when_ended, relaunch, engine, nursery.cancel_scope)
                    await progress.handshake(handshake, self.metadata)
                    await progress.wait_handshake_ready(handshake)
                    await ready.wait()
                    outcome = None
                    nursery.cancel_scope.cancel()
            except (EngineStartupError, OSError) as exc:
                outcome = str(exc)
        self._awaiting.pop(engine.identity, None)
        if outcome is None:
            return None
        ending = await relaunch.discard(engine)
        return f"{outcome}: {ending}" if ending else outcome


async def _cancel_when_ended(
    relaunch: Relaunch, engine: EngineHandle, scope: trio.CancelScope
) -> None:
    await relaunch.ended(engine)
    scope.cancel()

"""Noticing that an engine died, and telling which one it was.

Three ways an engine's death is seen, one task each:

* a launched engine's process exits (:func:`watch_process`);
* a remote or attached engine, which is no child process of ours, stops answering a
  cheap utility call within a deadline (:func:`check_liveness`): ZeroMQ reconnects
  silently, so nothing else would notice it being killed, hung or cut off;
* an engine sends ENGINE_CORE_DEAD, one frame that does not say who sent it
  (:class:`DeathAttribution`): with several engines the sender exits right after (or
  falls silent), and that says which it was; if nothing does within a bounded time,
  every engine is failed.
"""

from __future__ import annotations

import logging
from typing import final

import trio

from ..errors import EngineDeadError
from ._launch import EngineHandle
from ._transport import ClientLink

__all__ = ["DeathAttribution", "check_liveness", "watch_process"]

logger = logging.getLogger("trio_enginecore.client")

_STDERR_WAIT_S = 1.0


async def watch_process(engine: EngineHandle, link: ClientLink) -> None:
    """Report a launched engine's exit as its death, unless the client is closing
    (then the exit is the one it asked for). Its last stderr lines go in the reason."""
    process = engine.process
    assert process is not None
    code = await process.wait()
    if not link.state.closing:
        with trio.move_on_after(_STDERR_WAIT_S):
            await engine.stderr_done.wait()
        link.engine_died(engine, engine.exit_description(with_name=False))
        logger.debug("engine exit code %d", code)


async def check_liveness(
    engine: EngineHandle, link: ClientLink, *, interval_s: float, timeout_s: float, kind: str
) -> None:
    """Every ``interval_s``, ping ``engine``; report it dead when a ping is not
    answered within ``timeout_s``, and kill it if it is a process of ours (a hung
    engine holds memory and devices until it goes). Ends when the engine is dead or
    the client closes; a client failed by another engine's death keeps watching it,
    since its streams go on."""
    answered = trio.current_time()
    while True:
        await trio.sleep(interval_s)
        with trio.move_on_after(timeout_s) as unanswered:
            try:
                await link.ping(engine)
            except trio.ClosedResourceError:
                return
            except EngineDeadError:
                if not engine.alive:
                    return
                if link.state.failure is not None:
                    # Failed with the client, unanswered: the engine's streams go on
                    # (under "fail"), so it is still watched.
                    continue
                # The check was failed with the requests of an engine that came back
                # on its own (a second ready message): it spoke, so it lives.
        if not unanswered.cancelled_caught:
            answered = trio.current_time()
            continue
        silent_s = trio.current_time() - answered
        process = engine.process
        if process is not None and process.returncode is None:
            link.engine_died(
                engine,
                f"stopped responding for {silent_s:.1f} s (no answer to a liveness check "
                f"within {timeout_s:g} s: hung, or stopped); killed it",
            )
            process.kill()
        else:
            link.engine_died(
                engine,
                f"no answer to a liveness check within {timeout_s:g} s (the {kind} "
                f"engine stopped responding {silent_s:.1f} s ago, or the network "
                "between us failed)",
            )
        return


@final
class DeathAttribution:
    """Tells which engine sent an ENGINE_CORE_DEAD (see the module docstring).

    Args:
        link: the client's link (its engines, and how to report a death).
        window_s: how long the sender may take to be identified; None when nothing
            can identify it (then every live engine is failed at once).
    """

    def __init__(self, link: ClientLink, window_s: float | None) -> None:
        self.link = link
        self.window_s = window_s
        self._a_death = trio.Event()

    def death_recorded(self) -> None:
        """An engine's death was recorded (by whatever noticed it)."""
        death, self._a_death = self._a_death, trio.Event()
        death.set()

    def reported_dead(self, nursery: trio.Nursery) -> None:
        """Someone sent ENGINE_CORE_DEAD: with one live engine, it is that one; with
        several, start a task (in ``nursery``) waiting for one of them to die."""
        suspects = [engine for engine in self.link.state.engines if engine.alive]
        window = self.window_s
        if len(suspects) <= 1 or window is None:
            for engine in suspects:
                self.link.engine_died(
                    engine, "the engine reported a fatal error (ENGINE_CORE_DEAD)"
                )
            return
        logger.warning("an engine reported a fatal error; waiting up to %g s to tell which", window)
        nursery.start_soon(self._attribute, suspects, window)

    async def _attribute(self, suspects: list[EngineHandle], window_s: float) -> None:
        with trio.move_on_after(window_s):
            while all(engine.alive for engine in suspects):
                await self._a_death.wait()
            return
        for engine in suspects:
            self.link.engine_died(
                engine,
                "an engine reported a fatal error (ENGINE_CORE_DEAD) and none could be "
                f"identified as the sender within {window_s:g} s",
            )

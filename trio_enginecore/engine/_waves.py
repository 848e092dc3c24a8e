"""An engine's side of data-parallel request waves (pure logic: no I/O).

The engines of a data-parallel group alternate between a global *running* state and a
global *paused* state; a *wave* is one running period, numbered from 0. A client stamps
each request with the wave it last saw published and sends nothing else: only engines
start waves. The rules, as vLLM 0.33's ``DPEngineCoreProc`` follows them:

* a request for a later wave moves the engine to that wave;
* a request reaching a paused engine makes the engine run and ask the coordinator to
  start its current wave (``start_wave``), so that the other engines run too;
* ``START_DP_WAVE(wave, exclude)`` from the coordinator starts ``wave`` on every engine
  but ``exclude`` (which already has the request that started it);
* when the wave's work is done, the engine reports ``wave_complete`` and pauses.

vLLM decides "done" with an all-reduce across the ranks (a torch collective) and only
rank 0 reports, for all of them. The reference engines have no collective: each one
reports its own completion, after announcing once that it does so
(:data:`~trio_enginecore.protocol.REPORTS_OWN_WAVES`), and the coordinator ends the wave
once rank 0 and every engine that announced itself have reported it (see
:class:`~trio_enginecore.coordinator.CoordinatorState`).
"""

from __future__ import annotations

import attrs

__all__ = ["EngineWaveState"]


@attrs.define
class EngineWaveState:
    """The wave one engine (``rank``) is in, and whether it is running."""

    rank: int
    current_wave: int = 0
    running: bool = False

    def on_request(self, wave: int) -> int | None:
        """A request stamped with ``wave`` arrived; the engine has work now.

        Returns the wave the coordinator must be asked to start (``start_wave``): the
        engine's current one, whenever the engine was paused; ``None`` when it was
        already running.
        """
        if wave > self.current_wave:
            self.current_wave = wave
        if self.running:
            return None
        self.running = True
        return self.current_wave

    def on_start_wave(self, wave: int, exclude: int | None) -> None:
        """The coordinator broadcast ``START_DP_WAVE(wave, exclude)``."""
        if exclude != self.rank and wave >= self.current_wave:
            self.current_wave = wave
            self.running = True

    def on_idle(self) -> int | None:
        """The engine has no unfinished request.

        Returns the wave to report as complete (the engine pauses and moves to the next
        wave), or ``None`` when it was not running.
        """
        if not self.running:
            return None
        completed = self.current_wave
        self.current_wave += 1
        self.running = False
        return completed

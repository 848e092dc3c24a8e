"""An engine's side of data-parallel request waves (pure logic: no I/O).

The engines of a data-parallel group alternate between a global *running* state and a
global *paused* state; a *wave* is one running period, numbered from 0. A client stamps
each request with the wave it believes current. The rules, as vLLM's engines follow
them:

* a request for a later wave moves the engine to that wave;
* a request for an earlier wave reaching a paused engine means the client missed the
  end of a wave: the engine asks the coordinator to start its current wave
  (``start_wave``), so that the other engines run too;
* ``START_DP_WAVE(wave, exclude)`` from the coordinator starts ``wave`` on every engine
  but ``exclude`` (which already has the request that started it);
* when the wave's work is done, the engine reports ``wave_complete`` and pauses.

vLLM decides "done" with an all-reduce across the ranks (a torch collective) and only
rank 0 reports; the reference engines have no collective, so each engine reports when
it has no unfinished request of its own, and the coordinator ends the wave once every
engine has reported it (see :class:`~trio_enginecore.engine.CoordinatorState`).
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

        Returns the wave the coordinator must be asked to start (``start_wave``), or
        ``None``.
        """
        start = None
        if wave > self.current_wave:
            self.current_wave = wave
        elif wave < self.current_wave and not self.running:
            start = self.current_wave
        self.running = True
        return start

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

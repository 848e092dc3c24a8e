"""What a data-parallel coordinator knows, and vLLM's rules for it (pure logic: no I/O).

The serving task (:func:`~trio_enginecore.coordinator.serve_coordinator`) feeds a
:class:`CoordinatorState` what arrives on its sockets and sends what it returns; every
rule is here, where it can be tested without a socket.
"""

from __future__ import annotations

from typing import Final

import attrs
import msgspec

from ..protocol import (
    REPORTS_OWN_WAVES,
    CoordinatorPublication,
    EngineCoreOutputs,
    EngineCoreRequestType,
    StartDPWave,
)

__all__ = ["CoordinatorState", "start_wave_frames"]

_START_DP_WAVE: Final = EngineCoreRequestType.START_DP_WAVE.value
_IDLE: Final = (0, 0, 0.0)


def start_wave_frames(start: StartDPWave) -> list[bytes]:
    """The START_DP_WAVE broadcast to engines: ``[b"\\x02", msgpack((wave, exclude))]``."""
    return [_START_DP_WAVE, msgspec.msgpack.encode(start)]


@attrs.define
class CoordinatorState:
    """What the coordinator knows, and the wave rules (pure logic: no I/O).

    vLLM's rules: an engine's ``start_wave`` for a later wave, or for the current one
    while paused, starts that wave on the others; a ``wave_complete`` for the current
    wave (or a later one) ends it. vLLM's rank 0 reports the completion for every rank
    after an all-reduce; reference engines, which announce that they report their own
    (:data:`~trio_enginecore.protocol.REPORTS_OWN_WAVES`), must all report it, so the
    wave ends once rank 0 and every engine that announced itself have.
    """

    engines: int
    counts: list[tuple[int, int, float]] = attrs.field(init=False)
    """``(waiting, running, kv_cache_usage)`` of each engine, by rank."""
    current_wave: int = 0
    engines_running: bool = False
    changed: bool = True
    """The counts changed since the last publication (or a front-end subscribed)."""
    wave_changed: bool = False
    """The wave or the running state changed since the last publication."""
    _ready_after: int = attrs.field(init=False)
    _engines_subscribed: int = attrs.field(init=False, default=0)
    _own_reporters: set[int] = attrs.field(init=False, factory=set[int])
    _completed: dict[int, set[int]] = attrs.field(init=False, factory=dict[int, set[int]])

    def __attrs_post_init__(self) -> None:
        self.counts = [_IDLE] * self.engines
        self._ready_after = self.engines

    def engine_subscribed(self) -> bool:
        """An engine subscribed to the START_DP_WAVE broadcasts.

        Returns whether to send :data:`~trio_enginecore.protocol.COORDINATOR_READY`
        now. vLLM's engines wait for it until every engine of the group (the
        ``engines`` the coordinator started with) has subscribed; one that subscribes
        later (a restart) is told at once.
        """
        self._engines_subscribed += 1
        return self._engines_subscribed >= self._ready_after

    def frontend_subscribed(self) -> None:
        """A front-end subscribed: it is sent the counts at once, not at the next
        heartbeat."""
        self.changed = True

    def update(self, message: EngineCoreOutputs) -> StartDPWave | None:
        """Fold one engine's message in.

        Returns the START_DP_WAVE to broadcast to the engines, if any. Messages from
        unknown engines are ignored.
        """
        index = message.engine_index
        if not 0 <= index < self.engines:
            return None
        stats = message.scheduler_stats
        if stats is not None:
            new = (stats.num_waiting_reqs, stats.num_running_reqs, stats.kv_cache_usage)
            if new != self.counts[index]:
                self.counts[index] = new
                self.changed = True
        if message.wave_complete is not None:
            if message.wave_complete == REPORTS_OWN_WAVES:
                self._own_reporters.add(index)
            else:
                self._wave_completed(message.wave_complete, index)
        elif message.start_wave is not None:
            wave = message.start_wave
            if wave > self.current_wave or (wave == self.current_wave and not self.engines_running):
                self.current_wave = wave
                self.engines_running = True
                self.wave_changed = True
                return StartDPWave(wave, index)
        return None

    def scale(self, engines: int) -> None:
        """A front-end says the group now has ``engines`` engines (elastic EP).

        Raises:
            ValueError: ``engines`` < 1; nothing changed.
        """
        if engines < 1:
            raise ValueError(f"a group needs at least one engine, got {engines}")
        self.counts = (self.counts + [_IDLE] * engines)[:engines]
        self.engines = engines
        self._own_reporters = {rank for rank in self._own_reporters if rank < engines}
        self.changed = True

    def publication(self) -> bytes:
        """The counts and wave for front-ends; the end of the current changes."""
        self.changed = self.wave_changed = False
        return msgspec.msgpack.encode(
            CoordinatorPublication(self.counts, self.current_wave, self.engines_running)
        )

    def wave_publication(self) -> bytes:
        """The wave and running state alone (``counts`` None), sent at once when they
        change, as vLLM's coordinator does; the end of the wave change."""
        self.wave_changed = False
        return msgspec.msgpack.encode(
            CoordinatorPublication(None, self.current_wave, self.engines_running)
        )

    def _wave_completed(self, wave: int, engine: int) -> None:
        if wave < self.current_wave:
            return  # a wave that has ended (or been overtaken) already
        done = self._completed.setdefault(wave, set())
        done.add(engine)
        waiting_for = self._own_reporters | {0}
        if not waiting_for <= done:
            return
        self.current_wave = wave + 1
        self.engines_running = False
        self.wave_changed = True
        for old in [w for w in self._completed if w <= wave]:
            del self._completed[old]

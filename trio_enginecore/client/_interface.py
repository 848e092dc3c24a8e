"""The interface of every Trio engine-core client, and the snapshot its statistics give.

:class:`AsyncEngineCoreClient` documents every method once: the clients
(:class:`~trio_enginecore.TrioMPClient`, the data-parallel ones, the in-process one and
the test double of :mod:`trio_enginecore.testing`) all implement it.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, TypeVar, final

import attrs

from ..protocol import CheckpointState, EngineCoreOutputs, EngineCoreRequest, LoRARequest
from ._stream import RequestStream
from ._utilities import (
    UTILITIES,
    UtilitySpec,
    combine,
    convert_each,
    convert_result,
    sleep_arguments,
    trailing_given,
)

__all__ = [
    "AsyncEngineCoreClient",
    "ClientStatistics",
    "EngineState",
    "EngineStatus",
    "PauseMode",
    "convert_result",
]

R = TypeVar("R")

PauseMode = Literal["abort", "wait", "keep"]


EngineState = Literal["alive", "suspect", "restarting", "dead"]
"""Where an engine stands: ``"alive"`` (serving, or still starting), ``"suspect"``
(serving, but its connection was lost or it has made no progress for a while:
declared dead if that goes on, back to ``"alive"`` when it shows life),
``"restarting"`` (it died and is being launched again: the ``restart`` policy),
``"dead"`` (died, and taken out of routing; or shut down with its client)."""


@final
@attrs.frozen
class EngineStatus:
    """One engine, as ``statistics().engines`` shows it."""

    rank: int
    """The engine's data-parallel rank."""
    state: EngineState
    in_flight: int
    """This client's requests in flight on it."""
    death: str | None = None
    """Why it died (the message its failed requests carry), or None."""
    restarts: int = 0
    """How many times the client restarted it (the ``restart`` policy)."""
    location: str | None = None
    """Where it runs, for remote engines (``RemoteEngines.locations``; a restart
    may move it), else None."""
    suspicion: str | None = None
    """Why it is ``"suspect"``, or None."""


@final
@attrs.frozen
class ClientStatistics:
    """A snapshot of a client's state, from :meth:`TrioMPClient.statistics`."""

    requests_in_flight: int
    """Requests sent and neither finished nor aborted (streams included)."""
    open_streams: int
    """Streams whose ``async with`` block has not exited."""
    pending_utility_calls: int
    """Your utility calls waiting for their reply (the client's own liveness calls
    are not counted)."""
    pending_batches: int
    """Engine messages waiting for ``get_output()``."""
    messages_received: int
    """Messages decoded from the output socket."""
    outputs_received: int
    """Per-request outputs in those messages."""
    tokens_received: int
    """New token ids in those outputs."""
    protocol_errors: int
    """Engine messages (or parts of them) dropped because they broke the protocol:
    undecodable, from an engine this client does not have, or outputs of one request
    that cannot be merged."""
    engines_alive: int
    """Engines that have neither died nor been shut down."""
    outputs_dropped: int = 0
    """Outputs dropped because no request of theirs was in flight: late outputs of an
    aborted request (normal), and outputs an engine should not have sent (for an
    unknown id, a second finish, after the finish)."""
    engines: tuple[EngineStatus, ...] = ()
    """Each engine's state, by rank."""


class AsyncEngineCoreClient(abc.ABC):
    """The interface of every Trio engine-core client.

    Every async method is a checkpoint. Unless its docstring says otherwise it is
    atomic with respect to cancellation: it either completes, or raises
    :class:`trio.Cancelled` with nothing sent and nothing changed. Utility calls are
    the documented exception: a cancelled call may still have run on the engine.
    """

    @abc.abstractmethod
    async def add_request(self, request: EngineCoreRequest) -> None:
        """Submit a request; its outputs arrive through :meth:`get_output`."""

    async def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """Submit several requests, as :meth:`add_request` does for one."""
        for request in requests:
            await self.add_request(request)

    @abc.abstractmethod
    async def get_output(self) -> EngineCoreOutputs:
        """The next engine message with outputs of requests from :meth:`add_request`."""

    @abc.abstractmethod
    async def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests; unknown ids are ignored."""

    @abc.abstractmethod
    def stream(self, request: EngineCoreRequest) -> AbstractAsyncContextManager[RequestStream]:
        """Submit a request and stream its outputs (``async with ... as outputs``)."""

    @abc.abstractmethod
    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call a utility method on the engine and return its untyped result."""

    @abc.abstractmethod
    def statistics(self) -> ClientStatistics:
        """A frozen snapshot of the client's counters."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Abort in-flight requests and release everything the client holds."""

    async def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine; one untyped result per engine, by rank.

        A client with one engine answers ``[await self.call_utility(method, *args)]``.
        Cancellation and errors as :meth:`call_utility`.
        """
        return [await self.call_utility(method, *args)]

    async def _utility(self, spec: UtilitySpec[R], *args: Any) -> R:
        # Every typed wrapper: ask every engine, then combine as the table says.
        return combine(spec, await self.call_utility_all(spec.name, *args))

    async def is_sleeping(self) -> bool:
        """Whether the engine is asleep. Safe to retry after cancellation.

        With several engines, they must agree (else
        :class:`~trio_enginecore.client.EngineConsensusError`).
        """
        return await self._utility(UTILITIES.is_sleeping)

    async def sleep(
        self,
        level: int = 1,
        mode: Literal["abort", "wait", "keep"] | None = None,
        *,
        reset_connector: bool | None = None,
    ) -> None:
        """Put the engine (every engine) to sleep: it stops stepping until :meth:`wake_up`.

        ``mode`` says what becomes of the requests in flight (vLLM's pause modes;
        without one, a vLLM engine aborts them and the reference engine keeps them).
        ``reset_connector`` (vLLM 0.34 engines only; needs ``mode``) also resets the KV
        connector's cache. Sleeping pauses the scheduler, as in vLLM.

        Raises:
            UtilityCallError: an engine refused (e.g. while a process checkpoint is
                under way), or ``reset_connector`` went to an engine older than
                vLLM 0.34 (refused before sending).
        """
        return await self._utility(UTILITIES.sleep, *sleep_arguments(level, mode, reset_connector))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the engine up after :meth:`sleep`.

        Returns whether it is fully awake, as vLLM 0.33's engines answer: with
        ``tags`` naming part of its memory, the rest may stay asleep. An engine that
        answers nothing (older ones) counts as fully awake.
        """
        return await self._utility(UTILITIES.wake_up, tags)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Clear the engine's prefix cache; False if it could not (requests running)."""
        return await self._utility(
            UTILITIES.reset_prefix_cache, reset_running_requests, reset_connector
        )

    async def profile(self, is_start: bool = True) -> None:
        """Start (or stop) the engine's profiler."""
        return await self._utility(UTILITIES.profile, is_start)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter on the engine; False if there is no room."""
        return await self._utility(UTILITIES.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Unregister a LoRA adapter; False if it was not registered."""
        return await self._utility(UTILITIES.remove_lora, lora_id)

    async def list_loras(self) -> set[int]:
        """Ids of the LoRA adapters registered on the engine."""
        return await self._utility(UTILITIES.list_loras)

    async def pin_lora(self, lora_id: int) -> bool:
        """Keep a LoRA adapter registered; False if it is not registered."""
        return await self._utility(UTILITIES.pin_lora, lora_id)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """The tasks the engine serves, e.g. ``("generate",)``."""
        return await self._utility(UTILITIES.get_supported_tasks)

    async def execute_dummy_batch(self) -> None:
        """Run the model once on a throwaway batch (a warm-up)."""
        return await self._utility(UTILITIES.execute_dummy_batch)

    async def set_weight_version(self, version: str | None) -> None:
        """Record the weight version the engine reports on its outputs."""
        return await self._utility(UTILITIES.set_weight_version, version)

    async def get_weight_version(self) -> str | None:
        """The weight version set with :meth:`set_weight_version`."""
        return await self._utility(UTILITIES.get_weight_version)

    async def pause_scheduler(
        self,
        mode: Literal["abort", "wait", "keep"] = "abort",
        clear_cache: bool = True,
        *,
        reset_connector: bool | None = None,
    ) -> None:
        """Pause the engine's scheduler.

        ``abort`` aborts in-flight requests (their streams end with ABORT), ``wait``
        returns once running requests finished, ``keep`` freezes them in place.
        Requests added while paused wait until :meth:`resume_scheduler`.
        ``reset_connector`` (vLLM 0.34 engines only) also resets the KV connector's
        cache.
        """
        return await self._utility(
            UTILITIES.pause_scheduler, *trailing_given(mode, clear_cache, reset_connector)
        )

    async def release_kv_cache_memory(self, *, reset_connector: bool | None = None) -> None:
        """Discard the engines' KV cache memory after a completed pause
        (:meth:`pause_scheduler`); kept requests are recomputed after. vLLM 0.34 and
        the reference engine; ``reset_connector`` needs vLLM 0.34."""
        return await self._utility(
            UTILITIES.release_kv_cache_memory, *trailing_given(reset_connector)
        )

    async def is_inference_ready(self) -> bool:
        """Whether every engine would serve a new request now: none asleep, paused or
        in a process checkpoint (vLLM 0.34 engines and the reference engine; refused
        before sending to older ones)."""
        return await self._utility(UTILITIES.is_inference_ready)

    async def checkpoint_prepare(
        self, mode: Literal["abort", "wait", "keep"] = "wait"
    ) -> str | None:
        """Prepare every engine for a process checkpoint (vLLM 0.34): pause with
        ``mode``, then release what a checkpoint must not hold; watch
        :meth:`checkpoint_state` reach ``"prepared"``.

        Returns the first refusing engine's reason (by rank), or None. Engines that
        did not refuse are preparing: :meth:`checkpoint_restore` brings them back.
        """
        return await self._utility(UTILITIES.checkpoint_prepare, mode)

    async def checkpoint_restore(self) -> None:
        """Bring every engine back from a prepared checkpoint and resume serving."""
        return await self._utility(UTILITIES.checkpoint_restore)

    async def checkpoint_state(self) -> tuple[CheckpointState, str | None]:
        """``(state, error)`` of the engines' process checkpoint, merged over the
        engines as vLLM's client merges them: ``"failed"`` if any failed (with its
        error), else the state they share, else the transition under way."""
        return await self._utility(UTILITIES.checkpoint_state)

    async def resume_scheduler(self) -> None:
        """Resume the engine's scheduler after :meth:`pause_scheduler`."""
        return await self._utility(UTILITIES.resume_scheduler)

    async def is_scheduler_paused(self) -> bool:
        """Whether the engine's scheduler is paused."""
        return await self._utility(UTILITIES.is_scheduler_paused)

    async def get_request_counts(self) -> tuple[int, int]:
        """``(waiting, running)`` request counts of the engine, summed over the engines.

        A utility of the reference engine (``trio-enginecore serve``), in this order:
        waiting first. vLLM 0.33's engines have no such utility (the call raises
        :class:`~trio_enginecore.errors.UtilityCallError`; its internal
        ``Scheduler.get_request_counts()`` answers (running, waiting)). From a vLLM
        engine, read the same figures from the ``SchedulerStats`` its outputs carry
        with ``log_stats`` on (``num_waiting_reqs``, ``num_running_reqs``), or, with
        data parallelism, from the coordinator's publications the load balancer uses.
        """
        return await self._utility(UTILITIES.get_request_counts)

    async def get_request_counts_per_engine(self) -> list[tuple[int, int]]:
        """``(waiting, running)`` of each engine, by rank (see :meth:`get_request_counts`)."""
        spec = UTILITIES.get_request_counts
        return convert_each(spec, await self.call_utility_all(spec.name))

"""The two interfaces of every engine-core client: Trio and blocking.

:class:`AsyncEngineCoreClient` documents every method once: the Trio clients
(:class:`~trio_enginecore.TrioMPClient`, the data-parallel ones, the in-process one and
the test double of :mod:`trio_enginecore.testing`) all implement it.
:class:`EngineCoreClient` is the same interface, blocking (vLLM's ``EngineCoreClient``),
implemented by :class:`~trio_enginecore.SyncMPClient` and
:class:`~trio_enginecore.InprocClient`. Both take their typed utilities from one table
(:data:`._core._utilities.UTILITIES`), so the two faces cannot drift apart.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Self, TypeVar

from ..errors import UtilityCallError
from ..protocol import (
    CheckpointState,
    EngineCoreOutputs,
    EngineCoreRequest,
    LoRARequest,
    PauseMode,
    UtilityOutput,
)
from ._core._statistics import ClientStatistics, EngineState, EngineStatus
from ._core._stream import RequestStream
from ._core._utilities import (
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
    "EngineCoreClient",
    "EngineState",
    "EngineStatus",
    "PauseMode",
    "convert_result",
]

R = TypeVar("R")


class AsyncEngineCoreClient(abc.ABC):
    """The interface of every Trio engine-core client.

    Every async method is a checkpoint. Unless its docstring says otherwise it is
    atomic with respect to cancellation: it either completes, or raises
    :class:`trio.Cancelled` with nothing sent and nothing changed. Utility calls are
    the documented exception: a cancelled call may still have run on the engine.
    """

    @abc.abstractmethod
    async def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the engine; its outputs arrive through :meth:`get_output`.

        Sets ``request.client_index`` to this client's index.

        The request is checked first: nothing is sent or registered if it raises.

        Raises:
            TypeError: a field of the request has the wrong type (the message names
                it), e.g. a request id that is not a ``str``.
            ValueError: a request with this id is already in flight on this client, or
                a field has an impossible value (an empty id, a negative token id).
            EngineDeadError: the engine has died.
            trio.ClosedResourceError: the client is shutting down.
        """

    @abc.abstractmethod
    async def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """Send several requests with a single checkpoint.

        Cheaper than one :meth:`add_request` per request when many are ready at once
        (say, every request that finished in the last step being replaced): the sends
        go out back to back instead of one per scheduler tick. All-or-nothing with
        respect to cancellation: if it raises ``Cancelled``, none was sent.

        Raises:
            TypeError: a field of one request has the wrong type; then none was sent.
            ValueError: two requests share an id, one is already in flight, or a field
                has an impossible value; then none was sent.
            EngineDeadError: the engine has died.
            trio.ClosedResourceError: the client is shutting down.
        """

    @abc.abstractmethod
    async def get_output(self) -> EngineCoreOutputs:
        """The next engine message with outputs of requests added by :meth:`add_request`.

        Outputs of streamed requests are not delivered here. A caller that keeps up
        gets each engine message as it was sent; one that fell behind gets an engine's
        whole backlog folded into one message, outputs in arrival order (no output is
        ever dropped).

        Raises:
            EngineDeadError: the engine died and no output is pending.
            trio.ClosedResourceError: the client was closed.
        """

    @abc.abstractmethod
    async def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests on the engines that have them. Unknown ids are ignored.

        The engine sends no output for a request it aborts on our behalf, and outputs
        already received for it are dropped (those of a request that finished but
        whose outputs ``get_output()`` has not returned yet too): after this returns,
        ``get_output()`` never returns an output of these requests. A stream of an
        aborted request ends with a local ``FinishReason.ABORT`` output.

        An aborted request's id may be used again at once: the new request then goes
        to the engine under a fresh internal id (its ``external_req_id`` is yours), so
        the old request's late outputs are told apart and dropped; outputs reach you
        with your id.
        """

    @abc.abstractmethod
    def stream(self, request: EngineCoreRequest) -> AbstractAsyncContextManager[RequestStream]:
        """Send ``request`` and stream its outputs.

        ::

            async with client.stream(request) as outputs:
                async for output in outputs:
                    ...

        Leaving the block before the request finished (``break``, an exception,
        cancellation) aborts it on the engine, exactly once, before the block exits:
        the ABORT is one non-blocking send, with no checkpoint, so cancellation cannot
        skip it and nothing waits for it. Entering is atomic with respect to
        cancellation (a cancelled entry sent nothing).

        If the engine rejects or fails the request (it finishes it with
        ``FinishReason.ERROR``), iterating the stream raises
        :class:`~trio_enginecore.errors.RequestFailedError` with the engine's message,
        after every output that came before the error.

        Raises:
            TypeError, ValueError: on entry, as :meth:`add_request`; nothing was sent.
            EngineDeadError: the engine has died (on entry, or from the stream).
        """

    @abc.abstractmethod
    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` on the engine and return its (untyped) result.

        With several engines it goes to one of them (rank 0); see
        ``call_utility_all``. The typed wrappers (``is_sleeping``, ``sleep``, ...)
        go to every engine.

        Cancellation: the call's bookkeeping is undone and a late reply is dropped, but
        the engine may still have run the method; only the typed wrappers that are
        idempotent can simply be retried.

        Raises:
            UtilityCallError: the method raised on the engine; carries its message.
            EngineDeadError: the engine died before replying.
        """

    @abc.abstractmethod
    def statistics(self) -> ClientStatistics:
        """A frozen snapshot of the client's counters."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Abort in-flight requests, close every stream and call, stop the transport.

        A multiprocess client stops the engines it launched (SIGTERM, then SIGKILL
        after ``shutdown_timeout_s``), leaves attached engines running (their requests
        from this client aborted) and closes its sockets. Idempotent. Runs shielded
        from cancellation (bounded by the transport's timeouts), like every Trio
        ``aclose``.
        """

    async def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine in service; one result per engine,
        by rank (engines a ``route_around`` client took out of service are skipped).

        Cancellation and errors as :meth:`call_utility` (the first engine failure is
        raised, naming the engine).
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
        mode: PauseMode | None = None,
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
        mode: PauseMode = "abort",
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

    async def checkpoint_prepare(self, mode: PauseMode = "wait") -> str | None:
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


class EngineCoreClient(abc.ABC):
    """The blocking interface of every engine-core client (vLLM's ``EngineCoreClient``).

    The methods are those of :class:`~trio_enginecore.AsyncEngineCoreClient`, blocking.
    Use it as a context manager: leaving the ``with`` block closes the client.
    """

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Submit a request; its outputs arrive through :meth:`get_output`."""

    @abc.abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next engine message with outputs of submitted requests."""

    @abc.abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests; unknown ids are ignored."""

    @abc.abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Call a utility method on the engine and return its untyped result."""

    @abc.abstractmethod
    def statistics(self) -> ClientStatistics:
        """A frozen snapshot of the client's counters."""

    @abc.abstractmethod
    def close(self) -> None:
        """Abort in-flight requests and release everything. Idempotent."""

    def shutdown(self) -> None:
        """vLLM's name for :meth:`close`."""
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @staticmethod
    def _unwrap(method: str, reply: UtilityOutput) -> Any:
        if reply.failure_message is not None:
            raise UtilityCallError(method, reply.failure_message)
        return reply.result.result if reply.result is not None else None

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine; one untyped result per engine, by rank.

        A client with one engine answers ``[self.call_utility(method, *args)]``.
        """
        return [self.call_utility(method, *args)]

    def _utility(self, spec: UtilitySpec[R], *args: Any) -> R:
        # Every typed wrapper, as the Trio interface's: ask every engine, then combine
        # as the table says.
        return combine(spec, self.call_utility_all(spec.name, *args))

    def is_sleeping(self) -> bool:
        """Whether the engine is asleep (with several engines, they must agree)."""
        return self._utility(UTILITIES.is_sleeping)

    def sleep(
        self,
        level: int = 1,
        mode: PauseMode | None = None,
        *,
        reset_connector: bool | None = None,
    ) -> None:
        """Put the engine (every engine) to sleep (see the Trio client's ``sleep``)."""
        return self._utility(UTILITIES.sleep, *sleep_arguments(level, mode, reset_connector))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the engine up after :meth:`sleep`; whether it is fully awake."""
        return self._utility(UTILITIES.wake_up, tags)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Clear the engine's prefix cache; False if it could not (requests running)."""
        return self._utility(UTILITIES.reset_prefix_cache, reset_running_requests, reset_connector)

    def profile(self, is_start: bool = True) -> None:
        """Start (or stop) the engine's profiler."""
        return self._utility(UTILITIES.profile, is_start)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter on the engine; False if there is no room."""
        return self._utility(UTILITIES.add_lora, lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unregister a LoRA adapter; False if it was not registered."""
        return self._utility(UTILITIES.remove_lora, lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the LoRA adapters registered on the engine."""
        return self._utility(UTILITIES.list_loras)

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a LoRA adapter registered; False if it is not registered."""
        return self._utility(UTILITIES.pin_lora, lora_id)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """The tasks the engine serves, e.g. ``("generate",)``."""
        return self._utility(UTILITIES.get_supported_tasks)

    def execute_dummy_batch(self) -> None:
        """Run the model once on a throwaway batch (a warm-up)."""
        return self._utility(UTILITIES.execute_dummy_batch)

    def set_weight_version(self, version: str | None) -> None:
        """Record the weight version the engine reports on its outputs."""
        return self._utility(UTILITIES.set_weight_version, version)

    def get_weight_version(self) -> str | None:
        """The weight version set with :meth:`set_weight_version`."""
        return self._utility(UTILITIES.get_weight_version)

    def pause_scheduler(
        self,
        mode: PauseMode = "abort",
        clear_cache: bool = True,
        *,
        reset_connector: bool | None = None,
    ) -> None:
        """Pause the engine's scheduler (see the Trio client's ``pause_scheduler``)."""
        return self._utility(
            UTILITIES.pause_scheduler, *trailing_given(mode, clear_cache, reset_connector)
        )

    def release_kv_cache_memory(self, *, reset_connector: bool | None = None) -> None:
        """Discard the KV cache memory after a completed pause (see the Trio client's
        ``release_kv_cache_memory``)."""
        return self._utility(UTILITIES.release_kv_cache_memory, *trailing_given(reset_connector))

    def is_inference_ready(self) -> bool:
        """Whether every engine would serve a new request now (vLLM 0.34)."""
        return self._utility(UTILITIES.is_inference_ready)

    def checkpoint_prepare(self, mode: PauseMode = "wait") -> str | None:
        """Prepare every engine for a process checkpoint (see the Trio client's
        ``checkpoint_prepare``); the first refusal's reason, or None."""
        return self._utility(UTILITIES.checkpoint_prepare, mode)

    def checkpoint_restore(self) -> None:
        """Bring every engine back from a prepared checkpoint."""
        return self._utility(UTILITIES.checkpoint_restore)

    def checkpoint_state(self) -> tuple[CheckpointState, str | None]:
        """``(state, error)`` of the engines' process checkpoint, merged."""
        return self._utility(UTILITIES.checkpoint_state)

    def resume_scheduler(self) -> None:
        """Resume the engine's scheduler after :meth:`pause_scheduler`."""
        return self._utility(UTILITIES.resume_scheduler)

    def is_scheduler_paused(self) -> bool:
        """Whether the engine's scheduler is paused."""
        return self._utility(UTILITIES.is_scheduler_paused)

    def get_request_counts(self) -> tuple[int, int]:
        """``(waiting, running)`` request counts of the engine, summed over the engines.

        A reference-engine utility: vLLM 0.33's engines have none (see
        :meth:`AsyncEngineCoreClient.get_request_counts
        <trio_enginecore.AsyncEngineCoreClient.get_request_counts>`).
        """
        return self._utility(UTILITIES.get_request_counts)

    def get_request_counts_per_engine(self) -> list[tuple[int, int]]:
        """``(waiting, running)`` of each engine, by rank (see :meth:`get_request_counts`)."""
        spec = UTILITIES.get_request_counts
        return convert_each(spec, self.call_utility_all(spec.name))

"""Blocking clients, for code that does not run under Trio.

:class:`EngineCoreClient` is the blocking interface (the same method names as the Trio
clients, as plain methods). :class:`SyncMPClient` implements it by running a
:class:`~trio_enginecore.TrioMPClient` in a Trio event loop on one background thread and
reaching it with :func:`trio.from_thread.run`: every socket has exactly one owner (the
Trio thread), all the Trio client's guarantees carry over, and a blocked call can be
interrupted with Ctrl-C. Its per-request streams (:class:`SyncRequestStream`) are the
Trio client's streams, read one blocking step at a time from any thread. Every way the
loop can be gone (closed, ended, ending) reaches a caller as the library's
``EngineDeadError``, never as a Trio exception.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, Unpack, final

import trio

from ..config import EngineConfig
from ..errors import UtilityCallError
from ..protocol import (
    CheckpointState,
    EngineCoreOutputs,
    EngineCoreRequest,
    LoRARequest,
    UtilityOutput,
)
from ._interface import ClientStatistics
from ._mp import TrioMPClient, open_trio_mp_client
from ._options import ClientOptionKeywords, ClientOptions, options_from
from ._sync_stream import Portal, Reader, SyncRequestStream
from ._utilities import (
    UTILITIES,
    UtilitySpec,
    combine,
    convert_each,
    sleep_arguments,
    trailing_given,
)

__all__ = ["EngineCoreClient", "SyncMPClient", "SyncRequestStream"]

logger = logging.getLogger("trio_enginecore.client")

R = TypeVar("R")
T = TypeVar("T")


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
        mode: Literal["abort", "wait", "keep"] | None = None,
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
        mode: Literal["abort", "wait", "keep"] = "abort",
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

    def checkpoint_prepare(self, mode: Literal["abort", "wait", "keep"] = "wait") -> str | None:
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


@final
class SyncMPClient(EngineCoreClient):
    """A blocking client for engines in other processes, safe to use from many threads.

    ::

        with trio_enginecore.SyncMPClient(EngineConfig()) as client:
            with client.stream(request) as outputs:    # from any thread
                for output in outputs:
                    ...
            client.add_request(request)                 # or vLLM's batch API
            outputs = client.get_output()

    The constructor launches (or attaches to) the engines exactly like
    :func:`~trio_enginecore.open_engine_client`, whose keyword arguments it takes, and
    returns once they are ready. Calls block the calling thread only, and any number of
    threads may call at once. Each thread that wants outputs should
    :meth:`stream` its own requests; :meth:`get_output` has one reader at a time (a
    second thread calling it meanwhile gets :class:`RuntimeError`). A request
    sent with :meth:`add_request` comes out of :meth:`get_output` only, one sent with
    :meth:`stream` out of its stream only.

    A blocked call can be interrupted (Ctrl-C raises ``KeyboardInterrupt`` in the main
    thread); leaving the ``with`` block then stops the engine. If the engine dies,
    every blocked and later call raises
    :class:`~trio_enginecore.errors.EngineDeadError`. After :meth:`close` (or while it
    runs, in other threads), calls and streams raise ``EngineDeadError`` with the
    message ``"the engine client was closed"`` (or the engine's death, if it died
    first): no Trio exception ever reaches a caller.

    One documented difference from the Trio clients: leaving the ``with`` block (or
    :meth:`close`) never raises, even if the engine died meanwhile; the death was
    already reported to the calls it affected. A Trio client's ``async with`` block
    raises ``EngineDeadError`` on exit in that case, because structured concurrency
    surfaces background failures where the scope ends.

    Raises:
        EngineStartupError: from the constructor, as ``open_engine_client``.
        TypeError, ValueError: an option that does not exist, or a bad value (before
            any thread or engine is started).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        options: ClientOptions | None = None,
        *,
        cancel_on_failure: bool = False,
        **keywords: Unpack[ClientOptionKeywords],
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        # Checked here, in the caller's thread, before a thread or a loop exists.
        self.options = options_from(options, keywords)
        self._cancel_on_failure = cancel_on_failure
        self._portal = Portal()
        self._reader = Reader(
            self._portal,
            self._get_output,
            "another thread is already waiting in get_output(): each message goes to one "
            "caller, so two readers would split requests' outputs between them; read "
            "get_output() from one thread, or use client.stream(request) in each thread",
        )
        self._stop: trio.Event | None = None
        self._loop_scope: trio.CancelScope | None = None
        self._startup_error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="trio-enginecore-client", daemon=True
        )
        self._thread.start()
        try:
            self._ready.wait()
        except BaseException:
            # Interrupted while the engine starts: tear down what exists.
            self.close()
            raise
        error = self._startup_failure()
        if error is not None:
            self._thread.join()
            self._portal.closed = True
            raise error

    def _startup_failure(self) -> BaseException | None:
        # Set by the loop thread; read only after _ready says the loop got that far.
        return self._startup_error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            if self._portal.client is None:
                self._startup_error = exc
            else:
                self._portal.ended = exc
                logger.debug("the client's event loop ended with %r", exc)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        portal = self._portal
        with trio.CancelScope() as scope:
            # Published before the engine starts, so close() can abandon the startup.
            self._stop = trio.Event()
            self._loop_scope = scope
            portal.token = trio.lowlevel.current_trio_token()
            if portal.closed:  # closed (e.g. Ctrl-C) before the loop published its token
                return
            async with open_trio_mp_client(
                self.config, self.options, cancel_on_failure=self._cancel_on_failure
            ) as client:
                portal.client = client
                self._ready.set()
                await self._stop.wait()

    def _run_in_loop(self, function: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._portal.run(function, *args)

    @property
    def _trio_client(self) -> TrioMPClient:
        client = self._portal.client
        if client is None:
            raise self._portal.unusable()
        return client

    @property
    def engine_pids(self) -> tuple[int | None, ...]:
        """The process id of each launched engine."""
        return self._trio_client.engine_pids

    @property
    def is_dead(self) -> bool:
        """True once an engine died."""
        return self._trio_client.is_dead

    def add_request(self, request: EngineCoreRequest) -> None:
        """Submit a request; its outputs arrive through :meth:`get_output` (only).

        Raises:
            TypeError, ValueError: as the Trio client's ``add_request``; nothing sent.
            EngineDeadError: the engine has died, or the client is closed.
        """
        self._run_in_loop(self._trio_client.add_request, request)

    def get_output(self) -> EngineCoreOutputs:
        """The next engine message with outputs of requests sent with
        :meth:`add_request`, blocking until there is one.

        Outputs of streamed requests are not delivered here. One thread reads at a
        time: each message goes to one caller, so two threads reading at once would
        split requests' outputs between them. A thread that calls it while another
        waits in it gets :class:`RuntimeError` at once; to read outputs from many
        threads, give each thread its own requests with :meth:`stream`. A call
        interrupted by Ctrl-C loses nothing: the next call returns what it would have.

        Raises:
            RuntimeError: another thread is waiting in ``get_output()``.
            EngineDeadError: the engine died and no output is pending, or the client
                is closed (before or during the call).
        """
        return self._reader.read()

    async def _get_output(self) -> EngineCoreOutputs:
        return await self._trio_client.get_output()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests (streamed ones too: their streams end with an ABORT output);
        unknown ids are ignored."""
        self._run_in_loop(self._trio_client.abort_requests, list(request_ids))

    def stream(self, request: EngineCoreRequest) -> SyncRequestStream:
        """Send ``request`` and stream its outputs, blocking, from any thread::

            with client.stream(request) as outputs:
                for output in outputs:
                    ...

        Entering the block sends the request; the ``for`` loop blocks the thread until
        each output arrives and ends after the finished one. Its outputs come out of
        this stream only, never out of :meth:`get_output`. Leaving the block before
        the request finished (``break``, an exception, Ctrl-C) aborts it on the
        engine. Any number of threads may each stream their own request at once. See
        :class:`SyncRequestStream`.

        Raises:
            TypeError, ValueError: on entry, as :meth:`add_request`; nothing was sent.
            EngineDeadError: on entry or from the stream: the engine died, or the
                client was closed.
            RequestFailedError: from the stream: the engine rejected or failed the
                request.
        """
        return SyncRequestStream(self._portal, request)

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._run_in_loop(self._trio_client.call_utility, method, *args)

    def call_utility_all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every engine; one result per engine, by rank."""
        return self._run_in_loop(self._trio_client.call_utility_all, method, *args)

    def statistics(self) -> ClientStatistics:
        return self._trio_client.statistics()

    def close(self) -> None:
        """Stop the engines, close the sockets and end the background thread.

        Threads blocked in a call or reading a stream get
        :class:`~trio_enginecore.errors.EngineDeadError` (``"the engine client was
        closed"``, or the engine's death if it died first), and so does every later
        call. Idempotent; never raises.
        """
        portal = self._portal
        if portal.closed:
            return
        portal.closed = True
        token, stop, scope = portal.token, self._stop, self._loop_scope
        if token is not None and stop is not None and scope is not None:

            def stop_loop() -> None:
                if portal.client is None:
                    scope.cancel()  # still starting (interrupted constructor): abandon it
                else:
                    stop.set()

            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(stop_loop, trio_token=token)
        self._thread.join()
        if portal.client is not None and portal.client.is_dead:
            logger.debug("closed a client whose engine had died")

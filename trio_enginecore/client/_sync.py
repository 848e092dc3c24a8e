"""Blocking clients, for code that does not run under Trio.

:class:`SyncMPClient` implements the blocking interface
(:class:`~._interface.EngineCoreClient`) by running a
:class:`~trio_enginecore.TrioMPClient` in a Trio event loop on one background thread and
reaching it with :func:`trio.from_thread.run`: every socket has exactly one owner (the
Trio thread), all the Trio client's guarantees carry over, and a blocked call can be
interrupted with Ctrl-C. Its per-request streams (:class:`SyncRequestStream`) are the
Trio client's streams, read one blocking step at a time from any thread. Every way the
loop can be gone (closed, ended, ending) reaches a caller as the library's
``EngineDeadError``, never as a Trio exception.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar, Unpack, final

import trio

from ..config import EngineConfig
from ..protocol import (
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
)
from ._interface import ClientStatistics, EngineCoreClient
from ._mp import TrioMPClient, open_trio_mp_client
from ._options import ClientOptionKeywords, ClientOptions, options_from
from ._sync_stream import Portal, Reader, SyncRequestStream

__all__ = ["SyncMPClient", "SyncRequestStream"]

logger = logging.getLogger("trio_enginecore.client")

R = TypeVar("R")
T = TypeVar("T")


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
        self.options = options_from(options, keywords, opener=SyncMPClient)
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
    def engines(self) -> tuple[EngineCoreReadyResponse | None, ...]:
        """Each engine's ready message, by rank (``None`` for one not ready)."""
        return self._trio_client.engines

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

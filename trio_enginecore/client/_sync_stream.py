"""Blocking reads from a :class:`~trio_enginecore.SyncMPClient`'s Trio loop.

:class:`Portal` is the one way from the calling threads into the loop, and turns every
way the loop can be gone into the library's ``EngineDeadError``; :class:`Reader` lets one
thread at a time read a source (``get_output()``, a stream) without losing an output to
Ctrl-C; :class:`SyncRequestStream` is a Trio request stream read one blocking step at a
time.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar, final

import trio

from ..errors import EngineDeadError
from ..protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from ._core._stream import RequestStream

if TYPE_CHECKING:
    # Only a type here: the blocking client (._sync) creates the Trio client.
    from ._mp import TrioMPClient

__all__ = ["CLOSED", "Portal", "Reader", "SyncRequestStream"]

T = TypeVar("T")

CLOSED = "the engine client was closed"
"""The message of the ``EngineDeadError`` a blocking client's calls raise once it is
closed: the Trio client's words for the streams and calls its ``aclose()`` ends."""

_LEFT = "this stream's block was left: its request was aborted"
_BUSY_STREAM = "another thread is reading this stream"


class _Abandoned(Exception):
    """Ends a call into the loop whose thread stopped waiting for it (Ctrl-C); nobody
    ever sees it."""


@final
class Portal:
    """The way from the calling threads into a :class:`SyncMPClient`'s Trio loop.

    Every crossing goes through :meth:`run`, which turns each way the loop can be gone
    (closed, ended, ending) into the library's error: no Trio exception reaches a
    caller.
    """

    __slots__ = ("client", "closed", "ended", "token")

    def __init__(self) -> None:
        self.token: trio.lowlevel.TrioToken | None = None
        """The loop's token, once the loop runs."""
        self.client: TrioMPClient | None = None
        """The Trio client, once the engines are ready (kept after the close)."""
        self.closed = False
        """Set by ``close()`` before it stops the loop."""
        self.ended: BaseException | None = None
        """What ended the loop, if it ended by raising."""

    def unusable(self) -> EngineDeadError:
        """What a call raises when the loop cannot serve it: the engine's death if it
        died (before or after the close, as the Trio client's calls), else the close.
        A fresh error each time (one raised in several threads would mix their
        tracebacks)."""
        ended = self.ended
        if isinstance(ended, EngineDeadError):
            # The death, as the client's block raised it when the loop ended (its
            # details included).
            return copy.copy(ended)
        client = self.client
        death = client.failure_error() if client is not None else None
        if death is not None:
            return death
        if ended is not None and not self.closed:
            return EngineDeadError(f"the engine client stopped: {ended}")
        return EngineDeadError(CLOSED)

    def run(self, function: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await function(*args)`` in the loop; block until it is done.

        Raises:
            EngineDeadError: the client is closed, or its loop ended or is ending
                (:meth:`unusable`); and whatever ``function`` raises.
        """
        token = self.token
        if self.closed or token is None:
            raise self.unusable()
        try:
            return trio.from_thread.run(function, *args, trio_token=token)
        except (trio.ClosedResourceError, trio.RunFinishedError, trio.Cancelled):
            # The Trio client was closing, the loop had ended, or it ended (cancelling
            # its system tasks) while the call ran.
            raise self.unusable() from None

    def stop_waiting(self, scope: trio.CancelScope, done: trio.Event) -> None:
        """Cancel ``scope`` in the loop and return once the task in it is ``done``
        (if the loop still runs)."""

        async def cancel_and_wait() -> None:
            scope.cancel()
            await done.wait()

        token = self.token
        if token is not None:
            # Cancelled: the loop is ending, and ends the task too.
            with contextlib.suppress(trio.RunFinishedError, trio.Cancelled):
                trio.from_thread.run(cancel_and_wait, trio_token=token)


@final
class Reader(Generic[T]):
    """Reads from one source in the loop (``get_output()``, or a stream), from any
    thread, one thread at a time.

    A thread that reads while another waits gets :class:`RuntimeError` at once: two
    readers would split the outputs between them. A read whose thread stops waiting
    (Ctrl-C) loses nothing: its read in the loop is cancelled (the Trio reads are
    atomic with respect to cancellation), or, if it had taken its value already, the
    value is kept for the next read.
    """

    __slots__ = ("_busy", "_busy_message", "_kept", "_portal", "_read")

    def __init__(self, portal: Portal, read: Callable[[], Awaitable[T]], busy_message: str) -> None:
        self._portal = portal
        self._read = read
        self._busy_message = busy_message
        self._busy = threading.Lock()
        self._kept: list[T] = []

    def read(self) -> T:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(self._busy_message)
        try:
            kept = self._kept
            if kept:
                return kept.pop()
            scope, done = trio.CancelScope(), trio.Event()
            try:
                value = self._portal.run(self._guarded, scope, done)
            except BaseException as exc:
                if not isinstance(exc, Exception):  # KeyboardInterrupt while waiting
                    # Once the read in the loop is over, it either took nothing or
                    # kept what it took: the next read starts after that.
                    self._portal.stop_waiting(scope, done)
                raise
            kept.clear()
            return value
        finally:
            self._busy.release()

    async def _guarded(self, scope: trio.CancelScope, done: trio.Event) -> T:
        try:
            with scope:
                value = await self._read()
                # Taken: kept until the reading thread has it.
                self._kept.append(value)
                return value
            raise _Abandoned
        finally:
            done.set()


@final
class SyncRequestStream:
    """The outputs of one request of a :class:`SyncMPClient`, for a blocking ``for``.

    Obtained from :meth:`SyncMPClient.stream`::

        with client.stream(request) as outputs:
            for output in outputs:
                ...

    It mirrors the Trio client's :class:`~trio_enginecore.RequestStream` (it reads
    one, in the client's event-loop thread): every token exactly once and in order, the
    outputs that arrived while the reader was busy merged into one, and the ``for``
    loop ends after the output whose ``finish_reason`` is set. Each step blocks the
    reading thread until an output arrives (no polling).

    Thread safety: any thread may enter, read and leave it, and any number of threads
    may each stream their own request at once. One thread reads it at a time: a second
    thread that reads while one waits gets :class:`RuntimeError`.

    Leaving the ``with`` block before the request finished (``break``, ``return``, an
    exception, Ctrl-C) aborts the request on the engine, exactly once, before the
    block exits; so does leaving it from another thread, even while the request is
    still being sent (it is then aborted once sent, or never sent). A thread blocked
    reading it then gets :class:`RuntimeError`, as does reading it after the block.

    A read interrupted by Ctrl-C loses nothing: catch the ``KeyboardInterrupt`` and
    the next read returns what it would have.

    Reading it raises :class:`~trio_enginecore.errors.RequestFailedError` if the engine
    rejected or failed the request, and
    :class:`~trio_enginecore.errors.EngineDeadError` if the engine died, or the client
    was closed, before the request finished (see :meth:`__next__`).
    """

    __slots__ = (
        "_abandoned",
        "_block",
        "_done",
        "_left",
        "_portal",
        "_reader",
        "_request",
        "_request_id",
        "_stream",
    )

    def __init__(self, portal: Portal, request: EngineCoreRequest) -> None:
        self._portal = portal
        self._request: EngineCoreRequest | None = request
        self._request_id = request.request_id
        self._reader = Reader(portal, self._receive, _BUSY_STREAM)
        # Set in the loop thread: the Trio stream's block and its reading half.
        self._block: AbstractAsyncContextManager[RequestStream] | None = None
        self._stream: RequestStream | None = None
        self._abandoned = False  # the block was left: an entry still under way leaves too
        # The calling threads' view.
        self._left = False
        self._done = False

    @property
    def request_id(self) -> str:
        """The request's id, as the caller gave it."""
        return self._request_id

    def __enter__(self) -> Self:
        """Send the request (blocking until it is sent).

        Raises:
            TypeError, ValueError: as :meth:`SyncMPClient.add_request`; nothing was sent.
            EngineDeadError: the engine has died, or the client is closed.
            RuntimeError: the block was entered before, or left already.
        """
        request, self._request = self._request, None
        if request is None:
            raise RuntimeError("a client.stream(...) block can be entered only once")
        if self._left:
            raise RuntimeError(_LEFT)
        scope = trio.CancelScope()
        try:
            self._portal.run(self._enter, request, scope)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # KeyboardInterrupt while waiting
                # The with statement will not call __exit__: leave from here, so that
                # a request the loop sends after all is aborted.
                with contextlib.suppress(EngineDeadError):
                    self._portal.run(self._abandon, scope)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Abort the request if it has not finished (see the class docstring)."""
        if self._left:
            return
        self._left = True
        # A closed client (or a stopped loop) has aborted every request already.
        with contextlib.suppress(EngineDeadError):
            self._portal.run(self._abandon, None)

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> EngineCoreOutput:
        """The next output of the request (blocking), merged with any that queued up.

        Raises:
            StopIteration: the finished output was delivered (the ``for`` loop ends).
            RequestFailedError: the engine rejected or failed the request, after every
                output that came before; and again on every later read.
            EngineDeadError: the engine died before the request finished, or the
                client was closed before it did (the message is then ``"the engine
                client was closed"``).
            ProtocolError: the engine sent outputs for this request that cannot be
                used; other requests are not affected.
            RuntimeError: another thread is reading this stream, the block was not
                entered, or it was left.
        """
        if self._done:
            raise StopIteration
        if self._left:
            raise RuntimeError(_LEFT)
        if self._stream is None:
            raise RuntimeError(
                "read the stream inside its block: `with client.stream(request) as outputs:`"
            )
        output = self._reader.read()
        if output is None:
            self._done = True
            raise StopIteration
        if output.finish_reason is not None:
            if output.finish_reason is FinishReason.ABORT and self._portal.closed:
                # The local ABORT with which the closing Trio client ended the stream.
                raise self._portal.unusable()
            self._done = True
        return output

    # ------------------------------------------------------ in the loop thread

    async def _enter(self, request: EngineCoreRequest, scope: trio.CancelScope) -> None:
        with scope:
            if self._was_left():  # from another thread, before the entry began
                raise RuntimeError(_LEFT)
            client = self._portal.client
            assert client is not None
            block = client.stream(request)
            stream = await block.__aenter__()  # atomic: cancelled, it sent nothing
            self._block, self._stream = block, stream
            if self._was_left():  # while the request was being sent
                await self._leave()

    def _was_left(self) -> bool:
        # A method, not the attribute: it changes across the await above.
        return self._abandoned

    async def _abandon(self, scope: trio.CancelScope | None) -> None:
        self._abandoned = True
        if scope is not None:
            scope.cancel()
        await self._leave()

    async def _leave(self) -> None:
        block, self._block = self._block, None
        if block is not None:
            await block.__aexit__(None, None, None)  # the abort: no checkpoint

    async def _receive(self) -> EngineCoreOutput | None:
        stream = self._stream
        assert stream is not None
        try:
            return await stream.receive()
        except trio.EndOfChannel:
            return None
        except trio.ClosedResourceError:
            raise RuntimeError(_LEFT) from None
        except trio.BusyResourceError:
            # An interrupted read whose cancellation was itself interrupted (two
            # Ctrl-C at once) still waits in the loop.
            raise RuntimeError(_BUSY_STREAM) from None

"""An HTTP/1.1 server on Trio streams, h11 parsing and framing: :func:`serve_http`.

One task per connection, all in a nursery the server owns. A request's handler runs in
its connection's task, under a cancel scope that the connection cancels when the client
goes away: its end of the connection closed or reset (watched while the handler runs,
and seen by every write). The handler then meets ``trio.Cancelled`` at its next
checkpoint, as any Trio task would; that is how a request's work (an engine request) is
aborted.

A streamed response is written by a task of its own (the *writer*), while the
connection's task takes the chunks from the response body into an outbox (up to
``write_buffer_bytes``; past that the body waits for the client). Each write takes all
the outbox holds, as one HTTP chunk, in one ``send_all``: chunks that came while a write
was blocked (a client that lags) go out together. Woken by a single chunk, the writer
first gives the body one more turn of the event loop to add what else it has ready, as
long as such turns bring more or chunks are found waiting (a loop that lags, a body that
yields several chunks at once); after two turns in a row that bring nothing, each chunk
is written as soon as it comes (a client and a loop that keep up), until chunks are
found waiting again. ``merge_writes=False`` writes each chunk from the connection's task
instead, one write each (for measurements).
"""

from __future__ import annotations

import enum
import errno
import http
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from email.utils import formatdate
from typing import Final, NoReturn, cast, final

import h11
import trio

from .._groups import leaves
from ._http_messages import (
    KNOWN_METHODS,
    Headers,
    HttpLimits,
    HttpServerStatistics,
    Request,
    Response,
    error_response,
)

__all__ = ["Handler", "HttpServer", "serve_http"]

logger = logging.getLogger("trio_enginecore.server")

Handler = Callable[[Request], Awaitable[Response]]
"""``async def handler(request: Request) -> Response``."""

_RECEIVE_BYTES: Final = 64 * 1024
# After a response that closes the connection: how long to wait for the client to close
# its end, and how much of what it still sends to read and drop meanwhile. Closing a
# socket with unread data makes the kernel reset it, and the reset can destroy the
# response before the client has read it (h11's Trio example does the same).
_LINGER_S: Final = 1.0
_LINGER_BYTES: Final = 1024 * 1024
# A body asked for the next chunk after its request was cancelled, so that it meets the
# Cancelled at its next checkpoint: how many chunks it may still yield without one.
_CHUNKS_AFTER_CANCEL: Final = 64
# accept() failures that mean "out of something, try again later" (as trio.serve_listeners).
_ACCEPT_CAPACITY_ERRNOS: Final = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
)
_FRAMING_HEADERS: Final = frozenset({"content-length", "transfer-encoding"})


class _Connection:
    """One client connection's state, as the server sees it."""

    __slots__ = (
        "accepted_at",
        "h11",
        "idle_scope",
        "peer",
        "responses",
        "scope",
        "sending_since",
        "socket",
        "stream",
    )

    def __init__(self, stream: trio.abc.Stream, limits: HttpLimits) -> None:
        self.stream = stream
        # A socket's stream can be written without a trip through the event loop when
        # the kernel takes the bytes at once (see HttpServer._send).
        self.socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.peer = _peer(stream)
        self.scope = trio.CancelScope()
        self.accepted_at = trio.current_time()
        self.responses = 0  # written in full
        # Set while the connection waits for a request's first byte: a shutdown cancels it.
        self.idle_scope: trio.CancelScope | None = None
        # When the write in progress began (trio.current_time()), or None.
        self.sending_since: float | None = None


class _Outbox:
    """The chunks of a streamed response taken from its body and not yet written."""

    __slots__ = (
        "_chunks_lot",
        "_space_lot",
        "chunks",
        "ended",
        "failed",
        "keep_alive",
        "size",
        "written",
    )

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.ended = False  # the body is exhausted (or failed): no more chunks
        self.failed = False  # the body raised: end the response without its last chunk
        self.written = trio.Event()  # the writer is done (everything sent, or it gave up)
        self.keep_alive = False  # the response was written in full, and the connection can go on
        self._chunks_lot = trio.lowlevel.ParkingLot()
        self._space_lot = trio.lowlevel.ParkingLot()

    def put(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        if self._chunks_lot:
            self._chunks_lot.unpark()

    def end(self, *, failed: bool) -> None:
        self.ended = True
        self.failed = failed
        if self._chunks_lot:
            self._chunks_lot.unpark()

    def take(self) -> list[bytes]:
        chunks = self.chunks
        self.chunks = []
        self.size = 0
        if self._space_lot:
            self._space_lot.unpark_all()
        return chunks

    async def wait_chunks(self) -> None:
        await self._chunks_lot.park()

    async def wait_space(self) -> None:
        await self._space_lot.park()


class _TimedOut(enum.Enum):
    TIMED_OUT = enum.auto()


_TIMED_OUT: Final = _TimedOut.TIMED_OUT


@final
class HttpServer:
    """A running HTTP server: what :func:`serve_http` reports started with.

    :meth:`shutdown` stops it gracefully; cancelling :func:`serve_http`'s task stops it
    at once (every request cancelled, every connection closed).
    """

    def __init__(self, handler: Handler, limits: HttpLimits, *, merge_writes: bool) -> None:
        """Made by :func:`serve_http`, not by hand."""
        self._handler = handler
        self._limits = limits
        self._merge_writes = merge_writes
        self._connections: set[_Connection] = set()
        self._slots = trio.Semaphore(limits.max_connections)
        self._in_flight = 0
        self._completed = 0
        self._cancelled = 0
        self._writes = 0
        self._closing = False
        self._accepting = trio.CancelScope()
        self._serving = trio.CancelScope()
        self._stopped = trio.Event()
        self._date_second = -1
        self._date = ""

    def statistics(self) -> HttpServerStatistics:
        """A snapshot of the server's connections and requests."""
        return HttpServerStatistics(
            connections=len(self._connections),
            requests_in_flight=self._in_flight,
            requests_completed=self._completed,
            requests_cancelled=self._cancelled,
            writes=self._writes,
            closing=self._closing,
        )

    async def shutdown(self, deadline_s: float) -> None:
        """Stop the server gracefully, and return when it has stopped.

        At once: the listeners are closed (new connections are refused), and idle
        connections (waiting for a request) are closed. Requests in flight, and requests
        whose header fields or body are being received, go on for up to ``deadline_s``
        seconds; their responses say ``Connection: close`` when they have not begun, and
        their connections close when they are written. At the deadline whatever is left
        is cancelled (each handler meets ``trio.Cancelled``) and its connection closed.

        Calling it again may bring the deadline closer, never further. Call it from
        outside the server's handlers: it waits for all of them. Always a checkpoint.
        """
        if not self._closing:
            self._closing = True
            self._accepting.cancel()
            for connection in self._connections:
                if connection.idle_scope is not None:
                    connection.idle_scope.cancel()
        self._serving.deadline = min(self._serving.deadline, trio.current_time() + deadline_s)
        await self._stopped.wait()

    async def _serve(
        self,
        listeners: Sequence[trio.abc.Listener[trio.abc.Stream]],
        task_status: trio.TaskStatus[HttpServer],
    ) -> None:
        try:
            async with trio.open_nursery() as supervisor:
                supervisor.start_soon(self._cancel_stalled_writes)
                with self._serving:
                    async with trio.open_nursery() as connections:
                        with self._accepting:
                            async with trio.open_nursery() as acceptors:
                                for listener in listeners:
                                    acceptors.start_soon(self._accept, listener, connections)
                                task_status.started(self)
                supervisor.cancel_scope.cancel()
        finally:
            self._closing = True
            self._stopped.set()

    async def _accept(
        self, listener: trio.abc.Listener[trio.abc.Stream], connections: trio.Nursery
    ) -> None:
        async with listener:
            while True:
                await self._slots.acquire()
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    self._slots.release()
                    if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                        raise
                    logger.error("accept() failed, retrying in 100 ms: %s", exc)
                    await trio.sleep(0.1)
                    continue
                except BaseException:
                    self._slots.release()
                    raise
                connections.start_soon(self._run_connection, stream)

    async def _cancel_stalled_writes(self) -> None:
        """Cancel the connections whose current write has lasted longer than the
        ``send_timeout_s`` limit (cheaper than a cancel scope around every write)."""
        timeout = self._limits.send_timeout_s
        while True:
            await trio.sleep(min(1.0, timeout / 4))
            now = trio.current_time()
            for connection in self._connections:
                since = connection.sending_since
                if since is not None and now - since > timeout:
                    logger.debug("%s reads nothing: closing its connection", connection.peer)
                    connection.scope.cancel()

    async def _run_connection(self, stream: trio.abc.Stream) -> None:
        connection = _Connection(stream, self._limits)
        self._connections.add(connection)
        try:
            with connection.scope:
                await self._serve_connection(connection)
        except* Exception:
            # A bug of ours: this connection dies, the others go on (a cancellation
            # that came with it propagates).
            logger.exception("HTTP connection from %s failed", connection.peer)
        finally:
            self._connections.discard(connection)
            self._slots.release()
            await trio.aclose_forcefully(stream)

    async def _serve_connection(self, connection: _Connection) -> None:
        fresh = True
        while True:
            request = await self._read_request(connection, fresh=fresh)
            if request is None:
                return
            fresh = False
            if request.method in KNOWN_METHODS:
                keep = await self._respond(connection, request)
            else:
                keep = await self._write_error(
                    connection, 501, f"method {request.method} is not implemented"
                )
            if not keep:
                await self._linger(connection)
                return
            connection.h11.start_next_cycle()

    # -- reading -----------------------------------------------------------------------

    async def _receive(self, connection: _Connection, max_bytes: int = _RECEIVE_BYTES) -> bytes:
        """The next bytes from the client; ``b""`` once it has closed or reset its end."""
        try:
            data = await connection.stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""
        return data if isinstance(data, bytes) else bytes(data)

    async def _read_request(self, connection: _Connection, *, fresh: bool) -> Request | None:
        """The next request, its body read; None when the connection is to be closed
        (the client closed it, a timeout, a shutdown, or an error already answered).

        A ``fresh`` connection's request head must be complete ``header_timeout_s`` after
        the connection was accepted; a reused one's, after its first byte."""
        limits = self._limits
        started = connection.accepted_at if fresh else trio.current_time()
        conn = connection.h11
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            await self._answer_protocol_error(connection, exc)
            return None
        head: h11.Event | None = None
        # Read a head in pieces that keep h11's buffer within one byte past the limit:
        # h11 checks the size of incomplete events only, and one large read could bring
        # a complete head of any size.
        budget = limits.max_header_bytes + 1
        if isinstance(event, type):  # NEED_DATA (PAUSED comes only after a request)
            if not conn.trailing_data[0]:
                # Idle: nothing of the next request yet.
                if self._closing:
                    return None
                timeout = limits.header_timeout_s if fresh else limits.keep_alive_timeout_s
                data = b""
                with trio.move_on_at(started + timeout) as idle:
                    connection.idle_scope = idle
                    data = await self._receive(connection, budget)
                connection.idle_scope = None
                if idle.cancelled_caught or not data:
                    return None
                conn.receive_data(data)
                budget -= len(data)
                if not fresh:
                    started = trio.current_time()
            got = await self._next_event_by(
                connection, started + limits.header_timeout_s, budget=budget
            )
            if got is _TIMED_OUT:
                logger.debug("%s sent no complete request head in time", connection.peer)
                return None
            head = got
        else:
            head = event  # pipelined: already received
        if head is None or isinstance(head, h11.ConnectionClosed):
            return None
        if not isinstance(head, h11.Request):  # pragma: no cover - h11 guarantees it
            raise AssertionError(f"h11 gave {head!r} before a request")
        if head.http_version not in (b"1.1", b"1.0"):
            await self._write_error(
                connection, 505, f"HTTP/{head.http_version.decode()} is not supported"
            )
            await self._linger(connection)
            return None
        method = head.method.decode("ascii")
        length: int | None = None
        for name, value in head.headers:
            if name == b"content-length":
                length = int(value)
        if length is not None and length > limits.max_body_bytes:
            await self._write_error(
                connection, 413, f"the request body is larger than {limits.max_body_bytes} bytes"
            )
            await self._linger(connection)
            return None
        if conn.they_are_waiting_for_100_continue and not await self._send(
            connection,
            conn.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")),
        ):
            return None
        parts: list[bytes] = []
        size = 0
        body_deadline = trio.current_time() + limits.body_timeout_s
        while True:
            part = await self._next_event_by(connection, body_deadline)
            if part is _TIMED_OUT:
                await self._write_error(connection, 408, "the request body took too long to arrive")
                await self._linger(connection)
                return None
            if part is None or isinstance(part, h11.ConnectionClosed):
                return None
            if isinstance(part, h11.EndOfMessage):
                break
            if isinstance(part, h11.Data):
                size += len(part.data)
                if size > limits.max_body_bytes:
                    await self._write_error(
                        connection,
                        413,
                        f"the request body is larger than {limits.max_body_bytes} bytes",
                    )
                    await self._linger(connection)
                    return None
                parts.append(part.data)
        return Request(
            method=method,
            target=head.target.decode("latin-1"),
            headers=Headers(list(head.headers)),
            body=b"".join(parts),
            peer=connection.peer,
            http_version=head.http_version.decode("ascii"),
        )

    async def _next_event_by(
        self, connection: _Connection, deadline: float, *, budget: int | None = None
    ) -> h11.Event | _TimedOut | None:
        """:meth:`_next_event`, or ``_TIMED_OUT`` if it needs bytes that do not come by
        ``deadline``. An event h11 holds already (a request that came in one read,
        pipelined ones) is taken without a cancel scope (a profile of short requests:
        the three scopes of reading one, idle wait, head and body, took 8% of the
        server's CPU; the idle wait's is left)."""
        conn = connection.h11
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            await self._answer_protocol_error(connection, exc)
            return None
        if event is not h11.NEED_DATA:
            if event is h11.PAUSED:  # pragma: no cover - only after a complete request
                raise AssertionError("h11 paused while a request was being read")
            assert not isinstance(event, type)
            return event
        with trio.move_on_at(deadline):
            return await self._next_event(connection, budget=budget)
        return _TIMED_OUT

    async def _next_event(
        self, connection: _Connection, *, budget: int | None = None
    ) -> h11.Event | None:
        """h11's next event, reading as needed (no more than ``budget`` bytes in all,
        if given); None when the request was malformed (answered already) or the
        client went away in the middle of it."""
        conn = connection.h11
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                await self._answer_protocol_error(connection, exc)
                return None
            if event is h11.NEED_DATA:
                # With the budget spent h11 has raised already (its buffer is too long).
                size = _RECEIVE_BYTES if budget is None else max(budget, 1)
                data = await self._receive(connection, size)
                if not data:
                    return None  # closed in the middle of a request: nobody to answer
                if budget is not None:
                    budget -= len(data)
                conn.receive_data(data)
                continue
            if event is h11.PAUSED:  # pragma: no cover - only after a complete request
                raise AssertionError("h11 paused while a request was being read")
            assert not isinstance(event, type)
            return event

    async def _answer_protocol_error(
        self, connection: _Connection, exc: h11.RemoteProtocolError
    ) -> None:
        logger.debug("malformed request from %s: %s", connection.peer, exc)
        if connection.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self._write_error(
                connection, exc.error_status_hint, f"malformed HTTP request: {str(exc)[:200]}"
            )
            await self._linger(connection)

    # -- writing -----------------------------------------------------------------------

    async def _send(self, connection: _Connection, data: bytes) -> bool:
        """Write ``data``; False if the client is gone (the connection is then broken).

        Not a checkpoint when the socket's buffer takes ``data`` whole, which is the
        rule while the client keeps up: a write then costs its system call, not also
        the two turns of the event loop of ``SocketStream.send_all`` (measured: 2.7 µs
        against 18 µs for 300 bytes). Every caller's loop has checkpoints of its own
        (waiting for the next chunk, request or body part). The rest of a partial
        write goes through ``send_all``, which waits for the socket to drain."""
        sock = connection.socket
        if sock is not None:
            # -1 once the socket is closed (os.write then fails): never a reused number.
            try:
                sent = os.write(sock.fileno(), data)
            except BlockingIOError:
                sent = 0
            except OSError:  # reset, broken pipe, closed
                return False
            if sent == len(data):
                self._writes += 1
                return True
            data = data[sent:]
        connection.sending_since = trio.current_time()
        try:
            await connection.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        finally:
            connection.sending_since = None
        self._writes += 1
        return True

    def _http_date(self) -> str:
        now = int(time.time())
        if now != self._date_second:
            self._date_second = now
            self._date = formatdate(now, usegmt=True)
        return self._date

    def _head(self, response: Response, *, length: int | None, close: bool = False) -> h11.Response:
        """The response's h11 head: its own fields but the framing ones, then
        ``Content-Length: length`` (or chunked encoding for None), the date, and
        ``Connection: close`` if ``close`` or once the server is shutting down."""
        headers: list[tuple[str, str]] = [
            (name, value)
            for name, value in response.headers
            if name.lower() not in _FRAMING_HEADERS
        ]
        if response.status in (204, 304):
            pass  # no body, and no field framing one (RFC 9110 8.6, RFC 9112 6.1)
        elif length is None:
            headers.append(("transfer-encoding", "chunked"))
        else:
            headers.append(("content-length", str(length)))
        headers.append(("date", self._http_date()))
        if close or self._closing:
            headers.append(("connection", "close"))
        try:
            reason = http.HTTPStatus(response.status).phrase.encode("ascii")
        except ValueError:
            reason = b""
        return h11.Response(status_code=response.status, headers=headers, reason=reason)

    def _written(self, connection: _Connection) -> bool:
        """Count a response written in full; whether its connection can go on."""
        self._completed += 1
        connection.responses += 1
        conn = connection.h11
        return not self._closing and conn.our_state is h11.DONE and conn.their_state is h11.DONE

    async def _write_error(self, connection: _Connection, status: int, message: str) -> bool:
        """Answer with an OpenAI-style error; whether the connection can go on."""
        response = error_response(status, message)
        assert isinstance(response.body, bytes)
        conn = connection.h11
        # A request not read to its end: the connection cannot go on.
        head = self._head(
            response, length=len(response.body), close=conn.their_state is not h11.DONE
        )
        data = (
            conn.send(head)
            + conn.send(h11.Data(data=response.body))
            + conn.send(h11.EndOfMessage())
        )
        if not await self._send(connection, data):
            return False
        return self._written(connection)

    async def _respond(self, connection: _Connection, request: Request) -> bool:
        """Run the handler on ``request`` and write its response, while watching for the
        client to go away; whether the connection can serve another request."""
        self._in_flight += 1
        responses = connection.responses
        keep = False
        cancelled = True  # until the scope says otherwise: an outer cancellation
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_client, connection, scope)
                    keep = await self._handle(connection, request, scope, nursery)
                    nursery.cancel_scope.cancel()
            cancelled = scope.cancelled_caught
            return keep and not cancelled
        finally:
            self._in_flight -= 1
            # A client that closes its end as soon as it has read the response may be
            # seen doing so before this request is over: written in full, not cancelled.
            if cancelled and connection.responses == responses:
                self._cancelled += 1

    async def _watch_client(self, connection: _Connection, scope: trio.CancelScope) -> None:
        """While a request is served: cancel it when the client closes or resets its end.
        Bytes it sends meanwhile (a pipelined request) go to h11's buffer, up to a
        request head's worth; past that the watch stops (writes still notice a reset)."""
        limit = self._limits.max_header_bytes
        received = 0
        while received <= limit:
            data = await self._receive(connection, limit + 1 - received)
            if not data:
                logger.debug("%s went away: cancelling its request", connection.peer)
                scope.cancel()
                return
            connection.h11.receive_data(data)
            received += len(data)

    async def _handle(
        self,
        connection: _Connection,
        request: Request,
        scope: trio.CancelScope,
        nursery: trio.Nursery,
    ) -> bool:
        """Call the handler and write its response; whether the connection can go on.
        A client gone during a write cancels ``scope`` (from here, or the writer task)."""
        try:
            response = cast("object", await self._handler(request))
            if not isinstance(response, Response):
                raise TypeError(f"the handler returned {response!r}, not a Response")
            body = response.body
            if isinstance(body, bytes):
                head = self._head(response, length=len(body))
                chunks = None
            else:
                chunks = body.__aiter__()
                head = self._head(response, length=None)
        except Exception:
            logger.exception("the handler of %s %s failed", request.method, request.path)
            return await self._write_error(connection, 500, "internal server error")
        conn = connection.h11
        no_body = request.method == "HEAD" or response.status in (204, 304)
        if chunks is None:
            assert isinstance(body, bytes)
            parts = [conn.send(head)]
            if body and not no_body:
                parts.append(conn.send(h11.Data(data=body)))
            parts.append(conn.send(h11.EndOfMessage()))
            if not await self._send(connection, b"".join(parts)):
                await _cancel(scope)
            return self._written(connection)
        try:
            if no_body:
                if not await self._send(
                    connection, conn.send(head) + conn.send(h11.EndOfMessage())
                ):
                    await _cancel(scope)
                return self._written(connection)
            if self._merge_writes:
                return await self._stream_merged(connection, request, head, chunks, scope, nursery)
            return await self._stream_each(connection, request, head, chunks, scope)
        except trio.Cancelled:
            # The client went away (or the shutdown's deadline came) while the body was
            # suspended at a `yield`: have it meet the Cancelled at its next checkpoint.
            await _resume_cancelled(chunks, request)
            raise
        finally:
            await _close_body(chunks, request)

    async def _stream_each(
        self,
        connection: _Connection,
        request: Request,
        head: h11.Response,
        chunks: AsyncIterator[bytes],
        scope: trio.CancelScope,
    ) -> bool:
        """Write a streamed response one chunk per write, from this task."""
        conn = connection.h11
        if not await self._send(connection, conn.send(head)):
            await _cancel(scope)
        while True:
            try:
                chunk = await chunks.__anext__()
                _check_chunk(chunk)
            except StopAsyncIteration:
                break
            except Exception:
                logger.exception("the response body of %s %s failed", request.method, request.path)
                return False
            if chunk and not await self._send(connection, conn.send(h11.Data(data=chunk))):
                await _cancel(scope)
        if not await self._send(connection, conn.send(h11.EndOfMessage())):
            await _cancel(scope)
        return self._written(connection)

    async def _stream_merged(
        self,
        connection: _Connection,
        request: Request,
        head: h11.Response,
        chunks: AsyncIterator[bytes],
        scope: trio.CancelScope,
        nursery: trio.Nursery,
    ) -> bool:
        """Take the body's chunks into an outbox that a writer task empties, all it holds
        in one write: one chunk per write while the client keeps up, several when it lags.
        """
        outbox = _Outbox()
        nursery.start_soon(self._write_outbox, connection, head, outbox, scope)
        high_water = self._limits.write_buffer_bytes
        failed = False
        while True:
            try:
                chunk = await chunks.__anext__()
                _check_chunk(chunk)
            except StopAsyncIteration:
                break
            except Exception:
                logger.exception("the response body of %s %s failed", request.method, request.path)
                failed = True
                break
            if chunk:
                outbox.put(chunk)
                if outbox.size >= high_water:
                    await outbox.wait_space()
        outbox.end(failed=failed)
        await outbox.written.wait()
        return outbox.keep_alive

    async def _write_outbox(
        self, connection: _Connection, head: h11.Response, outbox: _Outbox, scope: trio.CancelScope
    ) -> None:
        conn = connection.h11
        high_water = self._limits.write_buffer_bytes
        # Whether to give the body one more turn of the event loop before writing, to
        # add what else it has ready to the same write: worth it while the loop or the
        # client lags (a turn brings more chunks, or chunks were found waiting), not
        # while the client keeps up (a turn would bring nothing, and cost a turn). Two
        # turns that brought nothing in a row, and the writer stops waiting them, until
        # chunks are found waiting again.
        turns = 2
        try:
            data = conn.send(head)
            while True:
                if outbox.ended or outbox.size >= high_water:
                    pass
                elif len(outbox.chunks) > 1:
                    turns = 2
                elif turns:
                    await trio.lowlevel.checkpoint()
                    turns = 2 if len(outbox.chunks) > 1 else turns - 1
                ended = outbox.ended
                chunks = outbox.take()
                if chunks:
                    data += conn.send(
                        h11.Data(data=b"".join(chunks) if len(chunks) > 1 else chunks[0])
                    )
                if ended and not outbox.failed:
                    data += conn.send(h11.EndOfMessage())
                if data:
                    if not await self._send(connection, data):
                        scope.cancel()
                        return
                    data = b""
                if ended:
                    if not outbox.failed:
                        outbox.keep_alive = self._written(connection)
                    return
                if not outbox.chunks and not outbox.ended:
                    await outbox.wait_chunks()
        finally:
            outbox.written.set()

    async def _linger(self, connection: _Connection) -> None:
        """Close our end gracefully: send EOF, then read (and drop) what the client still
        sends until it closes its end, for a short while."""
        stream = connection.stream
        with trio.move_on_after(_LINGER_S):
            if isinstance(stream, trio.abc.HalfCloseableStream):
                try:
                    await stream.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
            drained = 0
            while drained < _LINGER_BYTES:
                data = await self._receive(connection)
                if not data:
                    return
                drained += len(data)


def _check_chunk(chunk: object) -> None:
    if not isinstance(chunk, bytes | bytearray | memoryview):
        raise TypeError(f"a response body yielded {type(chunk).__name__}, not bytes")


async def _cancel(scope: trio.CancelScope) -> NoReturn:
    """The client went away during a write: cancel its request, here and now."""
    scope.cancel()
    await trio.lowlevel.checkpoint()
    raise AssertionError("a cancelled scope let its task through")  # pragma: no cover


async def _resume_cancelled(chunks: AsyncIterator[bytes], request: Request) -> None:
    """Ask a body whose request was just cancelled for its next chunk, so that it meets
    ``trio.Cancelled`` at its next checkpoint (as the handler's code would, in a task),
    rather than ``GeneratorExit`` at the ``yield`` it waits at. Chunks it still yields
    are dropped; one that yields many without a checkpoint is closed instead."""
    try:
        for _ in range(_CHUNKS_AFTER_CANCEL):
            await chunks.__anext__()
    except (StopAsyncIteration, trio.Cancelled):
        pass
    except Exception:
        logger.exception("the response body of %s %s failed", request.method, request.path)


async def _close_body(chunks: AsyncIterator[bytes], request: Request) -> None:
    if isinstance(chunks, AsyncGenerator | trio.abc.AsyncResource):
        try:
            await chunks.aclose()
        except Exception:
            logger.exception(
                "closing the response body of %s %s failed", request.method, request.path
            )


def _peer(stream: trio.abc.Stream) -> tuple[str, int] | None:
    if not isinstance(stream, trio.SocketStream):
        return None
    try:
        address: object = stream.socket.getpeername()
    except OSError:
        return None
    if isinstance(address, tuple) and len(address) >= 2:  # pyright: ignore[reportUnknownArgumentType]
        host, port = address[0], address[1]  # pyright: ignore[reportUnknownVariableType]
        if isinstance(host, str) and isinstance(port, int):
            return host, port
    return None


async def serve_http(
    handler: Handler,
    listeners: Sequence[trio.abc.Listener[trio.abc.Stream]],
    *,
    limits: HttpLimits | None = None,
    merge_writes: bool = True,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP/1.1 on ``listeners`` with ``handler`` until cancelled or shut down.

    ``handler`` is called with each :class:`Request` (its body read) and returns a
    :class:`Response`, complete or streamed. Start it with ``nursery.start``; it reports
    started with the :class:`HttpServer`, whose ``shutdown(deadline_s)`` stops it
    gracefully::

        listeners = await trio.open_tcp_listeners(8000, host="127.0.0.1")
        server = await nursery.start(serve_http, handler, listeners)
        ...
        await server.shutdown(30)

    It owns ``listeners`` (closes them when it stops). Cancelling it stops it at once.
    It installs no signal handler: a program that wants SIGTERM to drain the server
    receives the signal itself (``trio.open_signal_receiver``) and calls ``shutdown``.

    What the server answers by itself: a malformed request, 400 (431 for header fields
    larger than ``limits.max_header_bytes``, 505 for an HTTP version other than 1.0 and
    1.1), and the connection closed; a body larger than ``limits.max_body_bytes``, 413;
    a body that does not arrive within ``limits.body_timeout_s``, 408; a method it does
    not know, 501. A client that waits for ``100 Continue`` (``Expect: 100-continue``)
    gets it before its body is read, unless the body it declares is too large (413). A
    request head not complete within ``limits.header_timeout_s`` gets its connection
    closed without a word. A ``HEAD`` request goes to the handler, which answers it as
    a ``GET``: the server sends the head alone (a streamed body is closed unread). A
    handler that raises gets its client a 500 (an OpenAI-style JSON error, no
    traceback), and the exception is logged once to the ``trio_enginecore.server``
    logger. A client that goes away cancels its request: the handler (or the streamed
    body) meets ``trio.Cancelled``. Nothing one connection does affects another.

    ``merge_writes=False`` writes each chunk of a streamed response separately (for
    measuring what merging saves).

    Raises:
        ValueError: ``listeners`` is empty.
        OSError: a listener failed (other than by running out of descriptors or
            memory, which is retried), after the server started; the server has then
            stopped, its connections closed. Several failures together raise an
            ExceptionGroup of them.
    """
    if not listeners:
        raise ValueError("serve_http needs at least one listener")
    server = HttpServer(handler, limits or HttpLimits(), merge_writes=merge_writes)
    try:
        await server._serve(listeners, task_status)  # pyright: ignore[reportPrivateUsage]
    except BaseExceptionGroup as group:
        failures = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
        if len(failures) > 1:
            raise
        single = failures[0] if failures else leaves(group)[0]
    else:
        return
    raise single

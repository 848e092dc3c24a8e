"""The HTTP/1.1 server (``trio_enginecore.server._http``) over real loopback sockets.

Its clients are ones nobody here wrote: httpx and curl, and raw sockets for what no
well-behaved client sends (malformed requests, slow headers, resets). What is checked:

* plain requests, keep-alive, HEAD, unknown methods, pipelining, HTTP/1.0;
* streamed responses arrive chunk by chunk as they are produced, merged or not;
* a client that goes away cancels its request: the handler, or the response body,
  meets ``trio.Cancelled`` within a bounded time, and the server's connections, tasks
  and file descriptors come back to what they were;
* the limits: body size (413), slow headers and bodies, idle connections, the cap on
  connections;
* errors: malformed requests (400/431), a handler that raises (500, logged once), a
  body that fails mid-stream; one connection's trouble never reaches another;
* 200 concurrent streaming clients;
* graceful shutdown: requests in flight finish, idle connections close at once, new
  ones are refused, what is left at the deadline is cancelled;
* fuzzed raw requests: the server answers or closes, never crashes, and serves on.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import socket
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import h11
import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

from trio_enginecore.server._http import HttpServer, serve_http
from trio_enginecore.server._http_messages import (
    Headers,
    HttpLimits,
    Request,
    Response,
    error_response,
    error_type,
)

Handler = Callable[[Request], Awaitable[Response]]

FAST = HttpLimits(header_timeout_s=2.0, keep_alive_timeout_s=2.0, body_timeout_s=2.0)

# -- helpers ----------------------------------------------------------------------------


@asynccontextmanager
async def running(
    handler: Handler, *, limits: HttpLimits = FAST, merge_writes: bool = True
) -> AsyncIterator[tuple[HttpServer, int]]:
    """A server on a free loopback port, stopped (cancelled) on the way out."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(
            partial(serve_http, handler, listeners, limits=limits, merge_writes=merge_writes)
        )
        try:
            yield server, port
        finally:
            nursery.cancel_scope.cancel()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.01)


async def server_idle(server: HttpServer) -> None:
    """Wait until the server has no connection and no request left."""
    await wait_until(
        lambda: server.statistics().connections == 0 and server.statistics().requests_in_flight == 0
    )


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def task_count() -> int:
    """Every task of this Trio run."""

    def count(task: trio.lowlevel.Task) -> int:
        return 1 + sum(count(child) for n in task.child_nurseries for child in n.child_tasks)

    root = trio.lowlevel.current_root_task()
    assert root is not None
    return count(root)


async def raw_connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def read_until_closed(
    stream: trio.SocketStream, timeout_s: float = 5.0, *, pause_s: float = 0.0
) -> bytes:
    """Everything the server sends until it closes (a read every ``pause_s`` seconds)."""
    data = bytearray()
    with trio.fail_after(timeout_s):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return bytes(data)
            if not chunk:
                return bytes(data)
            data += chunk
            if pause_s:
                await trio.sleep(pause_s)


async def raw_exchange(port: int, request: bytes, *, half_close: bool = True) -> bytes:
    """Send ``request`` on a new connection, then read everything until the server
    closes it."""
    stream = await raw_connect(port)
    async with stream:
        await stream.send_all(request)
        if half_close:
            await stream.send_eof()
        return await read_until_closed(stream)


def reset(stream: trio.SocketStream) -> None:
    """Close with a reset (RST), not a FIN."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


def body_of(response: bytes) -> bytes:
    """The body of one whole HTTP/1.1 response (chunked or not), as h11 reads it: fails
    on any framing error."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(response)
    client.receive_data(b"")
    parts = []
    while not isinstance(event := client.next_event(), h11.EndOfMessage):
        assert event is not h11.NEED_DATA, "the response ends before its body does"
        if isinstance(event, h11.Data):
            parts.append(event.data)
    return b"".join(parts)


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:80]
    return int(response[9:12])


def json_body(response: bytes) -> Any:
    return json.loads(response.partition(b"\r\n\r\n")[2])


async def echo(request: Request) -> Response:
    if request.path == "/fixed":
        return Response(200, [("content-type", "text/plain")], b"0123456789")
    return Response(
        200,
        [("content-type", "application/json"), ("x-echo", "yes")],
        json.dumps(
            {
                "method": request.method,
                "path": request.path,
                "query": request.query_items(),
                "body": request.body.decode(),
                "content_type": request.headers.get("Content-Type"),
                "peer_port": request.peer[1] if request.peer else None,
            }
        ).encode(),
    )


def sse(i: int) -> bytes:
    return b"data: %d\n\n" % i


# -- the pure parts ---------------------------------------------------------------------


def test_headers_are_case_insensitive_and_keep_every_value() -> None:
    headers = Headers([(b"Content-Type", b"a/b"), (b"x-many", b"1"), (b"X-Many", b"2")])
    assert headers["content-type"] == headers["CONTENT-TYPE"] == "a/b"
    assert "X-MANY" in headers
    assert "X-Few" not in headers
    assert headers["x-many"] == "1"
    assert headers.get_all("X-Many") == ["1", "2"]
    assert headers.get("missing") is None
    assert sorted(headers) == ["content-type", "x-many"]


def test_a_request_splits_its_target() -> None:
    request = Request("GET", "/a%20b/c?x=1&y=&x=%2F", Headers())
    assert request.path == "/a b/c"
    assert request.query == "x=1&y=&x=%2F"
    assert request.query_items() == [("x", "1"), ("y", ""), ("x", "/")]


def test_error_bodies_are_openai_shaped() -> None:
    response = error_response(413, "too big")
    assert isinstance(response.body, bytes)
    assert json.loads(response.body) == {
        "error": {"message": "too big", "type": "ContentTooLargeError", "param": None, "code": 413}
    }
    assert error_type(500) == "InternalServerError"
    assert error_type(400) == "BadRequestError"
    assert error_type(418) == "ImATeapotError"
    assert error_type(599) == "InternalServerError"


def test_responses_and_limits_check_their_values() -> None:
    with pytest.raises(ValueError, match=r"200\.\.599"):
        Response(101)
    with pytest.raises(ValueError, match="max_body_bytes"):
        HttpLimits(max_body_bytes=0)
    assert not Response(200, [], b"x").streaming


# -- plain requests ---------------------------------------------------------------------


async def test_get_post_head_and_query_through_httpx() -> None:
    async with (
        running(echo) as (server, port),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        got = await client.get("/v1/models?a=1&b=%C3%A9")
        assert got.status_code == 200
        assert got.headers["x-echo"] == "yes"
        assert "date" in got.headers
        assert got.json()["query"] == [["a", "1"], ["b", "é"]]
        posted = await client.post(
            "/v1/completions", content=b'{"prompt": "x"}', headers={"Content-Type": "a/json"}
        )
        assert posted.json()["method"] == "POST"
        assert posted.json()["body"] == '{"prompt": "x"}'
        assert posted.json()["content_type"] == "a/json"
        head = await client.head("/fixed")
        assert head.status_code == 200
        assert head.content == b""
        assert head.headers["content-length"] == "10"
        # One connection served all three (keep-alive), each request from the same port.
        assert server.statistics().connections == 1
        # (Counted once the last write has returned: the client may read it first.)
        await wait_until(lambda: server.statistics().requests_completed == 3)
    await server_idle(server)


async def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    async with (
        running(echo) as (server, port),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        ports = {(await client.get(f"/{i}")).json()["peer_port"] for i in range(20)}
        assert len(ports) == 1
        await wait_until(lambda: server.statistics().requests_completed == 20)


async def test_curl_plain_requests_and_keep_alive() -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    async with running(echo) as (server, port):
        url = f"http://127.0.0.1:{port}"
        done = await trio.run_process(
            ["curl", "-sS", "-v", f"{url}/one?q=1", f"{url}/two", "-d", "payload"],
            capture_stdout=True,
            capture_stderr=True,
        )
        first, second = (
            json.loads(part) for part in done.stdout.replace(b"}{", b"}\n{").split(b"\n")
        )
        assert (first["path"], second["path"]) == ("/one", "/two")
        assert first["body"] == second["body"] == "payload"
        assert first["peer_port"] == second["peer_port"]
        assert b"Re-using existing connection" in done.stderr
        head = await trio.run_process(["curl", "-sS", "-I", f"{url}/x"], capture_stdout=True)
        assert head.stdout.startswith(b"HTTP/1.1 200 OK\r\n")
    await server_idle(server)


async def test_unknown_methods_get_501_and_the_connection_goes_on() -> None:
    async with running(echo) as (_, port):
        stream = await raw_connect(port)
        async with stream:
            await stream.send_all(
                b"BREW /pot HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                b"GET /after HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            data = await read_until_closed(stream)
    first, _, rest = data.partition(b"HTTP/1.1 200")
    assert status_of(first) == 501
    assert json_body(first)["error"]["type"] == "NotImplementedError"
    assert b'"path": "/after"' in rest


async def test_head_and_204_send_no_body_and_never_run_a_streamed_one() -> None:
    produced: list[bytes] = []

    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            produced.append(b"x")
            yield b"x"

        return Response(204 if request.path == "/empty" else 200, [], body())

    async with (
        running(handler) as (server, port),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        head = await client.head("/")
        assert (head.status_code, head.content) == (200, b"")
        empty = await client.get("/empty")
        assert (empty.status_code, empty.content) == (204, b"")
        assert "content-length" not in empty.headers
        assert "transfer-encoding" not in empty.headers
        assert (await client.head("/")).status_code == 200  # the connection went on
        assert produced == []
        assert server.statistics().connections == 1


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with running(echo) as (_, port):
        request = b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n"
        data = await raw_exchange(port, b"".join(request % i for i in range(5)))
    paths = [
        json.loads(b"{" + part.partition(b"{")[2])["path"] for part in data.split(b"HTTP/1.1 ")[1:]
    ]
    assert paths == ["/0", "/1", "/2", "/3", "/4"]


async def test_an_http_1_0_client_gets_a_stream_delimited_by_closing() -> None:
    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            for i in range(3):
                yield sse(i)

        return Response(200, [], body())

    async with running(handler) as (_, port):
        data = await raw_exchange(port, b"GET / HTTP/1.0\r\n\r\n", half_close=False)
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body == sse(0) + sse(1) + sse(2)


# -- streaming --------------------------------------------------------------------------


@pytest.mark.parametrize("merge_writes", [True, False])
async def test_a_stream_is_read_chunk_by_chunk_as_it_is_produced(merge_writes: bool) -> None:
    # Each event is produced only after the client has read the one before: the client
    # could not have them all at the end.
    read: list[trio.Event] = [trio.Event() for _ in range(5)]

    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            for i in range(5):
                yield sse(i)
                await read[i].wait()

        return Response(200, [("content-type", "text/event-stream")], body())

    async with (
        running(handler, merge_writes=merge_writes) as (server, port),
        httpx.AsyncClient() as client,
        client.stream("GET", f"http://127.0.0.1:{port}/") as response,
    ):
        assert response.headers["transfer-encoding"] == "chunked"
        received = b""
        i = 0
        async for chunk in response.aiter_raw():
            received += chunk
            while i < 5 and sse(i) in received:
                read[i].set()
                i += 1
        assert received == b"".join(sse(i) for i in range(5))
    await server_idle(server)
    assert server.statistics().requests_completed == 1


async def test_curl_reads_a_stream_as_it_is_produced() -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    gate = trio.Event()

    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield sse(0)
            await gate.wait()
            yield sse(1)

        return Response(200, [("content-type", "text/event-stream")], body())

    async with running(handler) as (server, port), trio.open_nursery() as nursery:
        command = ["curl", "-sS", "-N", f"http://127.0.0.1:{port}/"]
        process: trio.Process = await nursery.start(
            partial(trio.run_process, command, stdout=subprocess.PIPE)
        )
        assert process.stdout is not None
        if True:
            out = b""
            with trio.fail_after(10):
                while sse(0) not in out:
                    out += await process.stdout.receive_some()
                assert sse(1) not in out
                gate.set()
                while chunk := await process.stdout.receive_some():
                    out += chunk
            assert out == sse(0) + sse(1)
    await server_idle(server)


async def test_chunks_ready_together_go_out_in_one_write() -> None:
    # Ten events yielded with no checkpoint between them are ready together: merged,
    # the head and all ten and the end of the body go in one write.
    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            for i in range(10):
                yield sse(i)

        return Response(200, [], body())

    for merge_writes, writes in ((True, 1), (False, 12)):
        async with (
            running(handler, merge_writes=merge_writes) as (server, port),
            httpx.AsyncClient() as client,
        ):
            response = await client.get(f"http://127.0.0.1:{port}/")
            assert response.content == b"".join(sse(i) for i in range(10))
            await wait_until(lambda: server.statistics().requests_completed == 1)
            assert server.statistics().writes == writes


class SmallSendBuffers(trio.abc.Listener[trio.SocketStream]):
    """A listener whose connections have a small send buffer: a client that lags
    blocks the server's writes soon (a generic listener, as ``serve_http`` takes)."""

    def __init__(self, listener: trio.SocketListener) -> None:
        self.listener = listener

    async def accept(self) -> trio.SocketStream:
        stream = await self.listener.accept()
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        return stream

    async def aclose(self) -> None:
        await self.listener.aclose()


@pytest.mark.parametrize("merge_writes", [True, False])
async def test_a_client_that_lags_gets_what_is_ready_merged(merge_writes: bool) -> None:
    # The client reads slowly: the server's writes block, the events pile up in its
    # outbox meanwhile, and go out many to a write; unmerged, one write each.
    events = 1000

    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            for i in range(events):
                await trio.lowlevel.checkpoint()
                yield b"data: %d %s\n\n" % (i, b"x" * 2000)

        return Response(200, [], body())

    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(
            partial(serve_http, handler, [SmallSendBuffers(listener)], merge_writes=merge_writes)
        )
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # a small window
        await sock.connect(("127.0.0.1", port))
        async with trio.SocketStream(sock) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = await read_until_closed(stream, timeout_s=20, pause_s=0.002)
        # Every byte, in order, in well-formed chunks, however the writes were cut.
        assert body_of(data) == b"".join(
            b"data: %d %s\n\n" % (i, b"x" * 2000) for i in range(events)
        )
        writes = server.statistics().writes
        if merge_writes:
            assert writes < events / 4
        else:
            assert writes == events + 2  # the head, each event, the end
        nursery.cancel_scope.cancel()


# -- disconnects cancel -----------------------------------------------------------------


# httpx streams through a chain of async generators; a reader that stops early leaves
# them to the garbage collector, and Trio warns about each one (as in test_tutorial_http).
@pytest.mark.filterwarnings("ignore:Async generator .* was garbage collected:ResourceWarning")
@pytest.mark.parametrize("merge_writes", [True, False])
@pytest.mark.parametrize("how", ["close", "reset", "httpx"])
async def test_a_client_gone_mid_stream_cancels_the_body(merge_writes: bool, how: str) -> None:
    seen: list[type[BaseException]] = []
    cancelled = trio.Event()

    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                i = 0
                while True:
                    yield sse(i)
                    i += 1
                    await trio.sleep(0.005)
            except BaseException as exc:
                seen.append(type(exc))
                cancelled.set()
                raise

        return Response(200, [("content-type", "text/event-stream")], body())

    async with running(handler, merge_writes=merge_writes) as (server, port):
        await trio.sleep(0.05)
        fds, tasks = open_fds(), task_count()
        if how == "httpx":
            async with (
                httpx.AsyncClient() as client,
                client.stream("GET", f"http://127.0.0.1:{port}/") as response,
            ):
                async for chunk in response.aiter_raw():
                    if chunk.count(b"data:") >= 1:
                        break
        else:
            stream = await raw_connect(port)
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            while received.count(b"data:") < 3:
                received += await stream.receive_some()
            if how == "reset":
                reset(stream)
            else:
                await stream.aclose()
        with trio.fail_after(1):
            await cancelled.wait()
        assert seen == [trio.Cancelled]
        await server_idle(server)
        statistics = server.statistics()
        assert statistics.requests_cancelled == 1
        assert statistics.requests_completed == 0
        await wait_until(lambda: task_count() == tasks and open_fds() == fds)


@pytest.mark.parametrize("merge_writes", [True, False])
async def test_a_client_that_stops_reading_then_resets_cancels_the_body(
    merge_writes: bool,
) -> None:
    # The body produces faster than the client reads (it reads nothing): the writes
    # block, the outbox fills and holds the body at a `yield`. The reset must still
    # reach the body as a Cancelled, not as GeneratorExit.
    seen: list[type[BaseException]] = []
    produced = [0]

    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    await trio.lowlevel.checkpoint()
                    produced[0] += 1
                    yield b"x" * 16384
            except BaseException as exc:
                seen.append(type(exc))
                raise

        return Response(200, [], body())

    async with running(handler, merge_writes=merge_writes) as (server, port):
        stream = await raw_connect(port)
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # Until the server is blocked: nothing more is produced.
        before = -1
        while produced[0] != before:
            before = produced[0]
            await trio.sleep(0.2)
        assert server.statistics().requests_in_flight == 1
        reset(stream)
        await server_idle(server)
    assert seen == [trio.Cancelled]


async def test_a_client_that_reads_nothing_is_dropped_after_the_send_timeout() -> None:
    seen: list[type[BaseException]] = []

    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    await trio.lowlevel.checkpoint()
                    yield b"x" * 65536
            except BaseException as exc:
                seen.append(type(exc))
                raise

        return Response(200, [], body())

    limits = HttpLimits(send_timeout_s=0.4)
    async with running(handler, limits=limits) as (server, port):
        async with await raw_connect(port) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            started = trio.current_time()
            await wait_until(lambda: server.statistics().connections == 0)
            assert 0.4 < trio.current_time() - started < 2
        assert seen == [trio.Cancelled]
        assert server.statistics().requests_cancelled == 1


async def test_a_client_gone_while_the_handler_runs_cancels_the_handler() -> None:
    seen: list[str] = []

    async def handler(request: Request) -> Response:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            seen.append(request.path)
            raise

    async with running(handler) as (server, port):
        for path, close in (("/close", True), ("/reset", False)):
            stream = await raw_connect(port)
            await stream.send_all(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode()
            )
            await wait_until(lambda: server.statistics().requests_in_flight == 1)
            if close:
                await stream.aclose()
            else:
                reset(stream)
            await server_idle(server)
        assert seen == ["/close", "/reset"]
        assert server.statistics().requests_cancelled == 2


async def test_a_stream_waiting_for_its_first_event_is_cancelled_by_a_disconnect() -> None:
    cancelled = trio.Event()
    never = trio.Event()

    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                await never.wait()
            finally:
                cancelled.set()
            yield b""  # pragma: no cover

        return Response(200, [], body())

    async with running(handler) as (server, port):
        stream = await raw_connect(port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await wait_until(lambda: server.statistics().requests_in_flight == 1)
        await trio.sleep(0.05)
        await stream.aclose()
        with trio.fail_after(1):
            await cancelled.wait()
        await server_idle(server)


# -- limits -----------------------------------------------------------------------------


async def test_a_body_too_large_gets_413() -> None:
    limits = HttpLimits(max_body_bytes=1000, header_timeout_s=2, body_timeout_s=2)
    async with (
        running(echo, limits=limits) as (server, port),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        assert (await client.post("/", content=b"x" * 1000)).status_code == 200
        declared = await client.post("/", content=b"x" * 1001)
        assert declared.status_code == 413
        assert declared.json()["error"]["type"] == "ContentTooLargeError"
        assert declared.headers["connection"] == "close"

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(20):
                yield b"x" * 100

        streamed = await client.post("/", content=chunked())
        assert streamed.status_code == 413
        assert (await client.get("/")).status_code == 200
    await server_idle(server)


async def test_expect_100_continue_with_curl() -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    limits = HttpLimits(max_body_bytes=10_000)
    async with running(echo, limits=limits) as (server, port):
        url = f"http://127.0.0.1:{port}/"
        small = await trio.run_process(
            ["curl", "-sS", "-v", "-H", "Expect: 100-continue", "--data-binary", "x" * 5000, url],
            capture_stdout=True,
            capture_stderr=True,
        )
        assert b"HTTP/1.1 100 Continue" in small.stderr
        assert json.loads(small.stdout)["body"] == "x" * 5000
        large = await trio.run_process(
            ["curl", "-sS", "-v", "-H", "Expect: 100-continue", "--data-binary", "x" * 20000, url],
            capture_stdout=True,
            capture_stderr=True,
        )
        assert b"HTTP/1.1 100 Continue" not in large.stderr
        assert b"HTTP/1.1 413" in large.stderr
    await server_idle(server)


async def test_slow_or_missing_headers_time_out() -> None:
    limits = HttpLimits(header_timeout_s=0.3, keep_alive_timeout_s=0.2)
    async with running(echo, limits=limits) as (server, port):
        # Part of a head, then nothing: closed at the header timeout, with no answer.
        started = trio.current_time()
        async with await raw_connect(port) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            assert await read_until_closed(stream) == b""
        assert 0.25 < trio.current_time() - started < 1.5
        # A head trickling in, a byte at a time: the timeout counts from the connection.
        started = trio.current_time()
        async with await raw_connect(port) as stream:
            with pytest.raises(trio.BrokenResourceError):
                for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: " + b"y" * 100:
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(0.02)
        assert 0.25 < trio.current_time() - started < 1.5
        # Nothing at all.
        async with await raw_connect(port) as stream:
            assert await read_until_closed(stream) == b""
        # An idle keep-alive connection: closed after its own timeout.
        async with await raw_connect(port) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            started = trio.current_time()
            data = await read_until_closed(stream)
        assert status_of(data) == 200
        assert 0.15 < trio.current_time() - started < 1.0
        await server_idle(server)


async def test_a_slow_body_gets_408() -> None:
    limits = HttpLimits(body_timeout_s=0.3)
    async with running(echo, limits=limits) as (server, port):
        async with await raw_connect(port) as stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
            data = await read_until_closed(stream)
        assert status_of(data) == 408
        assert json_body(data)["error"]["code"] == 408
        await server_idle(server)


async def test_at_the_connection_cap_the_server_stops_accepting() -> None:
    limits = HttpLimits(max_connections=2)
    async with running(echo, limits=limits) as (server, port):
        first, second = await raw_connect(port), await raw_connect(port)
        await wait_until(lambda: server.statistics().connections == 2)
        third = await raw_connect(port)  # queued in the listen backlog
        await third.send_all(b"GET /third HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        with trio.move_on_after(0.3) as waited:
            await third.receive_some()
        assert waited.cancelled_caught
        assert server.statistics().connections == 2
        await first.aclose()
        data = await read_until_closed(third)
        assert b'"path": "/third"' in data
        await second.aclose()
        await third.aclose()
        await server_idle(server)


# -- errors -----------------------------------------------------------------------------

MALFORMED = [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
]


@pytest.mark.parametrize(("request_bytes", "status"), MALFORMED)
async def test_a_malformed_request_gets_an_error_and_the_server_goes_on(
    request_bytes: bytes, status: int
) -> None:
    async with running(echo) as (server, port):
        data = await raw_exchange(port, request_bytes, half_close=False)
        assert status_of(data) == status
        assert b"connection: close" in data.lower()
        body = json_body(data)
        assert body["error"]["code"] == status
        assert "Traceback" not in body["error"]["message"]
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/")).status_code == 200
        await server_idle(server)


async def test_a_handler_that_raises_gets_a_500_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_enginecore.server")

    async def handler(request: Request) -> Response:
        if request.path == "/boom":
            raise RuntimeError("secret internals")
        if request.path == "/not-a-response":
            return "oops"  # type: ignore[return-value]
        if request.path == "/bad-header":
            return Response(200, [("bad header", "x")], b"")
        if request.path == "/sync-body":
            return Response(200, [], [b"not", b"async"])  # type: ignore[arg-type]
        return await echo(request)

    async with (
        running(handler) as (server, port),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        for path in ("/boom", "/not-a-response", "/bad-header", "/sync-body"):
            response = await client.get(path)
            assert response.status_code == 500
            assert response.json() == {
                "error": {
                    "message": "internal server error",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
            assert b"secret" not in response.content
            # The connection goes on.
            assert (await client.get("/fine")).status_code == 200
        assert server.statistics().connections == 1
    # Each failure logged once, with its traceback, on the server's logger.
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.exc_info[0] if r.exc_info else None for r in failures] == [
        RuntimeError,
        TypeError,
        h11.LocalProtocolError,
        AttributeError,
    ]
    assert all(r.name == "trio_enginecore.server" for r in failures)


@pytest.mark.parametrize("merge_writes", [True, False])
async def test_a_body_that_fails_mid_stream_cuts_the_response_short(
    merge_writes: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield sse(0)
            await trio.sleep(0.01)
            raise ValueError("mid-stream")

        return Response(200, [], body())

    async with (
        running(handler, merge_writes=merge_writes) as (server, port),
        httpx.AsyncClient() as client,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(f"http://127.0.0.1:{port}/")
        await server_idle(server)
        assert server.statistics().requests_completed == 0
        assert server.statistics().requests_cancelled == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert errors[0].exc_info is not None
    assert errors[0].exc_info[0] is ValueError


# -- load -------------------------------------------------------------------------------


@pytest.mark.slow
async def test_200_concurrent_streaming_clients() -> None:
    clients = 200
    started = 0
    all_started = trio.Event()

    async def handler(request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            nonlocal started
            yield sse(0)
            started += 1
            if started == clients:
                all_started.set()
            await all_started.wait()  # every stream is open at once
            for i in range(1, 20):
                await trio.sleep(0.001)
                yield sse(i)

        return Response(200, [("content-type", "text/event-stream")], body())

    expected = b"".join(sse(i) for i in range(20))
    limits = HttpLimits(max_connections=clients)
    async with running(handler, limits=limits) as (server, port):
        fds = open_fds()
        bodies: list[bytes] = []
        async with httpx.AsyncClient(
            limits=httpx.Limits(max_connections=clients), timeout=30
        ) as client:

            async def one() -> None:
                async with client.stream("GET", f"http://127.0.0.1:{port}/") as response:
                    bodies.append(b"".join([chunk async for chunk in response.aiter_raw()]))

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for _ in range(clients):
                        nursery.start_soon(one)
            assert server.statistics().connections == clients
        assert bodies == [expected] * clients
        await server_idle(server)
        assert server.statistics().requests_completed == clients
        await wait_until(lambda: open_fds() == fds)


# -- shutdown ---------------------------------------------------------------------------


async def test_shutdown_lets_requests_in_flight_finish_and_refuses_new_ones() -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            await trio.sleep(0.3)
            return Response(200, [], b"slow done")

        async def body() -> AsyncIterator[bytes]:
            for i in range(20):
                await trio.sleep(0.02)
                yield sse(i)

        return Response(200, [], body())

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    results: dict[str, bytes] = {}
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(partial(serve_http, handler, listeners))
        idle = await raw_connect(port)
        await wait_until(lambda: server.statistics().connections == 1)

        async def fetch(name: str, path: str) -> None:
            results[name] = await raw_exchange(
                port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), half_close=False
            )

        for name, path in (("a", "/stream"), ("b", "/stream"), ("c", "/slow")):
            nursery.start_soon(fetch, name, path)
        await wait_until(lambda: server.statistics().requests_in_flight == 3)
        started = trio.current_time()
        shutdown_done = trio.Event()

        async def shut_down() -> None:
            await server.shutdown(5)
            shutdown_done.set()

        nursery.start_soon(shut_down)
        # The idle connection is closed at once, new connections are refused.
        async with idle:
            assert await read_until_closed(idle, timeout_s=0.5) == b""
        with pytest.raises(OSError, match="connect"):
            await raw_connect(port)
        with trio.fail_after(3):
            await shutdown_done.wait()
        assert trio.current_time() - started < 2
    for name in ("a", "b"):
        body = results[name].partition(b"\r\n\r\n")[2]
        assert body.count(b"data: ") == 20
        assert body.endswith(b"0\r\n\r\n")
    assert results["c"].endswith(b"slow done")
    assert b"connection: close" in results["c"].lower()  # answered after the shutdown began
    statistics = server.statistics()
    assert statistics.requests_completed == 3
    assert statistics.requests_cancelled == 0
    assert statistics.closing


async def test_shutdown_cancels_what_is_left_at_the_deadline() -> None:
    cancelled: list[str] = []

    async def handler(request: Request) -> Response:
        if request.path == "/handler":
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                cancelled.append("handler")
                raise

        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield sse(0)
                    await trio.sleep(0.01)
            except trio.Cancelled:
                cancelled.append("body")
                raise

        return Response(200, [], body())

    async with running(handler) as (server, port):
        streams = [await raw_connect(port) for _ in range(2)]
        await streams[0].send_all(b"GET /handler HTTP/1.1\r\nHost: x\r\n\r\n")
        await streams[1].send_all(b"GET /body HTTP/1.1\r\nHost: x\r\n\r\n")
        await wait_until(lambda: server.statistics().requests_in_flight == 2)
        started = trio.current_time()
        await server.shutdown(0.3)
        assert 0.25 < trio.current_time() - started < 1.5
        assert sorted(cancelled) == ["body", "handler"]
        assert server.statistics().requests_cancelled == 2
        assert server.statistics().connections == 0
        for stream in streams:
            await read_until_closed(stream)
            await stream.aclose()
        # Already stopped: returns at once (a checkpoint all the same).
        with trio.testing.assert_checkpoints():
            await server.shutdown(10)


class FailingListener(trio.abc.Listener[trio.SocketStream]):
    """A listener whose accept() fails with the errors given, then waits forever."""

    def __init__(self, *errors: OSError) -> None:
        self.errors = list(errors)
        self.closed = False

    async def accept(self) -> trio.SocketStream:
        await trio.lowlevel.checkpoint()
        if self.errors:
            raise self.errors.pop(0)
        await trio.sleep_forever()

    async def aclose(self) -> None:
        self.closed = True
        await trio.lowlevel.checkpoint()


async def test_a_listener_failure_stops_the_server_with_that_error_alone() -> None:
    # Out of descriptors: logged and retried. Anything else: raised as itself.
    listener = FailingListener(OSError(errno.EMFILE, "too many"), OSError(errno.EBADF, "bad"))
    (good,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    with pytest.raises(OSError, match="bad") as raised:
        await serve_http(echo, [listener, good])
    assert raised.value.errno == errno.EBADF
    assert listener.closed
    with pytest.raises(ValueError, match="at least one listener"):
        await serve_http(echo, [])


async def test_cancelling_serve_http_stops_everything_at_once() -> None:
    cancelled = trio.Event()

    async def handler(request: Request) -> Response:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    fds = open_fds()
    async with running(handler) as (server, port):
        stream = await raw_connect(port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await wait_until(lambda: server.statistics().requests_in_flight == 1)
    assert cancelled.is_set()
    assert await read_until_closed(stream) == b""
    await stream.aclose()
    assert open_fds() == fds


# -- fuzz -------------------------------------------------------------------------------

SEEDS = [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/completions?a=1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b'Content-Length: 15\r\n\r\n{"prompt": "x"}',
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"GET / HTTP/1.0\r\n\r\n",
    b"HEAD / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n",
]
NASTY = [
    b"\r\n",
    b"\n",
    b"\x00",
    b" ",
    b":",
    b"\r\n\r\n",
    b"99999999999999999999",
    b"-1",
    b"\xff",
    b"0",
]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """A seed request, damaged: bytes flipped, cut, repeated or spliced with nasty ones."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        where = rng.randrange(len(out) + 1)
        action = rng.randrange(5)
        if action == 0 and out:
            out[min(where, len(out) - 1)] = rng.randrange(256)
        elif action == 1:
            out[where:where] = rng.choice(NASTY)
        elif action == 2:
            del out[where : where + rng.randint(1, 8)]
        elif action == 3:
            out = out[:where]
        else:
            out[where:where] = out[rng.randrange(len(out) + 1) :][:20]
    return bytes(out)


def acceptable(response: bytes) -> bool:
    """Closed without a word, or one or more whole-looking responses."""
    return response == b"" or (response.startswith(b"HTTP/1.1 ") and response[9:12].isdigit())


@pytest.mark.slow
async def test_fuzzed_requests_are_answered_or_closed_and_others_are_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="trio_enginecore.server")

    async def handler(request: Request) -> Response:
        if request.path == "/stream":

            async def body() -> AsyncIterator[bytes]:
                for i in range(100):
                    await trio.sleep(0.01)
                    yield sse(i)

            return Response(200, [], body())
        return await echo(request)

    rng = random.Random(20261206)
    cases = [mutate(rng.choice(SEEDS), rng) for _ in range(400)] + [
        bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))) for _ in range(100)
    ]
    limits = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_timeout_s=0.5)
    async with (
        running(handler, limits=limits) as (server, port),
        httpx.AsyncClient() as client,
        client.stream("GET", f"http://127.0.0.1:{port}/stream") as long_stream,
    ):
        fds = open_fds()
        bad: list[tuple[bytes, bytes]] = []
        limiter = trio.CapacityLimiter(16)

        async def one(i: int, case: bytes) -> None:
            async with limiter:
                response = await raw_exchange(port, case, half_close=i % 2 == 0)
                if not acceptable(response):
                    bad.append((case, response[:100]))

        async with trio.open_nursery() as nursery:
            for i, case in enumerate(cases):
                nursery.start_soon(one, i, case)
        assert bad == []
        # The stream that ran meanwhile is whole, and the server serves on.
        body = b"".join([chunk async for chunk in long_stream.aiter_raw()])
        assert body == b"".join(sse(i) for i in range(100))
        assert (await client.get(f"http://127.0.0.1:{port}/after")).status_code == 200
    await server_idle(server)
    await wait_until(lambda: open_fds() <= fds)
    assert [r.getMessage() for r in caplog.records] == []


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    head=st.lists(
        st.sampled_from(
            [
                b"GET",
                b"POST",
                b" ",
                b"/",
                b"HTTP/1.1",
                b"HTTP/1.0",
                b"\r\n",
                b"Host: x",
                b"Content-Length: ",
                b"Transfer-Encoding: chunked",
                b"0",
                b"5",
                b":",
                b"\x00",
                b"Expect: 100-continue",
                b"Connection: close",
            ]
        ),
        max_size=20,
    ),
    tail=st.binary(max_size=50),
)
async def test_hypothesis_raw_bytes_never_crash_the_server(head: list[bytes], tail: bytes) -> None:
    async with running(echo, limits=HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5)) as (
        server,
        port,
    ):
        response = await raw_exchange(port, b"".join(head) + tail)
        assert acceptable(response), response[:200]
        assert status_of(await raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
        await server_idle(server)

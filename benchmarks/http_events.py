"""Server CPU per streamed event: the Trio HTTP server (h11 on Trio streams) against
hypercorn's Trio worker, on a trivial app (not a test).

    python -m benchmarks.http_events                       # every server, C = 64 and 256
    python -m benchmarks.http_events --servers merged each --clients 64 --seconds 3
    python -m benchmarks.http_events --burst 4             # events ready 4 at a time
    python -m benchmarks.http_events --interval-ms 10      # paced: the client keeps up
    python -m benchmarks.http_events --count-loop          # + loop turns, task steps

Each server runs in a process of its own, serving one trivial app: every request gets
a ``text/event-stream`` response of 512 fixed SSE-like events (88 bytes each), the app
passing a checkpoint before each (``await trio.sleep(0)``, or ``--interval-ms``; with
``--burst N``, before each N), as a handler that awaits its next token would. C clients
(one keep-alive connection each, raw sockets, in this process) request one stream after
another for ``--seconds``. The figure is the server process's CPU time (user + system,
``os.times()`` read through the app itself) divided by the events delivered.

Servers: ``merged`` is ``serve_http`` as shipped (a writer task per stream: what waits
when it writes goes out in one write); ``each`` is ``serve_http(...,
merge_writes=False)`` (one write per event, from the handler's task); ``bare`` is h11 on
Trio streams and nothing else (no limits, timeouts or disconnect watch: the floor);
``hypercorn`` is hypercorn's Trio worker with the same app in ASGI.

Measured on the 2-core development VM (Python 3.11, trio 0.35, h11 0.16, hypercorn
0.18) while other test suites ran on the same cores (load 2.5 to 4): the absolute
figures are 3 to 4 times those of an earlier run on a quiet machine (``bare`` was then
10.1 / 11.2 µs), and vary by up to 30 % from run to run; compare within a table.
Medians of 3 runs of 3 s, µs of server CPU per event (writes per event):

=========  =================  =================
server     C = 64             C = 256
=========  =================  =================
merged     33.4 (0.50)        43.9 (0.50)
each       47.3 (1.00)        64.7 (1.00)
bare       43.9 (1.00)        42.6 (1.00)
hypercorn  131.8              131.6
=========  =================  =================

Events ready 4 at a time (``--burst 4``, as ``n = 4`` choices give): ``merged`` 17.7 /
19.8 µs (0.19 writes per event), ``each`` 50.2 / 59.2 µs (1.00).

Paced, a client and a loop that keep up (``--interval-ms 10``, C = 64; timers dominate
the cost): ``merged`` 143 µs (1.00 writes per event, 3.0 task steps per event),
``each`` 153 µs (2.0 task steps), ``bare`` 135 µs (2.0 task steps): merging costs one
task step per event (the writer's wake-up) when there is nothing to merge.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import trio

EVENTS = 512
EVENT = (
    b'data: {"id":"cmpl-0","object":"text_completion","choices":[{"index":0,"text":" tok"}]}\n\n'
)
END = b"\r\n0\r\n\r\n"


# -- the servers (child processes) -------------------------------------------------------


class _LoopCounter(trio.abc.Instrument):
    """Counts the event loop's turns (each one ``epoll_wait`` call) and task steps."""

    def __init__(self) -> None:
        self.turns = 0
        self.steps = 0

    def before_io_wait(self, timeout: float) -> None:
        self.turns += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


_LOOP = _LoopCounter()


def _instruments() -> list[trio.abc.Instrument]:
    return [_LOOP] if os.environ.get("HTTP_EVENTS_COUNT_LOOP") else []


def _cpu() -> bytes:
    """This process's user and system CPU seconds, and its loop's turns and task steps."""
    times = os.times()
    return f"{times.user} {times.system} {_LOOP.turns} {_LOOP.steps}".encode()


async def _events(interval_s: float, burst: int) -> AsyncIterator[bytes]:
    for _ in range(EVENTS // burst):
        await trio.sleep(interval_s)
        for _ in range(burst):
            yield EVENT


def _serve_ours(port: int, *, merge: bool, interval_s: float, burst: int) -> None:
    from trio_enginecore.server._http import HttpServer, serve_http
    from trio_enginecore.server._http_messages import Request, Response

    server: HttpServer | None = None

    async def handler(request: Request) -> Response:
        if request.path == "/cpu":
            return Response(200, [], _cpu())
        if request.path == "/writes":
            assert server is not None
            return Response(200, [], str(server.statistics().writes).encode())
        return Response(200, [("content-type", "text/event-stream")], _events(interval_s, burst))

    async def main() -> None:
        nonlocal server
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1", backlog=1024)
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda task_status: serve_http(
                    handler, listeners, merge_writes=merge, task_status=task_status
                )
            )
            print(listeners[0].socket.getsockname()[1], flush=True)

    trio.run(main, instruments=_instruments())


def _serve_bare(port: int, *, interval_s: float, burst: int) -> None:
    """h11 on Trio streams and nothing else: no limits, no timeouts, no watching for
    disconnects, one write per event (the floor an earlier measurement used)."""
    import h11

    async def connection(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                target = b""
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some(65536)
                        if not data:
                            return
                        conn.receive_data(data)
                    elif isinstance(event, h11.Request):
                        target = event.target
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                if target == b"/cpu":
                    body = _cpu()
                    length = [("content-length", str(len(body)))]
                    await stream.send_all(
                        conn.send(h11.Response(status_code=200, headers=length))
                        + conn.send(h11.Data(data=body))
                        + conn.send(h11.EndOfMessage())
                    )
                else:
                    chunked = [("transfer-encoding", "chunked")]
                    await stream.send_all(conn.send(h11.Response(status_code=200, headers=chunked)))
                    async for event_bytes in _events(interval_s, burst):
                        await stream.send_all(conn.send(h11.Data(data=event_bytes)))
                    await stream.send_all(conn.send(h11.EndOfMessage()))
                if conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1", backlog=1024)
        print(listeners[0].socket.getsockname()[1], flush=True)
        await trio.serve_listeners(connection, listeners)

    trio.run(main, instruments=_instruments())


def _serve_hypercorn(port: int, *, interval_s: float, burst: int) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/cpu":
            body = _cpu()
            length = [(b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": length})
            await send({"type": "http.response.body", "body": body})
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(EVENTS // burst):
            await trio.sleep(interval_s)
            for _ in range(burst):
                await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.backlog = 1024
    config.accesslog = None
    config.keep_alive_timeout = 60

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            asgi_app: Any = app  # hypercorn's own ASGI types, not worth spelling out here
            nursery.start_soon(serve, asgi_app, config)
            await trio.sleep(0.5)
            print(port, flush=True)

    trio.run(main, instruments=_instruments())


# -- the load (this process) -------------------------------------------------------------


async def _get(port: int, path: str) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data.partition(b"\r\n\r\n")[2]


async def _client(port: int, until: float, counts: list[int]) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    request = b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n"
    async with stream:
        while trio.current_time() < until:
            await stream.send_all(request)
            events = 0
            tail = b""
            while True:
                data = await stream.receive_some(262144)
                if not data:
                    raise RuntimeError("the server closed the connection")
                events += data.count(b"data: ")
                tail = (tail + data)[-len(END) :]
                if tail == END:
                    break
            if events != EVENTS:
                raise RuntimeError(f"a response had {events} events, not {EVENTS}")
            counts[0] += events
            counts[1] += 1


async def _load(port: int, clients: int, seconds: float, ours: bool) -> dict[str, float]:
    counts = [0, 0]
    user0, system0, turns0, steps0 = map(float, (await _get(port, "/cpu")).split())
    writes0 = int(await _get(port, "/writes")) if ours else 0
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        until = trio.current_time() + seconds
        for _ in range(clients):
            nursery.start_soon(_client, port, until, counts)
    wall = time.perf_counter() - started
    user1, system1, turns1, steps1 = map(float, (await _get(port, "/cpu")).split())
    user, system = user1 - user0, system1 - system0
    cpu = user + system
    writes = int(await _get(port, "/writes")) - writes0 if ours else math.nan
    events = counts[0]
    return {
        "events": events,
        "us_per_event": cpu / events * 1e6,
        "user_us_per_event": user / events * 1e6,
        "system_us_per_event": system / events * 1e6,
        "writes_per_event": writes / events,
        "turns_per_event": (turns1 - turns0) / events if turns1 else math.nan,
        "steps_per_event": (steps1 - steps0) / events if steps1 else math.nan,
        "events_per_s": events / wall,
        "server_cpu_share": cpu / wall,
    }


def _measure(
    server: str, clients: int, seconds: float, interval_ms: float, burst: int
) -> dict[str, float]:
    argv = [sys.executable, "-m", "benchmarks.http_events", "--serve", server]
    argv += ["--interval-ms", str(interval_ms), "--burst", str(burst)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        return trio.run(_load, port, clients, seconds, server in ("merged", "each"))
    finally:
        process.terminate()
        process.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument(
        "--servers",
        nargs="+",
        default=["merged", "each", "bare", "hypercorn"],
        choices=["merged", "each", "bare", "hypercorn"],
    )
    parser.add_argument("--clients", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--interval-ms", type=float, default=0.0)
    parser.add_argument("--burst", type=int, default=1, choices=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--count-loop",
        action="store_true",
        help="count the server's loop turns (epoll_wait calls) and task steps per event "
        "(a Trio instrument: costs some CPU of its own)",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.count_loop:
        os.environ["HTTP_EVENTS_COUNT_LOOP"] = "1"  # for the servers, child processes
    interval_s = args.interval_ms / 1000
    if args.serve == "bare":
        _serve_bare(0, interval_s=interval_s, burst=args.burst)
        return 0
    if args.serve == "hypercorn":
        _serve_hypercorn(_free_port(), interval_s=interval_s, burst=args.burst)
        return 0
    if args.serve in ("merged", "each"):
        _serve_ours(0, merge=args.serve == "merged", interval_s=interval_s, burst=args.burst)
        return 0
    print(
        f"{EVENTS} events of {len(EVENT)} bytes per request, {args.burst} per checkpoint, "
        f"interval {args.interval_ms} ms"
    )
    print(
        f"{'server':10} {'C':>4} {'µs/event':>9} {'(user':>6} {'sys)':>6} "
        f"{'writes/event':>13} {'turns/event':>12} {'steps/event':>12} "
        f"{'events/s':>9} {'cpu':>5}"
    )
    for server in args.servers:
        for clients in args.clients:
            r = _measure(server, clients, args.seconds, args.interval_ms, args.burst)
            print(
                f"{server:10} {clients:4d} {r['us_per_event']:9.2f} "
                f"{r['user_us_per_event']:6.1f} {r['system_us_per_event']:6.1f} "
                f"{r['writes_per_event']:13.3f} {r['turns_per_event']:12.3f} "
                f"{r['steps_per_event']:12.3f} {r['events_per_s']:9.0f} "
                f"{r['server_cpu_share']:5.2f}",
                flush=True,
            )
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())

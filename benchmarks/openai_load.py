"""The load generator of ``benchmarks/openai_server.py``: OpenAI completions over raw
HTTP/1.1, in a process of its own (standard library only).

    python -m benchmarks.openai_load      # one JSON spec a line on stdin, a report each

A spec: ``port``, ``stream``, ``concurrency``, ``requests``, ``bodies`` (the request
bodies, cycled through), ``timeout_s``. The process stays up between specs, blocked on
its standard input (no CPU), so that a measurement pays no interpreter start-up.

One thread, one ``epoll`` selector, C non-blocking keep-alive connections to
``127.0.0.1:PORT``, a closed loop: each connection sends its next request as soon as
the previous response has ended, until ``requests`` have been sent, and all of them
have been answered. The parser is minimal: a response head (status 200 required;
``content-length`` or ``transfer-encoding: chunked``), then the body; a chunked body's
chunks are taken whole (a chunk's events count when its last byte arrives).

What it counts, per ``recv`` that completes events (an *arrival*: what a client sees at
once, whether the server wrote one event or several):

* SSE events that carry a choice's ``"text":``, and the tokens in them: the length of
  each text once its JSON escapes are undone. This holds for the benchmark's model only,
  whose every output token is one ASCII character (see ``openai_server.py``); the usage
  chunk's ``completion_tokens`` (``stream_options.include_usage``) is the authoritative
  count, and both are reported;
* TTFT: from sending the request to the first arrival with text;
* inter-token latency: for each later arrival with text, the time since the previous
  one divided by the tokens it brought, once per token (a token-weighted distribution);
* without streaming, the latency of the whole response and the usage's
  ``completion_tokens``.

Its own CPU time (``os.times()`` around the run) is reported, so that a reader can
judge what the load generator took from the two cores the servers share. The cyclic
garbage collector is off during a run (nothing it allocates forms cycles).

Answers each spec with one line: ``@{...}``, the counts and the percentiles (or
``@{"error": ...}``).
"""

from __future__ import annotations

import gc
import json
import os
import re
import selectors
import socket
import sys
import time
from array import array
from typing import Any, Final

_TEXT: Final = re.compile(rb'"text":("(?:[^"\\]|\\.)*")')
_COMPLETION_TOKENS: Final = re.compile(rb'"completion_tokens":(\d+)')
_HEAD_END: Final = b"\r\n\r\n"
_DONE: Final = b"data: [DONE]"


class ProtocolError(RuntimeError):
    """The server answered something this parser does not accept."""


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def weighted_percentile(values: array[float], weights: array[int], q: float) -> float:
    """The ``q`` quantile of ``values`` each counted ``weights`` times."""
    if not values:
        return float("nan")
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(weights)
    threshold = q * total
    seen = 0
    for value, weight in pairs:
        seen += weight
        if seen >= threshold:
            return value
    return pairs[-1][0]


class Connection:
    """One keep-alive connection and the response it is reading."""

    __slots__ = (
        "buffer",
        "chunked",
        "close_after",
        "done_stream",
        "empty_events",
        "events",
        "head_done",
        "length",
        "previous",
        "sent",
        "sock",
        "text_tokens",
        "ttft",
        "usage_tokens",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reset(0.0)

    def reset(self, sent: float) -> None:
        self.buffer = bytearray()
        self.head_done = False
        self.chunked = False
        self.length = -1
        self.close_after = False
        self.sent = sent
        self.previous = 0.0
        self.ttft = -1.0
        self.events = 0
        self.empty_events = 0
        self.text_tokens = 0
        self.usage_tokens = -1
        self.done_stream = False


class Load:
    """The closed loop of ``concurrency`` connections (see the module's docstring)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.port = int(spec["port"])
        self.path = str(spec.get("path", "/v1/completions"))
        self.stream = bool(spec["stream"])
        self.concurrency = int(spec["concurrency"])
        self.requests = int(spec["requests"])
        self.timeout_s = float(spec.get("timeout_s", 600))
        self.bodies = [json.dumps(body).encode() for body in spec["bodies"]]
        self.selector = selectors.DefaultSelector()
        self.issued = 0
        self.completed = 0
        # Per request, and per arrival (token-weighted inter-token latency).
        self.ttfts: list[float] = []
        self.latencies: list[float] = []
        self.itl = array("d")
        self.itl_weights = array("q")
        self.events = 0
        self.empty_events = 0
        self.text_tokens = 0
        self.usage_tokens = 0
        self.missing_usage = 0
        self.arrivals = 0
        self.recvs = 0
        self.mismatched = 0

    def _request(self, number: int) -> bytes:
        body = self.bodies[number % len(self.bodies)]
        return (
            f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    def _connect(self) -> Connection:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        connection = Connection(sock)
        self.selector.register(sock, selectors.EVENT_READ, connection)
        return connection

    def _send_next(self, connection: Connection) -> None:
        if self.issued >= self.requests:
            self.selector.unregister(connection.sock)
            connection.sock.close()
            return
        data = self._request(self.issued)
        self.issued += 1
        connection.reset(time.perf_counter())
        # A request is a few hundred bytes: a fresh socket's buffer takes it whole.
        sent = connection.sock.send(data)
        if sent != len(data):
            raise ProtocolError(f"sent {sent} of {len(data)} bytes")

    def run(self) -> dict[str, Any]:
        cpu0 = os.times()
        started = time.perf_counter()
        deadline = started + self.timeout_s
        for _ in range(min(self.concurrency, self.requests)):
            self._send_next(self._connect())
        while self.completed < self.requests:
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"{self.completed} of {self.requests} requests answered in {self.timeout_s} s"
                )
            for key, _ in self.selector.select(timeout=1.0):
                connection: Connection = key.data
                data = connection.sock.recv(262144)
                now = time.perf_counter()
                self.recvs += 1
                if not data:
                    raise ProtocolError("the server closed a connection mid-response")
                if self._feed(connection, data, now):
                    self._finish(connection, now)
        wall = time.perf_counter() - started
        cpu1 = os.times()
        self.selector.close()
        return self._report(wall, (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system))

    def _feed(self, c: Connection, data: bytes, now: float) -> bool:
        """Take ``data``; whether the response is complete."""
        buffer = c.buffer
        buffer += data
        if not c.head_done:
            end = buffer.find(_HEAD_END)
            if end < 0:
                return False
            head = bytes(buffer[:end]).lower()
            if not head.startswith((b"http/1.1 200", b"http/1.0 200")):
                status = bytes(buffer[: buffer.find(b"\r\n")])
                raise ProtocolError(f"the server answered {status!r}")
            c.chunked = b"transfer-encoding: chunked" in head
            if not c.chunked:
                found = re.search(rb"content-length:\s*(\d+)", head)
                if found is None:
                    raise ProtocolError(f"neither chunked nor a length: {head!r}")
                c.length = int(found.group(1))
            c.close_after = b"connection: close" in head
            del buffer[: end + len(_HEAD_END)]
            c.head_done = True
        if not c.chunked:
            return len(buffer) >= c.length
        # Whole chunks only: "<hex size>[;ext]\r\n<data>\r\n"; the last is "0\r\n\r\n".
        payload = bytearray()
        position, complete = 0, False
        while True:
            line_end = buffer.find(b"\r\n", position)
            if line_end < 0:
                break
            size = int(bytes(buffer[position:line_end]).split(b";", 1)[0], 16)
            if size == 0:
                if len(buffer) >= line_end + 4:  # no trailers
                    complete = True
                    position = line_end + 4
                break
            start = line_end + 2
            if len(buffer) < start + size + 2:
                break
            payload += buffer[start : start + size]
            position = start + size + 2
        del buffer[:position]
        if payload:
            self._events(c, bytes(payload), now)
        return complete

    def _events(self, c: Connection, payload: bytes, now: float) -> None:
        """SSE data that arrived at ``now`` (whole events: servers never split one
        across chunks)."""
        tokens = 0
        for match in _TEXT.finditer(payload):
            count = len(json.loads(match.group(1)))
            c.events += 1
            if count == 0:
                c.empty_events += 1
            tokens += count
        if _DONE in payload:
            c.done_stream = True
        usage = _COMPLETION_TOKENS.search(payload)
        if usage is not None:
            c.usage_tokens = int(usage.group(1))
        if tokens:
            self.arrivals += 1
            if c.ttft < 0:
                c.ttft = now - c.sent
            else:
                self.itl.append((now - c.previous) / tokens)
                self.itl_weights.append(tokens)
            c.previous = now
            c.text_tokens += tokens

    def _finish(self, c: Connection, now: float) -> None:
        self.completed += 1
        self.latencies.append(now - c.sent)
        if self.stream:
            if not c.done_stream:
                raise ProtocolError("a stream ended without data: [DONE]")
            if c.ttft >= 0:
                self.ttfts.append(c.ttft)
            self.events += c.events
            self.empty_events += c.empty_events
            self.text_tokens += c.text_tokens
        else:
            if not c.chunked:  # a chunked body went through _events already
                usage = _COMPLETION_TOKENS.search(c.buffer)
                c.usage_tokens = int(usage.group(1)) if usage else -1
                found = _TEXT.search(c.buffer)
                c.text_tokens = len(json.loads(found.group(1))) if found else 0
            self.text_tokens += c.text_tokens
        if c.usage_tokens < 0:
            self.missing_usage += 1
        else:
            self.usage_tokens += c.usage_tokens
            if c.usage_tokens != c.text_tokens:
                self.mismatched += 1
        if c.close_after:
            self.selector.unregister(c.sock)
            c.sock.close()
            if self.issued < self.requests:
                self._send_next(self._connect())
            return
        self._send_next(c)

    def _report(self, wall: float, cpu: float) -> dict[str, Any]:
        tokens = self.usage_tokens if not self.missing_usage else self.text_tokens
        return {
            "requests": self.completed,
            "wall_s": wall,
            "output_tokens": tokens,
            "usage_tokens": self.usage_tokens,
            "text_tokens": self.text_tokens,
            "missing_usage": self.missing_usage,
            "text_usage_mismatches": self.mismatched,
            "events": self.events,
            "empty_events": self.empty_events,
            "arrivals": self.arrivals,
            "recvs": self.recvs,
            "ttft_p50_s": percentile(self.ttfts, 0.5),
            "ttft_p99_s": percentile(self.ttfts, 0.99),
            "latency_p50_s": percentile(self.latencies, 0.5),
            "latency_p99_s": percentile(self.latencies, 0.99),
            "itl_p50_s": weighted_percentile(self.itl, self.itl_weights, 0.5),
            "itl_p99_s": weighted_percentile(self.itl, self.itl_weights, 0.99),
            "load_cpu_s": cpu,
        }


def main() -> int:
    gc.collect()
    gc.freeze()
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        gc.disable()
        try:
            report = Load(spec).run()
        except (OSError, ProtocolError, TimeoutError, ValueError) as exc:
            report = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            gc.enable()
            gc.collect()
        print("@" + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

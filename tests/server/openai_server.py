"""The OpenAI server as a program, for its end-to-end tests.

:func:`launch` runs ``python -m trio_enginecore api-server --port 0 OPTIONS`` on the
loopback interface, its stderr (logs and the one line saying where it serves) in a
file, and waits for that line; a :class:`Fleet` starts several at once.
:class:`ApiServer` knows its URL, its process and its engines (the server's child
processes, found in ``/proc`` with their data-parallel rank), and stops it: SIGTERM,
then SIGKILL if it does not go; no engine may be left. :func:`sse_stream` reads a
stream event by event, and leaves it by closing its connection.

The helpers the tests share read what the server answers: Server-Sent Events
(:func:`sse_data`), OpenAI-style error bodies (:func:`assert_openai_error`), Prometheus
samples (:func:`samples`), and how busy a process is (:func:`cpu_ticks`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import h11
import trio
from prometheus_client.parser import text_string_to_metric_families

MODEL: Final = "ngram"
"""The name the default server serves its model under (the built-in one's)."""

READY: Final = re.compile(
    r"^trio-enginecore api-server: serving '(?P<name>[^']*)' on "
    r"http://(?P<host>[0-9.]+):(?P<port>[0-9]+)$",
    re.MULTILINE,
)
"""The one line the server writes on stderr when it serves."""

_PR_SET_PDEATHSIG: Final = 1


@dataclass
class ApiServer:
    """A running ``trio-enginecore api-server``."""

    process: subprocess.Popen[bytes]
    url: str
    """``http://127.0.0.1:PORT``."""
    log_path: Path
    options: tuple[str, ...] = ()
    engines: dict[int, int] = field(default_factory=dict)
    """Each engine's pid by its data-parallel rank, as launched."""

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait for the line saying where it serves; learn its URL and engines."""
        if self.url:
            return
        deadline = time.monotonic() + timeout_s
        while (found := READY.search(self.log())) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(
                    f"api-server {' '.join(self.options)} did not start (exit code "
                    f"{self.process.returncode}); its log ends:\n{self.tail()}"
                )
            time.sleep(0.05)  # the next look at the log
        assert found["host"] == "127.0.0.1", found[0]
        self.url = f"http://127.0.0.1:{found['port']}"
        self.engines = engine_ranks(self.process.pid)

    @property
    def api(self) -> str:
        """The OpenAI client's ``base_url``."""
        return f"{self.url}/v1"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; its exit code. Then none of its
        engines may be left running."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        wait_gone(self.engines.values())
        return self.process.returncode


def start(log_path: Path, *options: str, env: dict[str, str] | None = None) -> ApiServer:
    """Start ``trio-enginecore api-server --port 0 OPTIONS`` (with ``env`` added to the
    environment); :meth:`ApiServer.wait_ready` waits until it serves.

    The server dies with the test process (``PR_SET_PDEATHSIG``) and is in a session of
    its own (a terminal's Ctrl-C is not its signal)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    command = [sys.executable, "-m", "trio_enginecore", "api-server", "--port", "0", *options]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            env=None if env is None else {**os.environ, **env},
            preexec_fn=lambda: libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0),
        )
    return ApiServer(process, "", log_path, options)


def launch(log_path: Path, *options: str) -> ApiServer:
    """Start a server and wait until it serves."""
    server = start(log_path, *options)
    server.wait_ready()
    return server


@contextmanager
def running(log_path: Path, *options: str) -> Iterator[ApiServer]:
    """A server for the duration of the block, stopped at its end."""
    server = launch(log_path, *options)
    try:
        yield server
    finally:
        server.stop()


class Fleet:
    """Servers started together (their start-up, a few seconds of CPU each, overlaps),
    each taken by the test or fixture that uses it."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._waiting: dict[str, list[ApiServer]] = {}
        self.servers: list[ApiServer] = []

    def start(self, name: str, *options: str) -> None:
        """Start one more server called ``name``."""
        log_path = self._directory / f"{name}-{len(self.servers)}.log"
        server = start(log_path, *options)
        self.servers.append(server)
        self._waiting.setdefault(name, []).append(server)

    def take(self, name: str) -> ApiServer:
        """The next server called ``name``, once it serves."""
        waiting = self._waiting.get(name)
        assert waiting, f"no server {name!r} was started"
        server = waiting.pop(0)
        server.wait_ready()
        return server

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


# ------------------------------------------------------------------ processes


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's)."""
    found: list[int] = []
    with suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with suppress(FileNotFoundError), open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(child) for child in f.read().split())
    return found


def engine_ranks(pid: int) -> dict[int, int]:
    """The engine processes among the children of ``pid``, by their ``--rank``."""
    ranks: dict[int, int] = {}
    for child in children(pid):
        with suppress(FileNotFoundError):
            arguments = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"serve" in arguments and b"--rank" in arguments:
                ranks[int(arguments[arguments.index(b"--rank") + 1])] = child
    return ranks


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has stopped running)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def cpu_ticks(pid: int) -> int:
    """The CPU time ``pid`` has used, user and system, in clock ticks."""
    fields = _stat(pid)
    assert fields is not None, f"process {pid} is gone"
    return int(fields[11]) + int(fields[12])


def wait_gone(pids: Iterable[int], timeout_s: float = 15.0) -> None:
    """Wait until none of ``pids`` runs."""
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while left := [pid for pid in pids if alive(pid)]:
        assert time.monotonic() < deadline, f"processes {left} still run"
        time.sleep(0.05)


# ------------------------------------------------------------------ what the server says


def sse_data(body: bytes) -> list[str]:
    """The ``data`` of each event of a Server-Sent Events body, checking its framing:
    each event one ``data: ...`` line and a blank line, nothing else."""
    assert body.endswith(b"\n\n"), body[-200:]
    data: list[str] = []
    for event in body[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event[:200]
        assert b"\n" not in event, event[:200]
        data.append(event[len(b"data: ") :].decode())
    return data


def sse_chunks(body: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of a whole stream, which must end with ``data: [DONE]`` (and
    have it only there)."""
    data = sse_data(body)
    assert data[-1] == "[DONE]", data[-3:]
    assert "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]


def assert_openai_error(
    body: Any, status: int, *, param: object = ..., error_type: str | None = None
) -> dict[str, Any]:
    """``body`` is an OpenAI-style error, ``{"error": {"message", "type", "param",
    "code"}}`` with ``code`` the status; ``param`` and ``error_type`` are checked when
    given. Returns the inner object."""
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict), body
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str), body
    assert error["message"], body
    assert isinstance(error["type"], str), body
    assert error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] == status, body
    if param is not ...:
        assert error["param"] == param, body
    if error_type is not None:
        assert error["type"] == error_type, body
    return error


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(exposition: str) -> Samples:
    """Every sample of a Prometheus text exposition, as a Prometheus server reads it,
    by name and labels (``_created`` samples left out: they are times)."""
    found: Samples = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in found, key
            found[key] = sample.value
    return found


def sample(found: Samples, name: str, engine: str = "0", **labels: str) -> float:
    """One sample of the default server's model (``model_name="ngram"``)."""
    return found[(name, frozenset({"model_name": MODEL, "engine": engine, **labels}.items()))]


# ------------------------------------------------------------------ streams read by hand


class SseStream:
    """A streamed ``POST`` on a connection of its own, read event by event as the
    server sends them (h11 on a Trio socket: leaving is closing the socket, and nothing
    is left half-read in a client library)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.socket = stream
        self._h11 = h11.Connection(h11.CLIENT)
        self._buffer = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.seen: list[str] = []
        """The data of every event read so far."""
        self.ended = False
        """Whether the response's body ended (its last chunk came)."""

    async def _next_h11_event(self) -> Any:
        while True:
            event = self._h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self._h11.receive_data(await self.socket.receive_some(65536))

    async def send_request(self, path: str, body: Any, headers: dict[str, str]) -> None:
        content = json.dumps(body).encode()
        fields = [
            ("host", "127.0.0.1"),
            ("content-type", "application/json"),
            ("content-length", str(len(content))),
            *headers.items(),
        ]
        request = h11.Request(method="POST", target=path, headers=fields)
        await self.socket.send_all(
            self._h11.send(request)
            + self._h11.send(h11.Data(data=content))
            + self._h11.send(h11.EndOfMessage())
        )
        response = await self._next_h11_event()
        assert isinstance(response, h11.Response), response
        self.status = response.status_code
        self.headers = {k.decode().lower(): v.decode() for k, v in response.headers}

    async def body(self) -> bytes:
        """The whole body, to its end."""
        while not self.ended:
            event = await self._next_h11_event()
            if isinstance(event, h11.Data):
                self._buffer += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self.ended = True
        return self._buffer

    async def next(self) -> str | None:
        """The next event's data; None when the body has ended.

        Raises:
            h11.RemoteProtocolError: the server closed the connection before the body's end.
            trio.BrokenResourceError: it reset the connection.
        """
        assert self.status == 200, self.status
        assert self.headers["content-type"] == "text/event-stream; charset=utf-8"
        while b"\n\n" not in self._buffer:
            if self.ended:
                assert self._buffer == b"", self._buffer[-200:]
                return None
            event = await self._next_h11_event()
            if isinstance(event, h11.Data):
                self._buffer += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self.ended = True
        event_bytes, _, self._buffer = self._buffer.partition(b"\n\n")
        assert event_bytes.startswith(b"data: "), event_bytes[:200]
        data = event_bytes[len(b"data: ") :].decode()
        self.seen.append(data)
        return data

    async def rest(self) -> list[str]:
        """Every event to the end of the stream; all events read."""
        while await self.next() is not None:
            pass
        return self.seen

    async def rest_or_cut(self) -> tuple[list[str], BaseException | None]:
        """Every event until the stream ends, or until the server cuts the connection
        (and how)."""
        try:
            await self.rest()
        except (h11.RemoteProtocolError, trio.BrokenResourceError) as exc:
            return self.seen, exc
        return self.seen, None


@asynccontextmanager
async def sse_stream(
    server: ApiServer,
    body: Any,
    *,
    path: str = "/v1/completions",
    headers: dict[str, str] | None = None,
) -> AsyncIterator[SseStream]:
    """``POST`` ``body`` on a new connection, its response's head read; the connection
    is closed at the end of the block (the client leaves, if the stream goes on)."""
    socket = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with socket:
        stream = SseStream(socket)
        await stream.send_request(path, body, headers or {})
        yield stream


async def post_json(server: ApiServer, path: str, body: Any) -> tuple[int, dict[str, str], bytes]:
    """``POST`` ``body`` as JSON on a connection of its own: the status, the header
    fields and the whole body (no client library: cheap enough for fuzzing)."""
    async with sse_stream(server, body, path=path) as exchange:
        return exchange.status, exchange.headers, await exchange.body()

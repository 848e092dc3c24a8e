"""The server of the "Serving over HTTP" tutorial, driven over real HTTP.

Each server is the tutorial program itself (``docs/tutorials/serving_http.py --serve``)
in a subprocess, with its own engine process; the tests talk to it with httpx, as a
client and a load balancer would, and read the engine's request counts from the
``/health`` endpoint the page documents.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import msgspec
import pytest
import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, make_client
from trio_enginecore.engine import NgramModel

PROGRAM = Path(__file__).resolve().parents[1] / "docs" / "tutorials" / "serving_http.py"

# httpx streams through a chain of async generators; a reader that stops early leaves
# them to the garbage collector, and Trio warns about each one. Stopping early is the
# point of the disconnect tests.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator .* was garbage collected:ResourceWarning"
)


class Server(NamedTuple):
    url: str
    engine_pid: int
    process: subprocess.Popen[str]


def start_server(*options: str) -> Server:
    process = subprocess.Popen(
        [sys.executable, str(PROGRAM), "--serve", *options],
        cwd=PROGRAM.parents[2],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.match(r"serving on (http://\S+) \(engine pid (\d+)\)", line)
    if match is None:
        process.kill()
        process.wait()
        raise AssertionError(f"the server did not start; it printed {line!r}")
    return Server(match[1], int(match[2]), process)


def stop_server(server: Server) -> tuple[int, str]:
    """SIGTERM the server (a graceful shutdown); its exit status and the rest of stdout."""
    server.process.send_signal(signal.SIGTERM)
    rest, _ = server.process.communicate(timeout=30)
    return server.process.returncode, rest


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = start_server()
    try:
        yield server
    finally:
        returncode, rest = stop_server(server)
    assert returncode == 0, rest
    assert "server stopped" in rest


@pytest.fixture(params=[()])
def doomed_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """A server of our own, whose engine a test may kill (``request.param``: the
    server's options)."""
    server = start_server(*request.param)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.communicate()


def death_logged(server: Server) -> str:
    """The line the client logs when the server's engine is killed."""
    return (
        f"ERROR trio_enginecore.client: engine rank 0, pid {server.engine_pid} died: "
        "was killed by signal 9"
    )


def parse_events(lines: list[str]) -> list[tuple[str, Any]]:
    """Server-sent events as (event name, decoded JSON data)."""
    events: list[tuple[str, Any]] = []
    name = "message"
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, msgspec.json.decode(line.removeprefix("data: "))))
            name = "message"
    return events


async def health(http: httpx.AsyncClient) -> tuple[int, Any]:
    response = await http.get("/health")
    return response.status_code, response.json()


async def wait_for_health(http: httpx.AsyncClient, status: int, **fields: Any) -> Any:
    """Poll /health until it answers ``status`` with these fields; its body."""
    while True:
        code, body = await health(http)
        if code == status and all(body.get(k) == v for k, v in fields.items()):
            return body
        await trio.sleep(0.005)


def expected_generation(prompt: str, **sampling: Any) -> list[int]:
    """What the engine generates for this request, computed without any server."""
    with make_client(EngineConfig(model="ngram"), multiprocess=False) as client:
        client.add_request(EngineCoreRequest.for_tokens(NgramModel().tokenize(prompt), **sampling))
        token_ids: list[int] = []
        while True:
            for output in client.get_output().outputs:
                token_ids.extend(output.new_token_ids)
                if output.finished:
                    return token_ids


LONG = {"prompt": "The river", "max_tokens": 4000, "ignore_eos": True}


async def test_streams_a_generation_to_the_end(server: Server) -> None:
    body = {"prompt": "The river", "max_tokens": 80, "temperature": 0.5, "seed": 1}
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        http.stream("POST", "/generate", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        lines = [line async for line in response.aiter_lines()]
    events = parse_events(lines)
    *tokens, (last_name, last) = events
    assert last_name == "finish"
    assert last == {"finish_reason": "length", "num_tokens": 80}
    assert tokens
    assert all(name == "message" for name, _ in tokens)
    token_ids = [t for _, data in tokens for t in data["token_ids"]]
    expected = expected_generation("The river", max_tokens=80, temperature=0.5, seed=1)
    assert token_ids == expected
    assert "".join(data["text"] for _, data in tokens) == NgramModel().detokenize(expected)


async def test_a_client_that_disconnects_gets_its_request_aborted(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        assert await health(http) == (200, {"status": "ok", "waiting": 0, "running": 0})
        events = 0
        async with http.stream("POST", "/generate", json=LONG) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 3:
                        assert await health(http) == (
                            200,
                            {"status": "ok", "waiting": 0, "running": 1},
                        )
                        break
        # Leaving the block closed the connection with the response unfinished.
        with trio.fail_after(1):
            await wait_for_health(http, 200, waiting=0, running=0)

        # The server goes on serving: the next request streams to the end.
        async with http.stream("POST", "/generate", json={"prompt": "A", "max_tokens": 5}) as r:
            events_after = parse_events([line async for line in r.aiter_lines()])
        assert events_after[-1] == ("finish", {"finish_reason": "length", "num_tokens": 5})


async def test_many_clients_that_disconnect_leave_nothing_running(server: Server) -> None:
    async def read_then_leave(http: httpx.AsyncClient, events_to_read: int) -> None:
        async with http.stream("POST", "/generate", json=LONG) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == events_to_read:
                    break

    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        async with trio.open_nursery() as nursery:
            for n in range(8):
                nursery.start_soon(read_then_leave, http, 1 + n % 4)
        with trio.fail_after(1):
            await wait_for_health(http, 200, waiting=0, running=0)


async def test_a_request_the_engine_rejects_gets_a_400(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        response = await http.post("/generate", json={"prompt": ""})  # no token at all
        assert response.status_code == 400
        assert "invalid_request" in response.json()["error"]
        response = await http.post("/generate", json={"prompt": "x", "max_tokens": 0})
        assert response.status_code == 400  # refused by the server's own validation
        response = await http.post("/generate", content=b"not json")
        assert response.status_code == 400
        assert (await http.get("/nowhere")).status_code == 404
        assert await health(http) == (200, {"status": "ok", "waiting": 0, "running": 0})


async def test_health_answers_503_once_the_engine_is_killed(doomed_server: Server) -> None:
    server = doomed_server
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        code, _ = await health(http)
        assert code == 200
        async with http.stream("POST", "/generate", json=LONG) as response:
            lines: list[str] = []
            async for line in response.aiter_lines():
                lines.append(line)
                if len(lines) == 2:  # the first event and its blank line
                    os.kill(server.engine_pid, signal.SIGKILL)
        # The stream that was running ends with an error event.
        name, data = parse_events(lines)[-1]
        assert name == "error"
        assert "killed by signal 9" in data["error"]

        with trio.fail_after(5):
            body = await wait_for_health(http, 503)
        assert body["status"] == "dead"
        assert "killed by signal 9" in body["error"]
        response = await http.post("/generate", json={"prompt": "The river"})
        assert response.status_code == 503
        assert (await http.get("/health")).status_code == 503  # and it stays so

    # Stopping it reports the engine's death, with a failing exit status; the client
    # had logged the death already (the program configures logging, to stdout).
    returncode, rest = stop_server(server)
    assert returncode == 1, rest
    assert "raised EngineDeadError" in rest
    assert death_logged(server) in rest


@pytest.mark.parametrize("doomed_server", [("--on-engine-death", "stop")], indirect=True)
async def test_with_cancel_on_failure_the_server_stops_by_itself_when_the_engine_dies(
    doomed_server: Server,
) -> None:
    server = doomed_server
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        assert (await health(http))[0] == 200
        os.kill(server.engine_pid, signal.SIGKILL)
        # No SIGTERM from us: the client cancels the block's body, the HTTP server
        # shuts down, and the program exits with the one EngineDeadError.
        with trio.fail_after(15):
            while server.process.poll() is None:
                await trio.sleep(0.05)
        with pytest.raises(httpx.ConnectError):
            await http.get("/health")
    rest, _ = server.process.communicate(timeout=30)
    assert server.process.returncode == 1, rest
    assert "raised EngineDeadError" in rest
    assert "killed by signal 9" in rest


@pytest.mark.parametrize("doomed_server", [("--on-engine-death", "restart")], indirect=True)
async def test_with_the_restart_policy_the_server_serves_on_after_the_engine_is_killed(
    doomed_server: Server,
) -> None:
    server = doomed_server
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        async with http.stream("POST", "/generate", json=LONG) as response:
            lines: list[str] = []
            async for line in response.aiter_lines():
                lines.append(line)
                if len(lines) == 2:
                    os.kill(server.engine_pid, signal.SIGKILL)
        name, data = parse_events(lines)[-1]
        assert name == "error"
        assert "killed by signal 9" in data["error"]
        with trio.fail_after(20):
            body = await wait_for_health(http, 200)
        assert body["status"] == "ok"
        response = await http.post("/generate", json={"prompt": "The river", "max_tokens": 5})
        assert response.status_code == 200
        events = parse_events(response.text.splitlines())
        assert events[-1][0] != "error"
    returncode, rest = stop_server(server)
    assert returncode == 0, rest
    assert "server stopped" in rest
    # The program configures logging (to stdout), so the death and the restart the
    # client logs are in its output, in that order.
    died = rest.find(death_logged(server))
    assert died >= 0, rest
    restarting = rest.find(
        f"WARNING trio_enginecore.client: restarting engine rank 0, pid {server.engine_pid}"
    )
    assert restarting > died, rest
    back = re.search(
        r"WARNING trio_enginecore\.client: engine rank 0, pid (\d+) is back in service "
        r"\(restart 1\)",
        rest,
    )
    assert back is not None, rest
    assert back.start() > restarting, rest
    assert int(back[1]) != server.engine_pid, rest  # a new process

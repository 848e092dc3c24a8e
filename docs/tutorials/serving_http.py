"""Serving over HTTP: token streams as server-sent events, on hypercorn's Trio worker.

With no arguments the program demonstrates itself: it starts the server, drives it with
an HTTP client, and stops. With --serve it serves until Ctrl-C (or SIGTERM):

    python docs/tutorials/serving_http.py --serve --port 8000
"""

import argparse
import codecs
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any, cast

import httpx
import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.typing import ASGIFramework

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    RequestFailedError,
    TrioMPClient,
    open_engine_client,
)
from trio_enginecore.engine import NgramModel

# The built-in language model at a pace you can watch: a token per request every 10 ms.
ENGINE = EngineConfig(model="ngram", step_time_s=0.01)
TOKENIZER = NgramModel()
HEALTH_TIMEOUT_S = 1.0
MAX_BODY_BYTES = 64 * 1024
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

# ASGI, by hand: a scope and messages are dicts; receive() and send() move messages.
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Message, Receive, Send], Awaitable[None]]


class GenerateParams(msgspec.Struct, forbid_unknown_fields=True):
    """The JSON body of POST /generate."""

    prompt: str
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    seed: int | None = None
    ignore_eos: bool = False


class TokenEvent(msgspec.Struct):
    token_ids: list[int]
    text: str


class FinishEvent(msgspec.Struct):
    finish_reason: str
    num_tokens: int


class ErrorEvent(msgspec.Struct):
    error: str


# ------------------------------------------------------------------ the application


def make_app(client: TrioMPClient) -> App:
    """The ASGI application: POST /generate and GET /health, served by one client."""

    async def app(scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
        elif scope["type"] != "http":
            return  # no websockets here
        elif scope["path"] == "/generate" and scope["method"] == "POST":
            await generate(client, receive, send)
        elif scope["path"] == "/health" and scope["method"] in ("GET", "HEAD"):
            status, body = await engine_health(client)
            await respond_json(send, status, body)
        else:
            await respond_json(send, 404, {"error": "not found"})

    return app


async def lifespan(receive: Receive, send: Send) -> None:
    # The engine client is opened around the whole server (see serve_until_stopped),
    # so there is nothing to start or stop here; answering tells the server so.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def engine_health(client: TrioMPClient) -> tuple[int, Message]:
    """200 if the engine answers a call within HEALTH_TIMEOUT_S, else 503."""
    try:
        with trio.fail_after(HEALTH_TIMEOUT_S):
            waiting, running = await client.get_request_counts()
    except EngineDeadError as exc:
        # The process died or reported a fatal error: client.is_dead is True, and
        # every later call fails like this one, at once.
        return 503, {"status": "dead", "error": str(exc)}
    except trio.TooSlowError:
        # Alive, as far as the client knows, but not answering: as bad for a caller.
        return 503, {"status": "unresponsive", "error": "the engine did not answer in time"}
    return 200, {"status": "ok", "waiting": waiting, "running": running}


async def generate(client: TrioMPClient, receive: Receive, send: Send) -> None:
    body = await read_body(receive)
    if body is None:
        return  # the client left before it finished sending its request
    if len(body) > MAX_BODY_BYTES:
        await respond_json(send, 413, {"error": f"the body is over {MAX_BODY_BYTES} bytes"})
        return
    try:
        params = msgspec.json.decode(body, type=GenerateParams)
    except msgspec.DecodeError as exc:  # not JSON, or not what GenerateParams says
        await respond_json(send, 400, {"error": str(exc)})
        return
    request = EngineCoreRequest.for_tokens(
        TOKENIZER.tokenize(params.prompt),
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
    )
    async with trio.open_nursery() as nursery:
        # hypercorn does not cancel a handler whose client went away: it delivers
        # http.disconnect to receive(). This task turns that into a cancellation.
        nursery.start_soon(cancel_on_disconnect, receive, nursery.cancel_scope)
        await stream_events(client, request, send)
        nursery.cancel_scope.cancel()  # the response is complete: stop watching


async def read_body(receive: Receive) -> bytes | None:
    """The request body (stopping once it is over MAX_BODY_BYTES), or None on disconnect."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk: bytes = message.get("body", b"")
        body += chunk
        if not message.get("more_body", False) or len(body) > MAX_BODY_BYTES:
            return body


async def cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def stream_events(client: TrioMPClient, request: EngineCoreRequest, send: Send) -> None:
    """Stream the request's outputs as server-sent events, one per engine output."""
    started = False
    num_tokens = 0
    # The ngram tokenizer is UTF-8, one token per byte: decode incrementally, so that a
    # character split across two outputs comes out whole.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        async with client.stream(request) as outputs:
            async for output in outputs:
                if not started:
                    # The status line waits for the first output, so that a request
                    # the engine rejects still gets a 4xx status.
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
                    )
                    started = True
                ids = output.new_token_ids
                if ids:
                    num_tokens += len(ids)
                    text = decoder.decode(bytes(t for t in ids if t != TOKENIZER.eos_token_id))
                    await send_event(send, TokenEvent(ids, text))
                if output.finish_reason is not None:
                    finish = FinishEvent(str(output.finish_reason), num_tokens)
                    await send_event(send, finish, event="finish")
    except (RequestFailedError, EngineDeadError) as exc:
        # Rejected by the engine (its message says why), or the engine died.
        if not started:
            retry_later = isinstance(exc, EngineDeadError) or exc.retryable
            await respond_json(send, 503 if retry_later else 400, {"error": str(exc)})
            return
        await send_event(send, ErrorEvent(str(exc)), event="error")
    except OSError:
        # Some ASGI servers raise from send() once the client is gone (hypercorn
        # does not). Leaving the stream's block has aborted the request.
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_event(send: Send, data: msgspec.Struct, *, event: str | None = None) -> None:
    frame = b"" if event is None else f"event: {event}\n".encode()
    frame += b"data: " + msgspec.json.encode(data) + b"\n\n"
    await send({"type": "http.response.body", "body": frame, "more_body": True})


async def respond_json(send: Send, status: int, body: Message) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": msgspec.json.encode(body) + b"\n"})


# ----------------------------------------------------------------------- the server


@asynccontextmanager
async def http_server(client: TrioMPClient, port: int) -> AsyncIterator[str]:
    """Serve make_app(client) on 127.0.0.1:port (0: any free port) and give its URL.

    Leaving the block shuts the server down gracefully: it stops accepting, lets
    running responses finish for config.graceful_timeout, then cancels them.
    """
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    # hypercorn's errors go through the program's logging too, not a handler of its own.
    config.errorlog = logging.getLogger("hypercorn.error")
    # hypercorn types ASGI messages as TypedDicts; ours are plain dicts.
    app = cast(ASGIFramework, make_app(client))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(
            partial(serve, app, config, shutdown_trigger=stop.wait)
        )
        try:
            yield urls[0]
        finally:
            stop.set()


async def serve_until_stopped(port: int, *, on_death: str = "answer-503") -> None:
    # What the server does when its engine dies: keep answering 503 until stopped (the
    # default), stop at once (the client cancels this block's body), or have the
    # client restart the engine and serve on.
    async with (
        open_engine_client(
            ENGINE,
            cancel_on_failure=on_death == "stop",
            on_engine_failure="restart" if on_death == "restart" else "fail",
        ) as client,
        http_server(client, port) as url,
    ):
        print(f"serving on {url} (engine pid {client.engine_pids[0]}); Ctrl-C stops it")
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                print(f"{signal.Signals(signum).name}: shutting down")
                break
    print("server stopped")


# ------------------------------------------------------------------------- the demo


async def demo(port: int) -> None:
    async with (
        open_engine_client(ENGINE) as client,
        http_server(client, port) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        pid = client.engine_pids[0]
        assert pid is not None
        print(f"serving on {url} (engine pid {pid})")
        await stream_to_the_end(http)
        await disconnect_mid_stream(http)
        await kill_the_engine(http, pid)


async def stream_to_the_end(http: httpx.AsyncClient) -> None:
    print("1. POST /generate, streamed to the end")
    body = {"prompt": "The river", "max_tokens": 80, "temperature": 0.5, "seed": 1}
    text = ""
    async with http.stream("POST", "/generate", json=body) as response:
        print(f"   {response.status_code} {response.headers['content-type']}")
        event = "message"
        # Each event is an optional "event:" line, one "data:" line and a blank line.
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
                if event == "message":
                    if not text:
                        print(f"   first event: {data}")
                    text += msgspec.json.decode(data)["text"]
                else:
                    print(f"   {event} event: {data}")
                event = "message"
    print(f"   text: {body['prompt']}{text}")


async def disconnect_mid_stream(http: httpx.AsyncClient) -> None:
    print("2. a client that disconnects mid-stream")
    body = {"prompt": "The river", "max_tokens": 4000, "ignore_eos": True}
    events = 0
    async with http.stream("POST", "/generate", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if events == 1:
                    print(f"   while streaming, GET /health: {show(await http.get('/health'))}")
                if events == 5:
                    break
    # Leaving the block closed the connection, mid-response.
    print(f"   read {events} events, then closed the connection")
    # The server learns of it from its socket, and aborts the request.
    health = await poll_health(http, lambda r: r.json()["running"] == 0, timeout_s=1)
    print(f"   the engine has dropped the request: GET /health: {show(health)}")


async def kill_the_engine(http: httpx.AsyncClient, pid: int) -> None:
    print("3. the engine process is killed")
    os.kill(pid, signal.SIGKILL)
    health = await poll_health(http, lambda r: r.status_code != 200, timeout_s=5)
    print(f"   GET /health: {show(health)}")
    response = await http.post("/generate", json={"prompt": "The river"})
    print(f"   POST /generate: {show(response)}")


async def poll_health(
    http: httpx.AsyncClient, done: Callable[[httpx.Response], bool], *, timeout_s: float
) -> httpx.Response:
    """GET /health until done(response), for timeout_s at most."""
    with trio.fail_after(timeout_s):
        while True:
            response = await http.get("/health")
            if done(response):
                return response
            await trio.sleep(0.01)


def show(response: httpx.Response) -> str:
    return f"{response.status_code} {response.text.strip()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="serve until Ctrl-C")
    parser.add_argument("--port", type=int, default=0, help="default: any free port")
    parser.add_argument(
        "--on-engine-death",
        choices=["answer-503", "stop", "restart"],
        default="answer-503",
        help="with --serve: what to do when the engine dies (default: answer-503)",
    )
    args = parser.parse_args()
    # The client logs an engine's death and restart on the "trio_enginecore.client"
    # logger, and the package adds no handler: without this line nothing shows.
    logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.serve:
            trio.run(partial(serve_until_stopped, args.port, on_death=args.on_engine_death))
        else:
            trio.run(demo, args.port)
    except EngineDeadError as exc:
        # The block did not raise, but the engine died while it ran: reported here.
        print(f"leaving the engine client's block raised EngineDeadError: {exc}")
        if args.serve:
            sys.exit(1)


if __name__ == "__main__":
    main()

"""Our client, started by a vLLM supervisor with the listeners vLLM bound for it.

Run in the project's environment by ``vllm_side/launch_bound_listeners.py`` as
``python listener_client.py INPUT_FD OUTPUT_FD``, the two descriptors inherited: vLLM's
``make_zmq_listener`` sockets for the client's input ROUTER and output PULL. It reads
the addresses they are bound to, opens the client on them
(``ListenerFd``, attach mode: vLLM's supervisor starts the engine), runs 8 concurrent
streams to the end and prints one report line, ``@{json}``, on stdout: the addresses,
what vLLM's ready message said, each request's tokens and finish reason, and whether
the descriptor numbers were handed over (no longer the listening sockets) once the
client was open. Failures go to stderr as a traceback, with a non-zero exit code.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, ListenerFd, open_engine_client


def requests() -> list[EngineCoreRequest]:
    """The 8 requests, run concurrently: odd ones end on ``max_tokens``, even ones on a
    stop token id (the counter model's next token is the last one plus one)."""
    plan = []
    for i in range(8):
        prompt = [300 + 40 * i, 301 + 40 * i]
        if i % 2:
            request = EngineCoreRequest.for_tokens(
                prompt, request_id=f"length-{i}", max_tokens=10 + 3 * i
            )
        else:
            request = EngineCoreRequest.for_tokens(
                prompt, request_id=f"stop-{i}", max_tokens=100, stop_token_ids=[prompt[-1] + 4 + i]
            )
        plan.append(request)
    return plan


def identity(fd: int) -> tuple[int, int] | None:
    """The file ``fd`` refers to now (device, inode), or None if it is not open."""
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino


async def main(input_fd: int, output_fd: int) -> dict[str, Any]:
    listeners = ListenerFd(input_fd), ListenerFd(output_fd)
    addresses = [listener.address() for listener in listeners]
    before = [identity(fd) for fd in (input_fd, output_fd)]
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    start = time.monotonic()
    with trio.fail_after(150):
        async with open_engine_client(
            EngineConfig(),
            input_address=listeners[0],
            output_address=listeners[1],
            ready_timeout_s=90,
        ) as client:
            ready_s = time.monotonic() - start
            after = [identity(fd) for fd in (input_fd, output_fd)]
            handed_over = [now != was for now, was in zip(after, before, strict=True)]
            ready = client.engines[0]
            assert ready is not None

            async def one(request: EngineCoreRequest) -> None:
                received: list[int] = []
                reason = None
                async with client.stream(request) as outputs:
                    async for output in outputs:
                        received += output.new_token_ids
                        reason = output.finish_reason
                tokens[request.request_id] = received
                finish[request.request_id] = None if reason is None else reason.name

            streams_start = time.monotonic()
            async with trio.open_nursery() as nursery:
                for request in requests():
                    nursery.start_soon(one, request)
            streams_s = time.monotonic() - streams_start
            in_flight = client.statistics().requests_in_flight
    return {
        "addresses": addresses,
        "handed_over": handed_over,
        "vllm_version": ready.vllm_version,
        "max_model_len": ready.max_model_len,
        "tokens": tokens,
        "finish": finish,
        "requests_in_flight": in_flight,
        "ready_s": ready_s,
        "streams_s": streams_s,
    }


if __name__ == "__main__":
    input_fd, output_fd = map(int, sys.argv[1:3])
    report = trio.run(main, input_fd, output_fd)
    print("@" + json.dumps(report), flush=True)

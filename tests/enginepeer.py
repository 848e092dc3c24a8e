"""A minimal client-side peer for driving a real engine process in tests.

It binds what a vLLM frontend binds (ROUTER for requests, PULL for outputs, and a
handshake ROUTER when asked), starts ``trio-enginecore serve`` as a subprocess, and
speaks the wire protocol with our codec: no engine-client code involved, so these tests
check the engine on its own.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
import zmq

from trio_enginecore._zmq import TrioSocket, make_socket
from trio_enginecore.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeMessage,
    HandshakeReady,
    UtilityOutput,
    UtilityRequest,
)
from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder

RANK0 = (0).to_bytes(2, "little")


def make_request(
    request_id: str,
    prompt: Sequence[int] = (1,),
    *,
    client_index: int = 0,
    **sampling: Any,
) -> EngineCoreRequest:
    sampling.setdefault("max_tokens", 8)
    request = EngineCoreRequest.for_tokens(prompt, request_id=request_id, **sampling)
    # This peer plays the client: stamping the index is the client's job.
    request.client_index = client_index
    return request


class EngineDied(Exception):
    """The engine sent ENGINE_CORE_DEAD."""


class EnginePeer:
    def __init__(self, router: TrioSocket, pull: TrioSocket) -> None:
        self.router = router
        self.pull = pull
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.process: trio.Process | None = None
        self.ready: EngineCoreReadyResponse | None = None
        self.handshake_messages: list[Any] = []
        self._call_id = 1000
        self.stray: list[EngineCoreOutputs] = []

    async def send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        await self.send_raw([request_type.value, *self.encoder.encode(payload)])

    async def send_raw(self, frames: Sequence[bytes | memoryview]) -> None:
        await self.router.send_multipart([RANK0, *frames])

    async def add(self, request: EngineCoreRequest) -> None:
        await self.send(EngineCoreRequestType.ADD, request)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.send(EngineCoreRequestType.ABORT, list(request_ids))

    async def receive(self) -> list[EngineCoreOutputs]:
        """The next batch of output messages (at least one)."""
        batch = []
        for frames in await self.pull.drain():
            if len(frames) == 1 and bytes(frames[0]) == ENGINE_CORE_DEAD:
                raise EngineDied
            batch.append(self.decoder.decode(frames))
        return batch

    async def call(self, method: str, *args: Any) -> UtilityOutput:
        """Call a utility; step outputs that arrive meanwhile go to ``self.stray``."""
        self._call_id += 1
        call_id = self._call_id
        await self.send(EngineCoreRequestType.UTILITY, UtilityRequest(0, call_id, method, args))
        while True:
            for outputs in await self.receive():
                reply = outputs.utility_output
                if reply is not None and reply.call_id == call_id:
                    return reply
                self.stray.append(outputs)

    async def collect(
        self, request_ids: set[str], *, into: dict[str, list[EngineCoreOutput]] | None = None
    ) -> dict[str, list[EngineCoreOutput]]:
        """Receive until every request in ``request_ids`` has finished."""
        results: dict[str, list[EngineCoreOutput]] = into if into is not None else {}
        pending = set(request_ids)
        backlog = [o for o in self.stray if o.utility_output is None]
        self.stray = [o for o in self.stray if o.utility_output is not None]
        while pending:
            batch = backlog or await self.receive()
            backlog = []
            for outputs in batch:
                if outputs.utility_output is not None:
                    self.stray.append(outputs)
                for output in outputs.outputs:
                    results.setdefault(output.request_id, []).append(output)
                    if output.finish_reason is not None:
                        pending.discard(output.request_id)
        return results


def tokens_of(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "trio_enginecore", "serve", "--log-level", "WARNING", *args]


@asynccontextmanager
async def running_engine(
    *engine_args: str, handshake: bool = False, wait_ready: bool = True
) -> AsyncIterator[EnginePeer]:
    """Bind the client-side sockets, start an engine process, wait for its ready message.

    On exit the engine gets SIGTERM (then SIGKILL after 5 s) and is always reaped.
    """
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    ctx: zmq.Context[Any] = zmq.Context()
    router = make_socket(ctx, zmq.ROUTER)
    pull = make_socket(ctx, zmq.PULL)
    handshake_sock = make_socket(ctx, zmq.ROUTER) if handshake else None
    try:
        input_address = router.bind(f"ipc://{tmp}/input")
        output_address = pull.bind(f"ipc://{tmp}/output")
        peer = EnginePeer(router, pull)
        if handshake_sock is not None:
            where = ["--handshake-address", handshake_sock.bind(f"ipc://{tmp}/handshake")]
        else:
            where = ["--input-address", input_address, "--output-address", output_address]
        async with trio.open_nursery() as nursery:
            command = serve_command(*where, *engine_args)
            peer.process = await nursery.start(partial(trio.run_process, command, check=False))
            try:
                with trio.fail_after(20):
                    if handshake_sock is not None:
                        await _do_handshake(peer, handshake_sock, input_address, output_address)
                    if wait_ready:
                        identity, payload = await router.recv_multipart()
                        assert identity == RANK0
                        peer.ready = MsgpackDecoder(EngineCoreReadyResponse).decode(payload)
                    if handshake_sock is not None and wait_ready:
                        frames = await handshake_sock.recv_multipart()
                        ready = MsgpackDecoder(HandshakeMessage).decode(frames[1:])
                        assert isinstance(ready, HandshakeReady)
                        peer.handshake_messages.append(ready)
                yield peer
            finally:
                if peer.process.returncode is None:
                    peer.process.send_signal(signal.SIGTERM)
                with trio.move_on_after(5):
                    await peer.process.wait()
                if peer.process.returncode is None:
                    peer.process.kill()
    finally:
        for sock in (router, pull, handshake_sock):
            if sock is not None:
                sock.close()
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)


async def _do_handshake(
    peer: EnginePeer, sock: TrioSocket, input_address: str, output_address: str
) -> None:
    identity, payload = await sock.recv_multipart()
    assert identity == RANK0
    hello = MsgpackDecoder(HandshakeMessage).decode(payload)
    peer.handshake_messages.append(hello)
    metadata = EngineHandshakeMetadata(
        addresses=EngineZmqAddresses(inputs=[input_address], outputs=[output_address])
    )
    await sock.send_multipart([identity, *MsgpackEncoder().encode(metadata)])

"""TrioMPClient: the engine-core client for engines in other processes.

One nursery per client holds every background task:

* the **receive task** drains the output (PULL) socket in batches, decodes each
  message once, resolves utility replies, merges stream outputs into their streams'
  collectors and hands the rest to :meth:`TrioMPClient.get_output` through a bounded,
  merging buffer. It never waits for a reader, and there is no checkpoint between
  taking a message off the socket and handing it over, so no message is ever lost to
  cancellation;
* per launched engine, a **watcher** that turns an exit nobody asked for into
  :class:`~trio_enginecore.errors.EngineDeadError` for every waiter, and a task keeping
  the tail of the engine's stderr for error messages.

Requests are sent from the caller's task (non-blocking multipart sends are atomic).
"""

from __future__ import annotations

import collections
import logging
import math
import secrets
import shutil
from collections.abc import AsyncGenerator, Iterable
from contextlib import asynccontextmanager
from typing import Any, Final, Literal, TypeVar, final

import attrs
import msgspec
import trio
import zmq

from .._zmq import Frames, TrioSocket, make_socket
from ..config import EngineConfig
from ..errors import EngineDeadError, EngineStartupError, ProtocolError, UtilityCallError
from ..protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHandshakeMetadata,
    EngineZmqAddresses,
    HandshakeHello,
    HandshakeMessage,
    HandshakeReady,
    LoRARequest,
    UtilityOutput,
    UtilityRequest,
)
from ..serial import MsgpackDecoder, MsgpackEncoder
from ._collector import BatchCollector
from ._launch import EngineHandle, engine_command, private_ipc_dir, start_engine_process
from ._stream import RequestStream

__all__ = ["ClientStatistics", "TrioMPClient"]

logger = logging.getLogger("trio_enginecore.client")

T = TypeVar("T")

_ADD: Final = EngineCoreRequestType.ADD.value
_ABORT: Final = EngineCoreRequestType.ABORT.value
_UTILITY: Final = EngineCoreRequestType.UTILITY.value
_NOTIFICATION_CALL_IDS: Final = (-1, -2)


@final
@attrs.frozen
class ClientStatistics:
    """A snapshot of a client's state, from :meth:`TrioMPClient.statistics`."""

    requests_in_flight: int
    """Requests sent and neither finished nor aborted (streams included)."""
    open_streams: int
    """Streams whose ``async with`` block has not exited."""
    pending_utility_calls: int
    """Utility calls waiting for their reply."""
    pending_batches: int
    """Engine messages waiting for :meth:`TrioMPClient.get_output`."""
    messages_received: int
    """Messages decoded from the output socket."""
    outputs_received: int
    """Per-request outputs in those messages."""
    tokens_received: int
    """New token ids in those outputs."""
    protocol_errors: int
    """Output messages dropped because they could not be decoded."""
    engines_alive: int
    """Engines that have neither died nor been shut down."""


@attrs.define(eq=False)
class _UtilityCall:
    method: str
    done: trio.Event = attrs.field(factory=trio.Event)
    reply: UtilityOutput | None = None
    failure: str | None = None


@final
class TrioMPClient:
    """A Trio client for engines running in other processes.

    Create it with :func:`trio_enginecore.open_engine_client`, which launches (or
    attaches to) the engines and returns only once they are ready; leaving the
    ``async with`` block shuts everything down.

    Every async method is a checkpoint. Unless its docstring says otherwise, it is
    atomic with respect to cancellation: it either completes or raises
    :class:`trio.Cancelled` with nothing sent and nothing changed.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        client_index: int = 0,
        max_pending_outputs: int = 64,
        abort_timeout_s: float = 1.0,
    ) -> None:
        self.config = config
        self.client_index = client_index
        self.abort_timeout_s = abort_timeout_s
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._input: TrioSocket | None = None
        self._output: TrioSocket | None = None
        self._engines: list[EngineHandle] = []
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._inflight: dict[str, EngineHandle] = {}
        self._streams: dict[str, RequestStream] = {}
        self._open_streams = 0
        self._calls: dict[int, _UtilityCall] = {}
        self._batches = BatchCollector(max_pending_outputs)
        self._batch_event = trio.Event()
        self._failure: str | None = None
        self._closing = False
        self._closed = False
        self._ipc_dir: str | None = None
        self._startup_scope: trio.CancelScope | None = None
        self._messages = 0
        self._outputs_received = 0
        self._tokens = 0
        self._protocol_errors = 0

    # ------------------------------------------------------------ public state

    @property
    def engines(self) -> tuple[EngineCoreReadyResponse | None, ...]:
        """Each engine's ready response, by rank."""
        return tuple(engine.ready for engine in self._engines)

    @property
    def engine_pids(self) -> tuple[int | None, ...]:
        """The process id of each launched engine (None for attached engines)."""
        return tuple(e.process.pid if e.process else None for e in self._engines)

    @property
    def is_dead(self) -> bool:
        """True once an engine died; every later call raises EngineDeadError."""
        return self._failure is not None

    def statistics(self) -> ClientStatistics:
        """A frozen snapshot of the client's counters."""
        return ClientStatistics(
            requests_in_flight=len(self._inflight),
            open_streams=self._open_streams,
            pending_utility_calls=len(self._calls),
            pending_batches=len(self._batches),
            messages_received=self._messages,
            outputs_received=self._outputs_received,
            tokens_received=self._tokens,
            protocol_errors=self._protocol_errors,
            engines_alive=sum(1 for e in self._engines if e.alive),
        )

    # ------------------------------------------------------------ batch API

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to the engine; its outputs arrive through :meth:`get_output`.

        Sets ``request.client_index`` to this client's index.

        Raises:
            ValueError: a request with this id is already in flight.
            EngineDeadError: the engine has died.
            trio.ClosedResourceError: the client is shutting down.
        """
        await self._send_add(request, stream=None)

    async def get_output(self) -> EngineCoreOutputs:
        """The next engine message with outputs of requests added by :meth:`add_request`.

        Outputs of streamed requests are not delivered here. If this is called less
        often than the engine steps, pending messages are merged past
        ``max_pending_outputs`` (no output is ever dropped).

        Raises:
            EngineDeadError: the engine died and no output is pending.
            trio.ClosedResourceError: the client was closed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            outputs = self._batches.take()
            if outputs is not None:
                break
            self._raise_if_unusable()
            await self._batch_event.wait()
            waited = True
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return outputs

    async def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests on the engines that have them. Unknown ids are ignored.

        The engine sends no output for a request it aborts on our behalf; a stream of
        an aborted request ends with a local ``FinishReason.ABORT`` output.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._abort_now(request_ids)
        await trio.lowlevel.cancel_shielded_checkpoint()

    # --------------------------------------------------------------- streams

    @asynccontextmanager
    async def stream(self, request: EngineCoreRequest) -> AsyncGenerator[RequestStream, None]:
        """Send ``request`` and stream its outputs.

        ::

            async with client.stream(request) as outputs:
                async for output in outputs:
                    ...

        Leaving the block before the request finished (``break``, an exception,
        cancellation) aborts it on the engine, exactly once, from a shielded scope
        bounded by ``abort_timeout_s``. Entering is atomic with respect to
        cancellation (a cancelled entry sent nothing).

        Raises:
            ValueError: a request with this id is already in flight.
            EngineDeadError: the engine has died (on entry, or from the stream).
        """
        stream = RequestStream(request.request_id, on_close=self._stream_closed)
        await self._send_add(request, stream=stream)
        self._open_streams += 1
        try:
            yield stream
        finally:
            self._open_streams -= 1
            stream._close()  # pyright: ignore[reportPrivateUsage]
            if request.request_id in self._inflight and not stream.finished:
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(self.abort_timeout_s):
                        await self.abort_requests([request.request_id])

    def _stream_closed(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    # ------------------------------------------------------------- utilities

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` on the engine and return its (untyped) result.

        Cancellation: the call's bookkeeping is undone and a late reply is dropped, but
        the engine may still have run the method; only the typed wrappers that are
        idempotent can simply be retried.

        Raises:
            UtilityCallError: the method raised on the engine; carries its message.
            EngineDeadError: the engine died before replying.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._raise_if_unusable()
        engine = self._utility_engine()
        call_id = self._new_call_id()
        call = _UtilityCall(method)
        payload = UtilityRequest(self.client_index, call_id, method, tuple(args))
        self._calls[call_id] = call
        try:
            await self._sock_in().send_multipart(
                [engine.identity, _UTILITY, *self._encoder.encode(payload)]
            )
            await call.done.wait()
        finally:
            if self._calls.pop(call_id, None) is not None and not call.done.is_set():
                logger.debug(
                    "utility call %s (%d) abandoned; a late reply is dropped", method, call_id
                )
        if call.failure is not None:
            raise EngineDeadError(call.failure)
        reply = call.reply
        assert reply is not None
        if reply.failure_message is not None:
            raise UtilityCallError(method, reply.failure_message)
        return reply.result.result if reply.result is not None else None

    async def _typed_call(self, result_type: type[T], method: str, *args: Any) -> T:
        result = await self.call_utility(method, *args)
        try:
            return msgspec.convert(result, result_type, strict=False)
        except msgspec.ValidationError as exc:
            raise ProtocolError(
                f"utility {method!r} returned {result!r}, expected {result_type}: {exc}"
            ) from exc

    async def is_sleeping(self) -> bool:
        """Whether the engine is asleep. Safe to retry after cancellation."""
        return await self._typed_call(bool, "is_sleeping")

    async def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep: it stops stepping until :meth:`wake_up`."""
        await self.call_utility("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine up after :meth:`sleep`."""
        await self.call_utility("wake_up", tags)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Clear the engine's prefix cache; False if it could not (requests running)."""
        return await self._typed_call(
            bool, "reset_prefix_cache", reset_running_requests, reset_connector
        )

    async def profile(self, is_start: bool = True) -> None:
        """Start (or stop) the engine's profiler."""
        await self.call_utility("profile", is_start)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter on the engine; False if there is no room."""
        return await self._typed_call(bool, "add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Unregister a LoRA adapter; False if it was not registered."""
        return await self._typed_call(bool, "remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        """Ids of the LoRA adapters registered on the engine."""
        return await self._typed_call(set[int], "list_loras")

    async def pin_lora(self, lora_id: int) -> bool:
        """Keep a LoRA adapter registered; False if it is not registered."""
        return await self._typed_call(bool, "pin_lora", lora_id)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """The tasks the engine serves, e.g. ``("generate",)``."""
        return await self._typed_call(tuple[str, ...], "get_supported_tasks")

    async def execute_dummy_batch(self) -> None:
        """Run the model once on a throwaway batch (a warm-up)."""
        await self.call_utility("execute_dummy_batch")

    async def set_weight_version(self, version: str | None) -> None:
        """Record the weight version the engine reports on its outputs."""
        await self.call_utility("set_weight_version", version)

    async def get_weight_version(self) -> str | None:
        """The weight version set with :meth:`set_weight_version`."""
        return await self._typed_call(str | None, "get_weight_version")  # type: ignore[arg-type]

    async def pause_scheduler(
        self, mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True
    ) -> None:
        """Pause the engine's scheduler.

        ``abort`` aborts in-flight requests (their streams end with ABORT), ``wait``
        returns once running requests finished, ``keep`` freezes them in place.
        Requests added while paused wait until :meth:`resume_scheduler`.
        """
        await self.call_utility("pause_scheduler", mode, clear_cache)

    async def resume_scheduler(self) -> None:
        """Resume the engine's scheduler after :meth:`pause_scheduler`."""
        await self.call_utility("resume_scheduler")

    async def is_scheduler_paused(self) -> bool:
        """Whether the engine's scheduler is paused."""
        return await self._typed_call(bool, "is_scheduler_paused")

    async def get_request_counts(self) -> tuple[int, int]:
        """``(waiting, running)`` request counts of the engine (for load balancing)."""
        return await self._typed_call(tuple[int, int], "get_request_counts")

    # -------------------------------------------------------------- internals

    def _sock_in(self) -> TrioSocket:
        assert self._input is not None, "the client is not started"
        return self._input

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        if self._closing:
            raise trio.ClosedResourceError("the engine client is closed")

    def _engine_for(self, request: EngineCoreRequest) -> EngineHandle:
        # The data-parallel clients override the choice; a single engine takes all.
        return self._engines[0]

    def _utility_engine(self) -> EngineHandle:
        return self._engines[0]

    def _new_call_id(self) -> int:
        while True:
            call_id = secrets.randbits(64)
            if call_id not in self._calls:
                return call_id

    async def _send_add(self, request: EngineCoreRequest, *, stream: RequestStream | None) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._raise_if_unusable()
        request_id = request.request_id
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} is already in flight")
        engine = self._engine_for(request)
        request.client_index = self.client_index
        frames = [engine.identity, _ADD, *self._encoder.encode(request)]
        # Register before sending: the reply may be received before send returns.
        self._inflight[request_id] = engine
        if stream is not None:
            self._streams[request_id] = stream
        try:
            await self._sock_in().send_multipart(frames)
        except BaseException:
            self._inflight.pop(request_id, None)
            if stream is not None:
                self._streams.pop(request_id, None)
            raise

    def _abort_now(self, request_ids: Iterable[str]) -> None:
        by_engine: dict[int, tuple[EngineHandle, list[str]]] = {}
        for request_id in request_ids:
            engine = self._inflight.get(request_id)
            if engine is not None:
                by_engine.setdefault(engine.rank, (engine, []))[1].append(request_id)
        for engine, ids in by_engine.values():
            if engine.alive and not self._closed:
                try:
                    self._sock_in().send_multipart_nowait(
                        [engine.identity, _ABORT, *self._encoder.encode(ids)]
                    )
                except trio.WouldBlock:  # pragma: no cover - a ROUTER with HWM 0 never blocks
                    logger.warning("could not send ABORT for %d request(s)", len(ids))
            for request_id in ids:
                del self._inflight[request_id]
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream._abort_locally()  # pyright: ignore[reportPrivateUsage]

    # ------------------------------------------------------- the receive task

    async def _receive_loop(self) -> None:
        sock = self._output
        assert sock is not None
        while True:
            try:
                batch = await sock.drain()
            except trio.ClosedResourceError:
                if self._closing:
                    return  # aclose() closed the socket under us: the normal way out
                raise
            for frames in batch:
                self._handle_message(frames)

    def _handle_message(self, frames: Frames) -> None:
        if len(frames) == 1 and frames[0] == ENGINE_CORE_DEAD:
            # The output socket does not tell which engine sent it; with one client per
            # engine set that is all of them (the data-parallel clients refine this).
            for engine in self._engines:
                self._engine_died(engine, "the engine reported a fatal error (ENGINE_CORE_DEAD)")
            return
        try:
            message = self._decoder.decode(frames)
        except ProtocolError as exc:
            self._protocol_errors += 1
            logger.error("dropping an undecodable output message: %s", exc)
            return
        self._messages += 1
        if message.utility_output is not None:
            self._resolve_utility(message.utility_output)
            if not message.outputs:
                return
        batch: list[EngineCoreOutput] = []
        for output in message.outputs:
            request_id = output.request_id
            self._outputs_received += 1
            self._tokens += len(output.new_token_ids)
            if request_id not in self._inflight:
                # Output of a request we aborted, produced before the abort arrived.
                continue
            if output.finish_reason is not None:
                del self._inflight[request_id]
            stream = self._streams.get(request_id)
            if stream is not None:
                stream._push(output)  # pyright: ignore[reportPrivateUsage]
                if output.finish_reason is not None:
                    del self._streams[request_id]
            else:
                batch.append(output)
        if batch or message.scheduler_stats is not None:
            if len(batch) != len(message.outputs):
                message.outputs = batch
            self._batches.put(message)
            self._wake_batch_readers()

    def _wake_batch_readers(self) -> None:
        self._batch_event.set()
        self._batch_event = trio.Event()

    def _resolve_utility(self, reply: UtilityOutput) -> None:
        if reply.call_id in _NOTIFICATION_CALL_IDS:
            logger.info("engine notification (call id %d): %r", reply.call_id, reply.result)
            return
        call = self._calls.get(reply.call_id)
        if call is None:
            logger.debug("dropping a late or unknown utility reply (call id %d)", reply.call_id)
            return
        call.reply = reply
        call.done.set()

    def _engine_died(self, engine: EngineHandle, reason: str) -> None:
        if not engine.alive:
            return
        engine.alive = False
        engine.death = reason
        if self._closing:
            return
        logger.error("%s died: %s", engine.describe(), reason)
        message = f"{engine.describe()} died: {reason}"
        if self._failure is None:
            self._failure = message
        for request_id, owner in list(self._inflight.items()):
            if owner is engine:
                del self._inflight[request_id]
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream._fail(message)  # pyright: ignore[reportPrivateUsage]
        for call in self._calls.values():
            if not call.done.is_set():
                call.failure = message
                call.done.set()
        self._wake_batch_readers()
        if self._startup_scope is not None:
            self._startup_scope.cancel()

    async def _watch_process(self, engine: EngineHandle) -> None:
        process = engine.process
        assert process is not None
        code = await process.wait()
        if not self._closing:
            with trio.move_on_after(1):
                await engine.stderr_done.wait()
            self._engine_died(engine, engine.exit_description(with_name=False))
            logger.debug("engine exit code %d", code)

    # ----------------------------------------------------------------- startup

    async def _start(
        self,
        nursery: trio.Nursery,
        *,
        input_address: str | None,
        output_address: str | None,
        ready_timeout_s: float,
    ) -> None:
        attach = input_address is not None or output_address is not None
        if attach and (input_address is None or output_address is None):
            raise ValueError("attaching needs both input_address and output_address")
        count = self.config.data_parallel_size
        self._engines = [
            EngineHandle(rank=rank, identity=rank.to_bytes(2, "little")) for rank in range(count)
        ]
        if not attach:
            self._ipc_dir = private_ipc_dir()
            input_address = f"ipc://{self._ipc_dir}/input"
            output_address = f"ipc://{self._ipc_dir}/output"
        assert input_address is not None
        assert output_address is not None
        self._input = make_socket(self._ctx, zmq.ROUTER)
        self._output = make_socket(self._ctx, zmq.PULL)
        bound_input = self._input.bind(input_address)
        bound_output = self._output.bind(output_address)
        handshake: TrioSocket | None = None
        timeout = trio.CancelScope()
        with trio.CancelScope() as scope:
            self._startup_scope = scope
            with trio.move_on_after(ready_timeout_s) as timeout:
                if not attach:
                    handshake = make_socket(self._ctx, zmq.ROUTER)
                    handshake_address = handshake.bind(f"ipc://{self._ipc_dir}/handshake")
                    for engine in self._engines:
                        config = self.config.evolve(data_parallel_rank=engine.rank)
                        await start_engine_process(
                            engine, engine_command(config, handshake_address), nursery
                        )
                        nursery.start_soon(self._watch_process, engine)
                    await self._handshake(handshake, bound_input, bound_output)
                await self._wait_ready()
                if handshake is not None:
                    await self._wait_handshake_ready(handshake)
        self._startup_scope = None
        if handshake is not None:
            handshake.close()
        if timeout.cancelled_caught or scope.cancelled_caught:
            raise await self._startup_error(ready_timeout_s, bool(timeout.cancelled_caught))
        nursery.start_soon(self._receive_loop)
        logger.info("client ready: %d engine(s) serving %r", count, self.config.model)

    async def _startup_error(self, timeout_s: float, timed_out: bool) -> EngineStartupError:
        details: list[str] = []
        for engine in self._engines:
            if engine.ready is not None and engine.alive:
                continue
            if engine.process is not None and engine.process.returncode is not None:
                with trio.move_on_after(1):
                    await engine.stderr_done.wait()
            if engine.process is not None or not engine.alive:
                details.append(engine.exit_description())
            else:
                details.append(f"engine rank {engine.rank} (attached) never sent its ready message")
        what = f"not ready within {timeout_s:g} s" if timed_out else "failed to start"
        return EngineStartupError(f"engine {what}: " + " | ".join(details))

    async def _handshake(self, sock: TrioSocket, input_address: str, output_address: str) -> None:
        decoder: MsgpackDecoder[HandshakeHello | HandshakeReady] = MsgpackDecoder(HandshakeMessage)
        metadata = self._encoder.encode(
            EngineHandshakeMetadata(
                addresses=EngineZmqAddresses(inputs=[input_address], outputs=[output_address])
            )
        )
        waiting = {engine.identity: engine for engine in self._engines}
        while waiting:
            identity, *payload = await sock.recv_multipart()
            engine = waiting.pop(bytes(identity), None)
            if engine is None:
                logger.warning("ignoring a handshake from unexpected identity %r", identity)
                continue
            try:
                hello = decoder.decode(payload)
            except ProtocolError as exc:
                raise EngineStartupError(
                    f"{engine.describe()} sent an invalid HELLO: {exc}"
                ) from exc
            if not isinstance(hello, HandshakeHello):
                raise EngineStartupError(f"{engine.describe()} sent {hello!r} instead of HELLO")
            await sock.send_multipart([engine.identity, *metadata])

    async def _wait_handshake_ready(self, sock: TrioSocket) -> None:
        decoder: MsgpackDecoder[HandshakeHello | HandshakeReady] = MsgpackDecoder(HandshakeMessage)
        waiting = {engine.identity for engine in self._engines}
        while waiting:
            identity, *payload = await sock.recv_multipart()
            message = decoder.decode(payload)
            if isinstance(message, HandshakeReady):
                waiting.discard(bytes(identity))

    async def _wait_ready(self) -> None:
        sock = self._sock_in()
        decoder = MsgpackDecoder(EngineCoreReadyResponse)
        waiting = {engine.identity: engine for engine in self._engines}
        while waiting:
            frames = await sock.recv_multipart()
            if len(frames) != 2:
                logger.warning("ignoring a %d-frame message on the input socket", len(frames))
                continue
            identity, payload = bytes(frames[0]), frames[1]
            engine = waiting.pop(identity, None)
            if engine is None:
                logger.warning("ignoring a ready message from unexpected identity %r", identity)
                continue
            if len(payload):
                try:
                    engine.ready = decoder.decode(payload)
                except ProtocolError as exc:
                    raise EngineStartupError(
                        f"{engine.describe()} sent an invalid ready message: {exc}"
                    ) from exc

    # ---------------------------------------------------------------- shutdown

    async def aclose(self, *, shutdown_timeout_s: float = 5.0) -> None:
        """Abort in-flight requests, stop launched engines, close sockets.

        Launched engines get SIGTERM and are killed if they have not exited within
        ``shutdown_timeout_s``. Attached engines are left running (their in-flight
        requests from this client are aborted). Idempotent. Runs shielded from
        cancellation (bounded by the timeout), like every Trio ``aclose``.
        """
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):
            self._closing = True
            if self._inflight and self._input is not None:
                self._abort_now(list(self._inflight))
            for stream in list(self._streams.values()):
                stream._fail("the engine client was closed")  # pyright: ignore[reportPrivateUsage]
            for call in self._calls.values():
                call.failure = "the engine client was closed"
                call.done.set()
            self._wake_batch_readers()
            await self._stop_processes(shutdown_timeout_s)
            self._closed = True
            for sock in (self._input, self._output):
                if sock is not None:
                    sock.close(linger=0)
            # Every socket is closed with linger 0, so terminating cannot block.
            self._ctx.term()
            if self._ipc_dir is not None:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)

    async def _stop_processes(self, timeout_s: float) -> None:
        processes = [e.process for e in self._engines if e.process is not None]
        for process in processes:
            if process.returncode is None:
                process.terminate()
        with trio.move_on_after(timeout_s):
            for process in processes:
                await process.wait()
        for process in processes:
            if process.returncode is None:
                logger.warning(
                    "engine pid %d did not exit in %g s; killing it", process.pid, timeout_s
                )
                process.kill()
                await process.wait()
        for engine in self._engines:
            engine.alive = False
            if engine.process is not None and engine.process.stderr is not None:
                await engine.process.stderr.aclose()


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception in a (nested) group, or None if there are several."""
    leaves: list[BaseException] = []
    pending: collections.deque[BaseException] = collections.deque([group])
    while pending:
        error = pending.popleft()
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)  # pyright: ignore[reportUnknownArgumentType, reportUnknownMemberType]
        else:
            leaves.append(error)
    return leaves[0] if len(leaves) == 1 else None


@asynccontextmanager
async def open_trio_mp_client(
    config: EngineConfig,
    *,
    input_address: str | None = None,
    output_address: str | None = None,
    ready_timeout_s: float = 60.0,
    shutdown_timeout_s: float = 5.0,
    max_pending_outputs: int = 64,
    client_index: int = 0,
) -> AsyncGenerator[TrioMPClient, None]:
    """Open a :class:`TrioMPClient` (see :func:`trio_enginecore.open_engine_client`)."""
    if not (math.isfinite(ready_timeout_s) and ready_timeout_s > 0):
        raise ValueError(f"ready_timeout_s must be a positive number, got {ready_timeout_s!r}")
    client = TrioMPClient(
        config, client_index=client_index, max_pending_outputs=max_pending_outputs
    )
    user_error: BaseException | None = None
    startup_error: BaseException | None = None
    background: BaseExceptionGroup[BaseException] | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                await client._start(  # pyright: ignore[reportPrivateUsage]
                    nursery,
                    input_address=input_address,
                    output_address=output_address,
                    ready_timeout_s=ready_timeout_s,
                )
            except BaseException as exc:
                startup_error = exc
            else:
                try:
                    yield client
                except BaseException as exc:
                    user_error = exc
            finally:
                await client.aclose(shutdown_timeout_s=shutdown_timeout_s)
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Background tasks never raise on purpose: this is an outer cancellation that
        # arrived during shutdown, or a bug. Either way the caller gets one exception.
        background = group
    # Raised outside any `except` block so the exception keeps its own __context__ and
    # __cause__: the caller's exception comes back exactly as it was.
    error = user_error or startup_error
    if error is None and background is not None:
        error = _single(background)
        if error is None:
            raise EngineDeadError("the engine client failed in the background") from background
    if error is not None:
        raise error
    if client._failure is not None:  # pyright: ignore[reportPrivateUsage]
        raise EngineDeadError(client._failure)  # pyright: ignore[reportPrivateUsage]

"""A fake engine for testing the client against an engine that breaks the protocol.

:class:`HostileEngine` is the engine side of the wire protocol done by hand with raw
ZeroMQ sockets: it connects a DEALER (identity ``rank.to_bytes(2, "little")``) to the
client's input ROUTER and a PUSH to the client's output PULL, sends the ready message
a real engine sends, then reads what the client sends and sends back whatever a test
crafts, consistent or not. :func:`attached_to_hostile_engine` opens a real
``TrioMPClient`` attached to one.

For transcripts with several engines, liveness checks or a coordinator,
:class:`ServingEngine` is a HostileEngine whose socket a task of its own reads, so that
it answers the client's liveness checks while the test waits for something else;
:class:`ScriptedCoordinator` is the publishing end of a data-parallel coordinator; and
:func:`attached_to_serving_engines` opens a real client attached to them.

Nothing of the engine package runs here except :meth:`EngineCore.ready_response`,
which supplies a well-formed ready message.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import AsyncGenerator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import numpy as np
import trio
import zmq

from trio_enginecore import (
    CoordinatorAddresses,
    EngineConfig,
    Liveness,
    TrioMPClient,
    open_engine_client,
)
from trio_enginecore._zmq import TrioSocket, make_socket
from trio_enginecore.engine import EngineCore
from trio_enginecore.protocol import (
    COORDINATOR_SUBSCRIBE,
    ENGINE_CORE_DEAD,
    CoordinatorPublication,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    LogprobsLists,
    UtilityOutput,
    UtilityRequest,
    UtilityResult,
)
from trio_enginecore.serial import Buffer, MsgpackDecoder, MsgpackEncoder

from .support import streamed_tokens

__all__ = [
    "AttachedPeers",
    "HostileEngine",
    "ScriptedCoordinator",
    "ServingEngine",
    "attached_to_hostile_engine",
    "attached_to_serving_engines",
    "delivered_until_finished",
    "fence",
    "fence_all",
    "finished",
    "logprobs",
    "output",
    "streamed_tokens",
]

_ADD: Final = EngineCoreRequestType.ADD.value
_ABORT: Final = EngineCoreRequestType.ABORT.value
_UTILITY: Final = EngineCoreRequestType.UTILITY.value


Delivered = dict[str, list[tuple[list[int], bool]]]
"""What ``get_output()`` returned, per request: (new token ids, finished) in order."""


async def delivered_until_finished(client: TrioMPClient, *request_ids: str) -> Delivered:
    """Call ``get_output()`` until these requests have finished; everything it returned."""
    delivered: Delivered = {}
    waiting = set(request_ids)
    while waiting:
        message = await client.get_output()
        for out in message.outputs:
            delivered.setdefault(out.request_id, []).append((out.new_token_ids, out.finished))
            if out.finished:
                waiting.discard(out.request_id)
    return delivered


def output(request_id: str, *tokens: int, **fields: Any) -> EngineCoreOutput:
    """An unfinished output carrying ``tokens`` for ``request_id``."""
    return EngineCoreOutput(request_id, list(tokens), **fields)


def finished(request_id: str, *tokens: int, **fields: Any) -> EngineCoreOutput:
    """The last output of ``request_id`` (finish reason LENGTH)."""
    return EngineCoreOutput(request_id, list(tokens), finish_reason=FinishReason.LENGTH, **fields)


def logprobs(rows: int, columns: int) -> LogprobsLists:
    """Sampled-token logprobs for ``rows`` tokens with ``columns`` candidates each."""
    return LogprobsLists(
        np.zeros((rows, columns), dtype=np.int32),
        np.zeros((rows, columns), dtype=np.float32),
        np.zeros(rows, dtype=np.int32),
    )


class HostileEngine:
    """The engine end of one client's sockets, driven by the test.

    Requests the client sends are read with :meth:`expect_adds`, :meth:`expect_abort`
    and :meth:`expect_utility`, which record everything they read on the way (other
    ADDs, ABORTs, UTILITY calls), so a test never loses a message by waiting for
    another kind. Messages are sent with :meth:`send` (well-formed, whatever they
    say), :meth:`send_frames` (any frames at all) and :meth:`reply`.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        input_address: str,
        output_address: str,
        *,
        rank: int = 0,
        vllm_version: str | None = None,
        ready_keys: Collection[str] | None = None,
    ) -> None:
        self.rank = rank
        self.vllm_version = vllm_version
        """The version its ready message names (the reference engine's by default)."""
        self.ready_keys = ready_keys
        """The keys its ready message has, of the reference engine's (every one by
        default): the shape of one release's ready message, or of none."""
        self.dealer: TrioSocket = make_socket(ctx, zmq.DEALER, identity=rank.to_bytes(2, "little"))
        self.push: TrioSocket = make_socket(ctx, zmq.PUSH)
        self.dealer.connect(input_address)
        self.push.connect(output_address)
        self.encoder = MsgpackEncoder()
        self._add_decoder = MsgpackDecoder(EngineCoreRequest)
        self._abort_decoder = MsgpackDecoder(list[str])
        self._utility_decoder = MsgpackDecoder(UtilityRequest)
        self.added: dict[str, EngineCoreRequest] = {}
        """Every ADD read so far, by request id."""
        self.prompt_forms: dict[str, str] = {}
        """How each ADD's prompt travelled, by request id: ``"list"`` (vLLM 0.33) or
        ``"int32 array"`` (vLLM 0.34)."""
        self.aborted: list[str] = []
        """Every request id an ABORT named, in the order read."""
        self.calls: list[UtilityRequest] = []
        """UTILITY calls read and not yet taken by :meth:`expect_utility`."""

    def close(self) -> None:
        self.dealer.close()
        self.push.close()

    # ------------------------------------------------------------ the startup

    async def send_ready(self) -> None:
        """Send the ready message that lets the client's ROUTER route to this engine."""
        config = EngineConfig(data_parallel_rank=self.rank, data_parallel_size=self.rank + 1)
        ready = EngineCore(config).ready_response()
        if self.vllm_version is not None:
            ready = msgspec.structs.replace(ready, vllm_version=self.vllm_version)
        message: object = ready
        if self.ready_keys is not None:
            keys = self.ready_keys
            message = {k: v for k, v in msgspec.structs.asdict(ready).items() if k in keys}
        await self.dealer.send_multipart(self.encoder.encode(message))

    # ---------------------------------------------------- what the client sends

    async def _receive(self) -> None:
        """Read one message from the client and record it."""
        request_type, *payload = await self.dealer.recv_multipart()
        if request_type == _ADD:
            request = self._add_decoder.decode(payload)
            self.added[request.request_id] = request
            prompt = MsgpackDecoder().decode(payload)[1]
            packed = isinstance(prompt, list) and prompt[:1] == ["<i4"]
            self.prompt_forms[request.request_id] = "int32 array" if packed else "list"
        elif request_type == _ABORT:
            self.aborted += self._abort_decoder.decode(payload)
        elif request_type == _UTILITY:
            await self._take_call(self._utility_decoder.decode(payload))
        else:
            raise AssertionError(f"unexpected request type {request_type!r}")

    async def _take_call(self, call: UtilityRequest) -> None:
        """Keep a UTILITY call the client sent for :meth:`expect_utility`."""
        self.calls.append(call)

    async def _read_one(self) -> None:
        # The expect_* methods read in the test's own task.
        await self._receive()

    async def expect_adds(self, *request_ids: str) -> None:
        """Read until the client has sent an ADD for each of these ids."""
        while not set(request_ids) <= self.added.keys():
            await self._read_one()

    async def expect_abort(self, request_id: str) -> None:
        """Read until the client has sent an ABORT naming this request."""
        while request_id not in self.aborted:
            await self._read_one()

    async def expect_utility(self) -> UtilityRequest:
        """The next UTILITY call the client sends."""
        while not self.calls:
            await self._read_one()
        return self.calls.pop(0)

    # -------------------------------------------------- what the engine sends

    async def send(
        self, *outputs: EngineCoreOutput, engine_index: int | None = None, **fields: Any
    ) -> None:
        """Send one message with these outputs (and any other EngineCoreOutputs fields)."""
        index = self.rank if engine_index is None else engine_index
        message = EngineCoreOutputs(engine_index=index, outputs=list(outputs), **fields)
        await self.push.send_multipart(self.encoder.encode(message))

    async def send_frames(self, frames: Sequence[Buffer]) -> None:
        """Send these frames as one message, whatever they hold."""
        await self.push.send_multipart(frames)

    async def send_engine_core_dead(self) -> None:
        await self.send_frames([ENGINE_CORE_DEAD])

    async def reply(
        self, call: UtilityRequest, result: Any = None, *, call_id: int | None = None
    ) -> None:
        """Answer a utility call (or, with ``call_id``, pretend to answer another one)."""
        reply = UtilityOutput(
            call.call_id if call_id is None else call_id, None, UtilityResult(result)
        )
        await self.send(utility_output=reply)


@asynccontextmanager
async def attached_to_hostile_engine(
    *,
    max_pending_outputs: int = 64,
    vllm_version: str | None = None,
    ready_keys: Collection[str] | None = None,
) -> AsyncGenerator[tuple[HostileEngine, TrioMPClient], None]:
    """A real client attached (ipc:// in a temp dir) to a :class:`HostileEngine`.

    Whatever the engine sends, the client's ``async with`` block must never end with an
    ExceptionGroup or with a ``trio.Cancelled`` that no enclosing scope asked for
    (a failed background task cancels the block): either is turned into an
    AssertionError here, since a stray Cancelled would otherwise end the test quietly.
    """
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    input_address, output_address = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    ctx: zmq.Context[Any] = zmq.Context()
    engine = HostileEngine(
        ctx, input_address, output_address, vllm_version=vllm_version, ready_keys=ready_keys
    )
    try:
        # Queued on the DEALER until the client binds its ROUTER.
        await engine.send_ready()
        try:
            async with open_engine_client(
                EngineConfig(),
                input_address=input_address,
                output_address=output_address,
                ready_timeout_s=20,
                max_pending_outputs=max_pending_outputs,
                # The hostile engine answers only the utilities a test scripts: the
                # progress deadline (tests/test_liveness.py) would declare it hung.
                liveness=None,
            ) as client:
                yield engine, client
        except trio.Cancelled as cancelled:
            if trio.current_effective_deadline() == -math.inf:
                raise  # an enclosing scope was cancelled: not the client's doing
            raise AssertionError("a bare trio.Cancelled escaped the client's block") from cancelled
        except BaseExceptionGroup as group:
            raise AssertionError("an ExceptionGroup escaped the client's block") from group
    finally:
        engine.close()
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)


async def fence(engine: HostileEngine, client: TrioMPClient) -> None:
    """Return once the client has handled every message the engine sent before.

    A utility call makes the round trip: the client sends it, the engine answers on the
    output socket behind everything it sent earlier, and the client's receive task
    handles messages in order.
    """
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.call_utility, "fence")
        await engine.reply(await engine.expect_utility())


# ------------------------------------------- engines that answer by themselves


class ServingEngine(HostileEngine):
    """A :class:`HostileEngine` whose input a task of its own reads (:meth:`serve`).

    It records what it reads as a HostileEngine does (``added``, ``aborted``,
    ``calls``), and its ``expect_*`` methods wait for that task instead of reading. A
    UTILITY call of a method in ``answers`` (by default the client's liveness check,
    ``is_sleeping``, answered ``False``) is answered at once and counted in
    ``answered``; any other waits in ``calls`` for the test. After
    :meth:`stop_answering` the engine answers nothing: every UTILITY call it reads goes
    into ``ignored``, as with an engine that hung.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        input_address: str,
        output_address: str,
        *,
        rank: int = 0,
        answers: Mapping[str, Any] | None = None,
        vllm_version: str | None = None,
        ready_keys: Collection[str] | None = None,
    ) -> None:
        super().__init__(
            ctx,
            input_address,
            output_address,
            rank=rank,
            vllm_version=vllm_version,
            ready_keys=ready_keys,
        )
        self.answers: dict[str, Any] = {"is_sleeping": False} if answers is None else dict(answers)
        self.answered: dict[str, int] = {}
        """How many calls of each method in ``answers`` were answered."""
        self.ignored: list[UtilityRequest] = []
        """UTILITY calls read after :meth:`stop_answering`, never answered."""
        self.silent = False
        self._read = trio.Event()

    def stop_answering(self) -> None:
        """From now on, leave every UTILITY call unanswered."""
        self.silent = True

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read what the client sends, for ever (run it in a nursery)."""
        task_status.started()
        while True:
            await self._receive()
            self._read.set()
            self._read = trio.Event()

    async def _take_call(self, call: UtilityRequest) -> None:
        if self.silent:
            self.ignored.append(call)
        elif call.method in self.answers:
            await self.reply(call, self.answers[call.method])
            self.answered[call.method] = self.answered.get(call.method, 0) + 1
        else:
            await super()._take_call(call)

    async def _read_one(self) -> None:
        # serve() reads; the expect_* methods wait for it to have read one more.
        await self._read.wait()

    async def expect_answered(self, method: str, count: int) -> None:
        """Wait until ``count`` calls of ``method`` (one of ``answers``) were answered."""
        while self.answered.get(method, 0) < count:
            await self._read_one()


async def fence_all(client: TrioMPClient, *engines: ServingEngine) -> None:
    """Return once each of ``engines`` (all of the client's) has read everything the
    client sent it before, and the client has handled every message they sent before.

    ``call_utility_all`` makes a round trip through every engine: each reads the call
    behind the client's earlier requests to it, and answers on its output socket behind
    everything it sent earlier.
    """
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.call_utility_all, "fence")
        for engine in engines:
            await engine.reply(await engine.expect_utility())


class ScriptedCoordinator:
    """The front-end side of a data-parallel coordinator, driven by the test.

    An XPUB bound at ``addresses.publish``, where a client given these addresses
    (``coordinator=``) subscribes; the other two addresses are the engines' and nobody
    binds them. A publication is vLLM's msgpack ``(counts, wave, running)``
    (:class:`~trio_enginecore.protocol.CoordinatorPublication`).
    """

    def __init__(self, ctx: zmq.Context[Any], directory: str) -> None:
        self.addresses = CoordinatorAddresses.in_directory(directory)
        self.xpub: TrioSocket = make_socket(ctx, zmq.XPUB)
        self.xpub.bind(self.addresses.publish)

    def close(self) -> None:
        self.xpub.close()

    async def expect_subscription(self) -> None:
        """Wait for the client's subscription; an XPUB drops what it publishes before."""
        frames = await self.xpub.recv_multipart()
        assert [bytes(frame) for frame in frames] == [COORDINATOR_SUBSCRIBE], frames

    async def publish(
        self, counts: list[tuple[int, int, float]] | None, wave: int, running: bool
    ) -> None:
        """Publish ``(counts, wave, running)``: counts as ``(waiting, running,
        kv_usage)`` per engine, or ``None`` (a wave change)."""
        publication = CoordinatorPublication(counts, wave, running)
        await self.publish_frames([msgspec.msgpack.encode(publication)])

    async def publish_frames(self, frames: Sequence[Buffer]) -> None:
        """Publish these frames as one message, whatever they hold."""
        await self.xpub.send_multipart(frames)


@dataclass
class AttachedPeers:
    """What :func:`attached_to_serving_engines` yields."""

    client: TrioMPClient
    engines: list[ServingEngine]
    scripted_coordinator: ScriptedCoordinator | None

    @property
    def coordinator(self) -> ScriptedCoordinator:
        assert self.scripted_coordinator is not None, "opened without a coordinator"
        return self.scripted_coordinator


@asynccontextmanager
async def attached_to_serving_engines(
    size: int = 1,
    *,
    coordinator: bool = False,
    liveness: Liveness | None = None,
    max_pending_outputs: int = 64,
    vllm_versions: Sequence[str | None] | None = None,
    ready_keys: Sequence[Collection[str] | None] | None = None,
) -> AsyncGenerator[AttachedPeers, None]:
    """A real client (``EngineConfig(data_parallel_size=size)``) attached over ipc://
    in a temp dir to ``size`` :class:`ServingEngine` peers (ranks 0 to size - 1), each
    served by a task of this context, and with ``coordinator`` to a
    :class:`ScriptedCoordinator` whose addresses it was given, once the client's
    subscription has reached it.

    As :func:`attached_to_hostile_engine`, an ExceptionGroup or a bare ``trio.Cancelled``
    escaping the client's block is turned into an AssertionError; any other exception
    of the block propagates as itself.
    """
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    input_address, output_address = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    ctx: zmq.Context[Any] = zmq.Context()
    engines: list[ServingEngine] = []
    scripted: ScriptedCoordinator | None = None
    error: BaseException | None = None
    try:
        versions = [None] * size if vllm_versions is None else list(vllm_versions)
        shapes = [None] * size if ready_keys is None else list(ready_keys)
        engines += [
            ServingEngine(
                ctx, input_address, output_address, rank=rank, vllm_version=version, ready_keys=keys
            )
            for rank, (version, keys) in enumerate(zip(versions, shapes, strict=True))
        ]
        scripted = ScriptedCoordinator(ctx, tmp) if coordinator else None
        async with trio.open_nursery() as nursery:
            for engine in engines:
                # Queued on the DEALER until the client binds its ROUTER.
                await engine.send_ready()
                await nursery.start(engine.serve)
            try:
                async with open_engine_client(
                    EngineConfig(data_parallel_size=size),
                    input_address=input_address,
                    output_address=output_address,
                    ready_timeout_s=20,
                    max_pending_outputs=max_pending_outputs,
                    coordinator=scripted.addresses if scripted is not None else None,
                    liveness=liveness,
                ) as client:
                    if scripted is not None:
                        await scripted.expect_subscription()
                    yield AttachedPeers(client, engines, scripted)
            except trio.Cancelled as cancelled:
                if trio.current_effective_deadline() == -math.inf:
                    raise  # an enclosing scope was cancelled: not the client's doing
                error = AssertionError("a bare trio.Cancelled escaped the client's block")
                error.__cause__ = cancelled
            except BaseExceptionGroup as group:
                error = AssertionError("an ExceptionGroup escaped the client's block")
                error.__cause__ = group
            except BaseException as exc:
                # Raised below, outside the nursery, so that it is not wrapped in a group.
                error = exc
            finally:
                nursery.cancel_scope.cancel()
    finally:
        for engine in engines:
            engine.close()
        if scripted is not None:
            scripted.close()
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error

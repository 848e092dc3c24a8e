"""What decides what happens to every request of a client: plain state, no I/O.

:class:`ClientState` holds the in-flight table, the streams' feeding halves, the
pending utility calls, the batch buffer behind ``get_output()`` and the engines'
deaths. It is fed decoded engine messages (:meth:`ClientState.handle_outputs`) and
told what callers do (register, abort, die, close); it never sends anything itself
except through the one callback it is given, ``send_abort``, which must not block.
Nothing here awaits: the client around it owns the checkpoints, so every rule can be
unit-tested synchronously, like :class:`~trio_enginecore.engine.EngineCore`.

Waking waiters is part of the state (a :class:`trio.Event` per wait): setting an event
needs no running event loop.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from typing import Final, final

import msgspec
import trio

from ...errors import EngineDeadError, ProtocolError
from ...protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from ._calls import UtilityCalls
from ._collector import BatchCollector
from ._engines import DeathNotice, EngineHandle
from ._lifecycle import EngineLifecycle
from ._policy import Fail, Policy
from ._statistics import ClientStatistics
from ._stream import StreamFeed

__all__ = ["MAX_TOMBSTONES", "ClientState"]

logger = logging.getLogger("trio_enginecore.client")

_FAIL: Final = Fail()

MAX_TOMBSTONES: Final = 10_000
"""How many aborted request ids a client remembers (see ``abort_requests``). By the
time an id falls out, its engine read the ABORT long ago."""


SendAbort = Callable[[EngineHandle, list[str]], None]


@final
class _IdsInFlight:
    """The caller's ids of the requests in flight (a view, for ``in`` tests)."""

    __slots__ = ("_inflight", "_wire_ids")

    def __init__(self, inflight: dict[str, EngineHandle], wire_ids: dict[str, str]) -> None:
        self._inflight = inflight
        self._wire_ids = wire_ids

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._inflight or request_id in self._wire_ids


@final
class ClientState:
    """The bookkeeping of one client (see the module docstring).

    Args:
        engines: the engines, by rank; their ``alive``, ``death`` and ``load.in_flight``
            are kept here.
        send_abort: delivers an ABORT of wire ids to one engine; never blocks.
        max_pending_outputs: messages kept for ``get_output()`` before merging.
        policy: what an engine's death does (:mod:`._policy`): it fails the client
            (``Fail``, the default), or only what depends on that engine while
            others serve (``RouteAround``), or that and the engine is restarted
            (``Restart``: it counts as in service until :meth:`engine_given_up`).
    """

    def __init__(
        self,
        engines: list[EngineHandle],
        send_abort: SendAbort,
        *,
        max_pending_outputs: int = 64,
        policy: Policy = _FAIL,
    ) -> None:
        self.engines = engines
        self.policy = policy
        self.engine_returned = trio.Event()
        """Set (and replaced) whenever a restarted engine is back in service."""
        self.send_abort = send_abort
        self.inflight: dict[str, EngineHandle] = {}
        """Wire id -> the engine that has the request."""
        self.streams: dict[str, StreamFeed] = {}
        """Wire id -> the feeding half of the request's stream (streamed requests)."""
        self.open_streams = 0
        self.calls = UtilityCalls()
        self.batches = BatchCollector(max_pending_outputs)
        self.batch_ready = trio.Event()
        """Set (and replaced) whenever ``get_output()`` waiters should look again."""
        self.failure: str | None = None
        """Why the client is dead (the first engine death), or None."""
        self.failure_notice: DeathNotice | None = None
        """The error every call raises once the client is dead (``failure``'s)."""
        self.ended = trio.Event()
        """Set once the client failed (``failure`` says why) or started closing."""
        self.closing = False
        self.closed = False
        self.messages = 0
        self.outputs_received = 0
        self.tokens = 0
        self.batched_outputs = 0
        self.protocol_errors = 0
        self.outputs_dropped = 0
        # Ids whose request was aborted while the engine may still be producing for
        # it, most recent last. Reusing one sends the new request under a fresh wire
        # id, so the old request's late outputs cannot be mistaken for the new one's.
        self.tombstones: dict[str, None] = {}
        # The requests in flight under such a wire id: user id -> wire id, and back.
        self.wire_ids: dict[str, str] = {}
        self.user_ids: dict[str, str] = {}
        self.ids_in_flight = _IdsInFlight(self.inflight, self.wire_ids)
        self.lifecycle = EngineLifecycle(self)
        """What an engine's death, silence or return does: the one writer of the
        engines' states."""
        self.output_observers: list[Callable[[EngineCoreOutputs], None]] = []
        """Called with every engine message of outputs, as it arrived, before routing."""

    # ---------------------------------------------------------------- queries

    def statistics(self) -> ClientStatistics:
        return ClientStatistics(
            requests_in_flight=len(self.inflight),
            open_streams=self.open_streams,
            pending_utility_calls=len(self.calls),
            pending_batches=len(self.batches),
            messages_received=self.messages,
            outputs_received=self.outputs_received,
            tokens_received=self.tokens,
            protocol_errors=self.protocol_errors,
            engines_alive=sum(1 for e in self.engines if e.alive),
            outputs_dropped=self.outputs_dropped,
            engines=tuple(engine.status() for engine in self.engines),
        )

    def raise_if_unusable(self) -> None:
        """Raise what every call raises once the client is dead or closing."""
        if self.failure is not None:
            raise self.dead_error()
        if self.closing:
            raise trio.ClosedResourceError("the engine client is closed")

    def dead_error(self) -> EngineDeadError:
        """A fresh copy of the error of a dead client (``failure`` must be set)."""
        assert self.failure is not None
        if self.failure_notice is not None:
            return self.failure_notice.error()
        return EngineDeadError(self.failure)

    def user_id(self, wire_id: str) -> str:
        """The caller's id of the request travelling under ``wire_id``."""
        return self.user_ids.get(wire_id, wire_id)

    # --------------------------------------------------------------- requests

    def register(
        self, request: EngineCoreRequest, engine: EngineHandle, *, stream: StreamFeed | None
    ) -> EngineCoreRequest:
        """Record ``request`` as in flight on ``engine``; the request to send.

        That is ``request`` itself, or, for an id whose aborted request the engine may
        still be producing for, a copy under a fresh wire id (the caller's object is
        not changed, so its ``request_id`` stays what the caller gave).
        """
        user_id = request.request_id
        wire = request
        if user_id in self.tombstones:
            wire_id = f"{user_id}~{secrets.token_hex(4)}"
            while wire_id in self.inflight:
                wire_id = f"{user_id}~{secrets.token_hex(4)}"
            wire = msgspec.structs.replace(
                request, request_id=wire_id, external_req_id=request.external_req_id or user_id
            )
            self.wire_ids[user_id] = wire_id
            self.user_ids[wire_id] = user_id
        self.inflight[wire.request_id] = engine
        engine.load.in_flight += 1
        if stream is not None:
            stream.wire_id = wire.request_id
            self.streams[wire.request_id] = stream
        return wire

    def forget(self, wire_id: str) -> None:
        """The request under ``wire_id`` is no longer in flight (finished, or unsent)."""
        engine = self.inflight.pop(wire_id, None)
        if engine is not None:
            engine.load.request_left()
        self.streams.pop(wire_id, None)
        user_id = self.user_ids.pop(wire_id, None)
        if user_id is not None:
            del self.wire_ids[user_id]

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests by the caller's ids (see ``abort_requests``)."""
        ids = list(request_ids)
        wire_ids = self.wire_ids
        self.abort_wire([wire_ids.get(request_id, request_id) for request_id in ids])
        if len(self.batches):
            # Outputs received before the abort must not surface after it, those of a
            # request that finished meanwhile included (they carry the caller's ids).
            self.batches.discard(set(ids))

    def abort_wire(self, wire_ids: list[str]) -> None:
        """Abort requests by wire id: one ABORT per engine that has some of them; their
        streams end with a local ABORT output."""
        by_engine: dict[int, tuple[EngineHandle, list[str]]] = {}
        for wire_id in wire_ids:
            engine = self.inflight.get(wire_id)
            if engine is not None:
                by_engine.setdefault(engine.rank, (engine, []))[1].append(wire_id)
        for engine, ids in by_engine.values():
            live = engine.alive and not self.closed
            if live:
                self.send_abort(engine, ids)
            for wire_id in ids:
                if live:
                    self.bury(self.user_ids.get(wire_id, wire_id))
                stream = self.streams.get(wire_id)
                self.forget(wire_id)
                if stream is not None:
                    stream.abort_locally()

    def bury(self, user_id: str) -> None:
        tombstones = self.tombstones
        tombstones.pop(user_id, None)
        tombstones[user_id] = None
        if len(tombstones) > MAX_TOMBSTONES:
            # The oldest: its engine read the ABORT long ago.
            del tombstones[next(iter(tombstones))]

    def stream_closed(self, stream: StreamFeed) -> None:
        """The reading half of ``stream`` was closed.

        While the request is in flight the stream stays registered, so that its late
        outputs reach the (closed) stream and are dropped there instead of leaking
        into ``get_output()``; finishing or aborting unregisters it.
        """
        wire = stream.wire_id
        if self.streams.get(wire) is stream and wire not in self.inflight:
            del self.streams[wire]

    def stream_left(self, stream: StreamFeed) -> None:
        """The caller left the ``stream()`` block: abort the request if it is still
        in flight. Synchronous, so an exit by cancellation cannot skip it."""
        self.open_streams -= 1
        stream.close()
        if self.streams.get(stream.wire_id) is stream and not stream.finished_received:
            self.abort_wire([stream.wire_id])

    # ---------------------------------------------------------------- receive

    def handle_outputs(self, message: EngineCoreOutputs) -> None:
        """Route one decoded engine message.

        An engine's message is checked for consistency as it is routed, never
        trusted: a message from an engine this client does not have is dropped whole
        (``protocol_errors``), an output of a request not in flight (late after an
        abort, for an unknown id, a second finish, after the finish) is dropped
        (``outputs_dropped``), and outputs of a stream that cannot be merged fail that
        stream with :class:`~trio_enginecore.errors.ProtocolError` and abort its
        request. Every other request is served on.
        """
        engine = self._engine(message.engine_index)
        if engine is None:
            self.protocol_errors += 1
            logger.error(
                "dropping a message from engine index %r: this client has engines %s",
                message.engine_index,
                [known.rank for known in self.engines],
            )
            return
        self.messages += 1
        engine.heard += 1
        if message.utility_output is not None:
            self.calls.resolve(message.utility_output)
            if not message.outputs:
                return
        if self.output_observers:
            self._observe(message)
        outputs = message.outputs
        inflight = self.inflight
        self.outputs_received += len(outputs)
        self.tokens += sum([len(output.new_token_ids) for output in outputs])
        batch = None
        if not self.streams and not self.user_ids:
            # The batch API's hot path: the whole message goes to get_output() as it is,
            # with the per-output work done in C-level set operations and
            # comprehensions rather than one loop. It needs every output to be of a
            # different request in flight; anything else takes the careful path.
            ids = [output.request_id for output in outputs]
            # All in flight and no id twice: then the intersection keeps every one.
            if len(inflight.keys() & ids) == len(ids):
                for request_id in [o.request_id for o in outputs if o.finish_reason is not None]:
                    inflight.pop(request_id).load.request_left()
                batch = outputs
        if batch is None:
            batch = self._route_outputs(outputs)
        if batch or message.scheduler_stats is not None:
            if batch is not outputs:
                message.outputs = batch
            self.batched_outputs += len(batch)
            self.batches.put(message)
            self.wake_batch_readers()

    def _observe(self, message: EngineCoreOutputs) -> None:
        for observer in list(self.output_observers):
            try:
                observer(message)
            except Exception:
                # An observer's bug must not stop the engines' outputs reaching
                # their requests: it is logged, and the observer is dropped.
                logger.exception("dropping the output observer %r: it raised", observer)
                if observer in self.output_observers:
                    self.output_observers.remove(observer)

    def undecodable(self, error: ProtocolError) -> None:
        """An engine message could not be decoded: dropped, counted."""
        self.protocol_errors += 1
        logger.error("dropping an undecodable output message: %s", error)

    def _engine(self, engine_index: int) -> EngineHandle | None:
        engines = self.engines
        if len(engines) == 1:
            return engines[0] if engines[0].rank == engine_index else None
        for engine in engines:
            if engine.rank == engine_index:
                return engine
        return None

    def _route_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Hand stream outputs to their streams; return the ones for get_output()."""
        batch: list[EngineCoreOutput] = []
        inflight = self.inflight
        streams = self.streams
        user_ids = self.user_ids
        for output in outputs:
            wire_id = output.request_id
            # A registered stream is in flight (forget() unregisters both at once).
            stream = streams.get(wire_id)
            if stream is None and wire_id not in inflight:
                # Produced before the engine read our ABORT (normal), or an output the
                # engine should never have sent.
                self.outputs_dropped += 1
                continue
            if user_ids:
                user_id = user_ids.get(wire_id)
                if user_id is not None:
                    output.request_id = user_id
            finished = output.finish_reason is not None
            if finished:
                self.forget(wire_id)
            if stream is None:
                batch.append(output)
                continue
            try:
                stream.push(output)
            except ProtocolError as exc:
                self.protocol_errors += 1
                logger.error("request %r: %s", stream.request_id, exc)
                stream.fail(str(exc), ProtocolError)
                if not finished:
                    self.abort_wire([wire_id])
        return batch

    def take_batch(self) -> EngineCoreOutputs | None:
        """The next message for ``get_output()``, or None."""
        return self.batches.take()

    def wake_batch_readers(self) -> None:
        self.batch_ready.set()
        self.batch_ready = trio.Event()

    def wake_engine_waiters(self) -> None:
        """Waiters for an engine in service look again (one came back, or was given
        up)."""
        self.engine_returned.set()
        self.engine_returned = trio.Event()

    def close(self) -> None:
        """The client is closing: abort what is in flight and wake every waiter."""
        self.closing = True
        self.ended.set()
        if self.inflight:
            self.abort_wire(list(self.inflight))
        for stream in list(self.streams.values()):
            stream.fail("the engine client was closed")
        self.calls.fail(DeathNotice("the engine client was closed"))
        self.wake_batch_readers()

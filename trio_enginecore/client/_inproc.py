"""In-process clients: the engine runs in the caller's process, with no sockets.

:class:`TrioInprocClient` runs the engine loop as a task in the client's nursery (the
model step runs in a worker thread, so the Trio thread stays responsive) and offers the
full Trio client API, streams included: for debugging and for tests that want no
subprocess. :class:`InprocClient` is vLLM's blocking in-process client: ``get_output()``
steps the engine.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, final

import trio

from .._request_checks import check_request
from ..config import EngineConfig
from ..engine import EngineCore, FatalEngineError
from ..errors import EngineDeadError
from ..protocol import (
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    UtilityOutput,
    UtilityRequest,
)
from ._client import TrioEngineClient
from ._core._engines import EngineHandle
from ._interface import ClientStatistics, EngineCoreClient
from ._multiprocess._startup import EngineDialects
from ._running import run_client
from ._transport import ClientLink

__all__ = ["InprocClient", "InprocTransport", "TrioInprocClient", "open_trio_inproc_client"]

logger = logging.getLogger("trio_enginecore.client")


@final
class InprocTransport:
    """The engine as a task of the client's nursery: the in-process transport.

    Calls reach the engine through an inbox it empties between model steps (the
    core is only touched by the engine task, never while a step runs in the worker
    thread); its messages are handed to the client's state as the step returns them.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._work = trio.Event()

    def _post(self, action: Callable[[], None]) -> None:
        self._inbox.append(action)
        self._work.set()

    def send_add(self, engine: EngineHandle, request: EngineCoreRequest) -> None:
        self._post(lambda: self.core.add_request(request))

    def send_abort(self, engine: EngineHandle, request_ids: list[str]) -> None:
        self._post(lambda: self.core.abort_requests(request_ids))

    def send_utility(self, engine: EngineHandle, call: UtilityRequest) -> None:
        self._post(
            lambda: self.core.call_utility(call.client_index, call.call_id, call.method, call.args)
        )

    async def start(self, nursery: trio.Nursery, link: ClientLink) -> None:
        engine = EngineHandle.for_rank(self.config.data_parallel_rank)
        engine.ready = self.core.ready_response()
        # The keys it would send over a socket, in the release it speaks.
        engine.ready_keys = frozenset(
            EngineCoreReadyResponse.__struct_fields__[: self.config.dialect.ready_keys]
        )
        EngineDialects().settle([engine])
        link.state.engines[:] = [engine]
        nursery.start_soon(self._engine_loop, link)
        await trio.lowlevel.checkpoint()

    @property
    def restarts_engines(self) -> bool:
        """Never: the engine is a task of the client, not a process to launch."""
        return False

    def engine_death_recorded(self, engine: EngineHandle) -> None:
        """Nothing to do: the engine task has ended already."""

    async def aclose(self) -> None:
        """Nothing to release: the engine task ends with the client's nursery."""
        await trio.lowlevel.checkpoint()

    async def _engine_loop(self, link: ClientLink) -> None:
        core = self.core
        state = link.state
        step_time = self.config.step_time_s
        try:
            while True:
                while self._inbox:
                    self._inbox.popleft()()
                self._deliver_utility_replies(link)
                if core.can_step:
                    messages = await trio.to_thread.run_sync(core.step)
                    for message in messages.values():
                        state.handle_outputs(message)
                    self._deliver_utility_replies(link)
                    if step_time:
                        await trio.sleep(step_time)
                    else:
                        await trio.lowlevel.checkpoint()
                    continue
                await self._work.wait()
                self._work = trio.Event()
        except FatalEngineError as exc:
            link.engine_died(state.engines[0], f"fatal engine error: {exc}")

    def _deliver_utility_replies(self, link: ClientLink) -> None:
        for _, reply in self.core.take_utility_outputs():
            link.state.handle_outputs(
                EngineCoreOutputs(engine_index=self.config.data_parallel_rank, utility_output=reply)
            )


@final
class TrioInprocClient(TrioEngineClient):
    """A Trio client whose engine runs as a task of its own nursery.

    Same API and semantics as :class:`~trio_enginecore.TrioMPClient`, with two
    documented differences: there is no engine process (so no process death, and
    ``engine_pids`` is ``(None,)``), and requests reach the engine between model
    steps, as they would through a socket. A fatal engine error fails every waiter
    with :class:`~trio_enginecore.errors.EngineDeadError`.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        client_index: int = 0,
        max_pending_outputs: int = 64,
    ) -> None:
        self.transport = InprocTransport(config)
        super().__init__(
            self.transport,
            config,
            client_index=client_index,
            max_pending_outputs=max_pending_outputs,
        )

    @property
    def core(self) -> EngineCore:
        """The engine this client runs."""
        return self.transport.core


@asynccontextmanager
async def open_trio_inproc_client(
    config: EngineConfig,
    *,
    max_pending_outputs: int = 64,
    client_index: int = 0,
    cancel_on_failure: bool = False,
) -> AsyncGenerator[TrioInprocClient, None]:
    """Open a :class:`TrioInprocClient` (see :func:`trio_enginecore.open_engine_client`)."""
    client = TrioInprocClient(
        config, client_index=client_index, max_pending_outputs=max_pending_outputs
    )
    async with run_client(client, cancel_on_failure=cancel_on_failure) as running:
        yield running


@final
class InprocClient(EngineCoreClient):
    """vLLM's in-process blocking client: the engine runs inside the calling thread.

    ``get_output()`` runs one engine step and returns its outputs, an empty
    :class:`~trio_enginecore.protocol.EngineCoreOutputs` when the engine has nothing to
    do (it never blocks). Utility calls run immediately; one that waits for the engine
    (``pause_scheduler("wait")``) steps it until done and keeps those outputs for
    ``get_output()``. Not thread-safe, like vLLM's: use one thread, or
    :class:`~trio_enginecore.SyncMPClient`.
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config if config is not None else EngineConfig()
        self.core = EngineCore(self.config)
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()
        self._inflight: set[str] = set()
        self._call_id = 0
        self._closed = False
        self._failure: str | None = None
        self._messages = 0
        self._outputs = 0
        self._tokens = 0

    def _check(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure, rank=self.config.data_parallel_rank)
        if self._closed:
            # What every blocking client raises once closed (no Trio exception
            # reaches code that does not run under Trio).
            raise EngineDeadError("the engine client was closed")

    def _step(self) -> None:
        try:
            messages = self.core.step()
        except FatalEngineError as exc:
            self._failure = f"fatal engine error: {exc}"
            self._inflight.clear()
            raise EngineDeadError(self._failure, rank=self.config.data_parallel_rank) from exc
        for message in messages.values():
            self._messages += 1
            for output in message.outputs:
                self._outputs += 1
                self._tokens += len(output.new_token_ids)
                if output.finish_reason is not None:
                    self._inflight.discard(output.request_id)
            self._pending.append(message)

    def add_request(self, request: EngineCoreRequest) -> None:
        check_request(request)
        self._check()
        if request.request_id in self._inflight:
            raise ValueError(f"request {request.request_id!r} is already in flight on this client")
        request.client_index = 0
        self._inflight.add(request.request_id)
        self.core.add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        self._check()
        if not self._pending and self.core.can_step:
            self._step()
        if not self._pending:
            return EngineCoreOutputs(engine_index=self.config.data_parallel_rank)
        if len(self._pending) == 1:
            return self._pending.popleft()
        merged = self._pending.popleft()
        while self._pending:
            merged.outputs.extend(self._pending.popleft().outputs)
        return merged

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._check()
        ids = [r for r in request_ids if r in self._inflight]
        self._inflight.difference_update(ids)
        self.core.abort_requests(ids)
        dropped = set(ids)
        for message in self._pending:
            message.outputs = [o for o in message.outputs if o.request_id not in dropped]

    def call_utility(self, method: str, *args: Any) -> Any:
        self._check()
        self._call_id += 1
        call_id = self._call_id
        self.core.call_utility(0, call_id, method, args)
        while True:
            reply = self._find_reply(call_id)
            if reply is not None:
                return self._unwrap(method, reply)
            if not self.core.can_step:
                raise EngineDeadError(f"utility {method!r} cannot complete: the engine is idle")
            self._step()

    def _find_reply(self, call_id: int) -> UtilityOutput | None:
        found = None
        for _, reply in self.core.take_utility_outputs():
            if reply.call_id == call_id:
                found = reply
        return found

    def statistics(self) -> ClientStatistics:
        return ClientStatistics(
            requests_in_flight=len(self._inflight),
            open_streams=0,
            pending_utility_calls=0,
            pending_batches=len(self._pending),
            messages_received=self._messages,
            outputs_received=self._outputs,
            tokens_received=self._tokens,
            protocol_errors=0,
            engines_alive=0 if self._closed or self._failure else 1,
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.core.abort_requests(list(self._inflight))
            self._inflight.clear()

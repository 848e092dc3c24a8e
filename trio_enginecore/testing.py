"""Test helpers for code that uses a trio-enginecore client.

:class:`FakeEngine` is a scripted stand-in for an engine that runs inside your test,
with no process and no socket, so tests of *your* application are fast, deterministic
and can use Trio's ``autojump_clock`` (virtual time: a 10 s generation takes no real
time). :func:`open_fake_engine_client` gives a client with the full Trio client API
(streams, batch API, utilities) connected to it::

    engine = FakeEngine(step_time_s=0.05)
    engine.script("req-1", [[10, 11], [12]], finish_reason=FinishReason.STOP)
    async with open_fake_engine_client(engine) as client:
        async with client.stream(request) as outputs:
            ...
    assert engine.aborted == []

Unscripted requests behave like the built-in ``counter`` model: one token per step,
each the previous token plus one, until ``max_tokens`` (finish reason LENGTH) or a
token of ``stop_token_ids`` (STOP). Every typed utility of the client (LoRA adapters up
to ``max_loras``, sleep, the profiler, pausing, weight versions, ...) is answered as
the reference engine answers it. The engine records what it received
(:attr:`FakeEngine.requests`, :attr:`FakeEngine.aborted`,
:attr:`FakeEngine.utility_calls`), can fail utilities on demand and can die
(:meth:`FakeEngine.kill`), so your error handling can be tested too.

It is a fake: it does not check sampling parameters or model lengths, and it knows
nothing of the wire format. To test against the real protocol, use
``open_engine_client`` with the built-in engine instead.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, final

import attrs
import trio

from .client import ClientLink, EngineHandle, TrioEngineClient, run_client
from .config import EngineConfig
from .protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    RequestError,
    UtilityOutput,
    UtilityRequest,
    UtilityResult,
)

__all__ = [
    "FakeEngine",
    "FakeTransport",
    "ScriptedResponse",
    "open_fake_engine_client",
]


@attrs.frozen
class ScriptedResponse:
    """What the fake engine answers to one request: one token list per step."""

    steps: tuple[tuple[int, ...], ...]
    finish_reason: FinishReason = FinishReason.LENGTH
    stop_reason: int | str | None = None
    error: RequestError | None = None


UtilityHandler = Callable[..., Any]


@final
class FakeEngine:
    """A scripted engine for tests (see the module docstring).

    Args:
        step_time_s: time between two outputs of a request (Trio time: with
            ``autojump_clock`` it costs nothing).
        vocab_size: wraps the counter-style tokens of unscripted requests.
    """

    def __init__(
        self, *, step_time_s: float = 0.0, vocab_size: int = 32000, max_loras: int = 4
    ) -> None:
        self.step_time_s = step_time_s
        self.vocab_size = vocab_size
        self.max_loras = max_loras
        self.requests: list[EngineCoreRequest] = []
        """Every request the engine received, in order."""
        self.aborted: list[str] = []
        """Ids of the requests the client aborted, in order."""
        self.utility_calls: list[tuple[str, tuple[Any, ...]]] = []
        """Every utility call received, as ``(method, args)``."""
        self._scripts: dict[str, ScriptedResponse] = {}
        self._utilities: dict[str, UtilityHandler] = self._default_utilities()
        self._sleeping = False
        self._profiling = False
        self._paused = False
        self._checkpoint = "running"
        self._weight_version: str | None = None
        self._loras: set[int] = set()
        self.client: TrioEngineClient | None = None
        """The client connected to this engine, once there is one."""
        self.transport: FakeTransport | None = None
        """The transport of that client."""

    # ----------------------------------------------------------------- scripting

    def script(
        self,
        request_id: str,
        steps: Sequence[Sequence[int]],
        *,
        finish_reason: FinishReason = FinishReason.LENGTH,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> None:
        """Answer request ``request_id`` with these token lists, one per step.

        The last step carries ``finish_reason``. An empty ``steps`` finishes the
        request at once with no token. ``error`` makes the engine fail the request
        after those steps, as a real engine rejects one (``FinishReason.ERROR`` with
        this message; a stream then raises
        :class:`~trio_enginecore.errors.RequestFailedError`).
        """
        if error is not None:
            finish_reason = FinishReason.ERROR
        self._scripts[request_id] = ScriptedResponse(
            tuple(tuple(step) for step in steps),
            finish_reason,
            stop_reason,
            None if error is None else RequestError("invalid_request", error),
        )

    def on_utility(self, method: str, handler: UtilityHandler) -> None:
        """Answer utility ``method`` with ``handler(*args)``; if it raises, the client
        gets a :class:`~trio_enginecore.errors.UtilityCallError` with its message."""
        self._utilities[method] = handler

    def kill(self, reason: str = "killed by the test") -> None:
        """Die now: every waiter of the client gets ``EngineDeadError``."""
        if self.transport is not None:
            self.transport.die(reason)

    @property
    def in_flight(self) -> int:
        """Requests the engine is still producing outputs for."""
        return self.transport.playing if self.transport is not None else 0

    def response_for(self, request: EngineCoreRequest) -> ScriptedResponse:
        """The scripted response, or the counter-style default.

        Scripts are found by the id the caller gave (``external_req_id`` when the
        client sent the request under an id of its own, as it does for an id reused
        right after an abort).
        """
        scripted = self._scripts.get(request.request_id)
        if scripted is None and request.external_req_id is not None:
            scripted = self._scripts.get(request.external_req_id)
        if scripted is not None:
            return scripted
        params = request.sampling_params
        count = params.max_tokens if params is not None and params.max_tokens else 16
        stops: set[int] = set(params.stop_token_ids or ()) if params is not None else set()
        last = request.prompt_token_ids[-1] if request.prompt_token_ids else 0
        steps: list[tuple[int, ...]] = []
        for i in range(1, count + 1):
            token = (last + i) % self.vocab_size
            steps.append((token,))
            if token in stops:
                return ScriptedResponse(tuple(steps), FinishReason.STOP, stop_reason=token)
        return ScriptedResponse(tuple(steps))

    def utility_handler(self, method: str) -> UtilityHandler | None:
        """What answers utility ``method`` (see :meth:`on_utility`), or None."""
        return self._utilities.get(method)

    def _default_utilities(self) -> dict[str, UtilityHandler]:
        # Every typed utility of the client, answered as the reference engine does
        # (minus the model): an application's calls work under the fake unchanged.
        def sleep(level: int = 1, *_: Any) -> None:
            self._sleeping = True
            self._paused = True

        def wake_up(tags: Any = None) -> bool:
            self._sleeping = False
            self._paused = False
            return True

        def checkpoint_prepare(mode: str = "wait") -> str | None:
            if self._checkpoint == "running" and self._sleeping:
                return "Preparing for a checkpoint requires an awake engine"
            self._checkpoint = "prepared"
            self._paused = True
            return None

        def checkpoint_restore() -> None:
            if self._checkpoint == "prepared":
                self._checkpoint = "running"
                self._paused = False

        def profile(is_start: bool = True, *_: Any) -> None:
            if is_start == self._profiling:
                state = "already running" if is_start else "not running"
                raise RuntimeError(f"the profiler is {state}")
            self._profiling = is_start

        def add_lora(lora_request: LoRARequest) -> bool:
            lora_id = lora_request.lora_int_id
            if lora_id not in self._loras and len(self._loras) >= self.max_loras:
                return False
            self._loras.add(lora_id)
            return True

        def pin_lora(lora_id: int) -> bool:
            return lora_id in self._loras

        def remove_lora(lora_id: int) -> bool:
            found = lora_id in self._loras
            self._loras.discard(lora_id)
            return found

        def set_paused(paused: bool) -> Callable[..., None]:
            def pause_or_resume(*_: Any) -> None:
                self._paused = paused

            return pause_or_resume

        def set_weight_version(version: str | None) -> None:
            self._weight_version = version

        return {
            "is_sleeping": lambda: self._sleeping or self._paused,
            "sleep": sleep,
            "wake_up": wake_up,
            "profile": profile,
            "get_supported_tasks": lambda: ("generate",),
            "get_request_counts": lambda: (0, self.in_flight),
            "add_lora": add_lora,
            "remove_lora": remove_lora,
            "pin_lora": pin_lora,
            "list_loras": lambda: set(self._loras),
            "reset_prefix_cache": lambda *args: True,
            "execute_dummy_batch": lambda: None,
            "set_weight_version": set_weight_version,
            "get_weight_version": lambda: self._weight_version,
            "pause_scheduler": set_paused(True),
            "resume_scheduler": set_paused(False),
            "is_scheduler_paused": lambda: self._paused,
            "release_kv_cache_memory": lambda *args: None,
            "is_inference_ready": lambda: not (self._sleeping or self._paused),
            "checkpoint_prepare": checkpoint_prepare,
            "checkpoint_restore": checkpoint_restore,
            "checkpoint_state": lambda: (self._checkpoint, None),
        }


@final
class FakeTransport:
    """The transport of a client connected to a :class:`FakeEngine`: each request is
    played by a task of the client's nursery, one scripted step per
    ``engine.step_time_s``; utility calls are answered by the engine's handlers."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.playing = 0
        """Requests the fake engine is still producing outputs for."""
        self._plays: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None
        self._link: ClientLink | None = None

    async def start(self, nursery: trio.Nursery, link: ClientLink) -> None:
        self._nursery = nursery
        self._link = link
        link.state.engines[:] = [EngineHandle(rank=0, identity=b"\x00\x00")]
        await trio.lowlevel.checkpoint()

    def _started(self) -> tuple[trio.Nursery, ClientLink]:
        assert self._nursery is not None, "not started"
        assert self._link is not None, "not started"
        return self._nursery, self._link

    def send_add(self, engine: EngineHandle, request: EngineCoreRequest) -> None:
        # Never blocks: add_requests() hands the whole batch over with one checkpoint,
        # as with the real transports.
        nursery, link = self._started()
        self.engine.requests.append(request)
        scope = trio.CancelScope()
        self._plays[request.request_id] = scope
        self.playing += 1
        nursery.start_soon(self._play, request, scope, link)

    async def _play(
        self, request: EngineCoreRequest, scope: trio.CancelScope, link: ClientLink
    ) -> None:
        response = self.engine.response_for(request)
        try:
            with scope:
                steps = response.steps or ((),)
                for i, tokens in enumerate(steps):
                    await trio.sleep(self.engine.step_time_s)
                    last = i == len(steps) - 1
                    output = EngineCoreOutput(
                        request.request_id,
                        list(tokens),
                        finish_reason=response.finish_reason if last else None,
                        stop_reason=response.stop_reason if last else None,
                        error=response.error if last else None,
                    )
                    link.state.handle_outputs(EngineCoreOutputs(outputs=[output]))
        finally:
            self._forget(request.request_id, scope)

    def send_abort(self, engine: EngineHandle, request_ids: list[str]) -> None:
        _, link = self._started()
        for request_id in request_ids:
            self.engine.aborted.append(link.state.user_id(request_id))
            scope = self._plays.get(request_id)
            if scope is not None:
                scope.cancel()
                # Forgotten now, as an engine forgets a request when it reads the
                # ABORT: a call right after this one must not count it.
                self._forget(request_id, scope)

    def _forget(self, request_id: str, scope: trio.CancelScope) -> None:
        if self._plays.get(request_id) is scope:
            del self._plays[request_id]
            self.playing -= 1

    def send_utility(self, engine: EngineHandle, call: UtilityRequest) -> None:
        nursery, link = self._started()
        self.engine.utility_calls.append((call.method, tuple(call.args)))
        nursery.start_soon(self._reply, self._run_utility(call), link)

    def _run_utility(self, call: UtilityRequest) -> UtilityOutput:
        handler = self.engine.utility_handler(call.method)
        try:
            if handler is None:
                raise AttributeError(f"the fake engine has no utility {call.method!r}")
            result = handler(*call.args)
        except Exception as exc:
            return UtilityOutput(call.call_id, f"Call to {call.method} method failed: {exc}")
        return UtilityOutput(call.call_id, None, UtilityResult(result))

    async def _reply(self, reply: UtilityOutput, link: ClientLink) -> None:
        await trio.lowlevel.checkpoint()
        link.state.handle_outputs(EngineCoreOutputs(utility_output=reply))

    def die(self, reason: str) -> None:
        """Fail the client as a dead engine would (see :meth:`FakeEngine.kill`)."""
        for scope in self._plays.values():
            scope.cancel()
        if self._link is not None:
            self._link.engine_died(self._link.state.engines[0], reason)

    @property
    def restarts_engines(self) -> bool:
        """Never: the scripted engine is not a process."""
        return False

    def engine_death_recorded(self, engine: EngineHandle) -> None:
        """Nothing more to stop: :meth:`die` stopped every play."""

    async def aclose(self) -> None:
        """Stop every play."""
        for scope in self._plays.values():
            scope.cancel()
        await trio.lowlevel.checkpoint()


@asynccontextmanager
async def open_fake_engine_client(
    engine: FakeEngine | None = None,
    *,
    max_pending_outputs: int = 64,
    cancel_on_failure: bool = False,
) -> AsyncGenerator[TrioEngineClient, None]:
    """A client connected to ``engine`` (a new :class:`FakeEngine` by default).

    The client is the real :class:`~trio_enginecore.client.TrioEngineClient` (every
    rule of the request bookkeeping, streams and cancellation is the library's own);
    only its transport is fake. Same contract as
    :func:`~trio_enginecore.open_engine_client`: leaving the block aborts in-flight
    requests; the block's exception propagates unchanged; if the engine was killed
    and the block did not raise, it raises ``EngineDeadError``.
    """
    engine = engine if engine is not None else FakeEngine()
    transport = FakeTransport(engine)
    client = TrioEngineClient(transport, EngineConfig(), max_pending_outputs=max_pending_outputs)
    engine.transport = transport
    engine.client = client
    async with run_client(client, cancel_on_failure=cancel_on_failure) as running:
        yield running

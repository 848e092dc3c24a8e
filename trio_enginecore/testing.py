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
each the previous token plus one, until ``max_tokens`` (finish reason LENGTH). The
engine records what it received (:attr:`FakeEngine.requests`, :attr:`FakeEngine.aborted`,
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

from .client._base import TrioClientBase, run_client
from .client._launch import EngineHandle
from .config import EngineConfig
from .protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    RequestError,
    UtilityOutput,
    UtilityRequest,
    UtilityResult,
)

__all__ = ["FakeEngine", "FakeEngineClient", "ScriptedResponse", "open_fake_engine_client"]


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

    def __init__(self, *, step_time_s: float = 0.0, vocab_size: int = 32000) -> None:
        self.step_time_s = step_time_s
        self.vocab_size = vocab_size
        self.requests: list[EngineCoreRequest] = []
        """Every request the engine received, in order."""
        self.aborted: list[str] = []
        """Ids of the requests the client aborted, in order."""
        self.utility_calls: list[tuple[str, tuple[Any, ...]]] = []
        """Every utility call received, as ``(method, args)``."""
        self._scripts: dict[str, ScriptedResponse] = {}
        self._utilities: dict[str, UtilityHandler] = self._default_utilities()
        self._sleeping = False
        self.client: FakeEngineClient | None = None
        """The client connected to this engine, once there is one."""

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
        if self.client is not None:
            self.client.die(reason)

    @property
    def in_flight(self) -> int:
        """Requests the engine is still producing outputs for."""
        return self.client.playing if self.client is not None else 0

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
        last = request.prompt_token_ids[-1] if request.prompt_token_ids else 0
        steps = tuple(((last + i) % self.vocab_size,) for i in range(1, count + 1))
        return ScriptedResponse(steps)

    def utility_handler(self, method: str) -> UtilityHandler | None:
        """What answers utility ``method`` (see :meth:`on_utility`), or None."""
        return self._utilities.get(method)

    def _default_utilities(self) -> dict[str, UtilityHandler]:
        def sleep(level: int = 1) -> None:
            self._sleeping = True

        def wake_up(tags: Any = None) -> bool:
            self._sleeping = False
            return True

        def counts() -> tuple[int, int]:
            return 0, self.in_flight

        return {
            "is_sleeping": lambda: self._sleeping,
            "sleep": sleep,
            "wake_up": wake_up,
            "get_supported_tasks": lambda: ("generate",),
            "get_request_counts": counts,
            "list_loras": list,
            "reset_prefix_cache": lambda *args: True,
            "is_scheduler_paused": lambda: False,
        }


@final
class FakeEngineClient(TrioClientBase):
    """A Trio client connected to a :class:`FakeEngine` (no process, no socket)."""

    def __init__(self, engine: FakeEngine, *, max_pending_outputs: int = 64) -> None:
        super().__init__(EngineConfig(), max_pending_outputs=max_pending_outputs)
        self.engine = engine
        self._state.engines = [EngineHandle(rank=0, identity=b"\x00\x00")]
        self._nursery: trio.Nursery | None = None
        self._plays: dict[str, trio.CancelScope] = {}
        self.playing = 0
        """Requests the fake engine is still producing outputs for."""
        engine.client = self

    async def _start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        await trio.lowlevel.checkpoint()

    def _spawn(self, function: Callable[[], Any]) -> None:
        assert self._nursery is not None, "the client is not started"
        self._nursery.start_soon(function)

    def _transport_add(self, engine: EngineHandle, request: EngineCoreRequest) -> None:
        # Never blocks: add_requests() hands the whole batch over with one checkpoint,
        # as with the real transports.
        self.engine.requests.append(request)
        scope = trio.CancelScope()
        self._plays[request.request_id] = scope
        self.playing += 1
        self._spawn(lambda: self._play(request, scope))

    async def _play(self, request: EngineCoreRequest, scope: trio.CancelScope) -> None:
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
                    self._handle_outputs(EngineCoreOutputs(outputs=[output]))
        finally:
            self._plays.pop(request.request_id, None)
            self.playing -= 1

    def _transport_abort(self, engine: EngineHandle, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.aborted.append(self._state.user_id(request_id))
            scope = self._plays.get(request_id)
            if scope is not None:
                scope.cancel()

    def _transport_utility(self, engine: EngineHandle, call: UtilityRequest) -> None:
        self.engine.utility_calls.append((call.method, tuple(call.args)))
        reply = self._run_utility(call)
        self._spawn(lambda: self._reply(reply))

    def _run_utility(self, call: UtilityRequest) -> UtilityOutput:
        handler = self.engine.utility_handler(call.method)
        try:
            if handler is None:
                raise AttributeError(f"the fake engine has no utility {call.method!r}")
            result = handler(*call.args)
        except Exception as exc:
            return UtilityOutput(call.call_id, f"Call to {call.method} method failed: {exc}")
        return UtilityOutput(call.call_id, None, UtilityResult(result))

    async def _reply(self, reply: UtilityOutput) -> None:
        await trio.lowlevel.checkpoint()
        self._handle_outputs(EngineCoreOutputs(utility_output=reply))

    def die(self, reason: str) -> None:
        """Fail the client as a dead engine would (see :meth:`FakeEngine.kill`)."""
        for scope in self._plays.values():
            scope.cancel()
        self._engine_died(self._state.engines[0], reason)

    async def aclose(self) -> None:
        """Abort what is in flight and stop the fake engine. Idempotent."""
        if not self._state.closed:
            self._fail_waiters_on_close()
            self._state.closed = True
            for scope in self._plays.values():
                scope.cancel()
        await trio.lowlevel.checkpoint()


@asynccontextmanager
async def open_fake_engine_client(
    engine: FakeEngine | None = None, *, max_pending_outputs: int = 64
) -> AsyncGenerator[FakeEngineClient, None]:
    """A client connected to ``engine`` (a new :class:`FakeEngine` by default).

    Same contract as :func:`~trio_enginecore.open_engine_client`: leaving the block
    aborts in-flight requests; the block's exception propagates unchanged; if the
    engine was killed and the block did not raise, it raises ``EngineDeadError``.
    """
    client = FakeEngineClient(
        engine if engine is not None else FakeEngine(), max_pending_outputs=max_pending_outputs
    )
    async with run_client(client, client._start) as running:  # pyright: ignore[reportPrivateUsage]
        yield running

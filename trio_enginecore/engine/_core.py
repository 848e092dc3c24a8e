"""EngineCore: the reference engine's scheduler and utility methods, free of I/O.

The process around it (:mod:`trio_enginecore.engine._proc`) feeds it decoded requests
and sends what it returns; everything here is synchronous and deterministic, so it is
unit-tested without sockets.

Scheduling follows vLLM v1's continuous batching, simplified to one new token per
running request per step: waiting requests join the batch in arrival order while fewer
than ``max_num_seqs`` run; a request leaves the batch when it finishes or is aborted.
"""

from __future__ import annotations

import collections
import enum
import inspect
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, NamedTuple, TypeVar, cast, get_type_hints, overload

import msgspec
import numpy as np

from .._request_checks import check_request
from ..config import EngineConfig
from ..protocol import (
    CheckpointState,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    LoRARequest,
    PauseMode,
    RequestError,
    SchedulerStats,
    Tensor,
    UtilityOutput,
    UtilityResult,
)
from ._logprobs import (
    logprobs_problem,
    prompt_logprobs,
    prompt_token_id_logprobs,
    sample_logprobs,
)
from ._models import Model, make_model

__all__ = ["EngineCore", "FatalEngineError", "PauseMode", "PrefixCache", "utility"]

logger = logging.getLogger("trio_enginecore.engine")

BLOCK_SIZE: Final = 16
"""Tokens per KV-cache block, as reported in the ready response."""
_PAUSE_MODES: Final = ("abort", "wait", "keep")
_RESTORED: Final[tuple[CheckpointState, ...]] = ("running", "restoring")
_FAULT_INJECTION: Final = frozenset({"inject_fault", "stall", "stall_steps"})
"""The utilities that make the engine fail or stall: refused unless
``EngineConfig.enable_fault_injection``."""

F = TypeVar("F", bound=Callable[..., Any])


class FatalEngineError(Exception):
    """An error the engine cannot continue after (the process reports ENGINE_CORE_DEAD)."""


class _Deferred:
    """Marker returned by a utility whose reply is sent later by the engine itself."""


_DEFERRED: Final = _Deferred()

Caller = tuple[int, int]
"""Who called a utility, to reply to later: ``(client_index, call_id)``."""


@overload
def utility(method: F, /) -> F: ...
@overload
def utility(*, deferred: bool = False) -> Callable[[F], F]: ...
def utility(method: F | None = None, /, *, deferred: bool = False) -> F | Callable[[F], F]:
    """Mark an :class:`EngineCore` method as callable by clients through UTILITY.

    ``@utility(deferred=True)`` marks one that may reply later: it is called with the
    ``caller`` keyword (a ``Caller``) besides the client's arguments, and returns
    ``_DEFERRED`` when the engine will send the reply itself, later, to that caller.
    """

    def mark(function: F) -> F:
        function.__engine_utility__ = True  # type: ignore[attr-defined]
        function.__engine_deferred__ = deferred  # type: ignore[attr-defined]
        return function

    return mark if method is None else mark(method)


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"


class _Request:
    """A request inside the engine. Satisfies the model's ``SamplingState``."""

    __slots__ = (
        "client_index",
        "eos_token_id",
        "events",
        "ignore_eos",
        "logprob_ids",
        "logprobs_top",
        "lora_id",
        "max_tokens",
        "min_p",
        "min_tokens",
        "output_token_ids",
        "prompt_len",
        "prompt_logprob_start",
        "prompt_logprob_token_ids",
        "prompt_logprobs_top",
        "request_id",
        "rng",
        "scored",
        "state",
        "stop_token_ids",
        "temperature",
        "token_ids",
        "top_k",
        "top_p",
    )

    def __init__(
        self,
        request: EngineCoreRequest,
        *,
        max_tokens: int,
        eos_token_id: int | None,
        rng: np.random.Generator,
    ) -> None:
        params = request.sampling_params
        assert params is not None
        assert request.prompt_token_ids is not None
        self.request_id = request.request_id
        self.client_index = request.client_index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.min_tokens = params.min_tokens
        self.ignore_eos = params.ignore_eos
        self.eos_token_id = eos_token_id
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.temperature = params.temperature
        self.top_k = params.top_k
        self.top_p = params.top_p
        self.min_p = params.min_p
        self.rng = rng
        self.lora_id = request.lora_request.lora_int_id if request.lora_request else None
        self.state = _State.WAITING
        self.events: list[EngineCoreEvent] | None = None
        # Logprobs: alternatives per sampled token (-1: all; None: no logprobs), or
        # these ids instead; the same for the prompt, from this position on.
        self.logprob_ids = params.logprob_token_ids or None
        self.logprobs_top = params.num_logprobs
        self.prompt_logprobs_top = params.prompt_logprobs
        self.prompt_logprob_token_ids = params.prompt_logprob_token_ids
        self.prompt_logprob_start = params.prompt_logprob_start or 0
        self.scored = (
            self.logprobs_top is not None
            or self.prompt_logprobs_top is not None
            or self.prompt_logprob_token_ids is not None
        )

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def add_event(self, event_type: EngineCoreEventType, now: float) -> None:
        if self.events is None:
            self.events = []
        self.events.append(EngineCoreEvent(event_type, now))

    def take_events(self) -> list[EngineCoreEvent] | None:
        events, self.events = self.events, None
        return events


class _Scored(NamedTuple):
    """One request's logprobs of one step, for its output."""

    position: int
    """Its position in the step's batch."""
    sample: LogprobsLists | None
    prompt: LogprobsTensors | None
    prompt_ids: Tensor | None
    """The scores of its ``prompt_logprob_token_ids``."""


def num_gpu_blocks(config: EngineConfig) -> int:
    """The KV-cache blocks the engine has: room for ``max_num_seqs`` full-length requests."""
    return config.max_num_seqs * config.max_model_len // BLOCK_SIZE


class PrefixCache:
    """The reference engine's stand-in for vLLM's prefix cache, bounded like the real one.

    vLLM keeps the KV blocks of past prompts for reuse until it needs the blocks for
    something else; the reference engine computes no KV, so it only records which
    prompts it would hold. Each prompt is one entry: a hash of its token ids (never
    the tokens) and the number of blocks its KV takes. The entries together take at
    most ``capacity_blocks`` blocks; a new prompt evicts the least recently used ones
    until it fits, and a prompt seen again becomes the most recently used. Memory is
    therefore bounded by the engine's configuration, however many prompts it serves.

    Args:
        capacity_blocks: how many blocks the entries may take in all.
        block_size: tokens per block.
    """

    __slots__ = ("_blocks_used", "_entries", "block_size", "capacity_blocks")

    def __init__(self, capacity_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity_blocks < 0 or block_size < 1:
            raise ValueError(
                f"need capacity_blocks >= 0 and block_size >= 1, got {capacity_blocks} "
                f"and {block_size}"
            )
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._entries: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._blocks_used = 0

    @property
    def blocks_used(self) -> int:
        """Blocks taken by the prompts held."""
        return self._blocks_used

    def __len__(self) -> int:
        """How many prompts are held."""
        return len(self._entries)

    def __contains__(self, prompt: object) -> bool:
        """Whether this prompt (a sequence of token ids) is held. Does not count as a use."""
        if not isinstance(prompt, Sequence):
            return False
        return _prompt_key(cast("Sequence[object]", prompt)) in self._entries

    def add(self, prompt: Sequence[int]) -> None:
        """Record that a prompt was computed: held (again) as the most recently used.

        A prompt too long for the whole cache is not held.
        """
        key = _prompt_key(prompt)
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
            return
        blocks = -(-len(prompt) // self.block_size)
        if blocks > self.capacity_blocks:
            return
        self._blocks_used += blocks
        entries[key] = blocks
        while self._blocks_used > self.capacity_blocks:
            _, evicted = entries.popitem(last=False)
            self._blocks_used -= evicted

    def clear(self) -> None:
        """Drop every prompt."""
        self._entries.clear()
        self._blocks_used = 0


def _prompt_key(prompt: Sequence[object]) -> int:
    # Python's tuple-of-int hash is 64 bits and the same in every process (no hash
    # randomisation for ints), which is all a stand-in needs: a collision only makes
    # two prompts share an entry.
    return hash(tuple(prompt))


class EngineCore:
    """The scheduler and utility methods of the reference engine.

    Feed it with :meth:`add_request`, :meth:`abort_requests` and :meth:`call_utility`;
    call :meth:`step` to run one model step and collect the messages to send, and
    :meth:`take_utility_outputs` for utility replies. Nothing here blocks or does I/O.

    Args:
        config: the engine configuration.
        model: the model to serve; by default the built-in one named by ``config``.
        clock: the time source for timestamps and events.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: Model | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.model = model if model is not None else make_model(config)
        self._clock = clock
        self._rng = np.random.default_rng(config.seed)
        self._requests: dict[str, _Request] = {}
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[str, _Request] = {}
        # The running requests that asked for logprobs: while it is empty, a step
        # computes none and looks at no request for them.
        self._scored: dict[str, _Request] = {}
        # Outputs decided outside a model step (rejections, engine-initiated aborts),
        # sent with the next step's outputs.
        self._pending_outputs: list[EngineCoreOutput] = []
        self._pending_clients: list[int] = []
        self._utility_outputs: list[tuple[int, UtilityOutput]] = []
        self._asleep: set[str] = set()
        """What vLLM's executor would have put to sleep: ``weights`` and ``kv_cache``
        after :meth:`sleep`, ``kv_cache`` after :meth:`release_kv_cache_memory`."""
        self._paused = False
        self._pause_waiters: list[Caller] = []
        self._draining_for_pause = False
        self._checkpoint: CheckpointState = "running"
        self._loras: dict[int, LoRARequest] = {}
        self._pinned_loras: set[int] = set()
        self._weight_version: str | None = None
        self._profiling = False
        self.prefix_cache = PrefixCache(num_gpu_blocks(config))
        """The prompts whose KV the engine would keep for reuse (see :class:`PrefixCache`)."""
        self._step_counter = 0
        self._fault_requested = False
        self._stall_s = 0.0
        self._instance_id = f"trio-enginecore-{uuid.uuid4().hex[:12]}"

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest, *, decoded: bool = False) -> None:
        """Queue a request, or (if it is invalid) an ERROR output for it.

        Never raises for a bad request: the client learns why through an output with
        ``FinishReason.ERROR`` and a :class:`~trio_enginecore.protocol.RequestError`.

        ``decoded``: the request came off the wire through the typed decoder, which
        already checked every field's type and the sampling parameters' ranges (in
        their ``__post_init__``); a request handed over in-process (the default) is
        checked field by field here, as a client checks what it sends.
        """
        problem = self._validate(request, decoded=decoded)
        if problem is not None:
            logger.warning("rejecting request %r: %s", request.request_id, problem)
            self.reject(request.request_id, request.client_index, problem)
            return
        try:
            self._admit(request)
        except Exception as exc:
            # Something no check foresaw: it is this request's failure, never the
            # engine's (an engine in the client's process would take the client down).
            logger.exception("rejecting request %r", request.request_id)
            self.reject(request.request_id, request.client_index, f"invalid request: {exc!r}")

    def _admit(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        assert params is not None
        assert request.prompt_token_ids is not None
        prompt_len = len(request.prompt_token_ids)
        room = self.config.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = params.eos_token_id if params.eos_token_id is not None else self.model.eos_token_id
        # Seeds are any 64-bit int, as in vLLM (torch remaps negative ones); numpy only
        # takes non-negative seeds, so wrap them instead of raising on a client's value.
        rng = np.random.default_rng(params.seed % 2**64) if params.seed is not None else self._rng
        state = _Request(request, max_tokens=max_tokens, eos_token_id=eos, rng=rng)
        if request.lora_request is not None and request.lora_request.lora_int_id not in self._loras:
            self._loras[request.lora_request.lora_int_id] = request.lora_request
        if self.config.log_stats:
            state.add_event(EngineCoreEventType.QUEUED, self._clock())
        self._requests[state.request_id] = state
        self._waiting.append(state)

    def _validate(self, request: EngineCoreRequest, *, decoded: bool) -> str | None:
        if not decoded:
            try:
                # What a typed decoder guarantees for requests off the wire, checked
                # for the ones handed over in-process, which nothing decoded.
                check_request(request)
            except (TypeError, ValueError) as exc:
                return str(exc)
        if request.request_id in self._requests:
            return f"a request with id {request.request_id!r} is already in flight"
        if request.sampling_params is None:
            return "this engine only serves generation requests (sampling_params is required)"
        if request.prompt_embeds is not None or request.mm_features:
            return "this engine accepts token-id prompts only (no embeddings or multimodal)"
        prompt = request.prompt_token_ids
        if not prompt:
            return "the prompt must contain at least one token"
        vocab = self.model.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            return f"prompt token ids must be in [0, {vocab})"
        if len(prompt) >= self.config.max_model_len:
            return (
                f"the prompt has {len(prompt)} tokens, but max_model_len is "
                f"{self.config.max_model_len} (at least one token must fit after it)"
            )
        lora = request.lora_request
        if (
            lora is not None
            and lora.lora_int_id not in self._loras
            and len(self._loras) >= self.config.max_loras
        ):
            return f"no room for LoRA adapter {lora.lora_int_id}: max_loras is full"
        params = request.sampling_params
        if (
            params.logprobs is not None
            or params.prompt_logprobs is not None
            or params.logprob_token_ids is not None
            or params.prompt_logprob_token_ids is not None
            or params.prompt_logprob_start is not None
        ):
            if not self.model.has_logprobs:
                return f"the {self.model.name} model computes no logprobs"
            return logprobs_problem(
                params, vocab, self.config.max_logprobs, self.config.max_model_len
            )
        return None

    def reject(self, request_id: str, client_index: int, message: str) -> None:
        """Queue an ERROR output for a request the engine will not run."""
        self._pending_outputs.append(
            EngineCoreOutput(
                request_id,
                [],
                finish_reason=FinishReason.ERROR,
                error=RequestError("invalid_request", message),
            )
        )
        self._pending_clients.append(client_index)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Forget these requests. Idempotent; unknown ids are ignored.

        Client-initiated aborts produce no output, as in vLLM: the client has already
        dropped the request.
        """
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is None:
                continue
            if state.state is _State.RUNNING:
                del self._running[request_id]
                self._scored.pop(request_id, None)
            else:
                self._waiting.remove(state)
        self._finish_pause_if_drained()

    def forget_client(self, client_index: int) -> int:
        """Drop everything of a client that is gone; return how many requests it had.

        Its requests are aborted with no output (there is nobody to send one to), and
        the outputs and utility replies queued for it are discarded, so none reaches
        the next client to take its index. A ``pause_scheduler("wait")`` it was waiting
        on still pauses the engine (engine-wide state outlives the client that set it),
        without a reply.
        """
        request_ids = [
            rid for rid, state in self._requests.items() if state.client_index == client_index
        ]
        self._pause_waiters = [w for w in self._pause_waiters if w[0] != client_index]
        self.abort_requests(request_ids)
        kept = [
            (client, output)
            for client, output in zip(self._pending_clients, self._pending_outputs, strict=True)
            if client != client_index
        ]
        self._pending_clients = [client for client, _ in kept]
        self._pending_outputs = [output for _, output in kept]
        self._utility_outputs = [
            (client, reply) for client, reply in self._utility_outputs if client != client_index
        ]
        return len(request_ids)

    def _abort_all_with_output(self) -> None:
        """Engine-initiated abort of everything in flight; clients get ABORT outputs."""
        for state in list(self._requests.values()):
            self._pending_outputs.append(
                EngineCoreOutput(state.request_id, [], finish_reason=FinishReason.ABORT)
            )
            self._pending_clients.append(state.client_index)
        self._requests.clear()
        self._waiting.clear()
        self._running.clear()
        self._scored.clear()

    def abort_all(self) -> None:
        """Abort every request, telling each client with an ABORT output (for drains)."""
        self._abort_all_with_output()

    # ----------------------------------------------------------------- stepping

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_requests(self) -> int:
        """Requests in flight (waiting or running)."""
        return len(self._requests)

    @property
    def can_step(self) -> bool:
        """True if :meth:`step` would make progress or has something to send."""
        if self._pending_outputs:
            return True
        if self._asleep or self._paused:
            return False
        return bool(self._running) or (bool(self._waiting) and not self._draining_for_pause)

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Run one model step; return the messages to send, keyed by client index.

        Sleeping or paused engines run no model step but still return pending outputs
        (rejections, engine-initiated aborts).

        Raises:
            FatalEngineError: the model failed; the engine cannot go on.
        """
        if self._fault_requested:
            raise FatalEngineError("fault injected on request (inject_fault utility)")
        now = self._clock()
        outputs = self._pending_outputs
        clients = self._pending_clients
        self._pending_outputs, self._pending_clients = [], []
        if not (self._asleep or self._paused):
            self._schedule(now)
            if self._running:
                if self._stall_s:
                    _hold_thread(self._stall_s)
                self._run_model(now, outputs, clients)
        self._finish_pause_if_drained()
        if not outputs:
            return {}
        stats = self._stats() if self.config.log_stats else None
        grouped: dict[int, list[EngineCoreOutput]] = {}
        for client, output in zip(clients, outputs, strict=True):
            grouped.setdefault(client, []).append(output)
        return {
            client: EngineCoreOutputs(
                engine_index=self.config.data_parallel_rank,
                outputs=batch,
                scheduler_stats=stats,
                timestamp=now,
                weight_version=self._weight_version,
            )
            for client, batch in grouped.items()
        }

    def _schedule(self, now: float) -> None:
        if self._draining_for_pause:
            return
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            state = self._waiting.popleft()
            state.state = _State.RUNNING
            self._running[state.request_id] = state
            if state.scored:
                self._scored[state.request_id] = state
            self.prefix_cache.add(state.token_ids[: state.prompt_len])
            if self.config.log_stats:
                state.add_event(EngineCoreEventType.SCHEDULED, now)

    def _run_model(self, now: float, outputs: list[EngineCoreOutput], clients: list[int]) -> None:
        batch = list(self._running.values())
        try:
            tokens = self.model.next_tokens(batch)
        except Exception as exc:
            raise FatalEngineError(f"model {self.model.name!r} failed: {exc!r}") from exc
        if len(tokens) != len(batch):
            raise FatalEngineError(
                f"model {self.model.name!r} returned {len(tokens)} tokens for {len(batch)}"
            )
        # Scored against each sequence as the model saw it, before its new token.
        scores = self._score(batch, tokens) if self._scored else None
        self._step_counter += 1
        first = len(outputs)
        for state, token in zip(batch, tokens, strict=True):
            state.token_ids.append(token)
            state.output_token_ids.append(token)
            finish, stop_reason = self._check_stop(state, token)
            if finish is not None:
                del self._running[state.request_id]
                del self._requests[state.request_id]
            outputs.append(
                EngineCoreOutput(
                    state.request_id,
                    [token],
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    events=state.take_events(),
                )
            )
            clients.append(state.client_index)
        if scores is not None:
            self._attach(scores, outputs, first)

    def _score(self, batch: list[_Request], tokens: list[int]) -> list[_Scored]:
        """The logprobs of this step's requests that asked for them. Prompt logprobs
        come with a request's first token."""
        scores: list[_Scored] = []
        model = self.model
        try:
            for index, state in enumerate(batch):
                if not state.scored:
                    continue
                sample = prompt = prompt_ids = None
                if state.logprobs_top is not None:
                    sample = sample_logprobs(
                        model,
                        state.token_ids,
                        tokens[index],
                        top=state.logprobs_top,
                        ids=state.logprob_ids,
                    )
                if not state.output_token_ids:
                    if state.prompt_logprobs_top is not None:
                        prompt = prompt_logprobs(
                            model,
                            state.token_ids,
                            top=state.prompt_logprobs_top,
                            start=state.prompt_logprob_start,
                        )
                    if state.prompt_logprob_token_ids is not None:
                        prompt_ids = prompt_token_id_logprobs(
                            model,
                            state.token_ids,
                            state.prompt_logprob_token_ids,
                            start=state.prompt_logprob_start,
                        )
                    if sample is None:
                        # It asked about its prompt only, and has its answer.
                        state.scored = False
                        del self._scored[state.request_id]
                scores.append(_Scored(index, sample, prompt, prompt_ids))
        except Exception as exc:
            raise FatalEngineError(
                f"model {model.name!r} failed computing logprobs: {exc!r}"
            ) from exc
        return scores

    def _attach(self, scores: list[_Scored], outputs: list[EngineCoreOutput], first: int) -> None:
        for position, sample, prompt, prompt_ids in scores:
            output = outputs[first + position]
            output.new_logprobs = sample
            output.new_prompt_logprobs_tensors = prompt
            output.prompt_token_id_logprobs = prompt_ids
            if output.finish_reason is not None:
                self._scored.pop(output.request_id, None)

    def _check_stop(self, state: _Request, token: int) -> tuple[FinishReason | None, int | None]:
        # Same order as vLLM: length limits win over stop tokens, and min_tokens only
        # holds back stop tokens.
        if len(state.output_token_ids) >= state.max_tokens:
            return FinishReason.LENGTH, None
        if len(state.token_ids) >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        if len(state.output_token_ids) < state.min_tokens:
            return None, None
        if not state.ignore_eos and token == state.eos_token_id:
            return FinishReason.STOP, None
        if token in state.stop_token_ids:
            return FinishReason.STOP, token
        return None, None

    def _stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            step_counter=self._step_counter,
            kv_cache_usage=self._kv_usage(),
            running_lora_adapters=self._lora_counts(self._running.values()),
            waiting_lora_adapters=self._lora_counts(self._waiting),
        )

    def _kv_usage(self) -> float:
        used = sum(len(s.token_ids) for s in self._running.values())
        capacity = self.config.max_num_seqs * self.config.max_model_len
        return min(1.0, used / capacity)

    def _lora_counts(self, states: Iterable[_Request]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for state in states:
            if state.lora_id is not None:
                lora = self._loras.get(state.lora_id)
                name = lora.lora_name if lora is not None else str(state.lora_id)
                counts[name] = counts.get(name, 0) + 1
        return counts

    # ------------------------------------------------------------------ utilities

    def call_utility(
        self, client_index: int, call_id: int, method: str, args: Sequence[Any]
    ) -> None:
        """Run a utility method by name and queue its reply for ``client_index``.

        Only methods marked with :func:`utility` can be called. Failures never escape:
        the reply carries ``failure_message`` (in vLLM's words, ``"Call to {method}
        method failed: {error}"``), and the engine keeps serving.
        """
        try:
            result = self._dispatch(client_index, call_id, method, args)
        except FatalEngineError:
            raise
        except Exception as exc:
            logger.info("utility %s failed: %r", method, exc)
            self.reply_failure(client_index, call_id, method, str(exc))
            return
        if result is not _DEFERRED:
            self._reply(client_index, call_id, result)

    def reply_failure(self, client_index: int, call_id: int, method: str, message: str) -> None:
        """Queue a failure reply for a utility call."""
        failure = f"Call to {method} method failed: {message}"
        self._utility_outputs.append((client_index, UtilityOutput(call_id, failure)))

    def _reply(self, client_index: int, call_id: int, result: Any) -> None:
        self._utility_outputs.append(
            (client_index, UtilityOutput(call_id, None, UtilityResult(result)))
        )

    def take_utility_outputs(self) -> list[tuple[int, UtilityOutput]]:
        """Utility replies ready to send, as ``(client_index, reply)`` pairs."""
        replies, self._utility_outputs = self._utility_outputs, []
        return replies

    @classmethod
    def utility_names(cls) -> list[str]:
        """Names of the methods clients may call."""
        return sorted(
            name
            for name, member in inspect.getmembers(cls, inspect.isfunction)
            if getattr(member, "__engine_utility__", False)
        )

    def _dispatch(self, client_index: int, call_id: int, method: str, args: Sequence[Any]) -> Any:
        function: Callable[..., Any] | None = getattr(type(self), method, None)
        if function is None or not getattr(function, "__engine_utility__", False):
            raise AttributeError(f"the engine has no utility method {method!r}")
        if method in _FAULT_INJECTION and not self.config.enable_fault_injection:
            raise PermissionError("fault injection is disabled on this engine")
        bound = getattr(self, method)
        if getattr(function, "__engine_deferred__", False):
            return bound(*_convert_args(function, args), caller=(client_index, call_id))
        return bound(*_convert_args(function, args))

    @utility
    def is_sleeping(self) -> bool:
        """Whether the engine is asleep at any level, as vLLM answers: its scheduler
        is paused (:meth:`sleep` pauses it; so does :meth:`pause_scheduler`), or part
        of its memory is asleep."""
        return self._paused or bool(self._asleep)

    @utility
    def sleep(
        self, level: int = 1, mode: PauseMode | None = None, reset_connector: bool = True
    ) -> None:
        """Pause the scheduler and put the engine's memory to sleep until
        :meth:`wake_up`, as vLLM does.

        ``mode`` is vLLM's (its clients always send one): ``"abort"`` aborts the
        requests in flight first (their clients get ABORT outputs), ``"keep"`` (and
        no mode, what this project's clients send by default) keeps them queued where
        they are. ``"wait"`` (finish them first) is refused: pause with
        ``pause_scheduler("wait")`` before sleeping instead. ``reset_connector``
        (vLLM 0.34's clients send it) means nothing here: there is no KV connector.
        Refused while a process checkpoint is under way, as vLLM 0.34 refuses it.
        """
        self._refuse_unless_checkpoint("sleep", ("running",))
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if mode == "wait":
            raise ValueError(
                "sleep mode 'wait' is not supported by the reference engine: call "
                "pause_scheduler('wait') first, then sleep"
            )
        if mode == "abort":
            self._abort_all_with_output()
        self._paused = True
        self._asleep = {"weights", "kv_cache"}
        if level == 2:
            # Level 2 discards weights in vLLM; our closest analogue is the cache.
            self.prefix_cache.clear()

    @utility
    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake the memory ``tags`` names (``weights``, ``kv_cache``; all of it
        without tags) and, once all of it is awake, resume the scheduler, as vLLM does.

        Returns whether the engine is fully awake. A ``"scheduling"`` tag (vLLM's
        level-0 wake-up) wakes no memory. Refused while a process checkpoint is
        prepared and not restored.
        """
        self._refuse_unless_checkpoint("wake up", _RESTORED)
        if tags is None:
            self._asleep.clear()
        else:
            self._asleep.difference_update(tags)
        if self._asleep:
            return False
        self.resume_scheduler()
        return True

    @utility
    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Clear the prefix cache; False (nothing done) while requests are running."""
        if self._running and not reset_running_requests:
            return False
        self.prefix_cache.clear()
        return True

    @utility
    def profile(
        self,
        is_start: bool = True,
        profile_prefix: str | None = None,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Start or stop profiling (vLLM 0.33's arguments; the reference engine has
        nothing to profile and only tracks the state)."""
        if is_start == self._profiling:
            state = "already running" if is_start else "not running"
            raise RuntimeError(f"the profiler is {state}")
        self._profiling = is_start

    @utility
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter; False if ``max_loras`` are registered already."""
        if lora_request.lora_int_id in self._loras:
            self._loras[lora_request.lora_int_id] = lora_request
            return True
        if len(self._loras) >= self.config.max_loras:
            return False
        self._loras[lora_request.lora_int_id] = lora_request
        return True

    @utility
    def remove_lora(self, lora_id: int) -> bool:
        """Unregister a LoRA adapter; False if it was not registered."""
        self._pinned_loras.discard(lora_id)
        return self._loras.pop(lora_id, None) is not None

    @utility
    def list_loras(self) -> set[int]:
        """Ids of the registered LoRA adapters."""
        return set(self._loras)

    @utility
    def pin_lora(self, lora_id: int) -> bool:
        """Keep a LoRA adapter registered; False if it is not registered."""
        if lora_id not in self._loras:
            return False
        self._pinned_loras.add(lora_id)
        return True

    @utility
    def get_supported_tasks(self) -> tuple[str, ...]:
        """The tasks this engine serves."""
        return ("generate",)

    @utility
    def execute_dummy_batch(self) -> None:
        """Run the model once on a throwaway sequence (a warm-up in vLLM)."""
        self.model.next_tokens([_DummyState(self._rng)])

    @utility
    def set_weight_version(self, version: str | None) -> None:
        """Record the version of the weights in use (reported on every output)."""
        self._weight_version = version

    @utility
    def get_weight_version(self) -> str | None:
        """The weight version set by :meth:`set_weight_version`, if any."""
        return self._weight_version

    @utility(deferred=True)
    def pause_scheduler(
        self,
        mode: PauseMode = "abort",
        clear_cache: bool = True,
        reset_connector: bool = True,
        *,
        caller: Caller,
    ) -> _Deferred | None:
        """Stop scheduling. ``abort``: abort in-flight requests (clients get ABORT);
        ``wait``: let running requests finish first (the reply comes then); ``keep``:
        freeze in-flight requests where they are. New requests queue until resumed.
        ``reset_connector`` (vLLM 0.34) means nothing here: there is no KV connector."""
        return self._pause(mode, clear_cache, waiter=caller)

    def _pause(self, mode: PauseMode, clear_cache: bool, waiter: Caller | None) -> _Deferred | None:
        """Pause, or (``wait`` with requests running) start draining for a pause:
        ``waiter`` then gets its reply once drained, and ``_DEFERRED`` is returned."""
        _check_pause_mode(mode)
        if self._paused:
            return None
        if mode == "abort":
            self._abort_all_with_output()
        elif mode == "wait" and self._running:
            self._draining_for_pause = True
            if waiter is None:
                return None
            self._pause_waiters.append(waiter)
            return _DEFERRED
        self._paused = True
        if clear_cache:
            self.prefix_cache.clear()
        self._pause_completed()
        return None

    def _finish_pause_if_drained(self) -> None:
        if self._draining_for_pause and not self._running:
            self._draining_for_pause = False
            self._paused = True
            self._answer_pause_waiters()
            self._pause_completed()

    def _answer_pause_waiters(self) -> None:
        """Reply to every ``pause_scheduler("wait")`` call still waiting."""
        for client_index, call_id in self._pause_waiters:
            self._reply(client_index, call_id, None)
        self._pause_waiters.clear()

    def _pause_completed(self) -> None:
        if self._checkpoint == "preparing":
            # What vLLM releases before a checkpoint (the KV cache, communicators) has
            # no counterpart here but the prefix cache.
            self.prefix_cache.clear()
            self._asleep.add("kv_cache")
            self._checkpoint = "prepared"

    @utility
    def resume_scheduler(self) -> None:
        """Resume scheduling after :meth:`pause_scheduler`. Refused while a process
        checkpoint is prepared and not restored."""
        self._refuse_unless_checkpoint("resume scheduling", _RESTORED)
        if self._checkpoint == "restoring":
            self._checkpoint = "running"
        self._paused = False
        if self._draining_for_pause:
            # A resume overtakes a pending pause(wait): that call completes now.
            self._draining_for_pause = False
            self._answer_pause_waiters()

    @utility
    def is_scheduler_paused(self) -> bool:
        """Whether the scheduler is paused."""
        return self._paused

    @utility
    def release_kv_cache_memory(self, reset_connector: bool = True) -> None:
        """Discard the KV cache (here: the prefix cache) after a completed pause, as
        vLLM does; ``reset_connector`` (vLLM 0.34) means nothing here."""
        if not self._paused or self._running or self._waiting:
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first")
        if self._asleep:
            raise RuntimeError(
                "release_kv_cache_memory() requires all executor memory to be resident"
            )
        self.prefix_cache.clear()
        self._asleep.add("kv_cache")

    @utility
    def is_inference_ready(self) -> bool:
        """Whether the engine would serve a new request now: not asleep, not paused
        and no process checkpoint under way (vLLM 0.34; its Rust frontend asks
        before it serves)."""
        return not self.is_sleeping() and self._checkpoint == "running"

    @utility
    def checkpoint_prepare(self, mode: PauseMode = "wait") -> str | None:
        """Get ready for a process checkpoint, as vLLM 0.34 does: pause with ``mode``
        (``"wait"`` drains the running requests first; new ones queue), then release
        what a checkpoint must not hold, and the state becomes ``prepared``.

        A reference engine has no device memory or communicators to release: it
        clears its prefix cache. A checkpoint of the process itself (CRIU and the
        like) is the caller's to take. Returns why it cannot prepare (nothing
        changed), or None; repeating is a no-op.
        """
        state = self._checkpoint
        if state in ("preparing", "prepared"):
            return None
        if state != "running":
            return f"Cannot prepare while the checkpoint state is {state}"
        if self._asleep:
            return "Preparing for a checkpoint requires an awake engine"
        _check_pause_mode(mode)  # before anything changes
        self._checkpoint = "preparing"
        if self._paused:
            self._pause_completed()
        else:
            self._pause(mode, clear_cache=False, waiter=None)
        return None

    @utility
    def checkpoint_restore(self) -> None:
        """Come back from a prepared checkpoint: wake the KV cache and resume
        scheduling; the state becomes ``running``. A no-op unless prepared (or
        failed: refused)."""
        state = self._checkpoint
        if state in _RESTORED:
            return
        if state != "prepared":
            raise RuntimeError(f"Cannot restore while the checkpoint state is {state}")
        self._checkpoint = "restoring"
        self.wake_up(["kv_cache"])  # all awake: resumes scheduling, and so running

    @utility
    def checkpoint_state(self) -> tuple[CheckpointState, str | None]:
        """``(state, error)``: the process-checkpoint state and why it failed (as vLLM
        answers; nothing the reference engine does can fail, so the error is None)."""
        return self._checkpoint, None

    def _refuse_unless_checkpoint(self, what: str, states: Sequence[str]) -> None:
        if self._checkpoint not in states:
            raise RuntimeError(f"Cannot {what} while the checkpoint state is {self._checkpoint}")

    @utility
    def get_request_counts(self) -> tuple[int, int]:
        """``(waiting, running)``: the counts a load balancer scores engines by."""
        return len(self._waiting), len(self._running)

    @utility
    def inject_fault(self) -> None:
        """Make the next step fail fatally (only with ``enable_fault_injection``)."""
        self._fault_requested = True

    @utility
    def stall(self, seconds: float) -> None:
        """Hold the engine's thread for ``seconds``, holding the GIL, then reply: a
        utility that keeps the busy loop (a LoRA load, a weight update, a
        ``collective_rpc``). Only with ``enable_fault_injection``."""
        _hold_thread(seconds)

    @utility
    def stall_steps(self, seconds: float) -> None:
        """From the next step on, hold the engine's thread for ``seconds`` in every
        step that runs the model, holding the GIL (0 stops it): a slow device, a
        long prefill, or with a very long time a hung one (a deadlock, a collective
        that never completes). Only with ``enable_fault_injection``."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        self._stall_s = seconds

    # -------------------------------------------------------------------- startup

    def ready_response(self) -> EngineCoreReadyResponse:
        """What the engine sends first on each input socket."""
        config = self.config
        return EngineCoreReadyResponse(
            max_model_len=config.max_model_len,
            num_gpu_blocks=num_gpu_blocks(config),
            block_size=BLOCK_SIZE,
            dp_stats_address=None,
            dtype="float32",
            vllm_version=config.vllm_version,
            world_size=1,
            data_parallel_size=config.data_parallel_size,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            data_parallel_rank=config.data_parallel_rank,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_seqs,
            instance_id=self._instance_id,
            supports_lora=True,
            max_loras=config.max_loras,
            kv_cache_size_tokens=config.max_num_seqs * config.max_model_len,
            kv_cache_max_concurrency=float(config.max_num_seqs),
            enable_sleep_mode=True,
        )


def _hold_thread(seconds: float) -> None:
    # Spinning in Python holds the GIL the whole time, as a busy engine's thread can:
    # nothing else in the process runs Python meanwhile (libzmq's I/O thread does).
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _check_pause_mode(mode: object) -> None:
    if mode not in _PAUSE_MODES:
        raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")


class _DummyState:
    """A one-token sequence for :meth:`EngineCore.execute_dummy_batch`."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.token_ids = [0]
        self.last_token_id = 0
        self.temperature = 1.0
        self.top_k = 0
        self.top_p = 1.0
        self.min_p = 0.0


def _convert_args(function: Callable[..., Any], args: Sequence[Any]) -> list[Any]:
    """Convert untyped msgpack arguments to the types the method declares.

    Arguments arrive as plain msgpack (a LoRARequest as a list, a set as a list...);
    msgspec converts each one against the method's annotations, and a mismatch is a
    failure of that call (reported to the client), never of the engine.
    """
    signature = inspect.signature(function)
    # Keyword-only parameters are the engine's own (a deferred utility's caller).
    params = [
        p
        for p in signature.parameters.values()
        if p.name != "self" and p.kind is not p.KEYWORD_ONLY
    ]
    if len(args) > len(params):
        raise TypeError(f"takes at most {len(params)} arguments ({len(args)} given)")
    hints = get_type_hints(function)
    converted: list[Any] = []
    for i, param in enumerate(params):
        if i < len(args):
            converted.append(msgspec.convert(args[i], hints.get(param.name, Any), strict=False))
        elif param.default is inspect.Parameter.empty:
            raise TypeError(f"missing required argument {param.name!r}")
        else:
            converted.append(param.default)
    return converted

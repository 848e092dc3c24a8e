"""A model executor for vLLM's real engine core (0.33 and 0.34), with a deterministic model.

Runs inside the vLLM environment only. vLLM's ``EngineCoreProc`` (its scheduler, KV
cache manager, input and output threads, utilities, ``ENGINE_CORE_DEAD``) is used as
shipped; only the executor is ours, selected with
``EngineArgs(distributed_executor_backend=CounterExecutor)``. Its model is the
project's ``counter`` model: the next token is the last one plus one, modulo the
vocabulary, so every output of every request can be checked.

Besides what the engine asks of an executor, it answers these ``collective_rpc``
methods (``call_utility("collective_rpc", "<name>", None, [args...])`` from a client;
vLLM calls a method given by name without any pickle):

- ``finished_request_ids``: the ids vLLM's scheduler reported as finished (sorted);
- ``scheduled_request_ids``: the ids it ever scheduled (sorted);
- ``clear_request_log``: forget both;
- ``arm_fault``: the next model step raises, which vLLM treats as a fatal error;
- ``set_step_delay``: seconds each model step takes from now on (a long one hangs the
  busy loop in its next step, its sockets and vLLM's I/O threads alive); with a pid,
  only the executor of that process (one rank of several) takes it;
- ``block``: hold the busy loop (which runs ``collective_rpc``) for the given seconds,
  as a long utility (a weight update, a LoRA load) does;
- ``executor_pid``: the process the executor (and so the engine core) runs in.

What differs between the releases is found by feature, not by version: 0.34's
``ModelRunnerOutput`` has no ``req_id_to_index``, and its scheduler sends a request
resumed after preemption as a new one whose ``prefill_token_ids`` holds the prompt and
the tokens generated so far (0.33 sent it among the cached ones, whose tokens this
executor still has). Importing this module answers vLLM 0.34's Triton check
(``triton_check.py``), and makes the engine core announce the version a launcher was
given with ``--announce-version`` (``common.announce_version_from_environment``), in
every process that builds or unpickles the executor.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from common import announce_version_from_environment
from triton_check import answer_triton_check
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes

answer_triton_check()  # before any config is built or re-checked in this process
announce_version_from_environment()  # a launcher's --announce-version, in every process

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
"""KV blocks the engine is given: enough for hundreds of requests of 1024 tokens."""
STEP_DELAY_VARIABLE = "TRIO_ENGINECORE_FAKE_STEP_S"
_HAS_REQ_ID_TO_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


class InjectedFault(RuntimeError):
    """The failure ``arm_fault`` asked for."""


class _CounterWorker:
    """The state a model runner keeps, and the counter model.

    Tracks every request from the scheduler's outputs (new requests with their
    prompts, cached ones with their progress, finished ids) and samples one token per
    request whose known tokens are all computed after this step; a partial prefill
    chunk samples nothing, as in vLLM's model runner.

    Sample logprobs, when a request of the step asks for them, are the counter model's:
    the token ``d`` ids after the last one (modulo the vocabulary) has logprob
    ``-0.5 * d + 0.25`` for ``d`` from 1 (the sampled token, rank 1) on, exact in
    float32. As vLLM's sampler sends them: a row per request of the step, the sampled
    token first, then the top ``k`` by rank, ``k`` the most any request of the step
    asked for (vLLM's logprobs processor keeps each request's own ``k``). Prompt
    logprobs are not made.
    """

    def __init__(self, vocab_size: int, num_layers: int, head_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.head_size = head_size
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.finished: set[str] = set()
        self.scheduled: set[str] = set()
        self.num_logprobs: dict[str, int] = {}
        self.fault_armed = False
        self.step_delay_s = float(os.environ.get(STEP_DELAY_VARIABLE, "0") or 0)
        self.pending: ModelRunnerOutput | None = None
        self.sleeping = False
        self.loras: set[int] = set()
        self.lock = threading.Lock()

    # ------------------------------------------------------ what the engine asks

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=self.head_size, dtype=torch.float32
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(self.num_layers)}

    def page_bytes(self) -> int:
        """KV bytes of one block over all layers."""
        return sum(spec.page_size_bytes for spec in self.get_kv_cache_spec().values())

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:
        pass

    def determine_available_memory(self) -> int:
        return NUM_BLOCKS * self.page_bytes()

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        pass

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def execute_model(self, scheduler_output: Any) -> None:
        with self.lock:
            if self.fault_armed:
                self.fault_armed = False
                raise InjectedFault("fault injected on request (arm_fault)")
            delay = self.step_delay_s
            self._track(scheduler_output)
            self.pending = self._sample(scheduler_output)
        if delay:
            time.sleep(delay)

    def _track(self, out: Any) -> None:
        for req_id in out.finished_req_ids:
            self.finished.add(req_id)
            self.tokens.pop(req_id, None)
            self.computed.pop(req_id, None)
            self.num_logprobs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            # Where set (always in 0.34), prefill_token_ids holds the prompt and, for a
            # request resumed after preemption, the tokens it generated before.
            tokens = getattr(new, "prefill_token_ids", None)
            if tokens is None:
                tokens = new.prompt_token_ids
            self.tokens[new.req_id] = list(tokens if tokens is not None else ())
            self.computed[new.req_id] = new.num_computed_tokens
            params = getattr(new, "sampling_params", None)
            if params is not None and params.logprobs is not None:
                self.num_logprobs[new.req_id] = params.logprobs
        cached = out.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.computed[req_id] = computed

    def _sample(self, out: Any) -> ModelRunnerOutput:
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, count in out.num_scheduled_tokens.items():
            self.scheduled.add(req_id)
            tokens = self.tokens[req_id]
            done = self.computed[req_id] + count
            self.computed[req_id] = done
            req_ids.append(req_id)
            if done >= len(tokens):
                token = (tokens[-1] + 1) % self.vocab_size
                tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])  # a chunk of a longer prompt: nothing to sample yet
        extra: dict[str, Any] = {}
        if _HAS_REQ_ID_TO_INDEX:  # 0.33; gone in 0.34
            extra["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
        wanted = [self.num_logprobs[req_id] for req_id in req_ids if req_id in self.num_logprobs]
        if wanted:
            top_k = self.vocab_size if min(wanted) < 0 else max(wanted)
            extra["logprobs"] = self._logprobs(req_ids, top_k)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)

    def _logprobs(self, req_ids: list[str], top_k: int) -> LogprobsLists:
        """The counter model's sample logprobs of this step (see the class)."""
        rows = len(req_ids)
        distance = np.arange(1, top_k + 1)
        ids = np.zeros((rows, top_k + 1), dtype=np.int64)
        logprobs = np.zeros((rows, top_k + 1), dtype=np.float32)
        for row, req_id in enumerate(req_ids):
            token = self.tokens[req_id][-1]  # sampled this step (or a prompt's: no sample)
            ids[row, 0] = token
            ids[row, 1:] = (token + distance - 1) % self.vocab_size
        logprobs[:, 0] = -0.25
        logprobs[:, 1:] = -0.5 * distance + 0.25
        ranks = np.ones(rows, dtype=np.int64)
        return LogprobsLists(ids, logprobs, ranks)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        with self.lock:
            output, self.pending = self.pending, None
        assert output is not None, "sample_tokens without execute_model"
        return output

    def execute_dummy_batch(self) -> None:
        pass

    def take_draft_token_ids(self) -> None:
        return None

    def synchronize_device(self) -> None:
        pass

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def sleep(self, level: int = 1) -> None:
        self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleeping = False

    # What vLLM 0.34's engine asks besides: release_kv_cache_memory discards the KV
    # cache, is_inference_ready asks about weight updates, and a process checkpoint
    # prepares and restores the workers. There is no memory or device state to keep.

    def discard(self, tags: tuple[str, ...]) -> None:
        pass

    def has_incomplete_weight_update(self) -> bool:
        return False

    def checkpoint_prepare(self) -> None:
        pass

    def checkpoint_restore(self) -> None:
        pass

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        pass

    def add_lora(self, lora_request: Any) -> bool:
        self.loras.add(lora_request.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        if lora_id not in self.loras:
            return False
        self.loras.discard(lora_id)
        return True

    def pin_lora(self, lora_id: int) -> bool:
        return lora_id in self.loras

    def list_loras(self) -> set[int]:
        return set(self.loras)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    # ------------------------------------------------ what the tests ask, by name

    def finished_request_ids(self) -> list[str]:
        with self.lock:
            return sorted(self.finished)

    def scheduled_request_ids(self) -> list[str]:
        with self.lock:
            return sorted(self.scheduled)

    def clear_request_log(self) -> None:
        with self.lock:
            self.finished.clear()
            self.scheduled.clear()

    def arm_fault(self) -> None:
        with self.lock:
            self.fault_armed = True

    def set_step_delay(self, seconds: float, pid: int | None = None) -> None:
        if pid is not None and pid != os.getpid():
            return
        with self.lock:
            self.step_delay_s = float(seconds)

    def block(self, seconds: float) -> None:
        time.sleep(seconds)

    def executor_pid(self) -> int:
        return os.getpid()


class CounterExecutor(Executor):
    """One in-process "worker" running the counter model; no device, no torch compute."""

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        hf_config = self.model_config.hf_config
        heads = hf_config.num_attention_heads
        self.worker = _CounterWorker(
            vocab_size=self.model_config.get_vocab_size(),
            num_layers=hf_config.num_hidden_layers,
            head_size=hf_config.hidden_size // heads,
        )

    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> list[Any] | Future[list[Any]]:
        if isinstance(method, str):
            function = getattr(self.worker, method)
            results = [function(*(args or ()), **(kwargs or {}))]
        else:
            results = [method(self.worker, *(args or ()), **(kwargs or {}))]
        if not non_block:
            return results
        future: Future[list[Any]] = Future()
        future.set_result(results)
        return future

    def execute_model(  # type: ignore[override]
        self, scheduler_output: Any, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput | None] | None:
        self.worker.execute_model(scheduler_output)
        if not non_block:
            return None
        future: Future[ModelRunnerOutput | None] = Future()
        future.set_result(None)  # None: the engine calls sample_tokens next
        return future

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: Any, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self.worker.sample_tokens(grammar_output)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def take_draft_token_ids(self) -> None:
        return None

    def check_health(self) -> None:
        self.worker.check_health()

    def shutdown(self) -> None:
        self.worker.shutdown()

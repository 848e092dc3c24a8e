"""The reference engine's scheduler, driven directly (no sockets, no Trio).

Every test uses the counter model, whose tokens are predictable (each new token is the
previous one plus one, modulo the vocabulary), so the tests assert exact token
sequences: a lost, duplicated or reordered token fails them.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trio_enginecore.config import EngineConfig
from trio_enginecore.dialects import NEWEST
from trio_enginecore.engine import CounterModel, EngineCore, FatalEngineError
from trio_enginecore.errors import ProtocolError
from trio_enginecore.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    PoolingParams,
    RequestError,
    SamplingParams,
    Tensor,
    UtilityOutput,
    UtilityResult,
)
from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder

from .support import with_changed_sampling

expected = CounterModel.expected_tokens

# ------------------------------------------------------------------------ helpers


class FakeClock:
    """A clock the test moves by hand, so timestamps and events are exact."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(
    rid: str,
    prompt: Sequence[int] | None = (1, 2, 3),
    *,
    max_tokens: int | None = 16,
    client_index: int = 0,
    lora: LoRARequest | None = None,
    **sampling: Any,
) -> EngineCoreRequest:
    """A generation request as a frontend would send it (``prompt=None``: none at all)."""
    request = EngineCoreRequest.for_tokens(
        prompt or (), request_id=rid, max_tokens=max_tokens, lora_request=lora, **sampling
    )
    if prompt is None:
        request.prompt_token_ids = None
    request.client_index = client_index
    return request


def engine_with(clock: FakeClock | None = None, **config: Any) -> EngineCore:
    return EngineCore(EngineConfig(**config), clock=clock or FakeClock())


def outputs_of(step: dict[int, EngineCoreOutputs]) -> list[EngineCoreOutput]:
    """All outputs of one step, whatever client they go to."""
    return [output for message in step.values() for output in message.outputs]


def step_outputs(engine: EngineCore) -> list[EngineCoreOutput]:
    return outputs_of(engine.step())


def run_to_completion(
    engine: EngineCore, max_steps: int = 10_000
) -> tuple[dict[str, list[int]], dict[str, EngineCoreOutput]]:
    """Step until nothing is left to do; return the tokens and final output per request."""
    tokens: dict[str, list[int]] = defaultdict(list)
    final: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not engine.can_step:
            return dict(tokens), final
        for output in step_outputs(engine):
            assert output.request_id not in final, f"output after the end: {output}"
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                final[output.request_id] = output
    raise AssertionError(f"the engine still had work after {max_steps} steps")


def call(
    engine: EngineCore, method: str, *args: Any, call_id: int = 7, client_index: int = 0
) -> UtilityOutput:
    """Call a utility that must answer at once; return its reply."""
    engine.call_utility(client_index, call_id, method, list(args))
    replies = engine.take_utility_outputs()
    assert len(replies) == 1, replies
    reply_client, reply = replies[0]
    assert reply_client == client_index
    assert reply.call_id == call_id
    return reply


def result_of(engine: EngineCore, method: str, *args: Any) -> Any:
    """Call a utility that must succeed at once; return its result."""
    reply = call(engine, method, *args)
    assert reply.failure_message is None, reply.failure_message
    assert reply.result is not None
    assert reply.result.type_info is None
    return reply.result.result


def ok_reply(call_id: int, result: Any = None) -> UtilityOutput:
    return UtilityOutput(call_id, None, UtilityResult(result))


# ----------------------------------------------------- exact counter sequences


def test_counter_requests_step_to_their_exact_sequences_and_finish_with_length() -> None:
    clock = FakeClock(50.0)
    engine = engine_with(clock, data_parallel_size=3, data_parallel_rank=2)
    prompts = {"a": [1, 2, 3], "b": [500], "c": [31997, 31998], "d": [7, 7, 7, 7]}
    max_tokens = {"a": 5, "b": 1, "c": 4, "d": 8}
    for rid, prompt in prompts.items():
        engine.add_request(req(rid, prompt, max_tokens=max_tokens[rid]))
    tokens: dict[str, list[int]] = defaultdict(list)
    finals: dict[str, EngineCoreOutput] = {}
    for step_number in range(1, 9):
        clock.now = 50.0 + step_number
        running_before = {rid for rid in prompts if rid not in finals}
        step = engine.step()
        assert list(step) == [0]
        message = step[0]
        assert message.engine_index == 2
        assert message.timestamp == clock.now
        assert message.scheduler_stats is None
        assert message.weight_version is None
        # One output, holding exactly one token, per running request, in arrival order.
        assert [o.request_id for o in message.outputs] == [
            rid for rid in prompts if rid in running_before
        ]
        for output in message.outputs:
            assert len(output.new_token_ids) == 1
            assert output.error is None
            assert output.events is None
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finals[output.request_id] = output
    assert not engine.can_step
    assert engine.step() == {}
    for rid, prompt in prompts.items():
        assert tokens[rid] == expected(prompt, max_tokens[rid])
        assert finals[rid].finish_reason is FinishReason.LENGTH
        assert finals[rid].stop_reason is None
    assert tokens["c"] == [31999, 0, 1, 2]
    assert engine.num_requests == 0


def test_requests_finish_on_the_step_of_their_last_token() -> None:
    engine = engine_with()
    engine.add_request(req("a", [10], max_tokens=3))
    assert [(o.new_token_ids, o.finish_reason) for o in step_outputs(engine)] == [([11], None)]
    assert [(o.new_token_ids, o.finish_reason) for o in step_outputs(engine)] == [([12], None)]
    assert [(o.new_token_ids, o.finish_reason) for o in step_outputs(engine)] == [
        ([13], FinishReason.LENGTH)
    ]
    assert engine.num_requests == 0
    assert not engine.can_step


def test_counter_wraps_around_modulo_a_small_vocabulary() -> None:
    engine = engine_with(vocab_size=10)
    engine.add_request(req("a", [7], max_tokens=6))
    engine.add_request(req("b", [9], max_tokens=12))
    tokens, finals = run_to_completion(engine)
    assert tokens["a"] == [8, 9, 0, 1, 2, 3]
    assert tokens["b"] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert tokens["b"] == expected([9], 12, vocab_size=10)
    assert {rid: o.finish_reason for rid, o in finals.items()} == {
        "a": FinishReason.LENGTH,
        "b": FinishReason.LENGTH,
    }


# ------------------------------------------------------------------- batching


def test_max_num_seqs_limits_the_batch_and_admits_waiting_requests_in_arrival_order() -> None:
    engine = engine_with(max_num_seqs=2)
    lengths = {"r0": 2, "r1": 3, "r2": 2, "r3": 2, "r4": 2}
    for rid, n in lengths.items():
        engine.add_request(req(rid, [int(rid[1]) * 10], max_tokens=n))
    assert (engine.num_waiting, engine.num_running, engine.num_requests) == (5, 0, 5)
    assert result_of(engine, "get_request_counts") == (5, 0)

    trace: list[list[str]] = []
    counts: list[tuple[int, int]] = []
    tokens: dict[str, list[int]] = defaultdict(list)
    while engine.can_step:
        outputs = step_outputs(engine)
        assert len(outputs) <= 2
        trace.append([o.request_id for o in outputs])
        counts.append((engine.num_waiting, engine.num_running))
        assert result_of(engine, "get_request_counts") == counts[-1]
        assert engine.num_requests == sum(counts[-1])
        for o in outputs:
            tokens[o.request_id] += o.new_token_ids

    assert trace == [
        ["r0", "r1"],
        ["r0", "r1"],  # r0 finishes
        ["r1", "r2"],  # r2 takes r0's place; r1 finishes
        ["r2", "r3"],  # r2 finishes
        ["r3", "r4"],  # r3 finishes
        ["r4"],  # r4 finishes
    ]
    assert counts == [(3, 2), (3, 1), (2, 1), (1, 1), (0, 1), (0, 0)]
    for rid, n in lengths.items():
        assert tokens[rid] == expected([int(rid[1]) * 10], n)


def test_a_batch_of_one_runs_requests_strictly_one_after_another() -> None:
    engine = engine_with(max_num_seqs=1)
    for rid in "abc":
        engine.add_request(req(rid, [1], max_tokens=2))
    trace = []
    while engine.can_step:
        trace.append([o.request_id for o in step_outputs(engine)])
    assert trace == [["a"], ["a"], ["b"], ["b"], ["c"], ["c"]]


# -------------------------------------------------------------- max_model_len


def test_max_model_len_caps_prompt_plus_output_even_if_max_tokens_is_larger() -> None:
    engine = engine_with(max_model_len=10)
    engine.add_request(req("a", [1, 2, 3, 4], max_tokens=100))
    tokens, finals = run_to_completion(engine)
    assert tokens["a"] == [5, 6, 7, 8, 9, 10]  # 4 + 6 == max_model_len
    assert finals["a"].finish_reason is FinishReason.LENGTH


def test_max_tokens_none_uses_all_the_room_left_by_the_prompt() -> None:
    engine = engine_with(max_model_len=10)
    engine.add_request(req("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=None))
    engine.add_request(req("b", list(range(9)), max_tokens=None))
    tokens, finals = run_to_completion(engine)
    assert tokens == {"a": [8, 9, 10], "b": [9]}
    assert finals["a"].finish_reason is FinishReason.LENGTH
    assert finals["b"].finish_reason is FinishReason.LENGTH


def test_max_tokens_smaller_than_the_room_wins() -> None:
    engine = engine_with(max_model_len=10)
    engine.add_request(req("a", [1], max_tokens=2))
    tokens, finals = run_to_completion(engine)
    assert tokens == {"a": [2, 3]}
    assert finals["a"].finish_reason is FinishReason.LENGTH


# ----------------------------------------------------------------------- stops


def test_a_stop_token_finishes_with_stop_and_names_the_token() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=10, stop_token_ids=[9, 4]))
    tokens, finals = run_to_completion(engine)
    assert tokens["a"] == [2, 3, 4]
    assert finals["a"].finish_reason is FinishReason.STOP
    assert finals["a"].stop_reason == 4


def test_the_frontend_eos_finishes_with_stop_and_no_stop_reason() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=10, _eos_token_id=5))
    tokens, finals = run_to_completion(engine)
    assert tokens["a"] == [2, 3, 4, 5]  # the EOS token itself is sent
    assert finals["a"].finish_reason is FinishReason.STOP
    assert finals["a"].stop_reason is None


def test_ignore_eos_runs_past_eos_but_stop_tokens_still_stop() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=10, _eos_token_id=3, ignore_eos=True))
    engine.add_request(
        req("b", [1], max_tokens=10, _eos_token_id=3, ignore_eos=True, stop_token_ids=[5])
    )
    tokens, finals = run_to_completion(engine)
    assert tokens["a"] == expected([1], 10)
    assert finals["a"].finish_reason is FinishReason.LENGTH
    assert tokens["b"] == [2, 3, 4, 5]
    assert finals["b"].finish_reason is FinishReason.STOP
    assert finals["b"].stop_reason == 5


def test_min_tokens_holds_back_a_stop_token_until_reached() -> None:
    engine = engine_with(vocab_size=5)
    # Tokens after [1] with vocab 5: 2 3 4 0 1 2 ... The first 2 comes too early.
    engine.add_request(req("held", [1], max_tokens=20, stop_token_ids=[2], min_tokens=3))
    # A stop token that is exactly the min_tokens-th token stops the request.
    engine.add_request(req("boundary", [1], max_tokens=20, stop_token_ids=[3], min_tokens=2))
    tokens, finals = run_to_completion(engine)
    assert tokens["held"] == [2, 3, 4, 0, 1, 2]
    assert finals["held"].finish_reason is FinishReason.STOP
    assert finals["held"].stop_reason == 2
    assert tokens["boundary"] == [2, 3]
    assert finals["boundary"].stop_reason == 3


def test_min_tokens_holds_back_eos_too() -> None:
    engine = engine_with(vocab_size=5)
    engine.add_request(req("a", [1], max_tokens=20, _eos_token_id=2, min_tokens=1))
    engine.add_request(req("b", [1], max_tokens=20, _eos_token_id=2, min_tokens=2))
    tokens, finals = run_to_completion(engine)
    assert tokens["a"] == [2]
    assert tokens["b"] == [2, 3, 4, 0, 1, 2]
    assert finals["a"].finish_reason is finals["b"].finish_reason is FinishReason.STOP
    assert finals["a"].stop_reason is finals["b"].stop_reason is None


def test_length_limits_win_over_stop_tokens_and_eos() -> None:
    engine = engine_with(max_model_len=4)
    # The third token is a stop token, EOS and the max_tokens-th token all at once.
    engine.add_request(req("max_tokens", [1], max_tokens=3, stop_token_ids=[4], _eos_token_id=4))
    # The third token is a stop token and fills max_model_len (1 + 3 == 4).
    engine.add_request(req("model_len", [1], max_tokens=None, stop_token_ids=[4]))
    tokens, finals = run_to_completion(engine)
    assert tokens == {"max_tokens": [2, 3, 4], "model_len": [2, 3, 4]}
    for rid in tokens:
        assert finals[rid].finish_reason is FinishReason.LENGTH
        assert finals[rid].stop_reason is None


# ------------------------------------------------------------------ rejection


def _changed_sampling(**changes: Any) -> EngineCoreRequest:
    """A request whose sampling parameters were changed after they were built."""
    return with_changed_sampling(req("bad"), **changes)


def _lora_with_str_id() -> LoRARequest:
    lora = LoRARequest("adapter", 1)
    lora.lora_int_id = "1"  # type: ignore[assignment]
    return lora


INVALID_REQUESTS = {
    "empty prompt": (req("bad", []), "at least one token"),
    "no prompt": (req("bad", None), "needs prompt_token_ids"),
    "token above the vocabulary": (req("bad", [1, 32000]), "[0, 32000)"),
    "negative token": (req("bad", [-1, 2]), "prompt_token_ids[0] is -1"),
    "prompt fills max_model_len": (req("bad", list(range(64))), "max_model_len is 64"),
    "prompt exceeds max_model_len": (req("bad", list(range(65))), "max_model_len is 64"),
    "pooling request": (
        msgspec.structs.replace(req("bad"), sampling_params=None, pooling_params=PoolingParams()),
        "sampling_params is required",
    ),
    "prompt embeddings": (
        msgspec.structs.replace(
            req("bad"),
            prompt_embeds=Tensor.from_numpy(np.zeros((3, 4), dtype=np.float32)),
        ),
        "token-id prompts only",
    ),
    "multimodal features": (
        msgspec.structs.replace(req("bad"), mm_features=[{"modality": "image"}]),
        "token-id prompts only",
    ),
    "empty request id": (req(""), "request_id must not be empty"),
    # Nothing decodes a request handed over in-process: the engine checks its fields.
    "a str seed": (_changed_sampling(seed="1"), "SamplingParams.seed must be an int or None"),
    "a str ignore_eos": (_changed_sampling(ignore_eos="yes"), "ignore_eos must be a bool"),
    "str stop token ids": (_changed_sampling(stop_token_ids=["a"]), "item 0 is str 'a'"),
    "a temperature out of range": (_changed_sampling(temperature=5.0), "temperature must be in"),
    "a seed beyond 64 bits": (_changed_sampling(seed=2**64), "must fit in 64 bits"),
    "a str LoRA id": (
        msgspec.structs.replace(req("bad"), lora_request=_lora_with_str_id()),
        "LoRARequest.lora_int_id must be an int",
    ),
}


@pytest.mark.parametrize(
    ("request_", "reason"), INVALID_REQUESTS.values(), ids=list(INVALID_REQUESTS)
)
def test_invalid_requests_get_an_error_output_and_others_keep_running(
    request_: EngineCoreRequest, reason: str
) -> None:
    engine = engine_with(max_model_len=64)
    engine.add_request(req("ok", [1], max_tokens=3))
    engine.step()
    engine.add_request(request_)
    assert engine.num_requests == 1
    outputs = step_outputs(engine)
    errors = [o for o in outputs if o.finish_reason is FinishReason.ERROR]
    assert len(errors) == 1
    error = errors[0]
    assert error.request_id == request_.request_id
    assert error.new_token_ids == []
    assert isinstance(error.error, RequestError)
    assert error.error.code == "invalid_request"
    assert reason in error.error.message
    assert [(o.request_id, o.new_token_ids) for o in outputs if o is not error] == [("ok", [3])]
    tokens, finals = run_to_completion(engine)
    assert tokens == {"ok": [4]}
    assert finals["ok"].finish_reason is FinishReason.LENGTH


def test_a_duplicate_in_flight_request_id_is_rejected_and_the_original_keeps_running() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=3))
    engine.step()
    engine.add_request(req("a", [50], max_tokens=3))
    outputs = step_outputs(engine)
    assert outputs[0].finish_reason is FinishReason.ERROR
    assert outputs[0].error is not None
    assert "'a' is already in flight" in outputs[0].error.message
    assert [(o.new_token_ids, o.finish_reason) for o in outputs[1:]] == [([3], None)]
    tokens, _ = run_to_completion(engine)
    assert tokens == {"a": [4]}
    # Once finished, the id may be used again.
    engine.add_request(req("a", [50], max_tokens=2))
    assert run_to_completion(engine)[0] == {"a": [51, 52]}


def test_a_request_off_the_wire_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The typed decoder checked every field of a decoded request (the sampling
    parameters' ranges too, in their ``__post_init__``): the engine checks field by
    field only what was handed over in-process, and still serves both."""
    import trio_enginecore.engine._core as core_module

    checked: list[str] = []
    real_check = core_module.check_request

    def counting_check(request: object) -> None:
        assert isinstance(request, EngineCoreRequest)
        checked.append(request.request_id)
        real_check(request)

    monkeypatch.setattr(core_module, "check_request", counting_check)
    engine = engine_with()
    engine.add_request(req("in-process", [1], max_tokens=2))
    frames = MsgpackEncoder().encode(req("off-the-wire", [10], max_tokens=2))
    engine.add_request(MsgpackDecoder(EngineCoreRequest).decode(frames), decoded=True)
    assert checked == ["in-process"]
    tokens, _ = run_to_completion(engine)
    assert tokens == {"in-process": [2, 3], "off-the-wire": [11, 12]}


def test_an_out_of_range_sampling_value_never_decodes() -> None:
    """What lets the engine skip its check: a decoded request's parameters had their
    ranges checked on the way in."""
    bad = req("a", [1], max_tokens=2)
    assert bad.sampling_params is not None
    bad.sampling_params.top_p = 1.5  # changed after construction: nothing checked it
    with pytest.raises(ProtocolError, match="top_p"):
        MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(bad))


def test_a_rejection_is_delivered_even_while_the_engine_sleeps() -> None:
    engine = engine_with()
    assert result_of(engine, "sleep") is None
    engine.add_request(req("bad", []))
    assert engine.can_step
    outputs = step_outputs(engine)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", FinishReason.ERROR)]
    assert not engine.can_step


def test_reject_queues_an_error_output_for_the_named_client() -> None:
    engine = engine_with()
    engine.reject("r9", 3, "undecodable request")
    step = engine.step()
    assert list(step) == [3]
    assert step[3].outputs == [
        EngineCoreOutput(
            "r9",
            [],
            finish_reason=FinishReason.ERROR,
            error=RequestError("invalid_request", "undecodable request"),
        )
    ]


# ----------------------------------------------------------------------- abort


def test_abort_all_gives_every_in_flight_request_an_abort_output_for_its_client() -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("running", [1], client_index=0))
    engine.add_request(req("waiting", [1], client_index=1))
    engine.step()
    engine.abort_all()
    assert engine.num_requests == engine.num_waiting == engine.num_running == 0
    step = engine.step()
    assert sorted(step) == [0, 1]
    assert step[0].outputs == [EngineCoreOutput("running", [], finish_reason=FinishReason.ABORT)]
    assert step[1].outputs == [EngineCoreOutput("waiting", [], finish_reason=FinishReason.ABORT)]
    assert not engine.can_step
    assert engine.step() == {}


def test_aborting_a_running_request_stops_its_outputs_and_spares_the_others() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=5))
    engine.add_request(req("b", [100], max_tokens=5))
    engine.step()
    engine.abort_requests(["a"])
    assert (engine.num_requests, engine.num_running) == (1, 1)
    engine.abort_requests(["a", "never-existed"])  # idempotent; unknown ids are fine
    tokens, finals = run_to_completion(engine)
    assert tokens == {"b": expected([100], 5)[1:]}
    assert finals["b"].finish_reason is FinishReason.LENGTH
    assert engine.num_requests == 0


def test_aborting_a_waiting_request_means_it_never_runs() -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("a", [1], max_tokens=3))
    engine.add_request(req("b", [1], max_tokens=3))
    engine.add_request(req("c", [10], max_tokens=2))
    engine.step()
    engine.abort_requests(["b"])
    assert (engine.num_waiting, engine.num_running, engine.num_requests) == (1, 1, 2)
    engine.abort_requests(["b"])
    tokens, _ = run_to_completion(engine)
    assert tokens == {"a": [3, 4], "c": [11, 12]}
    assert engine.num_requests == 0


def test_a_request_aborted_before_any_step_produces_nothing() -> None:
    engine = engine_with()
    engine.add_request(req("a"))
    engine.abort_requests(["a"])
    assert not engine.can_step
    assert engine.step() == {}
    assert engine.num_requests == 0


def test_aborting_a_finished_request_is_a_no_op() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=1))
    engine.add_request(req("b", [1], max_tokens=3))
    engine.step()
    engine.abort_requests(["a"])
    assert engine.num_requests == 1
    assert run_to_completion(engine)[0] == {"b": [3, 4]}


@pytest.mark.parametrize("seed", [0, 7, -5, -(2**63), 2**64 - 1])
def test_any_64_bit_seed_is_accepted(seed: int) -> None:
    """vLLM accepts negative seeds (torch remaps them); a request must never crash the engine."""
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=3, seed=seed))
    assert engine.num_requests == 1
    tokens, finals = run_to_completion(engine)
    assert tokens == {"a": [2, 3, 4]}
    assert finals["a"].finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------------- routing


def test_outputs_are_grouped_by_client_index() -> None:
    engine = engine_with()
    engine.add_request(req("a0", [1], max_tokens=2, client_index=0))
    engine.add_request(req("b1", [10], max_tokens=2, client_index=1))
    engine.add_request(req("c0", [20], max_tokens=2, client_index=0))
    engine.add_request(req("bad1", [], client_index=1))
    step = engine.step()
    assert sorted(step) == [0, 1]
    assert [(o.request_id, o.new_token_ids) for o in step[0].outputs] == [
        ("a0", [2]),
        ("c0", [21]),
    ]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in step[1].outputs] == [
        ("bad1", [], FinishReason.ERROR),
        ("b1", [11], None),
    ]
    assert step[0].timestamp == step[1].timestamp
    engine.abort_requests(["b1"])
    assert list(engine.step()) == [0]


# ------------------------------------------------------------------ log_stats


def test_log_stats_attaches_queued_and_scheduled_events_to_the_first_output() -> None:
    clock = FakeClock(10.0)
    engine = engine_with(clock, log_stats=True, max_num_seqs=1, max_model_len=100)
    engine.add_request(req("a", [1, 2, 3], max_tokens=2))
    clock.now = 11.0
    engine.add_request(req("b", [5], max_tokens=2))
    clock.now = 12.0
    step = engine.step()[0]
    assert [(o.request_id, o.events) for o in step.outputs] == [
        (
            "a",
            [
                EngineCoreEvent(EngineCoreEventType.QUEUED, 10.0),
                EngineCoreEvent(EngineCoreEventType.SCHEDULED, 12.0),
            ],
        )
    ]
    stats = step.scheduler_stats
    assert stats is not None
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.step_counter) == (1, 1, 1)
    assert stats.kv_cache_usage == 4 / 100  # a holds 3 + 1 tokens of 1 * 100
    clock.now = 13.0
    step = engine.step()[0]  # a finishes
    assert [(o.request_id, o.events) for o in step.outputs] == [("a", None)]
    assert step.scheduler_stats is not None
    assert (step.scheduler_stats.num_running_reqs, step.scheduler_stats.num_waiting_reqs) == (
        0,
        1,
    )
    clock.now = 14.0
    step = engine.step()[0]
    assert [(o.request_id, o.events) for o in step.outputs] == [
        (
            "b",
            [
                EngineCoreEvent(EngineCoreEventType.QUEUED, 11.0),
                EngineCoreEvent(EngineCoreEventType.SCHEDULED, 14.0),
            ],
        )
    ]
    assert step.scheduler_stats is not None
    assert step.scheduler_stats.step_counter == 3


def test_without_log_stats_there_are_no_events_and_no_scheduler_stats() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=3))
    while engine.can_step:
        for message in engine.step().values():
            assert message.scheduler_stats is None
            assert all(o.events is None for o in message.outputs)


def test_log_stats_counts_requests_per_lora_adapter() -> None:
    engine = engine_with(log_stats=True, max_num_seqs=1)
    lora = LoRARequest("sql", 3, "/adapters/sql")
    engine.add_request(req("a", [1], max_tokens=2, lora=lora))
    engine.add_request(req("b", [1], max_tokens=2, lora=lora))
    stats = engine.step()[0].scheduler_stats
    assert stats is not None
    assert stats.running_lora_adapters == {"sql": 1}
    assert stats.waiting_lora_adapters == {"sql": 1}
    assert result_of(engine, "list_loras") == {3}


# ------------------------------------------------------------------ utilities


def test_utility_replies_carry_the_call_id_and_go_to_the_calling_client() -> None:
    engine = engine_with()
    engine.call_utility(2, 41, "is_sleeping", [])
    engine.call_utility(0, 42, "get_weight_version", [])
    assert engine.take_utility_outputs() == [(2, ok_reply(41, False)), (0, ok_reply(42, None))]
    assert engine.take_utility_outputs() == []


def test_sleep_freezes_stepping_and_wake_up_continues_exactly_where_it_was() -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("a", [1], max_tokens=5))
    engine.add_request(req("b", [10], max_tokens=2))
    assert [o.new_token_ids for o in step_outputs(engine)] == [[2]]
    assert [o.new_token_ids for o in step_outputs(engine)] == [[3]]
    assert result_of(engine, "is_sleeping") is False
    assert call(engine, "sleep", call_id=3) == ok_reply(3)
    assert result_of(engine, "is_sleeping") is True
    engine.add_request(req("c", [20], max_tokens=1))
    assert not engine.can_step
    for _ in range(3):
        assert engine.step() == {}
    assert (engine.num_waiting, engine.num_running) == (2, 1)
    assert call(engine, "wake_up", call_id=4) == ok_reply(4, True)
    assert result_of(engine, "is_sleeping") is False
    assert engine.can_step
    tokens, _ = run_to_completion(engine)
    assert tokens == {"a": [4, 5, 6], "b": [11, 12], "c": [21]}


def test_sleep_accepts_levels_one_and_two_only() -> None:
    engine = engine_with()
    assert result_of(engine, "sleep", 2) is None
    # As vLLM answers: waking part of the memory leaves the engine asleep.
    assert result_of(engine, "wake_up", ["weights"]) is False
    assert result_of(engine, "is_sleeping") is True
    assert result_of(engine, "wake_up", ["scheduling", "kv_cache"]) is True
    assert result_of(engine, "is_scheduler_paused") is False
    reply = call(engine, "sleep", 3)
    assert reply.result is None
    assert reply.failure_message == "Call to sleep method failed: sleep level must be 1 or 2, got 3"
    assert result_of(engine, "is_sleeping") is False


def test_reset_prefix_cache_refuses_while_requests_run() -> None:
    engine = engine_with(max_num_seqs=1)
    assert result_of(engine, "reset_prefix_cache") is True
    engine.add_request(req("a", [1], max_tokens=1))
    assert result_of(engine, "reset_prefix_cache") is True  # waiting only
    engine.add_request(req("b", [1], max_tokens=2))
    engine.step()  # a runs and finishes
    engine.step()  # b runs
    assert engine.num_running == 1
    assert result_of(engine, "reset_prefix_cache") is False
    assert result_of(engine, "reset_prefix_cache", True) is True
    run_to_completion(engine)
    assert result_of(engine, "reset_prefix_cache") is True


# ------------------------------------------------------------ the prefix cache


def distinct_prompt(i: int, length: int = 8) -> list[int]:
    """Prompt number ``i``: no two numbers give the same prompt."""
    return [i % 30_000 + 1, i // 30_000 + 1, *range(1_000, 1_000 + length - 2)]


def serve_distinct_prompts(engine: EngineCore, first: int, count: int, length: int = 8) -> None:
    """Run prompts ``first .. first + count - 1`` to completion, a batch at a time."""
    params = SamplingParams(max_tokens=1)  # shared: the engine only reads it
    batch = engine.config.max_num_seqs
    for start in range(first, first + count, batch):
        for i in range(start, min(start + batch, first + count)):
            prompt = distinct_prompt(i, length)
            engine.add_request(
                EngineCoreRequest.for_tokens(prompt, request_id=f"p{i}", sampling_params=params)
            )
        while engine.can_step:
            engine.step()


def test_the_prefix_cache_holds_at_most_the_kv_blocks_the_engine_reports() -> None:
    engine = engine_with(max_num_seqs=64, max_model_len=256)
    blocks = engine.ready_response().num_gpu_blocks  # 64 * 256 / 16 = 1024
    assert engine.prefix_cache.capacity_blocks == blocks
    serve_distinct_prompts(engine, 0, 50_000)
    # An 8-token prompt takes one block: the cache is full, and no fuller.
    assert engine.prefix_cache.blocks_used == blocks
    assert len(engine.prefix_cache) == blocks
    assert distinct_prompt(49_999) in engine.prefix_cache
    assert distinct_prompt(0) not in engine.prefix_cache


@pytest.mark.slow
def test_serving_50000_distinct_prompts_keeps_the_engine_memory_flat() -> None:
    engine = engine_with(max_num_seqs=64, max_model_len=256)
    tracemalloc.start()
    try:
        serve_distinct_prompts(engine, 0, 2_000, length=24)  # fills the 1024-block cache
        gc.collect()
        warm, _ = tracemalloc.get_traced_memory()
        serve_distinct_prompts(engine, 2_000, 50_000, length=24)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Keeping every prompt (24 tokens) cost about 1 KiB each: 48 MiB here.
    assert after - warm < 64 * 1024


def test_the_prefix_cache_evicts_the_least_recently_used_prompt_first() -> None:
    engine = engine_with(max_num_seqs=1, max_model_len=48)  # room for 3 blocks of 16
    assert engine.prefix_cache.capacity_blocks == 3
    a, b, c, d = [7], [8], [9], [10]
    long_prompt = list(range(100, 117))  # 17 tokens: two blocks
    for n, prompt in enumerate([a, b, c, a, d]):  # a is used again before d comes
        engine.add_request(req(f"r{n}", prompt, max_tokens=1))
        run_to_completion(engine)
    assert [p in engine.prefix_cache for p in (a, b, c, d)] == [True, False, True, True]
    engine.add_request(req("long", long_prompt, max_tokens=1))
    run_to_completion(engine)
    assert [p in engine.prefix_cache for p in (a, c, d)] == [False, False, True]
    assert long_prompt in engine.prefix_cache
    assert engine.prefix_cache.blocks_used == 3


def test_reset_prefix_cache_sleep_level_2_and_pause_empty_the_prefix_cache() -> None:
    engine = engine_with()

    def cache_after(method: str, *args: Any) -> int:
        engine.add_request(req(f"before-{method}-{args}", [1, 2], max_tokens=1))
        run_to_completion(engine)
        assert len(engine.prefix_cache) == 1
        assert result_of(engine, method, *args) is not False
        return len(engine.prefix_cache)

    assert cache_after("reset_prefix_cache") == 0
    assert cache_after("sleep", 1) == 1
    assert result_of(engine, "wake_up") is True
    assert cache_after("sleep", 2) == 0
    assert result_of(engine, "wake_up") is True
    assert cache_after("pause_scheduler", "keep", False) == 1
    assert result_of(engine, "resume_scheduler") is None
    assert cache_after("pause_scheduler", "keep", True) == 0


def test_profile_start_and_stop_must_alternate() -> None:
    engine = engine_with()
    assert call(engine, "profile", False).failure_message == (
        "Call to profile method failed: the profiler is not running"
    )
    assert result_of(engine, "profile") is None
    assert call(engine, "profile", True, "prefix").failure_message == (
        "Call to profile method failed: the profiler is already running"
    )
    assert result_of(engine, "profile", False) is None
    assert call(engine, "profile", False).failure_message is not None


def test_lora_adapters_are_registered_listed_pinned_and_removed_within_max_loras() -> None:
    engine = engine_with(max_loras=2)
    assert result_of(engine, "list_loras") == set()
    # LoRARequests arrive from msgpack as plain arrays.
    assert result_of(engine, "add_lora", ["sql", 1, "/adapters/sql"]) is True
    assert result_of(engine, "add_lora", ["chat", 2, "/adapters/chat"]) is True
    assert result_of(engine, "add_lora", ["extra", 3, "/adapters/extra"]) is False
    assert result_of(engine, "add_lora", ["sql-v2", 1, "/adapters/sql2"]) is True  # replace
    assert result_of(engine, "list_loras") == {1, 2}
    assert result_of(engine, "pin_lora", 1) is True
    assert result_of(engine, "pin_lora", 3) is False
    assert result_of(engine, "remove_lora", 1) is True
    assert result_of(engine, "remove_lora", 1) is False
    assert result_of(engine, "list_loras") == {2}
    assert result_of(engine, "add_lora", ["extra", 3, "/adapters/extra"]) is True
    assert result_of(engine, "list_loras") == {2, 3}


def test_a_request_with_a_new_lora_is_rejected_when_max_loras_is_full() -> None:
    engine = engine_with(max_loras=1)
    engine.add_request(req("a", [1], max_tokens=1, lora=LoRARequest("one", 1, "/one")))
    engine.add_request(req("b", [1], max_tokens=1, lora=LoRARequest("two", 2, "/two")))
    engine.add_request(req("c", [1], max_tokens=1, lora=LoRARequest("one", 1, "/one")))
    outputs = {o.request_id: o for o in step_outputs(engine)}
    assert outputs["b"].finish_reason is FinishReason.ERROR
    assert outputs["b"].error is not None
    assert "max_loras" in outputs["b"].error.message
    assert outputs["a"].new_token_ids == outputs["c"].new_token_ids == [2]
    assert result_of(engine, "list_loras") == {1}


def test_get_supported_tasks_and_execute_dummy_batch() -> None:
    engine = engine_with()
    assert result_of(engine, "get_supported_tasks") == ("generate",)
    assert result_of(engine, "execute_dummy_batch") is None
    assert engine.num_requests == 0
    assert not engine.can_step


def test_the_weight_version_is_reported_on_every_step_output() -> None:
    engine = engine_with()
    assert result_of(engine, "get_weight_version") is None
    assert result_of(engine, "set_weight_version", "v2") is None
    assert result_of(engine, "get_weight_version") == "v2"
    engine.add_request(req("a", [1], max_tokens=2, client_index=0))
    engine.add_request(req("b", [1], max_tokens=2, client_index=1))
    assert {c: m.weight_version for c, m in engine.step().items()} == {0: "v2", 1: "v2"}
    assert result_of(engine, "set_weight_version", None) is None
    assert engine.step()[0].weight_version is None


def test_inject_fault_makes_the_next_step_fatal_when_enabled() -> None:
    engine = engine_with(enable_fault_injection=True)
    engine.add_request(req("a", [1], max_tokens=5))
    engine.step()
    assert call(engine, "inject_fault", call_id=9) == ok_reply(9)
    with pytest.raises(FatalEngineError, match="fault injected"):
        engine.step()


def test_stall_holds_the_engines_thread_for_the_time_given_then_replies() -> None:
    engine = engine_with(enable_fault_injection=True)
    started = time.monotonic()
    assert call(engine, "stall", 0.2, call_id=4) == ok_reply(4)
    assert time.monotonic() - started >= 0.2


def test_stall_steps_holds_each_model_step_until_turned_off() -> None:
    engine = engine_with(enable_fault_injection=True)
    engine.add_request(req("a", [1], max_tokens=3))
    assert result_of(engine, "stall_steps", 0.1) is None
    started = time.monotonic()
    engine.step()
    assert time.monotonic() - started >= 0.1
    assert result_of(engine, "stall_steps", 0) is None
    started = time.monotonic()
    engine.step()
    assert time.monotonic() - started < 0.1
    reply = call(engine, "stall_steps", -1.0)
    assert reply.failure_message is not None
    assert "finite number >= 0" in reply.failure_message


def test_utility_names_are_exactly_the_marked_methods() -> None:
    assert EngineCore.utility_names() == [
        "add_lora",
        "checkpoint_prepare",
        "checkpoint_restore",
        "checkpoint_state",
        "execute_dummy_batch",
        "get_request_counts",
        "get_supported_tasks",
        "get_weight_version",
        "inject_fault",
        "is_inference_ready",
        "is_scheduler_paused",
        "is_sleeping",
        "list_loras",
        "pause_scheduler",
        "pin_lora",
        "profile",
        "release_kv_cache_memory",
        "remove_lora",
        "reset_prefix_cache",
        "resume_scheduler",
        "set_weight_version",
        "sleep",
        "stall",
        "stall_steps",
        "wake_up",
    ]


# --------------------------------------------------------------- pause modes


def test_sleep_takes_vllms_mode_abort_aborts_keep_keeps_and_wait_is_refused() -> None:
    engine = engine_with()
    engine.add_request(req("kept", [1], max_tokens=5))
    engine.step()
    assert result_of(engine, "sleep", 1, "keep") is None
    assert engine.num_requests == 1
    assert result_of(engine, "wake_up") is True
    assert result_of(engine, "sleep", 1, "abort") is None  # what vLLM's clients send
    assert result_of(engine, "is_sleeping") is True
    assert engine.num_requests == 0
    assert engine.step()[0].outputs == [
        EngineCoreOutput("kept", [], finish_reason=FinishReason.ABORT)
    ]
    reply = call(engine, "sleep", 1, "wait")
    assert reply.failure_message is not None
    assert "pause_scheduler('wait') first" in reply.failure_message


def test_profile_takes_vllms_five_arguments() -> None:
    engine = engine_with()
    assert result_of(engine, "profile", True, "prefix", None, None, None) is None
    assert result_of(engine, "profile", False, None, 1, 10, {"record_shapes": True}) is None


def test_pause_abort_aborts_in_flight_requests_and_queues_new_ones_until_resume() -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("running", [1], max_tokens=5))
    engine.add_request(req("waiting", [1], max_tokens=5, client_index=1))
    engine.step()
    assert call(engine, "pause_scheduler", "abort", call_id=5) == ok_reply(5)
    assert result_of(engine, "is_scheduler_paused") is True
    assert engine.num_requests == 0
    step = engine.step()
    assert step[0].outputs == [EngineCoreOutput("running", [], finish_reason=FinishReason.ABORT)]
    assert step[1].outputs == [EngineCoreOutput("waiting", [], finish_reason=FinishReason.ABORT)]
    engine.add_request(req("new", [30], max_tokens=2))
    assert engine.num_waiting == 1
    assert not engine.can_step
    assert engine.step() == {}
    assert engine.num_waiting == 1
    assert call(engine, "resume_scheduler", call_id=6) == ok_reply(6)
    assert result_of(engine, "is_scheduler_paused") is False
    tokens, _ = run_to_completion(engine)
    assert tokens == {"new": [31, 32]}


def test_pause_scheduler_defaults_to_abort_mode() -> None:
    engine = engine_with()
    engine.add_request(req("a"))
    assert result_of(engine, "pause_scheduler") is None
    assert [o.finish_reason for o in step_outputs(engine)] == [FinishReason.ABORT]
    assert result_of(engine, "is_scheduler_paused") is True


def test_pause_keep_freezes_requests_and_resume_continues_the_exact_sequence() -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("a", [1], max_tokens=5))
    engine.add_request(req("b", [10], max_tokens=2))
    engine.step()
    engine.step()
    assert call(engine, "pause_scheduler", "keep", False, call_id=5) == ok_reply(5)
    assert result_of(engine, "is_scheduler_paused") is True
    engine.add_request(req("c", [20], max_tokens=1))
    assert not engine.can_step
    for _ in range(3):
        assert engine.step() == {}
    assert (engine.num_waiting, engine.num_running) == (2, 1)
    assert result_of(engine, "resume_scheduler") is None
    tokens, finals = run_to_completion(engine)
    assert tokens == {"a": [4, 5, 6], "b": [11, 12], "c": [21]}
    assert all(o.finish_reason is FinishReason.LENGTH for o in finals.values())


def test_pause_wait_replies_once_running_requests_finish_without_starting_waiting_ones() -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("a", [1], max_tokens=3))
    engine.add_request(req("b", [10], max_tokens=2))
    engine.step()
    engine.call_utility(1, 5, "pause_scheduler", ["wait"])
    assert engine.take_utility_outputs() == []  # deferred
    assert [(o.request_id, o.new_token_ids) for o in step_outputs(engine)] == [("a", [3])]
    assert engine.take_utility_outputs() == []
    outputs = step_outputs(engine)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("a", [4], FinishReason.LENGTH)
    ]
    assert engine.take_utility_outputs() == [(1, ok_reply(5))]
    assert result_of(engine, "is_scheduler_paused") is True
    assert not engine.can_step
    assert engine.step() == {}
    assert (engine.num_waiting, engine.num_running) == (1, 0)
    assert result_of(engine, "resume_scheduler") is None
    assert run_to_completion(engine)[0] == {"b": [11, 12]}


def test_requests_arriving_during_a_pause_wait_drain_do_not_start_even_with_room() -> None:
    engine = engine_with(max_num_seqs=4)
    engine.add_request(req("a", [1], max_tokens=2))
    engine.step()
    engine.call_utility(0, 5, "pause_scheduler", ["wait"])
    engine.add_request(req("late", [40], max_tokens=2))
    outputs = step_outputs(engine)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", FinishReason.LENGTH)]
    assert engine.take_utility_outputs() == [(0, ok_reply(5))]
    assert (engine.num_waiting, engine.num_running) == (1, 0)
    assert engine.step() == {}
    assert result_of(engine, "resume_scheduler") is None
    assert run_to_completion(engine)[0] == {"late": [41, 42]}


def test_pause_wait_with_nothing_running_replies_at_once() -> None:
    engine = engine_with()
    engine.add_request(req("waiting", [1], max_tokens=2))
    assert call(engine, "pause_scheduler", "wait", call_id=5) == ok_reply(5)
    assert result_of(engine, "is_scheduler_paused") is True
    assert engine.step() == {}
    assert engine.num_waiting == 1


def test_a_resume_before_the_drain_completes_a_pending_pause_wait() -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("a", [1], max_tokens=3))
    engine.add_request(req("b", [10], max_tokens=2))
    engine.step()
    engine.call_utility(0, 5, "pause_scheduler", ["wait"])
    assert engine.take_utility_outputs() == []
    engine.call_utility(0, 6, "resume_scheduler", [])
    assert engine.take_utility_outputs() == [(0, ok_reply(5)), (0, ok_reply(6))]
    assert result_of(engine, "is_scheduler_paused") is False
    tokens, _ = run_to_completion(engine)
    assert tokens == {"a": [3, 4], "b": [11, 12]}
    assert engine.take_utility_outputs() == []


def test_aborting_the_last_running_request_completes_a_pending_pause_wait() -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("a", [1], max_tokens=10))
    engine.add_request(req("b", [1], max_tokens=10))
    engine.step()
    engine.call_utility(0, 5, "pause_scheduler", ["wait"])
    assert engine.take_utility_outputs() == []
    engine.abort_requests(["a"])
    assert engine.take_utility_outputs() == [(0, ok_reply(5))]
    assert result_of(engine, "is_scheduler_paused") is True
    assert engine.step() == {}
    assert engine.num_waiting == 1


def test_pausing_a_paused_scheduler_replies_at_once_and_changes_nothing() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=3))
    engine.step()
    assert result_of(engine, "pause_scheduler", "keep") is None
    assert result_of(engine, "pause_scheduler", "abort") is None  # already paused: no abort
    assert engine.num_requests == 1
    assert result_of(engine, "resume_scheduler") is None
    assert run_to_completion(engine)[0] == {"a": [3, 4]}


def test_an_unknown_pause_mode_fails_the_call() -> None:
    engine = engine_with()
    reply = call(engine, "pause_scheduler", "sideways")
    assert reply.failure_message is not None
    assert reply.failure_message.startswith("Call to pause_scheduler method failed:")
    assert "sideways" in reply.failure_message
    assert result_of(engine, "is_scheduler_paused") is False


# ------------------------------------------------------------ utility failures

UTILITY_FAILURES = {
    "unknown method": ("no_such_method", [], "no utility method 'no_such_method'"),
    "request entry point": ("add_request", [["x", [1], None, {}]], "no utility method"),
    "private method": ("_validate", [None], "no utility method '_validate'"),
    "dunder method": ("__init__", [{}], "no utility method '__init__'"),
    "engine-side abort": ("abort_all", [], "no utility method 'abort_all'"),
    "step": ("step", [], "no utility method 'step'"),
    "reject": ("reject", ["a", 0, "boom"], "no utility method 'reject'"),
    "property": ("num_requests", [], "no utility method 'num_requests'"),
    "attribute": ("config", [], "no utility method 'config'"),
    "too many arguments": ("is_sleeping", [1], "takes at most 0 arguments (1 given)"),
    "missing argument": ("pin_lora", [], "missing required argument 'lora_id'"),
    "wrong argument type": ("pin_lora", ["one"], "Expected `int`, got `str`"),
    "malformed lora request": ("add_lora", [["name"]], "at least length 2"),
    "fault injection disabled": ("inject_fault", [], "fault injection is disabled"),
    "stall disabled": ("stall", [0.0], "fault injection is disabled"),
    "stalled steps disabled": ("stall_steps", [1.0], "fault injection is disabled"),
}


@pytest.mark.parametrize(
    ("method", "args", "reason"), UTILITY_FAILURES.values(), ids=list(UTILITY_FAILURES)
)
def test_failed_utility_calls_reply_with_a_failure_and_the_engine_keeps_working(
    method: str, args: list[Any], reason: str
) -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("a", [1], max_tokens=3))
    engine.add_request(req("b", [10], max_tokens=2))
    engine.step()
    engine.call_utility(1, 77, method, args)
    replies = engine.take_utility_outputs()
    assert len(replies) == 1
    client, reply = replies[0]
    assert (client, reply.call_id, reply.result) == (1, 77, None)
    assert reply.failure_message is not None
    assert reply.failure_message.startswith(f"Call to {method} method failed: ")
    assert reason in reply.failure_message
    # Nothing was executed: the requests are intact and run to their exact end.
    assert (engine.num_waiting, engine.num_running) == (1, 1)
    tokens, _ = run_to_completion(engine)
    assert tokens == {"a": [3, 4], "b": [11, 12]}
    assert result_of(engine, "is_sleeping") is False


# ----------------------------------------------------------------------- startup


def test_ready_response_describes_the_configuration() -> None:
    config = EngineConfig(
        max_model_len=2048, max_num_seqs=8, max_loras=3, data_parallel_size=4, data_parallel_rank=3
    )
    ready = EngineCore(config).ready_response()
    assert ready.max_model_len == 2048
    assert ready.max_num_seqs == 8
    assert ready.max_loras == 3
    assert ready.data_parallel_size == 4
    assert ready.data_parallel_rank == 3
    assert ready.vllm_version == NEWEST.tested_version  # the newest release, by default
    older = EngineCore(config.evolve(vllm_version="0.33.0")).ready_response()
    assert older.vllm_version == "0.33.0"
    assert ready.supports_lora is True
    assert ready.enable_sleep_mode is True
    assert ready.kv_cache_size_tokens == 8 * 2048
    assert ready.num_gpu_blocks * ready.block_size == 8 * 2048
    assert ready.instance_id.startswith("trio-enginecore-")


def test_each_engine_has_its_own_instance_id() -> None:
    config = EngineConfig()
    first = EngineCore(config)
    assert first.ready_response().instance_id == first.ready_response().instance_id
    assert first.ready_response().instance_id != EngineCore(config).ready_response().instance_id


# ------------------------------------------------------------------- property

VOCAB = 50
MAX_MODEL_LEN = 64

add_op = st.tuples(
    st.just("add"),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    st.integers(1, 12),
    st.integers(0, 2),
)
operations = st.lists(
    st.one_of(
        add_op,
        st.tuples(st.just("abort"), st.lists(st.integers(0, 30), max_size=3)),
        st.tuples(st.just("duplicate"), st.integers(0, 30)),
        st.just(("step",)),
    ),
    max_size=60,
)


@settings(max_examples=50, deadline=None, database=None)
@given(max_num_seqs=st.integers(1, 4), ops=operations)
def test_random_add_abort_step_never_loses_duplicates_or_reorders_tokens(
    max_num_seqs: int, ops: list[tuple[Any, ...]]
) -> None:
    engine = engine_with(vocab_size=VOCAB, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN)
    prompts: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}
    clients: dict[str, int] = {}
    received: dict[str, list[int]] = defaultdict(list)
    live: set[str] = set()
    arrival: list[str] = []  # every request ever added, in arrival order
    finished: set[str] = set()
    aborted: set[str] = set()
    expected_errors: list[str] = []

    def do_step() -> None:
        step = engine.step()
        stepped: set[str] = set()
        for client, message in step.items():
            for output in message.outputs:
                rid = output.request_id
                if output.finish_reason is FinishReason.ERROR:
                    assert rid in expected_errors
                    expected_errors.remove(rid)
                    assert clients[rid] == client
                    assert output.new_token_ids == []
                    continue
                assert rid in live, f"output for a request not in flight: {output}"
                assert rid not in stepped, "two outputs for one request in one step"
                stepped.add(rid)
                assert clients[rid] == client
                assert len(output.new_token_ids) == 1
                received[rid] += output.new_token_ids
                assert received[rid] == expected(prompts[rid], len(received[rid]), VOCAB)
                if output.finished:
                    assert output.finish_reason is FinishReason.LENGTH
                    assert len(received[rid]) == max_tokens[rid]
                    live.discard(rid)
                    finished.add(rid)
                else:
                    assert len(received[rid]) < max_tokens[rid]
        assert not expected_errors
        assert len(stepped) <= max_num_seqs
        # First come, first served: a request starts only once every live request that
        # arrived before it has started.
        started = {rid for rid in arrival if received[rid]}
        for rid in stepped:
            earlier = arrival[: arrival.index(rid)]
            assert all(other in started for other in earlier if other in live)

    def ids(indexes: Iterable[int]) -> list[str]:
        return [f"r{i}" for i in indexes]

    for op in ops:
        if op[0] == "add":
            _, prompt, n, client = op
            rid = f"r{len(prompts)}"
            prompts[rid], max_tokens[rid], clients[rid] = prompt, n, client
            engine.add_request(req(rid, prompt, max_tokens=n, client_index=client))
            live.add(rid)
            arrival.append(rid)
        elif op[0] == "abort":
            targets = ids(op[1])
            engine.abort_requests(targets)
            for rid in targets:
                if rid in live:
                    live.discard(rid)
                    aborted.add(rid)
        elif op[0] == "duplicate":
            (rid,) = ids([op[1]])
            if rid in live:
                engine.add_request(req(rid, [0], client_index=clients[rid]))
                expected_errors.append(rid)
        else:
            do_step()
        assert engine.num_requests == len(live)
        assert engine.num_waiting + engine.num_running == len(live)
        assert engine.num_running <= max_num_seqs

    while engine.can_step:
        do_step()
    assert live == set()
    assert engine.num_requests == 0
    for rid in finished:
        assert received[rid] == expected(prompts[rid], max_tokens[rid], VOCAB)
    for rid in aborted:
        assert len(received[rid]) < max_tokens[rid]


# ------------------------------------------------- vLLM 0.34: checkpoints, readiness


def test_is_inference_ready_is_false_while_asleep_paused_or_in_a_checkpoint() -> None:
    engine = engine_with()
    assert result_of(engine, "is_inference_ready") is True
    assert result_of(engine, "sleep", 1) is None
    assert result_of(engine, "is_inference_ready") is False
    assert result_of(engine, "is_scheduler_paused") is True  # sleeping pauses, as in vLLM
    assert result_of(engine, "wake_up") is True
    assert result_of(engine, "pause_scheduler", "keep") is None
    assert result_of(engine, "is_inference_ready") is False
    assert result_of(engine, "resume_scheduler") is None
    assert result_of(engine, "is_inference_ready") is True


def test_checkpoint_prepare_waits_for_running_requests_then_is_prepared() -> None:
    engine = engine_with(max_num_seqs=1)
    engine.add_request(req("a", [1], max_tokens=2))
    engine.add_request(req("b", [10], max_tokens=2))
    engine.step()
    assert result_of(engine, "checkpoint_prepare") is None  # mode "wait"
    assert result_of(engine, "checkpoint_state") == ("preparing", None)
    assert result_of(engine, "is_inference_ready") is False
    tokens, _ = run_to_completion(engine)
    assert tokens == {"a": [3]}  # "a" finished; "b" waits, never started
    assert result_of(engine, "checkpoint_state") == ("prepared", None)
    assert result_of(engine, "checkpoint_prepare") is None  # repeating is a no-op
    assert result_of(engine, "checkpoint_restore") is None
    assert result_of(engine, "checkpoint_state") == ("running", None)
    assert result_of(engine, "is_inference_ready") is True
    assert run_to_completion(engine)[0] == {"b": [11, 12]}


def test_checkpoint_prepare_abort_aborts_and_is_prepared_at_once() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=5))
    engine.step()
    assert result_of(engine, "checkpoint_prepare", "abort") is None
    assert result_of(engine, "checkpoint_state") == ("prepared", None)
    assert [o.finish_reason for o in step_outputs(engine)] == [FinishReason.ABORT]


def test_sleep_wake_up_and_resume_are_refused_mid_checkpoint_as_vllm_refuses_them() -> None:
    engine = engine_with()
    assert result_of(engine, "checkpoint_prepare", "keep") is None
    for method, args in (("sleep", (1,)), ("wake_up", ()), ("resume_scheduler", ())):
        reply = call(engine, method, *args)
        assert reply.failure_message is not None, method
        assert "while the checkpoint state is prepared" in reply.failure_message
    assert result_of(engine, "checkpoint_state") == ("prepared", None)
    assert result_of(engine, "checkpoint_restore") is None
    assert result_of(engine, "sleep", 1, "abort", True) is None  # 0.34's three arguments


def test_checkpoint_prepare_refuses_an_engine_asleep_and_restore_refuses_a_running_one() -> None:
    engine = engine_with()
    assert result_of(engine, "sleep", 1) is None
    reason = result_of(engine, "checkpoint_prepare")
    assert reason == "Preparing for a checkpoint requires an awake engine"
    assert result_of(engine, "checkpoint_state") == ("running", None)
    assert result_of(engine, "checkpoint_restore") is None  # running: a no-op


def test_a_bad_checkpoint_mode_changes_nothing() -> None:
    engine = engine_with()
    reply = call(engine, "checkpoint_prepare", "later")
    assert reply.failure_message is not None
    assert result_of(engine, "checkpoint_state") == ("running", None)


def test_release_kv_cache_memory_needs_a_completed_pause() -> None:
    engine = engine_with()
    engine.add_request(req("a", [1], max_tokens=5))
    reply = call(engine, "release_kv_cache_memory")
    assert reply.failure_message is not None
    assert "requires a completed pause" in reply.failure_message
    assert result_of(engine, "pause_scheduler", "abort", True, True) is None  # 0.34: 3 args
    step_outputs(engine)
    assert result_of(engine, "release_kv_cache_memory", True) is None
    # As vLLM: the KV cache is asleep now; waking it resumes the engine.
    assert result_of(engine, "is_sleeping") is True
    assert "requires all executor memory" in str(call(engine, "release_kv_cache_memory"))
    assert result_of(engine, "wake_up", ["kv_cache"]) is True
    assert result_of(engine, "is_scheduler_paused") is False
    assert result_of(engine, "pause_scheduler", "keep") is None
    assert result_of(engine, "release_kv_cache_memory") is None  # 0.33: no argument
    assert result_of(engine, "wake_up") is True
    engine.add_request(req("b", [5], max_tokens=2))
    assert run_to_completion(engine)[0] == {"b": [6, 7]}


def test_block_hashes_a_frontend_sends_are_never_trusted() -> None:
    # vLLM 0.34 lets a frontend name a prompt's cached blocks by hash; the reference
    # engine keys its prefix cache by the prompt itself, so a forged hash aliases
    # nothing.
    engine = engine_with()
    forged = [b"\x00" * 32]
    first = msgspec.structs.replace(req("a", [1, 2, 3], max_tokens=1), block_hashes=forged)
    engine.add_request(first)
    run_to_completion(engine)
    assert [1, 2, 3] in engine.prefix_cache
    other = msgspec.structs.replace(req("b", [7, 8, 9], max_tokens=1), block_hashes=forged)
    engine.add_request(other)
    assert [7, 8, 9] not in engine.prefix_cache  # the same hashes found no entry
    tokens, _ = run_to_completion(engine)
    assert tokens == {"b": [10]}
    assert len(engine.prefix_cache) == 2

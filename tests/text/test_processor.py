"""From engine outputs to request outputs: output kinds, n > 1, logprobs, aborts
(pure: the processor fed by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from trio_enginecore.protocol import (
    EngineCoreOutput,
    FinishReason,
    LogprobsLists,
    RequestOutputKind,
    SamplingParams,
)
from trio_enginecore.text import Logprob, Tokenizer, builtin_tokenizer
from trio_enginecore.text._processor import TextRequestState

BYTES = builtin_tokenizer()
EOS = 256


def ids(text: str) -> list[int]:
    return list(text.encode())


def state(**params: object) -> TextRequestState:
    return TextRequestState("r", "Q:", ids("Q:"), SamplingParams(**params), BYTES)  # type: ignore[arg-type]


def out(
    request_id: str, text: str, finish: FinishReason | None = None, **kw: object
) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, ids(text), finish_reason=finish, **kw)  # type: ignore[arg-type]


def test_cumulative_outputs_carry_everything_so_far() -> None:
    s = state(max_tokens=10)
    first, _ = s.process(out("r", "ab"))
    last, _ = s.process(out("r", "c", FinishReason.LENGTH))
    assert first is not None
    assert last is not None
    assert (first.outputs[0].text, first.outputs[0].token_ids) == ("ab", ids("ab"))
    assert (last.outputs[0].text, last.outputs[0].finish_reason) == ("abc", "length")
    assert last.finished
    assert last.prompt == "Q:"


def test_delta_outputs_carry_what_is_new() -> None:
    s = state(output_kind=RequestOutputKind.DELTA)
    texts = [s.process(out("r", t))[0] for t in ("ab", "c")]
    assert [o.outputs[0].text for o in texts if o] == ["ab", "c"]


def test_final_only_gives_one_output_at_the_end() -> None:
    s = state(output_kind=RequestOutputKind.FINAL_ONLY)
    assert s.process(out("r", "ab"))[0] is None
    final, _ = s.process(out("r", "c", FinishReason.LENGTH))
    assert final is not None
    assert final.outputs[0].text == "abc"


def test_a_stop_string_finishes_the_request_and_asks_for_the_abort() -> None:
    s = state(stop=["b"], output_kind=RequestOutputKind.DELTA)
    output = out("r", "abc")
    result, abort = s.process(output)
    assert abort  # the engine does not know: it must be told, once
    assert result is not None
    assert (result.outputs[0].text, result.outputs[0].finish_reason) == ("a", "stop")
    assert result.outputs[0].stop_reason == "b"
    assert output.new_token_ids == ids("ab")  # the surplus token is cut
    assert s.finished
    assert s.process(out("r", "more")) == (None, False)  # late outputs are dropped


def test_a_stop_token_keeps_its_id_as_stop_reason_and_needs_no_abort() -> None:
    s = state(stop_token_ids=[ord("!")])
    result, abort = s.process(out("r", "hi!", FinishReason.STOP, stop_reason=ord("!")))
    assert not abort
    assert result is not None
    c = result.outputs[0]
    assert (c.text, c.token_ids, c.stop_reason) == ("hi", ids("hi!"), ord("!"))


def test_n_sequences_are_gathered_by_index_and_finish_together() -> None:
    s = state(n=2, output_kind=RequestOutputKind.FINAL_ONLY, seed=1)
    assert s.engine_request_ids == ["0_r", "1_r"]
    assert s.process(out("1_r", "yy", FinishReason.LENGTH))[0] is None
    final, _ = s.process(out("0_r", "x", FinishReason.LENGTH))
    assert final is not None
    assert final.finished
    assert [(c.index, c.text) for c in final.outputs] == [(0, "x"), (1, "yy")]


def test_a_finished_sequence_is_never_handed_out_again() -> None:
    s = state(n=2, output_kind=RequestOutputKind.DELTA)
    first, _ = s.process(out("0_r", "a", FinishReason.LENGTH))
    assert first is not None
    assert not first.finished
    assert s.process(out("0_r", "late")) == (None, False)
    last, _ = s.process(out("1_r", "b", FinishReason.LENGTH))
    assert last is not None
    assert last.finished
    assert [c.index for c in last.outputs] == [1]


def test_stream_interval_hands_out_every_few_tokens() -> None:
    s = state(stream_interval=3, output_kind=RequestOutputKind.DELTA, max_tokens=20)
    given = [s.process(out("r", ch))[0] for ch in "abcdefg"]
    assert [o.outputs[0].text if o else None for o in given] == [
        "a", None, None, "bcd", None, None, "efg",
    ]  # fmt: skip


def test_logprobs_come_with_each_tokens_text() -> None:
    s = state(logprobs=1, output_kind=RequestOutputKind.DELTA)
    rows = LogprobsLists(
        np.array([[ord("h"), ord("j")], [ord("i"), ord("h")]], dtype=np.int32),
        np.array([[-0.5, -1.0], [-0.25, -2.0]], dtype=np.float32),
        np.array([1, 2], dtype=np.int32),
    )
    result, _ = s.process(out("r", "hi", new_logprobs=rows))
    assert result is not None
    c = result.outputs[0]
    assert c.logprobs == [
        {ord("h"): Logprob(-0.5, 1, "h"), ord("j"): Logprob(-1.0, 1, "j")},
        {ord("i"): Logprob(-0.25, 2, "i"), ord("h"): Logprob(-2.0, 1, "h")},
    ]
    assert c.cumulative_logprob == pytest.approx(-0.75)


def test_a_logprob_token_inside_a_character_gets_the_text_it_completes() -> None:
    s = state(logprobs=0, output_kind=RequestOutputKind.DELTA)
    emoji = ids("é")
    rows = LogprobsLists(
        np.array([[emoji[0]], [emoji[1]]], dtype=np.int32),
        np.array([[-0.1], [-0.2]], dtype=np.float32),
        np.array([1, 1], dtype=np.int32),
    )
    result, _ = s.process(EngineCoreOutput("r", emoji, new_logprobs=rows))
    assert result is not None
    assert result.outputs[0].logprobs is not None
    texts = [next(iter(p.values())).decoded_token for p in result.outputs[0].logprobs]
    assert texts == ["", "é"]


def test_abort_finishes_every_sequence_left(tricky: Tokenizer) -> None:
    s = TextRequestState("r", None, [5], SamplingParams(n=2), tricky)
    s.process(EngineCoreOutput("0_r", [7], finish_reason=FinishReason.LENGTH))
    last = s.abort()
    assert last is not None
    assert last.finished
    assert [(c.index, c.finish_reason) for c in last.outputs] == [(1, "abort")]
    assert s.abort() is None

"""From engine outputs to :class:`RequestOutput` s (pure: no I/O, no Trio).

:class:`TextRequestState` is everything the frontend knows of one text request: its
prompt, and one :class:`SequenceState` per engine request (``n`` of them for parallel
sampling). Fed each :class:`~trio_enginecore.EngineCoreOutput` of its engine requests,
it answers with the :class:`RequestOutput` to hand to the reader (or ``None``), and
whether that engine request must be aborted (a stop string ended it, which the engine
cannot know). The rules are vLLM's ``OutputProcessor``'s:

* ``DELTA`` outputs carry what is new; ``CUMULATIVE`` everything so far;
  ``FINAL_ONLY`` one output at the end (with ``n > 1``, all ``n`` sequences at once).
* A stop string found in the text finishes the sequence with ``finish_reason="stop"``
  and ``stop_reason=<the string>``; tokens the engine sent past it in the same step are
  dropped (their logprobs too).
* ``stream_interval`` > 1 hands out a sequence's output on its first token, every
  ``stream_interval`` tokens, and at the end.
* With ``n > 1``, a sequence that finished is never handed out again, and the request
  is finished when all its sequences are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, final

import msgspec

from ..protocol import EngineCoreOutput, FinishReason, RequestOutputKind, SamplingParams
from ._detokenizer import IncrementalDetokenizer
from ._logprobs import LogprobsDecoder
from ._outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from ._tokenizer import Tokenizer

__all__ = ["SequenceState", "TextRequestState", "child_request_id", "child_sampling_params"]

# vLLM's finish reason strings ("stop", "length", ...), looked up rather than made.
_FINISH_REASONS: dict[FinishReason, str] = {reason: str(reason) for reason in FinishReason}


def child_request_id(index: int, request_id: str) -> str:
    """The engine request id of sequence ``index`` of a request with ``n > 1``
    (vLLM's form: ``"<index>_<request id>"``)."""
    return f"{index}_{request_id}"


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sequence ``index`` of ``params`` (``n = 1``; with a seed,
    each sequence gets ``seed + index`` so that they differ)."""
    changes: dict[str, object] = {"n": 1}
    if params.seed is not None:
        changes["seed"] = params.seed + index
    return msgspec.structs.replace(params, **changes)


@final
class SequenceState:
    """One engine request's text, token ids and logprobs."""

    __slots__ = (
        "detokenizer",
        "engine_request_id",
        "finished",
        "index",
        "logprobs",
        "sent_tokens",
        "stream_interval",
    )

    def __init__(
        self,
        engine_request_id: str,
        index: int,
        tokenizer: Tokenizer | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        repair_text: bool = True,
    ) -> None:
        if not params.detokenize:
            tokenizer = None
        self.engine_request_id = engine_request_id
        self.index = index
        stop = params.stop
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            stop=[stop] if isinstance(stop, str) else (stop or ()),
            min_tokens=params.min_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            # vLLM's meaning: only with special tokens in the text can spacing apply.
            spaces_between_special_tokens=(
                params.skip_special_tokens or params.spaces_between_special_tokens
            ),
            request_id=engine_request_id,
            repair_text=repair_text,
        )
        self.logprobs = LogprobsDecoder(
            tokenizer,
            num_logprobs=params.num_logprobs,  # logprob_token_ids alone count too
            num_prompt_logprobs=params.prompt_logprobs,
            prompt_logprob_start=params.prompt_logprob_start or 0,
        )
        self.stream_interval = max(params.stream_interval or 1, 1)
        self.sent_tokens = 0
        self.finished = False


@final
class TextRequestState:
    """One text request, from its first engine output to its last.

    Args:
        request_id: the caller's id for the request.
        prompt: the prompt's text (``None`` when given as token ids).
        prompt_token_ids: its token ids.
        params: its sampling parameters (``n`` of them are fanned out).
        tokenizer: for the text; ``None`` for token ids only.
        repair_text: fix vLLM's two text mistakes
            (:class:`~._detokenizer.IncrementalDetokenizer`); ``False`` reproduces them.
    """

    __slots__ = (
        "_final_outputs",
        "_sequences",
        "_unfinished",
        "n",
        "num_cached_tokens",
        "output_kind",
        "prompt",
        "prompt_token_ids",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        *,
        repair_text: bool = True,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = params.output_kind
        self.n = params.n
        self.num_cached_tokens = 0
        if params.n == 1:
            ids = [request_id]
        else:
            ids = [child_request_id(i, request_id) for i in range(params.n)]
        self._sequences = {
            engine_id: SequenceState(
                engine_id, i, tokenizer, prompt_token_ids, params, repair_text=repair_text
            )
            for i, engine_id in enumerate(ids)
        }
        self._unfinished = set(ids)
        self._final_outputs: list[CompletionOutput | None] = [None] * params.n

    @property
    def engine_request_ids(self) -> list[str]:
        """The ids of the engine requests, in sequence order."""
        return list(self._sequences)

    @property
    def finished(self) -> bool:
        """Whether every sequence is finished."""
        return not self._unfinished

    def sequence(self, engine_request_id: str) -> SequenceState:
        """The state of one engine request."""
        return self._sequences[engine_request_id]

    def process(self, output: EngineCoreOutput) -> tuple[RequestOutput | None, bool]:
        """Take one engine output of one of this request's engine requests.

        Returns the output to hand out (``None`` when there is nothing to hand out
        yet) and whether that engine request must now be aborted on the engine (a stop
        string finished it there where the engine does not know it). ``output`` may be
        changed: tokens past a stop string are cut from it.
        """
        sequence = self._sequences[output.request_id]
        if sequence.finished:
            return None, False
        finish = output.finish_reason
        stop_reason = output.stop_reason
        new_ids = output.new_token_ids
        detokenizer = sequence.detokenizer
        tokens_before = len(detokenizer.token_ids)
        if output.prefill_stats is not None and tokens_before == 0:
            self.num_cached_tokens = output.prefill_stats.num_cached_tokens
        stop_string = detokenizer.update(
            new_ids, finish is FinishReason.STOP, finished=finish is not None
        )
        if stop_string is not None:
            finish = FinishReason.STOP
            stop_reason = stop_string
            kept = len(detokenizer.token_ids) - tokens_before
            if kept < len(new_ids):
                del new_ids[kept:]
                if output.new_logprobs is not None:
                    lists = output.new_logprobs
                    output.new_logprobs = type(lists)(
                        lists.logprob_token_ids[:kept],
                        lists.logprobs[:kept],
                        lists.sampled_token_ranks[:kept],
                        None,
                    )
        if output.new_logprobs is not None or output.new_prompt_logprobs_tensors is not None:
            sequence.logprobs.update(output.new_logprobs, output.new_prompt_logprobs_tensors)
        finished = finish is not None
        abort = finished and output.finish_reason is None
        if finished:
            sequence.finished = True
        return self._output_for(sequence, new_ids, finish, stop_reason), abort

    def abort(self) -> RequestOutput | None:
        """Finish every unfinished sequence as aborted (the caller gave up, or the
        request was aborted); returns the last output to hand out, if any."""
        result: RequestOutput | None = None
        for sequence in self._sequences.values():
            if sequence.finished:
                continue
            sequence.finished = True
            out = self._output_for(sequence, [], FinishReason.ABORT, None)
            if out is not None:
                if result is None:
                    result = out
                else:
                    result.add(out, aggregate=self.output_kind is RequestOutputKind.DELTA)
        return result

    def _output_for(
        self,
        sequence: SequenceState,
        new_ids: list[int],
        finish: FinishReason | None,
        stop_reason: int | str | None,
    ) -> RequestOutput | None:
        finished = finish is not None
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        detokenizer = sequence.detokenizer
        token_ids = new_ids
        if sequence.stream_interval > 1:
            produced = len(detokenizer.token_ids)
            if not (
                finished
                or sequence.sent_tokens == 0
                or produced - sequence.sent_tokens >= sequence.stream_interval
            ):
                return None
            if delta:
                token_ids = detokenizer.token_ids[sequence.sent_tokens :]
                sequence.sent_tokens = produced
        text = detokenizer.next_text(finished=finished, delta=delta)
        if not delta:
            # A delta output owns the engine output's list; a cumulative one a copy.
            token_ids = list(detokenizer.token_ids)
        decoder = sequence.logprobs
        logprobs = decoder.logprobs
        if logprobs is not None:
            if delta:
                logprobs = logprobs[-len(token_ids) :] if token_ids else []
            else:
                logprobs = list(logprobs)
        completion = CompletionOutput(
            sequence.index,
            text,
            token_ids,
            decoder.cumulative_logprob,
            logprobs,
            None if finish is None else _FINISH_REASONS[finish],
            stop_reason if finished else None,
        )
        outputs: list[CompletionOutput]
        if finished:
            self._unfinished.discard(sequence.engine_request_id)
        if self.n == 1:
            outputs = [completion]
            request_finished = finished
        else:
            if kind is RequestOutputKind.FINAL_ONLY:
                self._final_outputs[sequence.index] = completion
                if self._unfinished:
                    return None
                outputs = [c for c in self._final_outputs if c is not None]
            else:
                outputs = [completion]
            request_finished = not self._unfinished
        prompt_logprobs = decoder.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = decoder.take_prompt_logprobs() if delta else list(prompt_logprobs)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            prompt_logprobs,
            outputs,
            request_finished,
            self.num_cached_tokens,
        )

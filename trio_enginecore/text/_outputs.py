"""What a text request produces: :class:`RequestOutput` and its
:class:`CompletionOutput` s, field for field as vLLM's (pure data)."""

from __future__ import annotations

import msgspec

from ._logprobs import PromptLogprobs, SampleLogprobs

__all__ = ["CompletionOutput", "RequestOutput"]


# msgspec Structs with gc=False: a stream makes one of each per output, and outputs
# never form cycles, so the cyclic collector need not track them (measured: at 512
# streams, the collector took about a tenth of the frontend's CPU).
class CompletionOutput(msgspec.Struct, gc=False):
    """One generated sequence (one of the ``n`` choices) of a request, or the part of
    it that is new (``RequestOutputKind.DELTA``).

    Attributes:
        index: which of the ``n`` sequences (0-based).
        text: the generated text (the new text, for delta outputs).
        token_ids: the generated token ids (the new ones, for delta outputs); a
            terminal EOS or stop token is here though not in the text.
        cumulative_logprob: the sum of the sampled tokens' logprobs, when logprobs
            were asked for.
        logprobs: per position, token id -> :class:`Logprob`, when asked for.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or
            ``"repetition"``; ``None`` until the sequence finished.
        stop_reason: what stopped it: the stop string, or the stop token id
            (``None`` for EOS and every other reason).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether this sequence is finished."""
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, gc=False):
    """What a request produced, as vLLM's ``RequestOutput``.

    Attributes:
        request_id: the request's id (the caller's, not the engine's).
        prompt: the prompt's text (``None`` for a prompt given as token ids).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt position, when asked for (``None`` for the first).
            Delta outputs carry them once, with the first output.
        outputs: the sequences this output is about (with ``n > 1``, a delta output may
            carry only those that moved; a final one carries all ``n``).
        finished: whether the whole request (every sequence) is finished.
        num_cached_tokens: prompt tokens the engine found in its prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None

    def add(self, newer: RequestOutput, *, aggregate: bool) -> None:
        """Fold ``newer`` (a later output of the same request) into this one: delta
        outputs are appended (``aggregate``), cumulative ones replace, per ``index``."""
        self.finished |= newer.finished
        for completion in newer.outputs:
            for i, mine in enumerate(self.outputs):
                if mine.index != completion.index:
                    continue
                if aggregate:
                    mine.text += completion.text
                    mine.token_ids.extend(completion.token_ids)
                    if completion.logprobs:
                        assert mine.logprobs is not None
                        mine.logprobs.extend(completion.logprobs)
                    mine.cumulative_logprob = completion.cumulative_logprob
                    mine.finish_reason = completion.finish_reason
                    mine.stop_reason = completion.stop_reason
                else:
                    self.outputs[i] = completion
                break
            else:
                self.outputs.append(completion)

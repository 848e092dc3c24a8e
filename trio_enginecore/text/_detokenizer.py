"""Incremental detokenization and stop strings (pure: no I/O, no Trio).

One :class:`IncrementalDetokenizer` per generated sequence turns the token ids an
engine sends into text, step by step, the way vLLM's frontend does, so the text is
exactly vLLM's:

* The text comes from a ``tokenizers`` ``DecodeStream`` primed with the prompt's ids, so
  the first output token gets the leading space (or merge) the prompt gives it. The
  stream emits nothing for a token that ends inside a multi-byte character; the
  character appears, whole, with the token that completes it.
* Stop strings are looked for after each step, only in the new text and the
  ``len(stop) - 1`` characters before it (a stop string spanning tokens is found, text
  already searched is not searched again), and only once ``min_tokens`` output tokens
  exist. The match that *ends* first wins (ties: the earlier stop string in the list).
  The text is cut at the match's start (or its end, with ``include_stop_str_in_output``)
  and tokens after the one that completed it are dropped.
* While streaming, the last ``max(len(stop)) - 1`` characters are held back (when there
  are stop strings and they are not included in the output): they might begin a stop
  string, which must never reach the reader.
* A terminal stop token (EOS, or a ``stop_token_ids`` entry: the engine finished with
  ``FinishReason.STOP``) is kept in the token ids but left out of the text, unless
  ``include_stop_str_in_output`` is set.

Two things vLLM 0.33 and 0.34 get wrong are done right here (``repair_text``, on by
default; the differential tests turn it off to show that everything else is vLLM's
text exactly):

* **A prompt that ends inside a character.** Primed with such a prompt, the decoder's
  first text repeats the whole prompt's text (``"The quick ... Hello 🙂"`` where the
  output only completed the ``🙂``). Here the output starts after the prompt's last
  complete character: ``"🙂"``.
* **Complete characters pending at the finish.** The decoder holds back a token whose
  text ends inside a character, with any complete characters before it in the same
  token (``" \xf0"``: a space and the first byte of an emoji). If the sequence ends
  there, vLLM drops the space with the unfinished emoji. Here the complete characters
  come out with the last output; only the unfinished character is dropped.
"""

from __future__ import annotations

import bisect
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, final

if TYPE_CHECKING:
    from ._tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "find_stop_string"]

logger = logging.getLogger("trio_enginecore.text")

# The message tokenizers' DecodeStream raises when a tokenizer's output is not
# monotonic (it rewrote text it had already emitted): the stream cannot go on.
_INVALID_PREFIX: Final = "Invalid prefix encountered"
_REPLACEMENT: Final = "\ufffd"
# Tokens of context decoded around a repair: enough for any character and for the
# decoders that look at the previous token (a leading space, a merge).
_CONTEXT: Final = 8


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n
    while low < high:  # the longest k with a[:k] == b[:k]
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def find_stop_string(
    text: str, new_chars: int, stop: Sequence[str], *, include_in_output: bool
) -> tuple[str, int] | None:
    """The stop string that ends first in the last ``new_chars`` characters of
    ``text`` (or spans into them), and where to cut ``text``.

    Returns ``(stop_string, cut)``, ``cut`` being the length to truncate ``text`` to
    (the match's start; its end with ``include_in_output``), or ``-1`` when nothing
    is to be cut; ``None`` when no stop string matches.
    """
    if not new_chars or not stop:
        return None
    best: str | None = None
    best_start = 0
    best_end = sys.maxsize
    for candidate in stop:
        # Start far enough back for a match that begins in old text and ends in new.
        start = text.find(candidate, max(len(text) + 1 - new_chars - len(candidate), 0))
        if start < 0:
            continue
        end = start + len(candidate)
        if end < best_end:
            best, best_start, best_end = candidate, start, end
    if best is None:
        return None
    if include_in_output:
        return best, (-1 if best_end >= len(text) else best_end)
    return best, best_start


@final
class IncrementalDetokenizer:
    """The text of one generated sequence, one engine step at a time.

    Args:
        tokenizer: the model's tokenizer; ``None`` to keep token ids only (no text, no
            stop strings: vLLM's ``detokenize=False``).
        prompt_token_ids: the prompt, which primes the decoder.
        stop: stop strings (already validated).
        min_tokens: output tokens before stop strings are looked for.
        include_stop_str_in_output: keep the stop string (and a terminal stop token)
            in the text.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: with ``skip_special_tokens=False``, whether
            consecutive added tokens are separated as the decoder separates them
            (``True``) or written back to back (``False``).
        repair_text: do the two repairs the module docstring describes (``False``
            gives vLLM's text exactly, mistakes included).
    """

    __slots__ = (
        "_added_tokens",
        "_batch_exact",
        "_decoder_stream",
        "_emitted",
        "_last_was_added",
        "_pending",
        "_prompt_open",
        "_prompt_tail",
        "_repair",
        "_skip_special_tokens",
        "_stop",
        "_stop_hold_back",
        "_tokenizer",
        "flushed_at_finish",
        "include_stop_str_in_output",
        "min_tokens",
        "repaired_prompt_leak",
        "request_id",
        "text",
        "token_ids",
    )

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        request_id: str = "",
        repair_text: bool = True,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = []
        """Every output token id so far (a terminal stop token included)."""
        self.text = ""
        """The text so far, held-back characters included."""
        self._tokenizer = tokenizer
        self._stop = list(stop) if tokenizer is not None else []
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self._stop_hold_back = (
            max(map(len, self._stop)) - 1 if self._stop and not include_stop_str_in_output else 0
        )
        self._emitted = 0
        self._skip_special_tokens = skip_special_tokens
        self._decoder_stream: Any = None
        self._added_tokens: dict[int, str] | None = None
        self._last_was_added = False
        # The batch step is used only with decoders for which it is known to give the
        # same text as single steps (byte-level ones), and with no added-token spacing
        # to apply token by token.
        self._batch_exact = False
        self._repair = repair_text and tokenizer is not None
        self._pending: list[int] = []
        self._prompt_tail = list(prompt_token_ids[-_CONTEXT:])
        self._prompt_open = False
        self.repaired_prompt_leak = False
        """Whether this sequence's first text was repaired (its prompt ended inside a
        character)."""
        self.flushed_at_finish = False
        """Whether complete characters the decoder held were given out at the finish."""
        if tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            self._decoder_stream = DecodeStream(
                ids=_primer(tokenizer, prompt_token_ids), skip_special_tokens=skip_special_tokens
            )
            if not skip_special_tokens and not spaces_between_special_tokens:
                self._added_tokens = tokenizer.added_tokens or None
            self._batch_exact = tokenizer.byte_level and self._added_tokens is None
            if self._repair and self._prompt_tail:
                tail = tokenizer.decode(self._prompt_tail, skip_special_tokens=skip_special_tokens)
                self._prompt_open = tail.endswith(_REPLACEMENT)

    @property
    def stop_hold_back(self) -> int:
        """Characters held back while the sequence streams (0 without stop strings)."""
        return self._stop_hold_back

    def update(
        self, new_token_ids: Sequence[int], stop_terminated: bool, *, finished: bool = False
    ) -> str | None:
        """Take one step's new token ids; return the stop string that ended the
        sequence, if one did.

        ``stop_terminated``: the engine finished the sequence on a stop token (its
        last new token), which is then kept out of the text. ``finished``: this is the
        sequence's last step (complete characters the decoder still holds come out).
        When a stop string matches, :attr:`token_ids` drops the tokens after the one
        that completed it, and :attr:`text` is cut.
        """
        if not new_token_ids:
            return None
        tokenizer = self._tokenizer
        if tokenizer is None:
            self.token_ids.extend(new_token_ids)
            return None
        held_stop_token: int | None = None
        to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output:
            held_stop_token = new_token_ids[-1]
            to_decode = new_token_ids[:-1]
        token_ids = self.token_ids
        tokens_before = len(token_ids)
        stop = self._stop
        # The text is grown in a local with no other reference, which CPython extends
        # in place: ``self.text += piece`` would copy the whole text every token.
        text = self.text
        self.text = ""
        offsets: list[int] | None = None
        if stop:
            offsets = [len(text)]
        elif (
            len(to_decode) > 1
            and self._batch_exact
            and not self._prompt_open
            and tokenizer.completes_characters(to_decode[-1], self._skip_special_tokens)
        ):
            # No stop strings (no per-token offsets needed), and the last token ends
            # on a character boundary: one step for all of them gives the text that
            # one step per token gives (measured: about half the cost at 4 tokens).
            token_ids.extend(to_decode)
            piece = self._step(list(to_decode))
            if piece is not None:
                text += piece
                self._pending.clear()
            elif self._repair:
                self._pending.extend(to_decode)
            to_decode = ()
        step = self._decoder_stream.step
        backend = tokenizer.backend
        repair = self._repair
        added = self._added_tokens
        for token_id in to_decode:
            token_ids.append(token_id)
            try:
                piece = step(backend, token_id)
            except Exception as exc:
                piece = self._recover(token_id, exc)
            if repair:
                if piece is None:
                    self._pending.append(token_id)
                else:
                    if self._prompt_open:
                        self.text = text
                        piece = self._without_prompt_text(piece)
                    self._pending.clear()
            if added is not None:
                content = added.get(token_id)
                if content is not None and self._last_was_added:
                    # Back to back with the previous added token: its raw text, unspaced.
                    piece = content
                self._last_was_added = content is not None
            if piece:
                text += piece
            if offsets is not None:
                offsets.append(len(text))
        self.text = text
        if finished and self._pending and self._repair:
            self._flush()
            if offsets is not None:
                offsets[-1] = len(self.text)
        if held_stop_token is not None:
            self.token_ids.append(held_stop_token)
            if offsets is not None:
                offsets.append(len(self.text))
        if offsets is None or len(self.token_ids) <= self.min_tokens:
            return None
        # Text of tokens before the min_tokens-th is not searched.
        search_from = offsets[max(self.min_tokens - tokens_before, 0)]
        found = find_stop_string(
            self.text,
            len(self.text) - search_from,
            stop,
            include_in_output=self.include_stop_str_in_output,
        )
        if found is None:
            return None
        stop_string, cut = found
        stop_end = len(self.text) if cut == -1 else cut
        if not self.include_stop_str_in_output:
            stop_end += len(stop_string)
        # Keep the tokens up to the one whose text completed the stop string.
        kept = bisect.bisect_left(offsets, stop_end, lo=1)
        del self.token_ids[tokens_before + kept :]
        if cut != -1:
            self.text = self.text[:cut]
        return stop_string

    def _step(self, token_ids: int | list[int]) -> str | None:
        try:
            piece: str | None = self._decoder_stream.step(self._backend(), token_ids)
        except Exception as exc:
            if isinstance(token_ids, list):
                raise
            piece = self._recover(token_ids, exc)
        return piece

    def _backend(self) -> Any:
        tokenizer = self._tokenizer
        assert tokenizer is not None
        return tokenizer.backend

    def _recover(self, token_id: int, exc: Exception) -> str | None:
        # What vLLM's detokenizer does when the decoder raises on a token.
        if isinstance(exc, OverflowError | TypeError):
            # An id the tokenizer cannot take at all: no text for it.
            logger.warning("request %r: token id %r cannot be decoded", self.request_id, token_id)
            return None
        if not str(exc).startswith(_INVALID_PREFIX):
            raise exc
        # The tokenizer rewrote text it had emitted (some tokenizers' output is not
        # monotonic), which breaks the stream's state: start a fresh stream (no
        # prompt context) at this token.
        logger.warning(
            "request %r: the decoder met text it cannot extend; starting it afresh",
            self.request_id,
        )
        from tokenizers.decoders import DecodeStream

        self._decoder_stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        piece: str | None = self._decoder_stream.step(self._backend(), token_id)
        return piece

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self._tokenizer
        assert tokenizer is not None
        return tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _without_prompt_text(self, piece: str) -> str:
        # The first text after a prompt whose text ended in U+FFFD (an unfinished
        # character, or a byte that is no character): the decoder gives the prompt's
        # text again with it. What the output adds is what follows the text the prompt
        # and the output have in common (an unfinished character the output completes
        # belongs to the output; a stray byte's U+FFFD stays the prompt's).
        self._prompt_open = False
        before = self._decode(self._prompt_tail)
        after = self._decode(self._prompt_tail + self.token_ids)
        added = after[_common_prefix(before, after) :]
        if not piece.endswith(added):
            return piece  # not the shape this repair knows: leave the decoder's text
        self.repaired_prompt_leak = piece != added
        return added

    def _flush(self) -> None:
        # The sequence ends with tokens the decoder holds (their text ends in U+FFFD):
        # give out the complete characters among them; the trailing U+FFFDs (an
        # unfinished character, or stray bytes) stay out, as the decoder leaves them.
        pending = self._pending
        history = self._prompt_tail + self.token_ids[: len(self.token_ids) - len(pending)]
        context = history[-_CONTEXT:]
        before = self._decode(context)
        after = self._decode(context + pending)
        self._pending = []
        if self._prompt_open:
            start = _common_prefix(before, after)
        elif after.startswith(before):
            start = len(before)
        else:
            return  # not the shape this repair knows
        extra = after[start:].rstrip(_REPLACEMENT)
        if extra:
            self.text += extra
            self.flushed_at_finish = True

    def next_text(self, *, finished: bool, delta: bool) -> str:
        """The text to hand out now: what is new since the last call (``delta``), or
        all of it; without the held-back characters unless ``finished``."""
        hold = 0 if finished else self._stop_hold_back
        end = len(self.text) - hold
        if not delta:
            # Shorter than the hold-back: nothing yet (a negative end would count
            # from the end).
            return self.text[:-hold] if hold else self.text
        start = self._emitted
        if start < end:
            self._emitted = end
            return self.text[start:end]
        return ""


def _primer(tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> list[int]:
    """The end of the prompt the decoder stream starts from, as vLLM's detokenizer
    primes its own: the shortest suffix of 4 to 23 tokens that decodes to whole
    characters, else the whole prompt. The text a token adds depends only on the tokens
    just before it; priming with the whole prompt decoded all of it once (0.3 s for a
    million tokens, the event loop held), for the same pieces."""
    count = len(prompt_token_ids)
    if count > 4:
        for length in range(4, min(count + 1, 24)):
            suffix = list(prompt_token_ids[-length:])
            if _REPLACEMENT not in tokenizer.decode(suffix):
                return suffix
    return list(prompt_token_ids)

"""The incremental detokenizer and stop strings, driven by hand (no engine, no I/O).

Most cases use the built-in byte-level tokenizer, where every byte is a token: a
character of several bytes always spans tokens, so each rule can be shown on a few
bytes. The differential tests (tests/interop/test_text_differential.py) check the same
rules against vLLM's own output processor on thousands of random streams.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from trio_enginecore.text import IncrementalDetokenizer, Tokenizer, builtin_tokenizer
from trio_enginecore.text._detokenizer import find_stop_string

BYTES = builtin_tokenizer()
EOS = 256


def ids(text: str) -> list[int]:
    return list(text.encode())


def detokenizer(prompt: str = "Q:", **options: object) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(BYTES, ids(prompt), **options)  # type: ignore[arg-type]


def feed(d: IncrementalDetokenizer, steps: list[list[int]], *, last: bool = True) -> list[str]:
    """Each step's delta text, the last step marked finished."""
    deltas = []
    for i, step in enumerate(steps):
        finished = last and i == len(steps) - 1
        d.update(step, False, finished=finished)
        deltas.append(d.next_text(finished=finished, delta=True))
    return deltas


def test_no_half_character_is_ever_given_out() -> None:
    d = detokenizer()
    emoji = ids("🙂")  # four bytes, four tokens
    assert feed(d, [[b] for b in ids("a")] + [[b] for b in emoji], last=False) == [
        "a",
        "",
        "",
        "",
        "🙂",
    ]


def test_a_stop_string_spanning_tokens_ends_the_text_at_its_start() -> None:
    d = detokenizer(stop=["END"])
    found = None
    for b in ids("done END more"):
        found = d.update([b], False)
        if found:
            break
    assert found == "END"
    assert d.text == "done "
    assert d.token_ids == ids("done END")  # tokens after the one completing it: none


def test_the_stop_string_is_kept_with_include_stop_str_in_output() -> None:
    d = detokenizer(stop=["END"], include_stop_str_in_output=True)
    assert d.update(ids("done END more"), False) == "END"
    assert d.text == "done END"
    assert d.token_ids == ids("done END")  # the surplus tokens of the step are dropped


def test_the_match_that_ends_first_wins_whatever_the_list_order() -> None:
    d = detokenizer(stop=["long stop", "st"])
    assert d.update(ids("a long stop"), False) == "st"
    assert d.text == "a long "


def test_the_last_characters_wait_while_a_stop_string_could_still_begin_there() -> None:
    d = detokenizer(stop=["STOP"])
    deltas = feed(d, [ids("abc"), ids("ST"), ids("x"), ids("y")])
    # The last len("STOP") - 1 = 3 characters always wait (vLLM's rule: a count, not
    # a look at what they are), until the finish gives everything out.
    assert deltas == ["", "ab", "c", "STxy"]
    assert "".join(deltas) == "abcSTxy"


def test_a_stop_string_ending_on_a_multi_byte_character_is_found() -> None:
    d = detokenizer(stop=["é!"])
    found = None
    for b in ids("café! no"):
        found = d.update([b], False) or found
        if found:
            break
    assert found == "é!"
    assert d.text == "caf"


def test_stop_strings_wait_for_min_tokens() -> None:
    d = detokenizer(stop=["a"], min_tokens=3)
    assert d.update(ids("aa"), False) is None
    # The third token may end the sequence, but only in text after the first min_tokens.
    assert d.update(ids("ba"), False) == "a"
    assert d.text == "aab"


def test_the_stop_token_stays_out_of_the_text_but_in_the_token_ids() -> None:
    d = detokenizer()
    d.update([*ids("hi"), EOS], True, finished=True)
    assert d.text == "hi"
    assert d.token_ids == [*ids("hi"), EOS]
    shown = detokenizer(include_stop_str_in_output=True, skip_special_tokens=False)
    shown.update([*ids("hi"), EOS], True, finished=True)
    assert shown.text == "hi<|endoftext|>"


def test_spaces_between_special_tokens_off_writes_added_tokens_back_to_back(
    tricky: Tokenizer,
) -> None:
    tool, sep = 420, 421
    spaced = IncrementalDetokenizer(tricky, [5], skip_special_tokens=False)
    packed = IncrementalDetokenizer(
        tricky, [5], skip_special_tokens=False, spaces_between_special_tokens=False
    )
    for d in (spaced, packed):
        d.update([tool, sep, tool], False)
    assert packed.text == "<tool>[[sep]]<tool>"
    assert spaced.text.replace(" ", "") == packed.text


def test_no_tokenizer_keeps_token_ids_only() -> None:
    d = IncrementalDetokenizer(None, [1, 2], stop=["x"])
    assert d.update([3, 4], False) is None
    assert (d.token_ids, d.text) == ([3, 4], "")


# -------------------------------------------------- where we do better than vLLM


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output() -> None:
    prompt = [*ids("The quick brown fox. Hello "), *ids("🙂")[:2]]
    rest = ids("🙂")[2:] + ids(" world")
    theirs = IncrementalDetokenizer(BYTES, prompt, repair_text=False)
    ours = IncrementalDetokenizer(BYTES, prompt)
    for d in (theirs, ours):
        for b in rest:
            d.update([b], False)
    # vLLM's decoder repeats the prompt's text with the first character it completes.
    assert theirs.text == "The quick brown fox. Hello 🙂 world"
    assert ours.text == "🙂 world"
    assert ours.repaired_prompt_leak


def test_complete_characters_held_by_the_decoder_come_out_at_the_finish(
    tricky: Tokenizer,
) -> None:
    # Token 265 is a space and the first byte of an emoji: the decoder holds it whole.
    assert tricky.decode([265]) == " \ufffd"
    theirs = IncrementalDetokenizer(tricky, [43], repair_text=False)
    ours = IncrementalDetokenizer(tricky, [43])
    for d in (theirs, ours):
        d.update(tricky.encode("ok", add_special_tokens=False), False)
        d.update([265], False, finished=True)
    assert theirs.text == "ok"  # vLLM drops the space with the unfinished emoji
    assert ours.text == "ok "
    assert ours.flushed_at_finish


# ------------------------------------------------------------------ properties


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30
    ),
    cuts=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=40),
)
def test_the_deltas_add_up_to_the_text_however_the_tokens_are_grouped(
    text: str, cuts: list[int]
) -> None:
    tokens = ids(text)
    steps, start = [], 0
    for size in cuts * (len(tokens) // len(cuts) + 1):
        if start >= len(tokens):
            break
        steps.append(tokens[start : start + size])
        start += size
    d = detokenizer(prompt="> ")
    deltas = feed(d, steps)
    assert "".join(deltas) == text
    for delta in deltas:
        assert "\ufffd" not in delta or "\ufffd" in text


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab🙂é ", min_size=0, max_size=20),
    stop=st.lists(st.text(alphabet="ab🙂é ", min_size=1, max_size=4), min_size=1, max_size=3),
    new=st.integers(min_value=1, max_value=25),
)
def test_find_stop_string_finds_the_earliest_ending_match_in_the_new_text(
    text: str, stop: list[str], new: int
) -> None:
    found = find_stop_string(text, new, stop, include_in_output=False)
    new = min(new, len(text))
    # Brute force: every match that ends in the last `new` characters.
    candidates = [
        (start + len(s), i, s, start)
        for i, s in enumerate(stop)
        for start in range(len(text) - len(s) + 1)
        if text.startswith(s, start)
        and start + len(s) > len(text) - new
        # ``find`` returns each string's first match at or after the window start.
        and start == text.find(s, max(len(text) + 1 - new - len(s), 0))
    ]
    if not candidates or not new:
        assert found is None
        return
    _end, _i, string, start = min(candidates)
    assert found == (string, start)


def test_an_empty_step_changes_nothing() -> None:
    d = detokenizer(stop=["x"])
    assert d.update([], False) is None
    assert d.next_text(finished=False, delta=True) == ""


@pytest.mark.parametrize("delta", [True, False])
def test_finishing_gives_out_the_held_back_text(delta: bool) -> None:
    d = detokenizer(stop=["STOP"])
    d.update(ids("abcd"), False)
    assert d.next_text(finished=False, delta=delta) == "a"
    assert d.next_text(finished=True, delta=delta) == ("bcd" if delta else "abcd")


def test_a_prompts_stray_byte_stays_the_prompts() -> None:
    # The prompt ends in a byte that is no character (0xAD) and then the first byte of
    # an emoji: the output completes the emoji only. Its text is what decoding prompt
    # and output together adds to the prompt's own text.
    prompt = [*ids("Hi"), 0xAD, *ids("🙂")[:1]]
    d = IncrementalDetokenizer(BYTES, prompt)
    for b in ids("🙂")[1:] + ids("!"):
        d.update([b], False)
    assert d.text == "🙂!"
    assert d.repaired_prompt_leak


@settings(max_examples=300, deadline=None)
@given(
    stream=st.lists(st.integers(min_value=0, max_value=421), min_size=1, max_size=40),
    sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=40),
    skip=st.booleans(),
)
def test_several_tokens_in_one_step_give_the_text_of_one_token_a_step(
    tricky: Tokenizer, stream: list[int], sizes: list[int], skip: bool
) -> None:
    # The decoder's batch step is used for several tokens at once where it is exact:
    # after every step, the text must be what one token a step gives at that point.
    one_by_one = IncrementalDetokenizer(tricky, [43, 72], skip_special_tokens=skip)
    texts_after = [one_by_one.text]
    for i, token_id in enumerate(stream):
        one_by_one.update([token_id], False, finished=i == len(stream) - 1)
        texts_after.append(one_by_one.text)
    grouped = IncrementalDetokenizer(tricky, [43, 72], skip_special_tokens=skip)
    start = 0
    for size in sizes * len(stream):
        if start >= len(stream):
            break
        step = stream[start : start + size]
        start += len(step)
        grouped.update(step, False, finished=start == len(stream))
        assert grouped.text == texts_after[start], (stream, start)

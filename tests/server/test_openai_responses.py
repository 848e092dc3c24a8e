"""The streamed chunks' fast path: a chunk of new text is cut from a template encoded
once (``CompletionFrames.delta``, ``ChatFrames.delta``); it must be, byte for byte,
the chunk the general path encodes from scratch, whatever the text and the choice.
(The general path itself is held to vLLM's bytes by the interop suite's HTTP
differential.)"""

from __future__ import annotations

import json

from hypothesis import given, strategies as st

from trio_enginecore.server._openai_responses import ChatFrames, CompletionFrames

texts = st.text()
indexes = st.integers(0, 10**12)
fingerprints = st.none() | st.just("vllm-0.34.0-9c1b04e2")


@given(text=texts, index=indexes, fingerprint=fingerprints)
def test_a_completion_text_chunk_from_the_template_is_the_chunk_encoded_whole(
    text: str, index: int, fingerprint: str | None
) -> None:
    frames = CompletionFrames("cmpl-1", 1765000000, "ngram", fingerprint)
    assert frames.delta(index, text) == frames.chunk(index, text, None, None)


@given(text=texts, index=indexes, fingerprint=fingerprints)
def test_a_chat_text_chunk_from_the_template_is_the_chunk_encoded_whole(
    text: str, index: int, fingerprint: str | None
) -> None:
    frames = ChatFrames("chatcmpl-1", 1765000000, "ngram", fingerprint)
    assert frames.delta(index, text) == frames.chunk(index, text, None, None)


def test_a_text_chunk_is_one_server_sent_event_of_compact_json_with_utf8_text() -> None:
    frames = ChatFrames("chatcmpl-1", 1765000000, "ngram")
    event = frames.delta(2, 'é "\n')
    assert event.startswith(b"data: {")
    assert event.endswith(b"}\n\n")
    assert b"\n" not in event[:-2]
    assert b", " not in event
    assert '"é \\"\\n"'.encode() in event  # not \u00e9: vLLM writes non-ASCII as UTF-8
    assert json.loads(event[len(b"data: ") :]) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1765000000,
        "model": "ngram",
        "choices": [
            {
                "index": 2,
                "delta": {"content": 'é "\n'},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": None,
            }
        ],
        "kv_transfer_params": None,
    }


def test_the_usage_chunk_has_no_choices_and_the_fingerprint_when_there_is_one() -> None:
    for frames, name in (
        (CompletionFrames("c", 1, "m", "fp"), "text_completion"),
        (ChatFrames("c", 1, "m", "fp"), "chat.completion.chunk"),
    ):
        event = json.loads(frames.usage(3, 4)[len(b"data: ") :])
        assert event == {
            "id": "c",
            "object": name,
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4},
            "system_fingerprint": "fp",
        }
    assert "system_fingerprint" not in json.loads(CompletionFrames("c", 1, "m").usage(3, 4)[6:])

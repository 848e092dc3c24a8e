"""The requests of the OpenAI-server differential test, and how their answers are compared.

Each :class:`Case` is one HTTP request (method, path, JSON body or raw bytes) sent to
an OpenAI-compatible server serving ``vllm_server.write_served_model``'s directory as
``tiny``: vLLM's tokenizer-bearing tiny llama, whose counter model writes the token
after the last one (the built-in tokenizer's ids 0-255 are the bytes, 256 is
``<|endoftext|>``, the EOS). So ``"The capital of France is"`` goes on with
``"tuvwxyz{|}~\\x7f"``, the chat prompt ``"User: Hi\\n\\nAssistant:"`` with
``";<=>?@AB..."``, and a prompt of token ids ``[250]`` with five bytes that are no
UTF-8 then the EOS (``<|endoftext|>``, id 256) and, with ``ignore_eos``, the bytes
``\\x00\\x01...``.

:func:`record` sends one case with httpx and keeps what came back: the status, the
headers (``date`` left out), and the body as text. :func:`normalise` replaces in a
body what differs from one answer to the next, and only that (ids, ``created``,
``system_fingerprint``'s hash), so that two servers' normalised bodies can be compared
byte for byte: key order, spacing, escapes, float formatting and SSE framing are kept.

What is random in vLLM 0.34's answers:

- ids: ``cmpl-<16 hex>``, ``chatcmpl-<16 hex>`` (a completion over several prompts
  adds ``-<i>`` per prompt), ``modelperm-<16 hex>`` in ``/v1/models``; they become
  ``cmpl-<1>``, ``chatcmpl-<1>``... numbered by first appearance in the body, so that
  a stream whose chunks share one id still shows it;
- ``"created":<unix time>`` becomes ``"created":0``;
- ``system_fingerprint``: ``vllm-<version>[-tpN...]-<hash8 of the config>``, the hash
  covering the model's path; the hash becomes ``<hash>``;
- not random but the test's: ``/v1/models``' ``root`` is the model directory's path,
  which becomes ``<model_dir>`` when it is given.

:func:`comparable` is what two servers' answers to a case must agree on: the status,
the headers but ``date``, ``content-length`` and ``server``, and the normalised body,
its events sorted by choice where a stream with ``n`` > 1 interleaves its choices as
the timing has it (:attr:`Case.interleaved`). The cases whose prompt is
:data:`NEAR_EOS` show a mistake of vLLM's text (:attr:`Case.vllm_leaks_prompt_text`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "tiny"
"""The ``--served-model-name`` every server under comparison is given."""

PROMPT = "The capital of France is"
PROMPT_TEXT_OUT = "tuvwxyz{|}~\x7f"
"""What vLLM writes for the counter model's 16 tokens after ``PROMPT``: the bytes
after ``"s"`` up to DEL; the next four (0x80-0x83, UTF-8 continuation bytes with no
lead byte) give no text. A stop string ``"xyz"`` ends it after ``"tuvw"``."""
CHAT = [{"role": "user", "content": "Hi"}]
"""Rendered by the built-in template as ``"User: Hi\\n\\nAssistant:"``: the output
starts ``";<=>?@AB"``."""
NEAR_EOS = [250]
"""A token-id prompt five ids before the EOS (256): 251-255 are bytes that are no
UTF-8 (U+FFFD in the text), then the EOS ends the request (unless ``ignore_eos``)
and, past it, the counter wraps to 0."""
MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class Case:
    """One request. ``body`` is sent as JSON; ``raw``, when set, as it is."""

    name: str
    method: str
    path: str
    body: dict[str, Any] | None = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    vllm_leaks_prompt_text: bool = False
    """vLLM's text has the mistake our text layer repairs by default
    (``IncrementalDetokenizer(repair_text=True)``): its prompt ends in a byte that is
    no character (:data:`NEAR_EOS`), and vLLM's first text repeats the prompt's U+FFFD
    (six for the five bytes generated). A server whose text layer repairs it answers
    with one U+FFFD fewer; with ``repair_text=False`` the text is vLLM's exactly."""

    @property
    def streamed(self) -> bool:
        return bool(self.body and self.body.get("stream"))

    @property
    def interleaved(self) -> bool:
        """Whether the events of its choices interleave as the timing has it: a stream
        with ``n`` > 1. vLLM sends the engine one request per choice, and the engine's
        first step may start between the two: choice 1 then runs one step behind
        choice 0 (both are seen), so only the order within each choice is fixed."""
        return self.streamed and int((self.body or {}).get("n", 1)) > 1


def _completion(name: str, *, vllm_leaks_prompt_text: bool = False, **fields: Any) -> Case:
    body = {"model": MODEL, **fields}
    return Case(
        name, "POST", "/v1/completions", body, vllm_leaks_prompt_text=vllm_leaks_prompt_text
    )


def _chat(name: str, **fields: Any) -> Case:
    return Case(name, "POST", "/v1/chat/completions", {"model": MODEL, **fields})


_USAGE = {"include_usage": True}

CASES: list[Case] = [
    # ---------------------------------------------------------------- completions
    _completion("completions", prompt=PROMPT, max_tokens=16),
    _completion("completions_default_max_tokens", prompt=PROMPT),
    _completion("completions_max_tokens_1", prompt=PROMPT, max_tokens=1),
    _completion("completions_n2", prompt=PROMPT, max_tokens=4, n=2),
    _completion("completions_two_prompts", prompt=[PROMPT, "Hi"], max_tokens=3),
    _completion("completions_token_ids", prompt=[72, 105], max_tokens=3),
    _completion("completions_stop", prompt=PROMPT, max_tokens=16, stop="xyz"),
    _completion("completions_stop_list", prompt=PROMPT, max_tokens=16, stop=["zz", "wx"]),
    _completion(
        "completions_stop_included",
        prompt=PROMPT,
        max_tokens=16,
        stop=["xyz"],
        include_stop_str_in_output=True,
    ),
    _completion("completions_stop_not_met", prompt=PROMPT, max_tokens=4, stop=["@@"]),
    _completion("completions_echo", prompt=PROMPT, max_tokens=4, echo=True),
    _completion("completions_eos", prompt=NEAR_EOS, max_tokens=16),
    _completion(
        "completions_ignore_eos",
        prompt=NEAR_EOS,
        max_tokens=10,
        ignore_eos=True,
        vllm_leaks_prompt_text=True,
    ),
    # vLLM 0.34's engine checks the EOS before min_tokens (a model's logits processor
    # masks the EOS; the counter has none): the EOS still ends this one.
    _completion("completions_min_tokens_eos", prompt=NEAR_EOS, max_tokens=10, min_tokens=8),
    # Stop strings are looked for only after the first min_tokens tokens: "uv" is not.
    _completion(
        "completions_min_tokens_stop", prompt=PROMPT, max_tokens=10, min_tokens=4, stop=["uv", "yz"]
    ),
    _completion(
        "completions_special_tokens_kept",
        prompt=NEAR_EOS,
        max_tokens=8,
        ignore_eos=True,
        skip_special_tokens=False,
        vllm_leaks_prompt_text=True,
    ),
    _completion("completions_stop_token_ids", prompt=PROMPT, max_tokens=16, stop_token_ids=[120]),
    # max_tokens is cut to what the context has left.
    _completion("completions_fills_context", prompt=[65] * (MAX_MODEL_LEN - 2), max_tokens=16),
    _completion("completions_temperature_0", prompt=PROMPT, max_tokens=3, temperature=0.0),
    _completion("completions_stream", prompt=PROMPT, max_tokens=5, stream=True),
    _completion(
        "completions_stream_usage",
        prompt=PROMPT,
        max_tokens=5,
        stream=True,
        stream_options=_USAGE,
    ),
    _completion(
        "completions_stream_n2_usage",
        prompt=PROMPT,
        max_tokens=3,
        n=2,
        stream=True,
        stream_options=_USAGE,
    ),
    _completion("completions_stream_stop", prompt=PROMPT, max_tokens=16, stop="xyz", stream=True),
    _completion(
        "completions_stream_stop_included",
        prompt=PROMPT,
        max_tokens=16,
        stop="xyz",
        include_stop_str_in_output=True,
        stream=True,
    ),
    _completion("completions_stream_echo", prompt=PROMPT, max_tokens=3, echo=True, stream=True),
    _completion(
        "completions_stream_eos_usage",
        prompt=NEAR_EOS,
        max_tokens=16,
        stream=True,
        stream_options=_USAGE,
    ),
    _completion(
        "completions_stream_ignore_eos",
        prompt=NEAR_EOS,
        max_tokens=9,
        ignore_eos=True,
        skip_special_tokens=False,
        stream=True,
        vllm_leaks_prompt_text=True,
    ),
    # ---------------------------------------------------------------------- chat
    _chat("chat", messages=CHAT, max_completion_tokens=8),
    _chat("chat_max_tokens", messages=CHAT, max_tokens=3),
    _chat("chat_n2", messages=CHAT, max_completion_tokens=4, n=2),
    _chat("chat_stop", messages=CHAT, max_completion_tokens=8, stop=["?@"]),
    _chat("chat_stream", messages=CHAT, max_completion_tokens=4, stream=True),
    _chat(
        "chat_stream_usage",
        messages=CHAT,
        max_completion_tokens=4,
        stream=True,
        stream_options=_USAGE,
    ),
    _chat(
        "chat_stream_n2_usage",
        messages=CHAT,
        max_completion_tokens=3,
        n=2,
        stream=True,
        stream_options=_USAGE,
    ),
    _chat("chat_stream_stop", messages=CHAT, max_completion_tokens=8, stop="?@", stream=True),
    # ------------------------------------------------------------------ logprobs
    # The fake executor's counter model gives the token d ids on logprob 0.25 - d/2.
    _completion("completions_logprobs", prompt=PROMPT, max_tokens=6, logprobs=2),
    _completion("completions_logprobs_0", prompt=PROMPT, max_tokens=3, logprobs=0),
    _completion("completions_logprobs_stop", prompt=PROMPT, max_tokens=16, stop="xyz", logprobs=1),
    # Tokens that are no UTF-8 on their own: "bytes:\\xfb"-style token texts.
    _completion("completions_logprobs_bytes", prompt=NEAR_EOS, max_tokens=4, logprobs=3),
    _completion(
        "completions_stream_logprobs", prompt=PROMPT, max_tokens=4, logprobs=2, stream=True
    ),
    _completion(
        "completions_stream_logprobs_n2",
        prompt=PROMPT,
        max_tokens=3,
        logprobs=1,
        n=2,
        stream=True,
    ),
    _chat("chat_logprobs", messages=CHAT, max_completion_tokens=4, logprobs=True, top_logprobs=2),
    _chat("chat_logprobs_no_top", messages=CHAT, max_completion_tokens=3, logprobs=True),
    _chat(
        "chat_stream_logprobs",
        messages=CHAT,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    ),
    _completion("bad_logprobs_too_many", prompt=PROMPT, max_tokens=2, logprobs=21),
    _chat(
        "bad_top_logprobs_too_many",
        messages=CHAT,
        max_completion_tokens=2,
        logprobs=True,
        top_logprobs=21,
    ),
    _completion("bad_logprobs_negative", prompt=PROMPT, max_tokens=2, logprobs=-2),
    _completion("bad_prompt_logprobs_negative", prompt=PROMPT, max_tokens=2, prompt_logprobs=-2),
    _completion(
        "bad_prompt_logprobs_stream", prompt=PROMPT, max_tokens=2, prompt_logprobs=1, stream=True
    ),
    _chat(
        "bad_top_logprobs_negative",
        messages=CHAT,
        max_completion_tokens=2,
        logprobs=True,
        top_logprobs=-2,
    ),
    _chat(
        "bad_top_logprobs_without_logprobs", messages=CHAT, max_completion_tokens=2, top_logprobs=2
    ),
    # ---------------------------------------------------------------- the others
    Case("models", "GET", "/v1/models"),
    Case("tokenize", "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT}),
    Case(
        "tokenize_token_strs",
        "POST",
        "/tokenize",
        {"model": MODEL, "prompt": "Hé", "add_special_tokens": False, "return_token_strs": True},
    ),
    Case("tokenize_chat", "POST", "/tokenize", {"model": MODEL, "messages": CHAT}),
    Case(
        "tokenize_chat_no_generation_prompt",
        "POST",
        "/tokenize",
        {"model": MODEL, "messages": CHAT, "add_generation_prompt": False},
    ),
    Case("detokenize", "POST", "/detokenize", {"model": MODEL, "tokens": [72, 195, 169, 256]}),
    # ---------------------------------------------------------------- bad inputs
    Case(
        "bad_json",
        "POST",
        "/v1/completions",
        raw=b'{"model": "tiny", "prompt": ',
        headers={"content-type": "application/json"},
    ),
    Case(
        "bad_json_chat",
        "POST",
        "/v1/chat/completions",
        raw=b"{not json}",
        headers={"content-type": "application/json"},
    ),
    _completion("bad_n_0", prompt=PROMPT, n=0),
    _completion("bad_max_tokens_negative", prompt=PROMPT, max_tokens=-1),
    _completion("bad_temperature_type", prompt=PROMPT, temperature="hot"),
    _completion("bad_model", prompt=PROMPT, max_tokens=2, model="nope"),
    _chat("bad_model_chat", messages=CHAT, max_completion_tokens=2, model="nope"),
    _completion("bad_prompt_too_long", prompt=[65] * (MAX_MODEL_LEN + 10), max_tokens=2),
    _completion(
        "bad_prompt_too_long_stream",
        prompt=[65] * (MAX_MODEL_LEN + 10),
        max_tokens=2,
        stream=True,
    ),
    _completion("bad_stream_options_without_stream", prompt=PROMPT, stream_options=_USAGE),
    _chat("bad_stream_options_without_stream_chat", messages=CHAT, stream_options=_USAGE),
    _completion("bad_missing_prompt", max_tokens=2),
    _chat("bad_missing_messages", max_completion_tokens=2),
    _chat("bad_n_0_chat_stream", messages=CHAT, n=0, stream=True),
    # What vLLM's frontend refuses before its engine sees it: ids its sampler would
    # index the logits with, and its limits on one request.
    _completion(
        "bad_logit_bias_out_of_vocab",
        prompt=PROMPT,
        max_tokens=2,
        logit_bias={"3": 1.0, "257": 2.0, "-1": 0.5},
    ),
    _completion("bad_logit_bias_key", prompt=PROMPT, max_tokens=2, logit_bias={"a": 1.0}),
    _chat(
        "bad_stop_token_ids_out_of_vocab",
        messages=CHAT,
        max_completion_tokens=2,
        stop_token_ids=[300],
    ),
    _completion(
        "bad_allowed_token_ids_out_of_vocab",
        prompt=PROMPT,
        max_tokens=2,
        allowed_token_ids=[5, 999],
    ),
    _completion("bad_allowed_token_ids_empty", prompt=PROMPT, max_tokens=2, allowed_token_ids=[]),
    _completion("bad_words_of_no_token", prompt=PROMPT, max_tokens=2, bad_words=["  "]),
    _completion("bad_n_too_many", prompt=PROMPT, max_tokens=2, n=16385),
    _completion("bad_too_many_prompts", prompt=["Hi"] * 1025, max_tokens=1),
    _chat("bad_too_many_stop_strings", messages=CHAT, stop=["a", "b", "c", "d", "e"]),
    Case(
        "bad_content_type",
        "POST",
        "/v1/completions",
        raw=json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode(),
        headers={"content-type": "text/plain"},
    ),
    Case(
        "bad_no_content_type",
        "POST",
        "/v1/chat/completions",
        raw=json.dumps({"model": MODEL, "messages": CHAT}).encode(),
    ),
    Case(
        "bad_data_parallel_rank",
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
        headers={"x-data-parallel-rank": "1"},
    ),
    _chat("bad_cache_salt", messages=CHAT, max_completion_tokens=2, cache_salt="tenant/a"),
    # Accepted as vLLM accepts them (the counter model bans and biases nothing).
    _completion("completions_cache_salt", prompt=PROMPT, max_tokens=3, cache_salt="tenant-a"),
    _completion("completions_logit_bias", prompt=PROMPT, max_tokens=3, logit_bias={"120": 500}),
    _completion("completions_bad_words", prompt=PROMPT, max_tokens=3, bad_words=["xyz", " q"]),
    Case("bad_method", "GET", "/v1/completions"),
    Case("bad_path", "POST", "/v1/nothing", {"model": MODEL}),
]

# ------------------------------------------------------------------ normalising

_ID = re.compile(r'"((?:cmpl|chatcmpl|modelperm)-)([0-9a-f]{8,32})((?:-\d+)?)"')
_CREATED = re.compile(r'"created":\d+')
_FINGERPRINT = re.compile(r'("system_fingerprint":"vllm-[^"]*?-)[0-9a-f]{8}"')
MODEL_DIR_PLACEHOLDER = "<model_dir>"


def normalise(body: str | bytes, *, model_dir: str | None = None) -> str:
    """``body`` (a JSON document, or an SSE stream's text) with what is random in it
    replaced, every other byte kept: ids become ``<prefix>-<n>`` (numbered by first
    appearance, so that a stream keeps one id per response), ``created`` becomes 0,
    ``system_fingerprint``'s hash ``<hash>``, and the model directory's path (in
    ``/v1/models``' ``root``), when given, ``<model_dir>``."""
    text = body.decode() if isinstance(body, bytes) else body
    numbers: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        n = numbers.setdefault(match[2], len(numbers) + 1)
        return f'"{match[1]}<{n}>{match[3]}"'

    text = _ID.sub(number, text)
    text = _CREATED.sub('"created":0', text)
    text = _FINGERPRINT.sub(r'\1<hash>"', text)
    if model_dir:
        text = text.replace(json.dumps(model_dir)[1:-1], MODEL_DIR_PLACEHOLDER)
    return text


def sse_events(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (``[DONE]`` included)."""
    assert body.endswith("\n\n"), body[-200:]
    events = body[: -len("\n\n")].split("\n\n")
    assert all(event.startswith("data: ") for event in events), events
    return [event.removeprefix("data: ") for event in events]


def _choice_index(event: str) -> float:
    choices = json.loads(event).get("choices") if event != "[DONE]" else None
    return choices[0]["index"] if choices else math.inf


def by_choice(body: str) -> str:
    """An SSE body with its events stably sorted by choice index (the usage chunk,
    whose ``choices`` is empty, and ``[DONE]`` last), the bytes of each kept: the
    order within each choice, without the interleaving of the choices, which depends
    on timing (see :attr:`Case.interleaved`)."""
    events = sorted(sse_events(body), key=_choice_index)
    return "".join(f"data: {event}\n\n" for event in events)


# -------------------------------------------------------------------- recording

_UNRECORDED_HEADERS = frozenset({"date"})


def record(client: httpx.Client, case: Case) -> dict[str, Any]:
    """Send ``case`` and keep its answer: ``status``, ``headers`` (a list of
    ``[name, value]`` in the order sent, ``date`` left out) and ``body`` (the text,
    exactly as sent)."""
    content = case.raw if case.raw is not None else None
    json_body = case.body if case.raw is None else None
    response = client.request(
        case.method, case.path, content=content, json=json_body, headers=case.headers
    )
    return {
        "name": case.name,
        "request": {
            "method": case.method,
            "path": case.path,
            "body": case.body if case.raw is None else case.raw.decode(),
        },
        "status": response.status_code,
        "headers": [
            [name.decode("latin-1").lower(), value.decode("latin-1")]
            for name, value in response.headers.raw
            if name.decode("latin-1").lower() not in _UNRECORDED_HEADERS
        ],
        "body": response.content.decode(),
    }


def normalised(recorded: dict[str, Any], *, model_dir: str | None = None) -> dict[str, Any]:
    """A :func:`record` with its body normalised (and ``content-length`` left out of
    its headers: it counts the random ids' bytes)."""
    return {
        **recorded,
        "headers": [pair for pair in recorded["headers"] if pair[0] != "content-length"],
        "body": normalise(recorded["body"], model_dir=model_dir),
    }


def comparable(recorded: dict[str, Any], case: Case, *, model_dir: str | None = None) -> Any:
    """What must be equal between two servers' answers to ``case``: the status, the
    headers but ``content-length`` and ``server``, and the normalised body (sorted
    :func:`by_choice` where the choices interleave as the timing has it)."""
    answer = normalised(recorded, model_dir=model_dir)
    body = answer["body"]
    if case.interleaved and answer["status"] == 200:
        body = by_choice(body)
    headers = [pair for pair in answer["headers"] if pair[0] != "server"]
    return {"status": answer["status"], "headers": headers, "body": body}


def check_sane(recorded: dict[str, Any], case: Case) -> None:
    """What every server's answer must be, whatever its bytes: 2xx for good requests
    and 4xx for bad ones (``bad_*``); a JSON error object for those; streams that are
    SSE ending with ``data: [DONE]``, each other event a JSON object."""
    status, body = recorded["status"], recorded["body"]
    headers = dict(recorded["headers"])
    if case.name.startswith("bad_"):
        assert 400 <= status < 500, (case.name, status, body)
        if headers.get("content-type", "").startswith("application/json"):
            error = json.loads(body)
            assert "error" in error or "detail" in error, (case.name, body)
        return
    assert status == 200, (case.name, status, body)
    if case.streamed:
        assert headers["content-type"].startswith("text/event-stream"), (case.name, headers)
        events = sse_events(body)
        assert events[-1] == "[DONE]", (case.name, body[-200:])
        for event in events[:-1]:
            assert isinstance(json.loads(event), dict), (case.name, event)
    else:
        assert headers["content-type"] == "application/json", (case.name, headers)
        assert isinstance(json.loads(body), dict), (case.name, body)

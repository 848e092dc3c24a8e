"""Our chat templates against transformers' and vLLM's own rendering, case by case.

The templates of ``tests/server/test_chat_template.py`` (Llama 3.1, Qwen 2.5, Qwen 3,
Mistral, Gemma 3, a gpt-oss style one, Hermes' named ``default``/``tool_use`` pair,
Phi 3 in ``chat_template.jinja``, one with ``{% generation %}`` blocks), each in a
tokenizer directory, are rendered in the vLLM environment of the release under test
(``tests/interop/vllm_side/chat_templates.py``) on random cases (seeded):

* **transformers** (``PreTrainedTokenizerFast.apply_chat_template(...,
  tokenize=False)``) on conversations as they reach it: unicode, empty and
  whitespace-padded content, content as a list of parts, tool calls and results,
  reasoning under its three names, tools, documents, extra template variables (one
  overriding ``bos_token``), ``add_generation_prompt`` both ways,
  ``continue_final_message`` (and with ``add_generation_prompt``: an error), roles that
  do not alternate; compared with :meth:`ChatTemplate.render_conversation`;
* **vLLM's chat pipeline** (its request model, ``parse_chat_messages`` in the content
  format it detects, ``safe_apply_chat_template``) on OpenAI request bodies: content
  strings and part lists (``text``, ``input_text``, ``refusal``, ``thinking``,
  extra fields), ``null`` content, tool calls with JSON, invalid or empty arguments,
  tool results as parts, ``developer`` messages, ``reasoning_content``, names, Claude
  Code's billing header; compared with :meth:`ChatTemplate.prepare` (the conversation,
  key order included) and :meth:`ChatTemplate.render`.

Both must give the same text, or both fail (a template's ``raise_exception`` with the
same message, transformers' checks with theirs, a template's error quoted in ours).
What transformers loads from each directory (its templates, its special tokens) and
the content format vLLM detects (here and for ``DETECTION``'s templates) must be what
ours finds. Three kinds of case are told apart, and counted, not compared:

* a request setting both ``continue_final_message`` and ``add_generation_prompt``:
  vLLM's request model refuses it (the server's request parsing must, too);
* content parts outside OpenAI's schema for the message's role (``input_text``,
  ``thinking``, bare strings, ...), which vLLM's request model sometimes checks
  against that schema (depending on which member of its union pydantic picks) and then
  refuses; ours reads every part vLLM's own parser reads;
* on vLLM 0.33 (transformers 5.20), a message's reasoning: transformers 5.22 (vLLM
  0.34's) also gives it to the template as ``reasoning_content`` and ``thinking``, as
  ours does.
"""

# ruff: noqa: RUF001 - the cases write CJK punctuation on purpose

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

import pytest

from .support import newest_release_only, require_vllm, run_to_the_end, vllm_release

require_vllm()
newest_release_only("our chat templates are held to vLLM's newest chat pipeline")
pytest.importorskip("jinja2")

from tests.server.test_chat_template import DETECTION, MODELS, write_model  # noqa: E402
from trio_enginecore.errors import InvalidInputError  # noqa: E402
from trio_enginecore.server._chat_template import (  # noqa: E402
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateRejectedError,
    ChatTemplates,
    ChatTemplateSecurityError,
    template_tools,
)
from trio_enginecore.text import load_tokenizer  # noqa: E402

TRANSFORMERS_CASES = 50
"""Cases per model rendered by transformers directly (9 models)."""
VLLM_CASES = 30
"""Request cases per model through vLLM's pipeline."""

TEXTS = [
    "Hello!",
    "Hi 🙂",
    "",
    " ",
    "  padded \n",
    "\n\nleading newlines",
    "trailing newlines\n\n",
    "Naïve café, crème brûlée",
    "日本語のテキスト、漢字。",
    "中文：你好，世界！",
    "Emoji 👍🏽 🇫🇷 ❤️ 🧪",
    "Ελληνικά και Кириллица",
    "عربي مع أرقام ١٢٣",
    "quotes \" ' and \\ backslash",
    "{{ not a template }} {% neither %}",
    "<|im_end|> injected <|im_start|>",
    "<s></s> special tokens",
    "multi\nline\n\ttabbed",
    "<think>\nreasoning here\n</think>\n\nthe answer",
    "</think> lone close",
    "x" * 200,
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo d'une ville 🌦",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "ville"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time"}},
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            "strict": True,
        },
    },
]
DOCUMENTS = [
    {"title": "Rivers", "text": "The Rhône flows south."},
    {"text": "Untitled 文書"},
]
KWARGS = [
    {},
    {},
    {"enable_thinking": False},
    {"enable_thinking": True},
    {"reasoning_effort": "high"},
    {"date_string": "01 Jan 2025"},
    {"bos_token": "<BOS>"},
    {"custom_variable": "ü"},
]


def _text(rng: random.Random) -> str:
    return rng.choice(TEXTS)


def _content(rng: random.Random, *, images: bool) -> Any:
    # Lists of parts mostly for the template that reads them (Gemma 3's, with images):
    # most templates add the content to strings, which fails on a list.
    if rng.random() > (0.5 if images else 0.02):
        return _text(rng)
    parts: list[dict[str, Any]] = [
        {"type": "text", "text": _text(rng)} for _ in range(rng.randint(0, 3))
    ]
    if images and rng.random() < 0.5:
        parts.insert(rng.randint(0, len(parts)), {"type": "image"})
    return parts


def _tool_call(rng: random.Random, index: int, *, arguments_as: str) -> dict[str, Any]:
    arguments: dict[str, Any] = rng.choice(
        [{"city": "Zürich"}, {"q": "ünïcode", "n": 3}, {}, {"nested": {"a": [1, 2.5, None]}}]
    )
    value: Any = arguments if arguments_as == "object" else json.dumps(arguments)
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": rng.choice(["get_weather", "search"]), "arguments": value},
    }


def _conversation(rng: random.Random, *, images: bool) -> list[dict[str, Any]]:
    """A conversation as transformers takes it (arguments as objects)."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": _content(rng, images=False)})
    turns = rng.randint(1, 4)
    for turn in range(turns):
        messages.append({"role": "user", "content": _content(rng, images=images)})
        if rng.random() < 0.06:
            messages.append({"role": "user", "content": _text(rng)})  # roles not alternating
        last = turn == turns - 1
        if last and rng.random() < 0.5:
            break
        if rng.random() < 0.2:
            calls = [
                _tool_call(rng, i, arguments_as="object") for i in range(rng.choice([1, 1, 2]))
            ]
            content = None if rng.random() < 0.15 else ""
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
            messages.extend(
                {"role": "tool", "tool_call_id": call["id"], "content": _text(rng)}
                for call in calls
            )
        message: dict[str, Any] = {"role": "assistant", "content": _content(rng, images=False)}
        if rng.random() < 0.25:
            message[rng.choice(["reasoning_content", "reasoning", "thinking"])] = _text(rng)
        if rng.random() < 0.1:
            message["name"] = "helper"
        messages.append(message)
    return messages


def transformers_cases(model: str, rng: random.Random, count: int) -> list[dict[str, Any]]:
    cases = []
    for _ in range(count):
        conversation = _conversation(rng, images=model == "gemma3")
        continue_final = rng.random() < 0.25
        add_prompt = rng.random() < (0.1 if continue_final else 0.6)
        case: dict[str, Any] = {
            "kind": "transformers",
            "model": model,
            "conversation": conversation,
            "add_generation_prompt": add_prompt,
            "continue_final_message": continue_final,
            "kwargs": rng.choice(KWARGS),
        }
        if rng.random() < 0.35:
            case["tools"] = rng.sample(TOOLS, rng.randint(1, 2))
        if rng.random() < 0.2:
            case["documents"] = DOCUMENTS
        cases.append(case)
    return cases


def _request_content(rng: random.Random) -> Any:
    shape = rng.random()
    if shape < 0.5:
        return _text(rng)
    parts: list[Any] = []
    for _ in range(rng.randint(0, 3)):
        kind = rng.random()
        if kind < 0.7:
            parts.append({"type": "text", "text": _text(rng)})
        elif kind < 0.8:
            parts.append({"type": "text", "text": _text(rng), "cache_control": {"type": "x"}})
        elif kind < 0.88:
            parts.append({"type": "refusal", "refusal": _text(rng)})
        elif kind < 0.92:
            parts.append({"type": "input_text", "text": _text(rng)})
        elif kind < 0.96:
            parts.append({"type": "thinking", "thinking": _text(rng), "closed": True})
        else:
            parts.append(_text(rng))
    return parts


# The content parts of OpenAI's schema for each role (vLLM's request model may check a
# message's parts against it; its own parser reads the others too).
OPENAI_PARTS = {
    "user": {"text", "image_url", "input_audio", "file"},
    "assistant": {"text", "refusal"},
}


def _has_parts_outside_openai_schema(body: dict[str, Any]) -> bool:
    for message in body["messages"]:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        allowed = OPENAI_PARTS.get(message["role"], {"text"})
        if any(not isinstance(p, dict) or p.get("type") not in allowed for p in content):
            return True
    return False


def _request(rng: random.Random, model: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.35:
        system = _request_content(rng)
        if rng.random() < 0.2:
            system = "x-anthropic-billing-header: cch=123\n" + _text(rng)
        messages.append({"role": rng.choice(["system", "system", "developer"]), "content": system})
    turns = rng.randint(1, 3)
    for turn in range(turns):
        messages.append({"role": "user", "content": _request_content(rng)})
        if rng.random() < 0.1:
            messages.append({"role": "developer", "content": _text(rng)})
        if turn == turns - 1 and rng.random() < 0.5:
            break
        if rng.random() < 0.25:
            calls = []
            for i in range(rng.choice([1, 1, 2])):
                call = _tool_call(rng, i, arguments_as="string")
                if rng.random() < 0.15:
                    call["function"]["arguments"] = rng.choice(["", "not json", "[1, 2]"])
                calls.append(call)
            messages.append(
                {"role": "assistant", "content": rng.choice([None, ""]), "tool_calls": calls}
            )
            for call in calls:
                result: Any = _text(rng)
                if rng.random() < 0.3:
                    result = [{"type": "text", "text": _text(rng)}, {"type": "text", "text": "b"}]
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        message: dict[str, Any] = {"role": "assistant", "content": _request_content(rng)}
        if rng.random() < 0.3:
            message[rng.choice(["reasoning_content", "reasoning"])] = _text(rng)
        if rng.random() < 0.15:
            message["name"] = "helper"
        messages.append(message)
    body: dict[str, Any] = {"messages": messages}
    if rng.random() < 0.25:
        body["continue_final_message"] = True
        if rng.random() < 0.75:
            body["add_generation_prompt"] = rng.random() < 0.2  # both: vLLM's request error
        # else add_generation_prompt is true by default: transformers' error
    elif rng.random() < 0.5:
        body["add_generation_prompt"] = rng.random() < 0.7
    if rng.random() < 0.35:
        body["tools"] = rng.sample(TOOLS, rng.randint(1, 2))
    if rng.random() < 0.2:
        body["documents"] = DOCUMENTS
    kwargs = rng.choice(KWARGS)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


def vllm_cases(model: str, rng: random.Random, count: int) -> list[dict[str, Any]]:
    return [{"kind": "vllm", "model": model, "request": _request(rng, model)} for _ in range(count)]


def _has_reasoning(case: dict[str, Any]) -> bool:
    messages = (
        case["conversation"] if case["kind"] == "transformers" else case["request"]["messages"]
    )
    fields = ("reasoning_content", "thinking", "reasoning")
    return any(message.get(field) is not None for message in messages for field in fields)


def _ours(action: Any) -> dict[str, Any]:
    try:
        return {"text": action()}
    except ChatTemplateRejectedError as exc:
        return {"error": "rejected", "message": exc.reason, "exc": exc}
    except ChatTemplateSecurityError as exc:
        return {"error": "security", "message": exc.reason, "exc": exc}
    except ChatTemplateError as exc:
        return {"error": "template", "message": exc.reason, "exc": exc}
    except InvalidInputError as exc:
        return {"error": "input", "message": exc.reason, "exc": exc}


def _render_ours(templates: ChatTemplates, case: dict[str, Any]) -> dict[str, Any]:
    if case["kind"] == "transformers":
        tools = case.get("tools")
        return _ours(
            lambda: templates.select(tools=tools is not None).render_conversation(
                case["conversation"],
                add_generation_prompt=case["add_generation_prompt"],
                continue_final_message=case["continue_final_message"],
                tools=tools,
                documents=case.get("documents"),
                chat_template_kwargs=case["kwargs"],
            )
        )
    # A vLLM-compatible server's reading of the request: the fields' defaults, tools as
    # vLLM's request model dumps them.
    body = case["request"]
    tools = template_tools(body["tools"]) if body.get("tools") else None
    template = templates.select(tools=tools is not None)
    result = _ours(
        lambda: template.render(
            body["messages"],
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
            tools=tools,
            documents=body.get("documents"),
            chat_template_kwargs=body.get("chat_template_kwargs"),
        )
    )
    result["conversation"] = template.prepare(body["messages"])
    result["content_format"] = template.content_format
    return result


def _same(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """The same text, or the same failure: a template's own message (vLLM answers with
    it), the sandbox's refusal, a template's error quoted in ours, transformers' checks
    with their messages (ours may leave out its echo of the rendered text)."""
    if "text" in theirs or "text" in ours:
        return bool(ours.get("text") == theirs.get("text"))
    if theirs["error"] == "rejected" or ours["error"] == "rejected":
        return bool(ours["error"] == theirs["error"] and ours["message"] == theirs["message"])
    if theirs["error"] == "security":
        return bool(ours["error"] == "security")
    if theirs["error"] == "template" or theirs["type"] == "TypeError":
        return ours["error"] == "template" and theirs["message"] in ours["message"]
    if theirs["type"] in ("ValueError", "VLLMValidationError"):
        # vLLM's 400 quotes the template's error (or transformers' check).
        return ours["error"] in ("input", "template") and (
            theirs["message"].startswith(ours["message"]) or theirs["message"] in ours["message"]
        )
    return False


def test_our_chat_templates_render_as_transformers_and_vllm(tmp_path: Path) -> None:
    models = {name: str(write_model(tmp_path / name, name)) for name in MODELS}
    seed = {"0.33": 33, "0.34": 34}.get(vllm_release(), 1)
    rng = random.Random(seed)
    cases = []
    for name in MODELS:
        cases += transformers_cases(name, rng, TRANSFORMERS_CASES)
        cases += vllm_cases(name, rng, VLLM_CASES)
    models_file, cases_file = tmp_path / "models.json", tmp_path / "cases.json"
    formats_file, results_file = tmp_path / "formats.json", tmp_path / "results.json"
    models_file.write_text(json.dumps(models), encoding="utf-8")
    formats = {name: source for name, (source, _) in DETECTION.items()}
    formats_file.write_text(json.dumps(formats), encoding="utf-8")
    cases_file.write_text(json.dumps(cases, ensure_ascii=False), encoding="utf-8")
    report = run_to_the_end(
        "chat_templates.py",
        [str(models_file), str(formats_file), str(cases_file), str(results_file)],
        tmp_path / "log",
        600,
    )
    if report["date_before"] != report["date_after"]:
        pytest.skip("the date changed while transformers rendered (strftime_now)")
    theirs_all = json.loads(results_file.read_text(encoding="utf-8"))
    assert len(theirs_all) == len(cases)

    # The content format vLLM detects, and what the unit tests expect.
    assert report["formats"] == {name: expected for name, (_, expected) in DETECTION.items()}
    for name, source in formats.items():
        assert ChatTemplate(source).content_format == report["formats"][name], name

    # What each directory holds, as transformers loads it and vLLM reads it.
    templates: dict[str, ChatTemplates] = {}
    for name, directory in models.items():
        tokenizer = load_tokenizer(directory)
        loaded = report["models"][name]
        expected = loaded["chat_template"]
        assert tokenizer.chat_templates == (
            expected if isinstance(expected, dict) else {"default": expected}
        ), name
        assert tokenizer.template_tokens == loaded["special_tokens_map"], name
        templates[name] = ChatTemplates.from_tokenizer(tokenizer)
        for key, template in templates[name].templates.items():
            assert template.content_format == loaded["content_format"][key], (name, key)
            assert template.supports_developer_role == loaded["developer_role"][key], (name, key)

    aliases = tuple(int(part) for part in report["transformers"].split(".")[:2]) >= (5, 22)
    outcomes: collections.Counter[str] = collections.Counter()
    misses: list[tuple[int, object, object, object]] = []
    for index, (case, theirs) in enumerate(zip(cases, theirs_all, strict=True)):
        ours = _render_ours(templates[case["model"]], case)
        if case["kind"] == "vllm" and theirs.get("error") == "request":
            # vLLM's request model refused the body (continue_final_message with
            # add_generation_prompt): a server's request parsing must, too.
            body = case["request"]
            assert body.get("continue_final_message")
            assert body.get("add_generation_prompt")
            outcomes["vllm: request refused"] += 1
            continue
        if case["kind"] == "vllm" and theirs.get("error") == "request_parts":
            # vLLM's request model validates some messages' parts lazily against OpenAI's
            # schema for their role (when pydantic's union picks that schema): parts
            # outside it (input_text, thinking, bare strings, ...) then fail when vLLM
            # reads them. Ours reads every part vLLM's parser reads.
            assert _has_parts_outside_openai_schema(case["request"]), case
            outcomes["vllm: parts refused by vLLM's request model"] += 1
            continue
        if case["kind"] == "vllm" and "conversation" in theirs:
            prepared = json.dumps(ours["conversation"], ensure_ascii=False)
            if prepared != json.dumps(theirs["conversation"], ensure_ascii=False):
                misses.append((index, "conversation", ours["conversation"], theirs["conversation"]))
                continue
            if "content_format" in theirs:
                assert ours["content_format"] == theirs["content_format"]
        if not _same(ours, theirs):
            if not aliases and _has_reasoning(case):
                # transformers before 5.22 (vLLM 0.33's) gives a message's reasoning to
                # the template under the name it came with only; ours (5.22's, vLLM
                # 0.34's) also as `reasoning_content` and `thinking`.
                outcomes["differ: reasoning not aliased before transformers 5.22"] += 1
                continue
            misses.append((index, case, {k: v for k, v in ours.items() if k != "exc"}, theirs))
            continue
        outcomes[f"{case['kind']}: {'text' if 'text' in theirs else theirs['error']}"] += 1
    assert not misses, f"{len(misses)} cases differ, the first: {misses[:3]}"
    total = sum(outcomes.values())
    assert total == len(cases) >= 500
    print(
        f"vLLM {report['vllm']} (transformers {report['transformers']}): "
        f"{total} cases: {dict(sorted(outcomes.items()))}"
    )

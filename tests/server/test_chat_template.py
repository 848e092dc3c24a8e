"""Chat templates rendered as vLLM 0.34 renders them (``trio_enginecore.server._chat_template``).

The templates below are those of real model families, written out here (nothing is
downloaded): Llama 3.1 (``bos_token``, ``strftime_now``, tools in the first user
message), Qwen 2.5 (ChatML, tools), Qwen 3 (reasoning, ``namespace``,
``enable_thinking``), Mistral (``raise_exception`` when roles do not alternate), Gemma 3
(content as a list of parts: the "openai" content format), a gpt-oss style template
(the ``developer`` role, reasoning read as ``thinking``, documents), a Hermes style
pair of named templates (``default`` and ``tool_use``), a Phi 3 style template in
``chat_template.jinja``, and a template with ``{% generation %}`` blocks. Each is
rendered on several conversations and compared with the text transformers renders
(checked by hand, and against transformers itself by
``tests/interop/test_chat_templates_differential.py``, which uses these templates).
"""

# ruff: noqa: E501 - the templates are written as their models ship them, long lines and all

from __future__ import annotations

import json
import re
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jinja2")

from trio_enginecore.errors import InvalidInputError, ModelDirectoryError
from trio_enginecore.server._chat_template import (
    RESERVED_TEMPLATE_KWARGS,
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateRejectedError,
    ChatTemplates,
    ChatTemplateSecurityError,
    ChatTemplateSyntaxError,
    template_tools,
)

# ------------------------------------------------------------------------- templates

LLAMA3 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

MISTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ boi_token + image_token }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"""

HARMONY = r"""{#- A gpt-oss style template: the developer role, reasoning read as `thinking`, documents. -#}
{{- '<|start|>system<|message|>Knowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\nReasoning: ' + (reasoning_effort | default('medium')) + '<|end|>' }}
{%- if documents %}
    {{- '<|start|>developer<|message|># Documents\n' }}
    {%- for doc in documents %}
        {{- '\n## ' + (doc.title | default('Document ' ~ loop.index)) + '\n' + doc.text }}
    {%- endfor %}
    {{- '<|end|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'developer' or message.role == 'system' %}
        {{- '<|start|>developer<|message|># Instructions\n\n' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.thinking and loop.last %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {{- '<|start|>assistant to=functions.' + call.function.name + '<|channel|>commentary json<|message|>' + call.function.arguments | tojson + '<|call|>' }}
            {%- endfor %}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + ('<|end|>' if not loop.last else '<|return|>') }}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {{- '<|start|>functions.' + (message.name | default('tool')) + ' to=assistant<|channel|>commentary<|message|>' + message.content | tojson + '<|end|>' }}
    {%- else %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}"""

HERMES_DEFAULT = r"""{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + (' name=' + message['name'] if message['name'] is defined else '') + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}"""

HERMES_TOOL_USE = r"""{{- bos_token + '<|im_start|>system\nYou are a function calling AI model. Here are the available tools: <tools> ' }}
{%- for tool in tools %}
{{- tool | tojson(indent=2, sort_keys=true) }}
{%- if not loop.last %}{{ ', ' }}{% endif %}
{%- endfor %}
{{- ' </tools>' + '<|im_end|>\n' }}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{{- '<|im_start|>tool\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- elif message.tool_calls is defined %}
{{- '<|im_start|>assistant\n' }}
{%- for call in message.tool_calls %}
{{- '<tool_call>\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson(separators=(',', ':')) + '\n</tool_call>\n' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

PHI3 = """{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>
' + message['content'] + '<|end|>
'}}{% elif message['role'] == 'user' %}{{'<|user|>
' + message['content'] + '<|end|>
'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>
' + message['content'] + '<|end|>
'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>
' }}{% else %}{{ eos_token }}{% endif %}
"""

GENERATION = r"""{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\n' }}
{%- if message['role'] == 'assistant' %}
{% generation %}
{{- message['content'] + '<|im_end|>' }}
{% endgeneration %}
{%- else %}
{{- message['content'] + '<|im_end|>' }}
{%- endif %}
{{- '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

MODELS: dict[str, dict[str, Any]] = {
    "llama3": {"chat_template": LLAMA3},
    "qwen25": {"chat_template": QWEN25},
    "qwen3": {"chat_template": QWEN3},
    "mistral": {"chat_template": MISTRAL},
    "gemma3": {
        "chat_template": GEMMA3,
        # Model-specific special tokens: a "*_token" key, and extra_special_tokens.
        "image_token": "[[sep]]",
        "extra_special_tokens": {"boi_token": "<tool>"},
    },
    "harmony": {"chat_template": HARMONY},
    "hermes": {
        "chat_template": [
            {"name": "default", "template": HERMES_DEFAULT},
            {"name": "tool_use", "template": HERMES_TOOL_USE},
        ]
    },
    # chat_template.jinja replaces the config's template (transformers 5).
    "phi3": {"chat_template": "IGNORED {{ messages }}", "files": {"chat_template.jinja": PHI3}},
    "generation": {"chat_template": GENERATION},
}
"""Model directories the tests write: tokenizer_config.json's edits, and files."""


def write_model(directory: Path, model: str) -> Path:
    """A tokenizer directory (``tests/text``'s trained BPE) with ``model``'s templates."""
    from tests.text.tokenizers_for_tests import write_tricky_dir

    write_tricky_dir(directory)
    spec = dict(MODELS[model])
    files: dict[str, str] = spec.pop("files", {})
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config.update(spec)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text, encoding="utf-8")
    return directory


SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}
DAY = datetime(2024, 7, 26, 12, 30)


def day() -> datetime:
    return DAY


def template(source: str, **tokens: str) -> ChatTemplate:
    return ChatTemplate(source, special_tokens={**SPECIAL, **tokens}, clock=day)


TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief. "},
    {"role": "user", "content": "Hi 🙂"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather in Zürich?"},
]
TOOL_CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 °C"},
]

# Templates that show how vLLM detects the content format, and what it detects.
DETECTION = {
    "prints content": ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
    "loops over content": (
        "{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
        "openai",
    ),
    "loops over content by key": (
        "{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endfor %}",
        "openai",
    ),
    "filtered content of sliced messages": (
        "{% set loop_messages = messages[1:] %}{% for message in loop_messages %}"
        "{% for part in message.content | selectattr('type', 'equalto', 'text') %}"
        "{{ part.text }}{% endfor %}{% endfor %}",
        "openai",
    ),
    "content through a macro": (
        "{% macro render(c) %}{% for item in c %}{{ item.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
        "openai",
    ),
    "loops over a variable named content": (
        "{% for m in messages %}{% set content = m.content %}"
        "{% for x in content %}{{ x }}{% endfor %}{% endfor %}",
        "openai",
    ),
    "messages in a namespace": (
        "{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}"
        "{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}",
        "openai",
    ),
    "tuple loop target (vLLM's fallback)": (
        "{% for m, n in messages %}{% for c in m.content %}{{ c }}{% endfor %}{% endfor %}",
        "string",
    ),
    "indexes content": (
        "{% for m in messages %}"
        "{{ m.content if m.content is string else m.content[0].text }}{% endfor %}",
        "string",
    ),
    "macro looping over tools": (
        "{% macro f(content) %}{% for x in content %}{{ x }}{% endfor %}{% endmacro %}"
        "{{ f(tools) }}{% for m in messages %}{{ m.content }}{% endfor %}",
        "string",
    ),
}

# --------------------------------------------------------------- real templates, rendered

TEMPLATE_TOOLS = template_tools([TOOL])
"""TOOL as vLLM gives it to a template: description and parameters always present."""
TOOL_JSON_4 = json.dumps(TEMPLATE_TOOLS[0], indent=4, ensure_ascii=False)


def test_template_tools_are_vllms_dump_of_the_request_tools() -> None:
    assert [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Météo d'une ville",
                "parameters": TOOL["function"]["parameters"],
            },
        }
    ] == TEMPLATE_TOOLS
    # Unset fields are None; strict and defer_loading appear only when set (the tool's
    # defer_loading is copied to its function); other fields are dropped.
    assert template_tools(
        [
            {"function": {"name": "f", "strict": True, "extra": 1}, "defer_loading": False},
            {"type": "function", "function": {"name": "g", "defer_loading": True}},
        ]
    ) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": None,
                "parameters": None,
                "strict": True,
                "defer_loading": False,
            },
            "defer_loading": False,
        },
        {
            "type": "function",
            "function": {
                "name": "g",
                "description": None,
                "parameters": None,
                "defer_loading": True,
            },
        },
    ]
    for bad, reason in [
        ("f", "tools[0] must be an object"),
        ({"type": "code", "function": {"name": "f"}}, "'type' must be 'function'"),
        ({"function": {"name": 3}}, "'name' must be a string"),
        ({"function": {"name": "f", "parameters": []}}, "'parameters' must be an object"),
        ({"function": {"name": "f", "strict": "yes"}}, "'strict' must be a boolean"),
    ]:
        with pytest.raises(InvalidInputError, match=re.escape(reason)) as caught:
            template_tools([bad])
        assert caught.value.param == "tools"


def test_llama3_with_bos_token_and_strftime_now() -> None:
    llama = template(LLAMA3)
    assert llama.content_format == "string"
    assert llama.render(CHAT, add_generation_prompt=True) == (
        "<s><|start_header_id|>system<|end_header_id|>\n"
        "\n"
        "Cutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n"
        "\n"
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
        "\n"
        "Hi 🙂<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
        "\n"
        "Hello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
        "\n"
        "Weather in Zürich?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
        "\n"
    )
    tools_header = (
        "<s><|start_header_id|>system<|end_header_id|>\n"
        "\n"
        "Environment: ipython\n"
        "Cutting Knowledge Date: December 2023\n"
        "Today Date: {date}\n"
        "\n"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
        "\n"
        "Given the following functions, please respond with a JSON for a function call with "
        "its proper arguments that best answers the given prompt.\n"
        "\n"
        'Respond in the format {{"name": function name, "parameters": dictionary of argument '
        "name and its value}}.Do not use variables.\n"
        "\n"
        f"{TOOL_JSON_4.replace('{', '{{').replace('}', '}}')}\n"
        "\n"
        "Weather in Zürich?<|eot_id|>"
    )
    # The tools go in the first user message, as JSON indented by 4.
    assert llama.render(
        [{"role": "user", "content": "Weather in Zürich?"}],
        add_generation_prompt=True,
        tools=TEMPLATE_TOOLS,
    ) == tools_header.format(date="26 Jul 2024") + (
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # A tool call (its arguments parsed from JSON by vLLM's preparation), a tool
    # result, and a template variable of the request's (date_string).
    assert llama.render(
        TOOL_CHAT,
        add_generation_prompt=True,
        tools=TEMPLATE_TOOLS,
        chat_template_kwargs={"date_string": "01 Jan 2025"},
    ) == tools_header.format(date="01 Jan 2025") + (
        "<|start_header_id|>assistant<|end_header_id|>\n"
        "\n"
        '{"name": "get_weather", "parameters": {"city": "Zürich"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n"
        "\n"
        '"22 °C"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n'
        "\n"
    )
    # Two tool calls at once: the template refuses, with its own message.
    two_calls: list[dict[str, Any]] = [
        TOOL_CHAT[0],
        {**TOOL_CHAT[1], "tool_calls": TOOL_CHAT[1]["tool_calls"] * 2},
    ]
    with pytest.raises(ChatTemplateRejectedError) as caught:
        llama.render(two_calls, add_generation_prompt=True)
    assert caught.value.reason == "This model only supports single tool-calls at once!"
    assert caught.value.param == "messages"
    assert caught.value.lineno == 72  # the template line that raises


def test_qwen25_chatml_with_tools() -> None:
    qwen = template(QWEN25)
    assert qwen.render(CHAT, add_generation_prompt=True) == (
        "<|im_start|>system\n"
        "Be brief. <|im_end|>\n"
        "<|im_start|>user\n"
        "Hi 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
        "Hello!<|im_end|>\n"
        "<|im_start|>user\n"
        "Weather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert qwen.render(TOOL_CHAT, add_generation_prompt=True, tools=TEMPLATE_TOOLS) == (
        "<|im_start|>system\n"
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n"
        "\n"
        "# Tools\n"
        "\n"
        "You may call one or more functions to assist with the user query.\n"
        "\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Météo '
        'd\'une ville", "parameters": {"type": "object", "properties": {"city": '
        '{"type": "string"}}, "required": ["city"]}}}\n'
        "</tools>\n"
        "\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "Weather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n"
        "22 °C\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_reasoning_and_enable_thinking() -> None:
    qwen = template(QWEN3)
    # A request's reasoning_content reaches the template (as vLLM passes it on).
    reasoning = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
    ]
    assert qwen.render(reasoning, add_generation_prompt=False) == (
        "<|im_start|>user\n"
        "2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<think>\n"
        "Two and two.\n"
        "</think>\n"
        "\n"
        "4<|im_end|>\n"
    )
    hi = [{"role": "user", "content": "Hi"}]
    assert qwen.render(
        hi, add_generation_prompt=True, chat_template_kwargs={"enable_thinking": False}
    ) == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen.render(hi, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_mistral_raises_when_roles_do_not_alternate() -> None:
    mistral = template(MISTRAL)
    assert mistral.render(CHAT, add_generation_prompt=True) == (
        "<s> [INST] Be brief. \n\nHi 🙂 [/INST] Hello!</s> [INST] Weather in Zürich? [/INST]"
    )
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateRejectedError) as caught:
        mistral.render(twice, add_generation_prompt=True)
    assert caught.value.reason == (
        "After the optional system message, conversation roles must alternate "
        "user/assistant/user/assistant/..."
    )
    assert str(caught.value) == f"messages: {caught.value.reason}"
    assert caught.value.lineno == 11
    assert isinstance(caught.value, InvalidInputError)  # a 400 for an HTTP server
    with pytest.raises(ChatTemplateRejectedError, match="Only user and assistant roles"):
        mistral.render(
            [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}],
            add_generation_prompt=True,
        )


def test_gemma3_takes_content_as_parts() -> None:
    gemma = template(GEMMA3, image_token="[[sep]]", boi_token="<tool>")
    assert gemma.content_format == "openai"
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, " here "]},
    ]
    assert gemma.prepare(chat)[3] == {
        "role": "user",
        "content": [{"type": "text", "text": "Look:"}, {"type": "text", "text": " here "}],
    }
    assert gemma.render(chat, add_generation_prompt=True) == (
        "<s><start_of_turn>user\n"
        "Be brief.\n"
        "\n"
        "Hi<end_of_turn>\n"
        "<start_of_turn>model\n"
        "Hello!<end_of_turn>\n"
        "<start_of_turn>user\n"
        "Look:here<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    # A conversation given as it is (transformers' way), with an image part and the
    # model-specific special tokens.
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    assert gemma.render_conversation(image, add_generation_prompt=True) == (
        "<s><start_of_turn>user\n<tool>[[sep]]What?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_a_gpt_oss_style_template_with_developer_documents_and_thinking() -> None:
    harmony = template(HARMONY)
    assert harmony.supports_developer_role
    chat: list[dict[str, Any]] = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Salut"},
        {"role": "assistant", "content": "Bonjour", "reasoning": "Say hi"},
    ]
    documents = [{"title": "Rivers", "text": "The Rhône flows south."}, {"text": "Untitled"}]
    # The reasoning is read as `thinking` (transformers 5.22's alias).
    assert harmony.render(
        chat,
        add_generation_prompt=False,
        documents=documents,
        chat_template_kwargs={"reasoning_effort": "low"},
    ) == (
        "<|start|>system<|message|>Knowledge cutoff: 2024-06\n"
        "Current date: 2024-07-26\n"
        "\n"
        "Reasoning: low<|end|><|start|>developer<|message|># Documents\n"
        "\n"
        "## Rivers\n"
        "The Rhône flows south.\n"
        "## Document 2\n"
        "Untitled<|end|><|start|>developer<|message|># Instructions\n"
        "\n"
        "Answer in French.<|end|><|start|>user<|message|>Salut<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Say hi<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Bonjour<|return|>"
    )


def test_named_templates_choose_tool_use_when_tools_are_given(tmp_path: Path) -> None:
    from trio_enginecore.text import load_tokenizer

    tokenizer = load_tokenizer(write_model(tmp_path / "hermes", "hermes"))
    assert tokenizer.chat_template == HERMES_DEFAULT
    assert tokenizer.chat_templates == {"default": HERMES_DEFAULT, "tool_use": HERMES_TOOL_USE}
    templates = ChatTemplates.from_tokenizer(tokenizer, clock=day)
    assert templates.select() is templates.select(tools=False) is templates.templates["default"]
    tool_use = templates.select(tools=True)
    assert tool_use is templates.templates["tool_use"]
    assert templates.select("tool_use") is tool_use  # a request may name one
    assert templates.select().render(
        [{"role": "user", "content": "Hi", "name": "ann"}], add_generation_prompt=True
    ) == ("<|im_start|>user name=ann\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tool_use.render(TOOL_CHAT, add_generation_prompt=True, tools=TEMPLATE_TOOLS) == (
        "<s><|im_start|>system\n"
        "You are a function calling AI model. Here are the available tools: <tools> "
        f"{json.dumps(TEMPLATE_TOOLS[0], indent=2, sort_keys=True, ensure_ascii=False)}"
        " </tools><|im_end|>\n"
        "<|im_start|>user\n"
        "Weather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n"
        "<tool_call>\n"
        '{"name":"get_weather","arguments":{"city":"Zürich"}}\n'
        "</tool_call>\n"
        "<|im_end|>\n"
        "<|im_start|>tool\n"
        "<tool_response>\n"
        "22 °C\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_jinja_replaces_the_configs_template(tmp_path: Path) -> None:
    from trio_enginecore.text import load_tokenizer

    tokenizer = load_tokenizer(write_model(tmp_path / "phi3", "phi3"))
    assert tokenizer.chat_templates == {"default": PHI3}
    phi = ChatTemplates.from_tokenizer(tokenizer).select()
    # The file's last newline is not rendered (jinja2 drops a template's final newline).
    assert phi.render(CHAT[:3], add_generation_prompt=False) == (
        "<|system|>\nBe brief. <|end|>\n<|user|>\nHi 🙂<|end|>\n<|assistant|>\nHello!<|end|>\n</s>"
    )
    assert phi.render(CHAT, add_generation_prompt=True).endswith(
        "<|user|>\nWeather in Zürich?<|end|>\n<|assistant|>\n"
    )


def test_generation_blocks_render_their_body() -> None:
    generation = template(GENERATION)
    assert generation.render(CHAT[1:3], add_generation_prompt=False) == (
        "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n\n"
    )
    with pytest.raises(ChatTemplateSyntaxError, match="endgeneration"):
        ChatTemplate("{% generation %}unclosed")


# ---------------------------------------------------------------- continue_final_message


def test_continue_final_message_leaves_the_last_message_open() -> None:
    hello = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert template(QWEN25).render(
        hello, add_generation_prompt=False, continue_final_message=True
    ) == (
        "<|im_start|>system\n"
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n"
        "Hi<|im_end|>\n"
        "<|im_start|>assistant\n"
        "Hel"
    )
    # A template that trims the message: its trailing space goes too.
    spaced = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello "}]
    assert (
        template(LLAMA3)
        .render(spaced, add_generation_prompt=False, continue_final_message=True)
        .endswith("<|start_header_id|>assistant<|end_header_id|>\n\nHello")
    )
    # Content as parts: the last text part is continued.
    parts: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "One"}, "Tw"]},
    ]
    assert template(GEMMA3).render(
        parts, add_generation_prompt=False, continue_final_message=True
    ) == ("<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nOneTw")


def test_continue_final_message_errors() -> None:
    qwen = template(QWEN25)
    hello = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    # vLLM's chat requests have add_generation_prompt on by default: a request that
    # sets only continue_final_message gets transformers' error.
    with pytest.raises(InvalidInputError, match="are not compatible") as caught:
        qwen.render(hello, add_generation_prompt=True, continue_final_message=True)
    assert caught.value.param == "continue_final_message"
    with pytest.raises(InvalidInputError, match='has no "content" to continue'):
        qwen.render_conversation(
            [{"role": "assistant", "content": None}],
            add_generation_prompt=False,
            continue_final_message=True,
        )
    with pytest.raises(InvalidInputError, match="could not find any text to continue"):
        template(GEMMA3).render_conversation(
            [{"role": "user", "content": [{"type": "image"}]}],
            add_generation_prompt=False,
            continue_final_message=True,
        )
    # A template that never prints `content`, or drops the final message.
    with pytest.raises(ChatTemplateError, match="not an accepted field in the chat_template"):
        template("{{ messages | length }}").render(
            hello, add_generation_prompt=False, continue_final_message=True
        )
    with pytest.raises(ChatTemplateError, match="does not appear in the chat"):
        template("{{ messages[0].content }}").render(
            hello, add_generation_prompt=False, continue_final_message=True
        )


# --------------------------------------------------------------- transformers' environment


def render_text(source: str, **variables: object) -> str:
    return template(source).render_conversation(
        [{"role": "user", "content": "x"}],
        add_generation_prompt=False,
        chat_template_kwargs=variables,
    )


def test_the_environment_is_transformers() -> None:
    # trim_blocks and lstrip_blocks; the template's last newline dropped.
    assert render_text("  {% if true %}\n  a\n  {% endif %}\nb\n") == "  a\nb"
    # tojson keeps non-ASCII text and takes indent, separators and sort_keys.
    value = {"b": "é", "a": [1, 2]}
    assert render_text("{{ v | tojson }}", v=value) == '{"b": "é", "a": [1, 2]}'
    assert render_text("{{ v | tojson(indent=2) }}", v=value) == json.dumps(
        value, indent=2, ensure_ascii=False
    )
    assert render_text("{{ v | tojson(separators=(',', ':'), sort_keys=true) }}", v=value) == (
        '{"a":[1,2],"b":"é"}'
    )
    assert render_text("{{ '<b>&' | tojson }}") == '"<b>&"'  # no HTML escaping
    # loop controls, namespace, the guarded dict.
    assert (
        render_text(
            "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        )
        == "012"
    )
    assert render_text("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}") == "2"
    assert render_text("{{ dict(a=1) }} {{ dict.fromkeys(['k'], 0) }}") == "{'a': 1} {'k': 0}"
    # Special tokens are variables; the request's variables override them.
    assert render_text("{{ bos_token }}{{ eos_token }}{{ unk_token is defined }}") == "<s></s>False"
    assert render_text("{{ bos_token }}", bos_token="<BOS>") == "<BOS>"
    # Undefined variables print nothing (jinja2's default Undefined, as transformers).
    assert render_text("[{{ nothing }}]") == "[]"


def test_strftime_now_reads_the_local_clock() -> None:
    before = datetime.now().strftime("%Y-%m-%d")
    text = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render_conversation(
        [{"role": "user", "content": "x"}], add_generation_prompt=False
    )
    assert text in {before, datetime.now().strftime("%Y-%m-%d")}


def test_the_conversation_is_rendered_from_a_copy() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "assistant", "content": "b", "reasoning": "r"},
    ]
    snapshot = json.dumps(messages)
    for source in (GEMMA3, QWEN3):
        template(source).render(messages, add_generation_prompt=False, continue_final_message=True)
        template(source).render_conversation(
            messages, add_generation_prompt=False, continue_final_message=True
        )
    assert json.dumps(messages) == snapshot


def test_renders_from_several_threads_at_once() -> None:
    qwen = template(QWEN3)
    chats = [
        [{"role": "user", "content": f"question {i} ✓"}, {"role": "assistant", "content": f"{i}"}]
        for i in range(8)
    ]
    expected = [qwen.render(chat, add_generation_prompt=True) for chat in chats]
    results: dict[tuple[int, int], str] = {}

    def work(worker: int) -> None:
        for round_ in range(50):
            index = (worker + round_) % len(chats)
            results[worker, round_] = qwen.render(chats[index], add_generation_prompt=True)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(text == expected[(w + r) % len(chats)] for (w, r), text in results.items())
    assert len(results) == 200


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception.__globals__.keys() }}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{% set ns = namespace(_secret=1) %}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ dict.__call__.__globals__ }}",
        "{{ ''.format.__self__.__class__ }}x{{ (''|attr('__class__')).__mro__ }}",
    ],
)
def test_the_sandbox_refuses_escapes(source: str) -> None:
    with pytest.raises(ChatTemplateSecurityError) as caught:
        render_text(source)
    assert isinstance(caught.value, ChatTemplateError)
    assert caught.value.param == "messages"
    assert "sandbox" in caught.value.reason
    assert caught.value.lineno == 1


def test_an_unsafe_attribute_alone_prints_nothing_as_in_transformers() -> None:
    # The sandbox gives an undefined value (it fails only when used further).
    assert render_text("[{{ ''.__class__ }}]") == "[]"


def test_a_template_that_fails_names_its_line() -> None:
    source = "line one\n{% for m in messages %}\n{{ m.content + 1 }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError) as caught:
        render_text(source)
    assert type(caught.value) is ChatTemplateError
    assert caught.value.lineno == 3
    assert caught.value.reason == (
        'the chat template failed: TypeError: can only concatenate str (not "int") to str '
        "(chat template line 3)"
    )
    with pytest.raises(ChatTemplateError, match="'dict object' has no attribute 'missing'"):
        render_text("{{ messages[0].missing.deeper }}")
    with pytest.raises(ChatTemplateError, match="Range too big"):
        render_text("{% for i in range(10 ** 9) %}{% endfor %}")


def test_a_template_that_does_not_compile_is_refused_at_load() -> None:
    with pytest.raises(ChatTemplateSyntaxError) as caught:
        ChatTemplate("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    assert caught.value.lineno == 2
    assert caught.value.param == "chat_template"
    assert caught.value.name is None
    assert caught.value.reason == ("the chat template does not compile: unexpected '}' (line 2)")
    with pytest.raises(ChatTemplateSyntaxError, match="'tool_use' does not compile") as named:
        ChatTemplates({"default": "ok", "tool_use": "{% if %}"})
    assert named.value.name == "tool_use"


def test_inputs_transformers_refuses() -> None:
    qwen = template(QWEN25)
    with pytest.raises(InvalidInputError, match="empty conversation") as caught:
        qwen.render([], add_generation_prompt=True)
    assert caught.value.param == "messages"
    with pytest.raises(InvalidInputError, match="Tools should either be a JSON schema"):
        qwen.render(CHAT, add_generation_prompt=True, tools=["get_weather"])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="Documents should be a list of dicts"):
        qwen.render(CHAT, add_generation_prompt=True, documents=["text"])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="Chat messages should be dicts"):
        qwen.render_conversation(["hello"], add_generation_prompt=True)  # type: ignore[list-item]
    for name in ["messages", "tools", "add_generation_prompt", "chat_template", "tokenize"]:
        assert name in RESERVED_TEMPLATE_KWARGS
        with pytest.raises(InvalidInputError, match=repr(name)) as reserved:
            qwen.render(CHAT, add_generation_prompt=True, chat_template_kwargs={name: 1})
        assert reserved.value.param == "chat_template_kwargs"


def test_a_model_without_a_template() -> None:
    with pytest.raises(ChatTemplateError, match="the model has no chat template") as caught:
        ChatTemplates({}).select()
    assert caught.value.param == "chat_template"
    assert "default chat template is no longer allowed" in caught.value.reason
    with pytest.raises(ChatTemplateError, match=r"\('a', 'b'\) include no 'default'"):
        ChatTemplates({"b": "x", "a": "y"}).select()
    # A template given as text (a request's, or the server's --chat-template) is
    # compiled once and kept.
    templates = ChatTemplates({}, special_tokens=SPECIAL)
    given = templates.select("{{ bos_token }}{{ messages[0].content }}")
    assert templates.select("{{ bos_token }}{{ messages[0].content }}") is given
    assert given.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == "<s>hi"


# ------------------------------------------------------------- vLLM's content format


@pytest.mark.parametrize("name", sorted(DETECTION))
def test_the_content_format_is_detected_as_vllm_detects_it(name: str) -> None:
    source, expected = DETECTION[name]
    assert ChatTemplate(source).content_format == expected


@pytest.mark.parametrize(
    ("model", "expected"),
    [("llama3", "string"), ("qwen25", "string"), ("qwen3", "string"), ("gemma3", "openai")],
)
def test_real_templates_content_format(model: str, expected: str) -> None:
    assert ChatTemplate(MODELS[model]["chat_template"]).content_format == expected


# ------------------------------------------------------ vLLM's message preparation


def test_prepare_joins_text_parts_for_string_templates() -> None:
    string = template(QWEN25)
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": ""},  # empty parts are dropped
                "b",
                {"type": "input_text", "text": "c"},
                {"type": "refusal", "refusal": "d"},
                {"type": "thinking", "thinking": "e", "closed": True},
                {"type": "text", "text": None},  # skipped, as vLLM skips it
            ],
        },
        {"role": "assistant", "content": None},
        {"role": "user", "content": []},
    ]
    assert string.prepare(messages) == [
        {"role": "user", "content": "a\nb\nc\nd\ne"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""},
    ]


def test_prepare_keeps_parts_for_openai_templates() -> None:
    openai = template(GEMMA3)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "", "cache_control": {"type": "ephemeral"}},
                {"type": "input_text", "text": "b"},
                {"type": "tool_reference", "name": "search"},
            ],
        },
        {"role": "assistant", "content": None},
    ]
    assert openai.prepare(messages) == [
        {"role": "system", "content": [{"type": "text", "text": "s"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "b"},
                {"type": "tool_reference", "name": "search"},
            ],
        },
        {"role": "assistant", "content": []},
    ]
    # Either format can be asked for (vLLM's --chat-template-content-format).
    assert openai.prepare(messages, content_format="string")[1]["content"] == "b\nsearch"


def test_prepare_keeps_only_what_templates_read() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "q", "name": "ann", "task": "t", "extra": 1},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "because",  # the request's old name for reasoning
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x": [1, "é"]}', "extra": 2},
                    "id": "c1",
                },
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "oops"}},
                {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
                {"id": "c4", "type": "function", "function": {"name": "i", "arguments": ""}},
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
        },
        {"role": "assistant", "content": "done", "tool_calls": []},
    ]
    prepared = template(GEMMA3).prepare(messages)
    assert prepared == [
        {"role": "user", "content": [{"type": "text", "text": "q"}], "name": "ann", "task": "t"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": ""}],
            "tool_calls": [
                # The request model's field order, the arguments parsed (an object,
                # else {}).
                {
                    "id": "c1",
                    "function": {"arguments": {"x": [1, "é"]}, "name": "f", "extra": 2},
                    "type": "function",
                },
                {"id": "c2", "function": {"arguments": {}, "name": "g"}, "type": "function"},
                {"id": "c3", "function": {"arguments": {}, "name": "h"}, "type": "function"},
                {"id": "c4", "function": {"arguments": {}, "name": "i"}, "type": "function"},
            ],
            "reasoning": "because",
            "reasoning_content": "because",
        },
        # A tool result's text parts are joined, whatever the format.
        {"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"},
        # No tool calls: the plain assistant path.
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
    ]
    assert list(prepared[1]) == ["role", "content", "tool_calls", "reasoning", "reasoning_content"]


def test_prepare_makes_developer_messages_system_ones_where_the_template_has_no_developer() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "developer", "content": [{"type": "text", "text": "dev"}], "tools": [TOOL]},
    ]
    assert template(QWEN25).prepare(messages) == [
        {"role": "system", "content": "sys\n\ndev"},
        {"role": "user", "content": "q"},
    ]
    # A template that knows the role keeps it (with its tools).
    kept = template(HARMONY).prepare(messages)
    assert kept[2]["role"] == "developer"
    assert kept[2]["tools"] == [{"function": TOOL["function"], "type": "function"}]


def test_prepare_drops_claude_codes_billing_header() -> None:
    system = {"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."}
    assert template(QWEN25).prepare([system])[0]["content"] == "Be brief."
    only = {"role": "system", "content": "x-anthropic-billing-header: cch=1"}
    assert template(QWEN25).prepare([only])[0]["content"] == ""


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("hello", "messages[0]: a message must be an object, not str"),
        ({"content": "x"}, "messages[0]: 'role' must be a string, not null"),
        ({"role": "user", "content": 3}, "'content' must be a string or a list, not int"),
        ({"role": "user", "content": [3]}, "messages[0].content[0]: a content part must be"),
        ({"role": "user", "content": [{"text": "x"}]}, "Missing 'type' field in multimodal part."),
        ({"role": "user", "content": [{"type": 1}]}, "Invalid 'type' field in multimodal part."),
        ({"role": "user", "content": [{"type": "video"}]}, "Unsupported chat content part type"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "'image_url' content is not supported: the model takes text only",
        ),
        ({"role": "user", "content": [{"image_url": "x"}]}, "'image_url' content is not supported"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "'text' must be a string"),
        ({"role": "assistant", "content": "", "tool_calls": {}}, "'tool_calls' must be a list"),
        ({"role": "assistant", "content": "", "tool_calls": [1]}, "entries must be objects"),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"type": "custom"}]},
            "only support assistant tool_calls of type 'function'",
        ),
        ({"role": "assistant", "content": "", "reasoning": 1}, "'reasoning' must be a string"),
    ],
)
def test_prepare_refuses_malformed_messages(message: object, reason: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(reason)) as caught:
        template(QWEN25).prepare([message])  # type: ignore[list-item]
    assert caught.value.param == "messages"


# ----------------------------------------------------------- the model directory's templates


def test_the_directory_gives_the_templates_special_tokens(tmp_path: Path) -> None:
    from trio_enginecore.text import load_tokenizer

    tokenizer = load_tokenizer(write_model(tmp_path / "gemma3", "gemma3"))
    # transformers' special_tokens_map: the named tokens that are set, and the
    # model-specific ones (other "*_token" keys, extra_special_tokens).
    assert tokenizer.template_tokens == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "</s>",
        "image_token": "[[sep]]",
        "boi_token": "<tool>",
    }
    assert ChatTemplates.from_tokenizer(tokenizer).select().render_conversation(
        [{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=False
    ) == ("<s><start_of_turn>user\n<tool>[[sep]]<end_of_turn>\n")


def test_the_directory_layouts_transformers_reads(tmp_path: Path) -> None:
    from trio_enginecore.text import load_tokenizer
    from trio_enginecore.text._tokenizer import Tokenizer

    model = write_model(tmp_path / "m", "qwen25")
    assert load_tokenizer(model).chat_templates == {"default": QWEN25}
    # Template files replace the config's templates altogether (transformers 5).
    (model / "chat_templates").mkdir()
    (model / "chat_templates" / "tool_use.jinja").write_text("T", encoding="utf-8")
    assert load_tokenizer(model).chat_templates == {"tool_use": "T"}
    assert load_tokenizer(model).chat_template is None
    (model / "chat_template.jinja").write_text("D", encoding="utf-8")
    assert load_tokenizer(model).chat_templates == {"default": "D", "tool_use": "T"}
    assert load_tokenizer(model).chat_template == "D"
    # A malformed list of named templates.
    other = write_model(tmp_path / "bad", "qwen25")
    config = json.loads((other / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "default"}]
    (other / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelDirectoryError, match="list of named templates"):
        load_tokenizer(other)
    # A Tokenizer made by hand with one template has it as "default".
    made = load_tokenizer(model)
    by_hand = Tokenizer(
        made.backend, directory=model, special_tokens={"bos_token": "<s>"}, chat_template="X"
    )
    assert by_hand.chat_templates == {"default": "X"}
    assert by_hand.template_tokens == {"bos_token": "<s>"}

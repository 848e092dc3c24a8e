"""Render chat template cases with transformers and with vLLM's chat pipeline (the
release installed).

Usage: ``chat_templates.py MODELS_JSON FORMATS_JSON CASES_JSON RESULTS_JSON``

``MODELS_JSON`` maps a model name to its tokenizer directory (the template in
``tokenizer_config.json`` or in ``chat_template.jinja``). For each model this writes
what transformers loads (``tokenizer.chat_template``, ``special_tokens_map``) and what
vLLM detects (the content format of each template, whether it knows the developer
role), and the content format vLLM detects for each template of ``FORMATS_JSON`` (an
object, name -> template). Each case is one of:

* ``"transformers"``: ``PreTrainedTokenizerFast.from_pretrained(dir).apply_chat_template(
  conversation, tools=..., documents=..., add_generation_prompt=...,
  continue_final_message=..., tokenize=False, **kwargs)``;
* ``"vllm"``: an OpenAI chat request body through vLLM's own steps, as its chat
  completions server takes them (``ChatCompletionRequest``, ``build_chat_params``,
  ``parse_chat_messages`` with the detected content format, then
  ``safe_apply_chat_template`` over vLLM's tokenizer): the conversation vLLM prepared
  and the prompt text.

Results are ``{"text": ...}`` or ``{"error": kind, "type": ..., "message": ...}``; kind is
``"rejected"`` for a template's ``raise_exception``, ``"security"`` for a sandbox
refusal, ``"template"`` for jinja2's other errors, ``"request"`` for a request vLLM's
model rejects, and ``"other"``. Prints ``@{"event": "done", ...}`` with the date before
and after (``strftime_now`` reads the clock).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import say


def error_result(exc: BaseException) -> dict[str, Any]:
    import jinja2.exceptions

    chain: BaseException | None = exc
    while chain is not None and not isinstance(chain, jinja2.exceptions.TemplateError):
        chain = chain.__cause__ or chain.__context__
    if chain is not None and type(chain) is jinja2.exceptions.TemplateError:
        kind = "rejected"
    elif isinstance(chain, jinja2.exceptions.SecurityError):
        kind = "security"
    elif chain is not None:
        kind = "template"
    else:
        kind = "other"
    return {"error": kind, "type": type(exc).__name__, "message": str(exc)}


def main() -> None:
    models_path, formats_path, cases_path, results_path = sys.argv[1:5]
    date_before = time.strftime("%Y-%m-%d")
    import pydantic
    import transformers
    import vllm
    from transformers import PreTrainedTokenizerFast
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import (
        _consolidate_system_messages,
        _convert_developer_to_system,
        _detect_content_format,
        _detect_developer_role_support,
        resolve_chat_template_content_format,
        safe_apply_chat_template,
    )
    from vllm.renderers.params import merge_kwargs
    from vllm.tokenizers import get_tokenizer

    models: dict[str, str] = json.loads(Path(models_path).read_text(encoding="utf-8"))
    cases = json.loads(Path(cases_path).read_text(encoding="utf-8"))
    formats = {
        name: _detect_content_format(text, default="string")
        for name, text in json.loads(Path(formats_path).read_text(encoding="utf-8")).items()
    }

    hf_tokenizers: dict[str, Any] = {}
    vllm_tokenizers: dict[str, Any] = {}
    configs: dict[str, Any] = {}
    model_reports: dict[str, Any] = {}
    for name, directory in models.items():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
        hf_tokenizers[name] = tokenizer
        vllm_tokenizers[name] = get_tokenizer(directory)
        configs[name] = SimpleNamespace(
            model=directory,
            tokenizer=directory,
            revision=None,
            code_revision=None,
            tokenizer_revision=None,
            trust_remote_code=False,
            enable_prompt_embeds=False,
            multimodal_config=None,
            is_multimodal_model=False,
            hf_config=SimpleNamespace(model_type="llama"),
            allowed_local_media_path="",
            allowed_media_domains=None,
        )
        templates = tokenizer.chat_template
        named = templates if isinstance(templates, dict) else {"default": templates}
        model_reports[name] = {
            "chat_template": templates,
            "special_tokens_map": tokenizer.special_tokens_map,
            "content_format": {
                key: _detect_content_format(text, default="string") for key, text in named.items()
            },
            "developer_role": {
                key: _detect_developer_role_support(text) for key, text in named.items()
            },
        }

    results: list[dict[str, Any]] = []
    for case in cases:
        model = case["model"]
        try:
            if case["kind"] == "transformers":
                text = hf_tokenizers[model].apply_chat_template(
                    case["conversation"],
                    tools=case.get("tools"),
                    documents=case.get("documents"),
                    add_generation_prompt=case["add_generation_prompt"],
                    continue_final_message=case["continue_final_message"],
                    tokenize=False,
                    **case.get("kwargs", {}),
                )
                results.append({"text": text})
                continue
            # vLLM's chat completions path (OpenAIServingChat.render_chat_request ->
            # preprocess_chat -> HfRenderer.render_messages), without the engine.
            tokenizer, config = vllm_tokenizers[model], configs[model]
            try:
                request = ChatCompletionRequest.model_validate({"model": "m", **case["request"]})
            except Exception as exc:
                results.append({"error": "request", "type": type(exc).__name__, "message": ""})
                continue
            tool_dicts = (
                None if request.tools is None else [tool.model_dump() for tool in request.tools]
            )
            defaults = merge_kwargs(None, {"tools": tool_dicts, "tokenize": False})
            params = request.build_chat_params(None, "auto").with_defaults(defaults)
            content_format = resolve_chat_template_content_format(
                chat_template=params.chat_template,
                tools=params.chat_template_kwargs.get("tools"),
                given_format=params.chat_template_content_format,
                tokenizer=tokenizer,
                model_config=config,
            )
            try:
                conversation, _, _ = parse_chat_messages(
                    request.messages, config, content_format=content_format
                )
            except pydantic.ValidationError as exc:
                # Content parts that the request model validates lazily, against the
                # OpenAI schema of the message's role, when pydantic's smart union
                # picked that schema: refused when they are read.
                results.append({"error": "request_parts", "type": type(exc).__name__})
                continue
            prepared = conversation
            if any(m["role"] == "developer" for m in conversation):
                chosen = tokenizer.get_chat_template(None, tools=tool_dicts)
                if not _detect_developer_role_support(chosen):
                    prepared = _consolidate_system_messages(
                        _convert_developer_to_system(conversation)
                    )
            prepared_json = json.loads(json.dumps(prepared))
            try:
                text = safe_apply_chat_template(
                    config, tokenizer, conversation, **params.get_apply_chat_template_kwargs()
                )
            except Exception as exc:
                results.append({**error_result(exc), "conversation": prepared_json})
                continue
            results.append(
                {"text": text, "conversation": prepared_json, "content_format": content_format}
            )
        except Exception as exc:
            results.append(error_result(exc))
    Path(results_path).write_text(json.dumps(results, ensure_ascii=False), encoding="utf-8")
    say(
        event="done",
        cases=len(results),
        models=model_reports,
        formats=formats,
        vllm=vllm.__version__,
        transformers=transformers.__version__,
        date_before=date_before,
        date_after=time.strftime("%Y-%m-%d"),
    )


if __name__ == "__main__":
    main()

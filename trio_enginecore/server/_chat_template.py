"""Chat templates, rendered exactly as vLLM 0.34 renders them (pure: no I/O, no Trio).

vLLM renders a chat request in two steps, both reproduced here without transformers:

1. **Message preparation** (vLLM's ``parse_chat_messages``, ``renderers/chat_utils``):
   each OpenAI message becomes a *conversation message* holding only what templates
   read (``role``, ``content``, ``tool_calls``, ``reasoning``, ``tool_call_id``,
   ``name``, ...). Its content is normalised to the template's **content format**,
   detected from the template's syntax tree (``renderers/hf.py``,
   ``_detect_content_format``): ``"string"`` (the text parts joined with ``"\\n"``)
   for templates that print ``message.content``, ``"openai"`` (a list of
   ``{"type": "text", "text": ...}`` parts) for templates that loop over it. Tool call
   arguments become objects, and ``developer`` messages become ``system`` ones for
   templates that do not know that role. See :meth:`ChatTemplate.prepare`.
2. **Rendering** (transformers' ``apply_chat_template(..., tokenize=False)``,
   ``utils/chat_template_utils.py``): jinja2 in an ``ImmutableSandboxedEnvironment``
   with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the
   ``{% generation %}`` block; a ``tojson`` filter that keeps non-ASCII text and takes
   ``indent``, ``separators`` and ``sort_keys``; the ``raise_exception`` and
   ``strftime_now`` globals, and transformers' guarded ``dict`` and ``namespace``. The
   template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``,
   the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) and the
   request's extra ``chat_template_kwargs``; ``continue_final_message`` leaves the
   last message open as transformers does. See :meth:`ChatTemplate.render_conversation`.

A template is compiled once (:class:`ChatTemplate`), and a model's named templates
are held together (:class:`ChatTemplates`: ``tool_use`` is chosen when tools are
given, as transformers does). Both are immutable and safe to use from several threads
at once. Rendering is CPU work that an untrusted template can make long: run it in a
worker thread, with a deadline (vLLM's ``VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT``).

Errors are :class:`~trio_enginecore.errors.InvalidInputError` (400 for an HTTP
server): malformed messages, and the errors of transformers' own checks, with its
messages; a template that refuses the conversation (``raise_exception``) raises
:class:`ChatTemplateRejectedError` with the template's message, one that fails
:class:`ChatTemplateError`, one that reaches outside the sandbox
:class:`ChatTemplateSecurityError`, and one that does not compile
:class:`ChatTemplateSyntaxError` when it is loaded. The messages name the template's
line where it is known.

Needs ``jinja2`` 3.1.6 or newer (the ``server`` extra), imported by this module only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final, Literal, cast, final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..text._tokenizer import Tokenizer

__all__ = [
    "RESERVED_TEMPLATE_KWARGS",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTemplateRejectedError",
    "ChatTemplateSecurityError",
    "ChatTemplateSyntaxError",
    "ChatTemplates",
    "ContentFormat",
    "template_tools",
]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


if _version(jinja2.__version__) < (3, 1, 6):  # pragma: no cover - depends on the environment
    raise ImportError(
        f"chat templates need jinja2 3.1.6 or newer (older releases have sandbox escapes), "
        f"not {jinja2.__version__}: pip install '/path/to/trio-enginecore[server]'"
    )

ContentFormat = Literal["string", "openai"]
"""How message content reaches a template: a string, or a list of OpenAI parts."""

RESERVED_TEMPLATE_KWARGS: Final = frozenset(
    {
        # What the template is given by render_conversation's own parameters.
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        # transformers' apply_chat_template and render_jinja_template take these as
        # parameters: they never reach a template, or fail as duplicates.
        "conversation",
        "conversations",
        "chat_template",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""Names ``chat_template_kwargs`` may not hold: the template gets them otherwise, or
transformers takes them as its own parameters (vLLM rejects ``chat_template`` and
``tokenize``; a vLLM server lets a request's own fields override the others)."""

_CONTINUE_TAG: Final = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS: Final = ("reasoning_content", "thinking", "reasoning")
_TEMPLATE_FILENAME: Final = "<template>"  # jinja2's name for a template from a string
_MISSING_TEMPLATE: Final = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must "
    "provide a chat template if the tokenizer does not define one."
)


# ---------------------------------------------------------------------------- errors


class ChatTemplateError(InvalidInputError):
    """A chat template cannot render this request: it failed while rendering (an
    undefined variable used as an object, text added to a list, ...), or (its
    subclasses) it refused the conversation, broke the sandbox's rules, or does not
    compile.

    A request error (400 for an HTTP server), as in vLLM, which answers any failure of
    the template with its message.

    Attributes:
        param: ``"messages"`` for an error while rendering, ``"chat_template"`` for a
            template that does not compile, or the option at fault
            (``"continue_final_message"``).
        reason: what went wrong, with the template's line where it is known.
        lineno: the template's line at fault (1-based), if known.
    """

    def __init__(self, param: str, reason: str, *, lineno: int | None = None) -> None:
        super().__init__(param, reason)
        self.lineno = lineno


class ChatTemplateRejectedError(ChatTemplateError):
    """The template refused the conversation: it called ``raise_exception(message)``
    (roles that do not alternate, an unsupported role, ...). ``reason`` is the
    template's message as it wrote it; vLLM answers 400 with that message alone."""


class ChatTemplateSecurityError(ChatTemplateError):
    """The template tried something the sandbox forbids (an underscore attribute such
    as ``__class__``, a method that changes a list, ...): refused, as transformers'
    sandbox refuses it."""


class ChatTemplateSyntaxError(ChatTemplateError):
    """The template does not compile; raised when it is loaded (``param`` is
    ``"chat_template"``), naming the line.

    Attributes:
        name: the template's name (``"default"``, ``"tool_use"``, or ``None`` for a
            template given as text).
    """

    def __init__(self, reason: str, *, lineno: int | None, name: str | None) -> None:
        super().__init__("chat_template", reason, lineno=lineno)
        self.name = name


class _TemplateRaised(TemplateError):
    # What raise_exception raises inside the template (transformers raises a plain
    # TemplateError; a subclass tells it from jinja2's own errors).
    pass


def _template_line(exc: BaseException) -> int | None:
    # jinja2 rewrites tracebacks so that a template's frames carry its line numbers.
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _TEMPLATE_FILENAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _at_line(reason: str, line: int | None) -> str:
    return reason if line is None else f"{reason} (chat template line {line})"


# ------------------------------------------------------------ transformers' jinja2 set-up


class _GenerationBlocks(jinja2.ext.Extension):
    """transformers' ``AssistantTracker``: the ``{% generation %}...{% endgeneration %}``
    block, which marks what the assistant wrote. Rendering text only, the block's body
    is its output (transformers tracks the spans only for assistant masks)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation_support")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _generation_support(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: object) -> None:
    raise _TemplateRaised(cast("str", message))


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: jinja2's own escapes HTML characters and takes no options.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    # transformers' guarded `dict`: callable and `dict.fromkeys`, nothing else.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # transformers' `namespace`: no underscore-prefixed attributes.
    def __init__(*args: Any, **kwargs: Any) -> None:
        # jinja2's signature trick, so that `namespace(self=...)` still works.
        self, rest = args[0], args[1:]
        attrs: dict[Any, Any] = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


def _environment(clock: Callable[[], datetime]) -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlocks, jinja2.ext.loopcontrols],
    )

    def strftime_now(format: str) -> str:  # transformers' parameter name
        return clock().strftime(format)

    environment.filters["tojson"] = _tojson
    template_globals = cast("Any", environment.globals)
    template_globals["raise_exception"] = _raise_exception
    template_globals["strftime_now"] = strftime_now
    template_globals["dict"] = _TemplateDict()
    template_globals["namespace"] = _TemplateNamespace
    return environment


def _plain(value: object) -> object:
    # transformers' _plain_template_data: everything the template sees is rebuilt out
    # of plain JSON types (a fresh copy: the caller's objects are never changed), and
    # anything else is replaced by an inert placeholder naming its type.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        items = cast("Mapping[object, object]", value).items()
        return {_plain(key): _plain(item) for key, item in items}
    if isinstance(value, list):
        return [_plain(item) for item in cast("list[object]", value)]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in cast("tuple[object, ...]", value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list[dict[str, object]]) -> list[dict[str, object]]:
    # transformers 5.22: a message's reasoning is also given as `reasoning_content` (the
    # standard name) and `thinking` (gpt-oss templates read that).
    aliased: list[dict[str, object]] = []
    for message in chat:
        reasoning = next(
            (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


# ------------------------------------------------------------- vLLM's content format


class _Unrecognised(Exception):
    # A template shape vLLM's detection does not handle (it asserts, then falls back).
    pass


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == varname
    # `ns.rest` matches the dotted alias "ns.rest".
    if isinstance(node, jinja2.nodes.Getattr) and "." in varname:
        base, _, attr = varname.rpartition(".")
        return node.attr == attr and _is_var_access(node.node, base)
    return False


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _attr_dotted_name(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts: list[str] = []
    while isinstance(node, jinja2.nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _names_assigned_from(root: jinja2.nodes.Node, varname: str) -> Iterator[str]:
    # vLLM's _iter_nodes_assign_var_or_elems: the variable, and every name (or
    # namespace attribute) assigned from it or from a slice of it, transitively.
    yield varname
    seen = {varname}
    pending = [varname]
    while pending:
        related = pending.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            lhs, rhs = assign.target, assign.node
            if isinstance(lhs, jinja2.nodes.Name) and _is_var_or_elems_access(rhs, related):
                yield lhs.name
                if lhs.name != related and lhs.name not in seen:
                    seen.add(lhs.name)
                    pending.append(lhs.name)
            aliases: list[str] = []
            if (
                isinstance(lhs, jinja2.nodes.Name)
                and isinstance(rhs, jinja2.nodes.Call)
                and isinstance(rhs.node, jinja2.nodes.Name)
                and rhs.node.name == "namespace"
            ):
                aliases = [
                    f"{lhs.name}.{kwarg.key}"
                    for kwarg in rhs.kwargs
                    if _is_var_or_elems_access(kwarg.value, related)
                ]
            elif isinstance(lhs, jinja2.nodes.Getattr | jinja2.nodes.NSRef) and (
                _is_var_or_elems_access(rhs, related)
            ):
                dotted = _attr_dotted_name(lhs)
                aliases = [dotted] if dotted is not None else []
            for alias in aliases:
                yield alias
                if alias != related and alias not in seen:
                    seen.add(alias)
                    pending.append(alias)


def _loop_target(loop: jinja2.nodes.For) -> str:
    if not isinstance(loop.target, jinja2.nodes.Name):
        raise _Unrecognised
    return loop.target.name


def _message_loop_names(root: jinja2.nodes.Node) -> Iterator[str]:
    # The loop variables of `{% for message in messages %}` loops (or over aliases).
    messages_names = list(_names_assigned_from(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, name) for name in messages_names):
            yield _loop_target(loop)


def _content_loops(root: jinja2.nodes.Node) -> Iterator[jinja2.nodes.For]:
    # vLLM's _iter_nodes_assign_content_item: loops over a message's content, directly,
    # through a macro's parameter, or over a variable named `content`.
    message_names = list(_message_loop_names(root))

    def is_content(node: jinja2.nodes.Node) -> bool:
        return any(_is_var_or_elems_access(node, name, "content") for name in message_names)

    macro_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and is_content(arg):
                        content_params.add(macro.args[i].name)
                for keyword in call.kwargs:
                    if keyword.key in param_names and is_content(keyword.value):
                        content_params.add(keyword.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_params_by_loop[id(loop)] = content_params

    for loop in root.find_all(jinja2.nodes.For):
        if is_content(loop.iter):
            _loop_target(loop)
            yield loop
            continue
        params = macro_params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name) and params and loop.iter.name in params:
            _loop_target(loop)
            yield loop
            continue
        if (
            id(loop) not in loops_in_macros
            and isinstance(loop.iter, jinja2.nodes.Name)
            and loop.iter.name == "content"
        ):
            _loop_target(loop)
            yield loop


def _detect_content_format(tree: jinja2.nodes.Template) -> ContentFormat:
    try:
        next(_content_loops(tree))
    except StopIteration:
        return "string"
    except _Unrecognised:
        return "string"  # vLLM's default when its detection fails
    return "openai"


# ----------------------------------------------------------- vLLM's message preparation

_TEXT_PART_FIELDS: Final = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# The content part types vLLM reads media from (a text-only model takes none).
_MEDIA_PART_TYPES: Final = (
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
)
# The keys that make an untyped part a media part, in the order vLLM tries them.
_MEDIA_PART_KEYS: Final = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)
_KNOWN_PART_TYPES: Final = frozenset({*_TEXT_PART_FIELDS, "tool_reference", *_MEDIA_PART_TYPES})
# Every field of vLLM's content part types: the others of a text part are kept.
_KNOWN_PART_FIELDS: Final = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
_BILLING_HEADER: Final = "x-anthropic-billing-header"


def _bad(where: str, reason: str) -> InvalidInputError:
    return InvalidInputError("messages", f"{where}: {reason}")


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _as_mapping(value: object) -> Mapping[str, object] | None:
    return cast("Mapping[str, object]", value) if isinstance(value, Mapping) else None


def _as_list(value: object) -> list[object] | None:
    return cast("list[object]", value) if isinstance(value, list | tuple) else None


def _strip_billing_header(parts: list[object]) -> list[object]:
    # vLLM drops Claude Code's attribution line from system text (it changes on every
    # request, so a prompt that keeps it misses the prefix cache).
    kept: list[object] = []
    for part in parts:
        mapping = _as_mapping(part)
        text: object = (
            part
            if isinstance(part, str)
            else mapping.get("text")
            if mapping is not None and mapping.get("type") == "text"
            else None
        )
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            kept.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            kept.append(rest if mapping is None else {**mapping, "text": rest})
    return kept


def _parse_part(where: str, part: object, *, wrap: bool) -> object:
    # One content part (vLLM's parse_chat_message_content_part): its text, or a
    # {"type": "text", ...} part in the "openai" format; None when vLLM skips it.
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    mapping = _as_mapping(part)
    if mapping is None:
        raise _bad(where, f"a content part must be a string or an object, not {_type_name(part)}")
    part_type = mapping.get("type")
    if part_type is None or mapping.get("uuid") is not None:
        media = next((key for key in _MEDIA_PART_KEYS if key in mapping), None)
        if media is not None:
            raise _bad(where, f"{media!r} content is not supported: the model takes text only")
        if "tool_reference" not in mapping:
            raise _bad(where, "Missing 'type' field in multimodal part.")
        part_type = "tool_reference"
    elif not isinstance(part_type, str):
        raise _bad(where, "Invalid 'type' field in multimodal part.")
    elif part_type not in _KNOWN_PART_TYPES:
        supported = ", ".join(sorted(_KNOWN_PART_TYPES))
        raise _bad(
            where,
            f"Unsupported chat content part type: {part_type!r}. Supported types: {supported}.",
        )
    elif part_type in _MEDIA_PART_TYPES:
        raise _bad(where, f"{part_type!r} content is not supported: the model takes text only")

    if part_type == "tool_reference":
        name = mapping.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(where, f"'name' must be a string, not {_type_name(name)}")
        return {"type": "tool_reference", "name": name} if wrap else name
    field = _TEXT_PART_FIELDS[part_type]
    text = mapping.get(field)
    if text is None and part_type in ("text", "refusal"):
        return None  # vLLM skips it, with a warning
    if not isinstance(text, str):
        raise _bad(
            where, f"a {part_type!r} part's {field!r} must be a string, not {_type_name(text)}"
        )
    if not wrap:
        return text
    extra = {key: value for key, value in mapping.items() if key not in _KNOWN_PART_FIELDS}
    return {"type": "text", "text": text, **extra}


def _ordered(value: object, fields: Sequence[str]) -> object:
    # vLLM's request model (pydantic TypedDicts) puts declared fields first, then the
    # others in the order given.
    mapping = _as_mapping(value)
    if mapping is None:
        return value
    first = {key: mapping[key] for key in fields if key in mapping}
    return {**first, **{key: item for key, item in mapping.items() if key not in first}}


def _tool_call(value: object) -> object:
    call = _ordered(value, ("id", "function", "type"))
    mapping = _as_mapping(call)
    if mapping is not None and "function" in mapping:
        return {**mapping, "function": _ordered(mapping["function"], ("arguments", "name"))}
    return call


def _tool(value: object) -> object:
    tool = _ordered(value, ("function", "type"))
    mapping = _as_mapping(tool)
    if mapping is not None and "function" in mapping:
        function = _ordered(mapping["function"], ("name", "description", "parameters", "strict"))
        return {**mapping, "function": function}
    return tool


def _parse_message(index: int, message: object, content_format: ContentFormat) -> dict[str, object]:
    # One message (vLLM's parse_chat_message_content, with the request model's renaming
    # of `reasoning_content` to `reasoning`).
    where = f"messages[{index}]"
    mapping = _as_mapping(message)
    if mapping is None:
        raise _bad(where, f"a message must be an object, not {_type_name(message)}")
    role = mapping.get("role")
    if not isinstance(role, str):
        raise _bad(where, f"'role' must be a string, not {_type_name(role)}")
    reasoning = mapping.get("reasoning")
    if reasoning is None:
        reasoning = mapping.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise _bad(where, f"'reasoning' must be a string, not {_type_name(reasoning)}")

    content = mapping.get("content")
    parts: list[object]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    else:
        listed = _as_list(content)
        if listed is None:
            raise _bad(where, f"'content' must be a string or a list, not {_type_name(content)}")
        parts = listed
    if role == "system":
        parts = _strip_billing_header(parts)
    wrap = content_format == "openai"
    # vLLM keeps the parts that are not empty (an empty string is dropped).
    parsed = [
        item
        for i, part in enumerate(parts)
        if (item := _parse_part(f"{where}.content[{i}]", part, wrap=wrap))
    ]
    result: dict[str, object] = {
        "role": role,
        "content": parsed if wrap else "\n".join(cast("list[str]", parsed)),
    }

    if role == "assistant":
        tool_calls = mapping.get("tool_calls")
        if tool_calls is not None:
            calls = _as_list(tool_calls)
            if calls is None:
                raise _bad(where, f"'tool_calls' must be a list, not {_type_name(tool_calls)}")
            result["tool_calls"] = [_tool_call(call) for call in calls]
        if reasoning is not None:
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in mapping:
            result["tool_call_id"] = mapping["tool_call_id"]
        items = _as_list(result["content"])
        if items is not None:
            # Most templates print a tool result as a string: text parts are joined.
            dicts = [_as_mapping(item) for item in items]
            if not any(d is not None and d.get("type") != "text" for d in dicts):
                texts = [
                    cast("str", d.get("text", ""))
                    for d in dicts
                    if d is not None and d.get("type") == "text"
                ]
                result["content"] = "\n".join(texts) if texts else ""
    name = mapping.get("name")
    if isinstance(name, str):
        result["name"] = name
    task = mapping.get("task")
    if isinstance(task, str):
        result["task"] = task
    if role == "developer":
        tools = mapping.get("tools")
        listed_tools = _as_list(tools)
        if tools is not None and listed_tools is None:
            raise _bad(where, f"'tools' must be a list, not {_type_name(tools)}")
        result["tools"] = None if listed_tools is None else [_tool(t) for t in listed_tools]
    return result


def _parse_tool_arguments(conversation: list[dict[str, object]]) -> None:
    # vLLM's _postprocess_messages: templates read tool call arguments as objects.
    for index, message in enumerate(conversation):
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        calls = _as_list(message["tool_calls"])
        if calls is None:
            continue
        if not calls:
            del message["tool_calls"]  # keeps templates on the plain assistant path
            continue
        for call in calls:
            item = _as_mapping(call)
            if item is None:
                raise _bad(f"messages[{index}]", "assistant tool_calls entries must be objects.")
            function = _as_mapping(item.get("function"))
            if item.get("type", "function") != "function" or function is None:
                raise _bad(
                    f"messages[{index}]",
                    "chat completions only support assistant tool_calls of type 'function'.",
                )
            arguments = function.get("arguments")
            parsed: object = {}
            if isinstance(arguments, Mapping):
                parsed = cast("Mapping[str, object]", arguments)
            elif isinstance(arguments, str) and arguments:
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError:
                    parsed = {}  # vLLM coerces it, so that the conversation can go on
            if not isinstance(parsed, Mapping):
                parsed = {}
            cast("dict[str, object]", function)["arguments"] = parsed


def _developer_to_system(conversation: list[dict[str, object]]) -> list[dict[str, object]]:
    converted: list[dict[str, object]] = []
    for message in conversation:
        if message["role"] == "developer":
            message = {**message, "role": "system"}
            message.pop("tools", None)
        converted.append(message)
    # vLLM's _consolidate_system_messages: one system message, first (some templates
    # require it there).
    contents: list[object] = []
    others: list[dict[str, object]] = []
    needs_merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        if i > 0 or contents:
            needs_merge = True
        content = message.get("content", "")
        items = _as_list(content)
        if items is not None:
            texts: list[object] = []
            for item in items:
                part = _as_mapping(item)
                if part is not None and "text" in part:
                    texts.append(part["text"])
                elif isinstance(item, str):
                    texts.append(item)
            content = "\n".join(cast("list[str]", texts))
        if content:
            contents.append(content)
    if not needs_merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(cast("list[str]", contents))}, *others]


def _prepare_messages(
    messages: Sequence[Mapping[str, object]],
    *,
    content_format: ContentFormat,
    developer_role: bool,
) -> list[dict[str, object]]:
    listed = _as_list(messages)
    if listed is None:
        raise InvalidInputError("messages", f"must be a list, not {_type_name(messages)}")
    conversation = [
        _parse_message(index, _plain(message), content_format)
        for index, message in enumerate(listed)
    ]
    _parse_tool_arguments(conversation)
    if not developer_role and any(m["role"] == "developer" for m in conversation):
        conversation = _developer_to_system(conversation)
    return conversation


def template_tools(tools: Sequence[object]) -> list[dict[str, object]]:
    """The tools of a chat request as vLLM gives them to a template.

    vLLM's request model turns each tool into
    ``{"type": "function", "function": {"name", "description", "parameters"}}`` with
    ``None`` for an unset description or parameters, ``strict`` and ``defer_loading``
    only where they are set, and any other field dropped. A template that prints its
    tools as JSON (most do) shows exactly that. A request's empty list of tools counts
    as none in vLLM 0.34 (give the template ``None``; vLLM 0.33 refuses it).

    Raises:
        InvalidInputError: a tool is malformed (``param`` is ``"tools"``).
    """
    result: list[dict[str, object]] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        mapping = _as_mapping(tool)
        if mapping is None:
            raise InvalidInputError("tools", f"{where} must be an object, not {_type_name(tool)}")
        if mapping.get("type", "function") != "function":
            raise InvalidInputError("tools", f"{where}: 'type' must be 'function'")
        function = _as_mapping(mapping.get("function"))
        if function is None:
            raise InvalidInputError("tools", f"{where}: 'function' must be an object")
        name = function.get("name")
        if not isinstance(name, str):
            raise InvalidInputError("tools", f"{where}.function: 'name' must be a string")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidInputError("tools", f"{where}.function: 'description' must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidInputError("tools", f"{where}.function: 'parameters' must be an object")
        strict = function.get("strict")
        defer = mapping.get("defer_loading")
        function_defer = function.get("defer_loading")
        for key, flag in (
            ("strict", strict),
            ("defer_loading", defer),
            ("defer_loading", function_defer),
        ):
            if flag is not None and not isinstance(flag, bool):
                raise InvalidInputError("tools", f"{where}: {key!r} must be a boolean")
        if defer is not None and function_defer is None:
            function_defer = defer  # vLLM copies the tool's flag to its function
        out_function: dict[str, object] = {
            "name": name,
            "description": description,
            "parameters": _plain(function.get("parameters")),
        }
        if strict is not None:
            out_function["strict"] = strict
        if function_defer is not None:
            out_function["defer_loading"] = function_defer
        out: dict[str, object] = {"type": "function", "function": out_function}
        if defer is not None:
            out["defer_loading"] = defer
        result.append(out)
    return result


# ------------------------------------------------------------------------- templates


@final
class ChatTemplate:
    """One chat template, compiled once; immutable, and safe to render from several
    threads at once.

    Args:
        source: the template's Jinja text.
        special_tokens: the tokenizer's special tokens by name, given to the template as
            variables (transformers' ``special_tokens_map``: ``bos_token``,
            ``eos_token``, ... and model-specific ones; :attr:`Tokenizer.template_tokens
            <trio_enginecore.text.Tokenizer.template_tokens>`). ``None`` values are left
            out.
        name: the template's name among the model's (``"default"``, ``"tool_use"``), for
            error messages; ``None`` for a template given as text.
        clock: what ``strftime_now`` reads (default: :meth:`datetime.now`, local time,
            as transformers).

    Raises:
        ChatTemplateSyntaxError: the template does not compile (the message names the
            line).

    Attributes:
        source: the template's text.
        content_format: how message content reaches this template (vLLM's detection):
            ``"openai"`` if it loops over a message's content, else ``"string"``.
        supports_developer_role: whether the template names the ``developer`` role
            (vLLM's test); if not, :meth:`prepare` makes ``developer`` messages
            ``system`` ones.
    """

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        name: str | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self.source = source
        self.name = name
        self.special_tokens: dict[str, str] = {
            key: token for key, token in (special_tokens or {}).items() if token is not None
        }
        environment = _environment(clock or datetime.now)
        try:
            tree = environment.parse(source)
            self._template = environment.from_string(tree)
        except TemplateSyntaxError as exc:
            where = "the chat template" if name is None else f"the chat template {name!r}"
            raise ChatTemplateSyntaxError(
                f"{where} does not compile: {exc.message} (line {exc.lineno})",
                lineno=exc.lineno,
                name=name,
            ) from None
        self.content_format: ContentFormat = _detect_content_format(tree)
        self.supports_developer_role: bool = '"developer"' in source or "'developer'" in source

    def __repr__(self) -> str:
        name = "" if self.name is None else f" {self.name!r}"
        return f"<ChatTemplate{name}, {len(self.source)} characters, {self.content_format}>"

    def prepare(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        content_format: ContentFormat | None = None,
    ) -> list[dict[str, object]]:
        """The conversation vLLM gives this template for a request's ``messages``.

        Each message keeps ``role`` and ``content`` (in ``content_format``, default
        this template's: ``"\\n"``-joined text, or a list of ``{"type": "text", "text":
        ...}`` parts; empty for ``null`` content), an assistant's ``tool_calls`` (their
        ``arguments`` parsed to objects: ``{}`` when they are not a JSON object) and
        ``reasoning`` (also as ``reasoning_content``; a request's
        ``reasoning_content`` is read as ``reasoning``), a tool result's
        ``tool_call_id`` (and its text parts joined), ``name`` and ``task`` when they are
        strings, and a developer message's ``tools``. ``developer`` messages become
        ``system`` ones (merged into one, first) unless :attr:`supports_developer_role`.
        The messages given are not changed.

        Raises:
            InvalidInputError: a message is malformed, or holds media (images, audio,
                ...: the model takes text only); ``param`` is ``"messages"`` and the
                reason names the message (``messages[2].content[0]: ...``).
        """
        return _prepare_messages(
            messages,
            content_format=content_format or self.content_format,
            developer_role=self.supports_developer_role,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, object]] | None = None,
        documents: Sequence[Mapping[str, object]] | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        content_format: ContentFormat | None = None,
    ) -> str:
        """The prompt vLLM renders for a chat request: :meth:`prepare`, then
        :meth:`render_conversation`.

        ``tools`` are given as the template should see them (``template_tools``
        makes them from a request's). Blocking CPU work: see the module's notes.

        Raises:
            InvalidInputError: as :meth:`prepare` and :meth:`render_conversation` do.
        """
        return self.render_conversation(
            self.prepare(messages, content_format=content_format),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            chat_template_kwargs=chat_template_kwargs,
        )

    def render_conversation(
        self,
        conversation: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, object]] | None = None,
        documents: Sequence[Mapping[str, object]] | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> str:
        """The template rendered on ``conversation`` as it is: what transformers'
        ``apply_chat_template(conversation, tools=..., documents=...,
        add_generation_prompt=..., continue_final_message=..., tokenize=False,
        **chat_template_kwargs)`` returns.

        Args:
            conversation: the messages (objects), given to the template as
                ``messages``; a reasoning field (``reasoning_content``, ``thinking``,
                ``reasoning``) is given under all three names.
            add_generation_prompt: given to the template, which then opens the
                assistant's turn.
            continue_final_message: leave the last message open for the model to
                continue (its ``content`` must appear in the rendered text; the text
                ends where it ends, without what the template writes after it).
            tools: given to the template as ``tools`` (``None`` if not given).
            documents: given as ``documents`` (``None`` if not given).
            chat_template_kwargs: more variables for the template; they override the
                special tokens of the same name, and may not use a name of
                ``RESERVED_TEMPLATE_KWARGS``.

        Raises:
            ChatTemplateRejectedError: the template called ``raise_exception``;
                ``reason`` is its message.
            ChatTemplateSecurityError: the template broke the sandbox's rules.
            ChatTemplateError: the template failed otherwise, or cannot continue the
                final message.
            InvalidInputError: the conversation is empty, ``continue_final_message``
                is given with ``add_generation_prompt`` or without a final message to
                continue, a tool or document is not an object, or
                ``chat_template_kwargs`` uses a reserved name.
        """
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise InvalidInputError(
                "chat_template_kwargs",
                f"may not set {', '.join(map(repr, reserved))}: "
                "give them as the request's own fields",
            )
        if len(conversation) == 0:
            raise InvalidInputError(
                "messages",
                "Cannot apply chat template to an empty conversation. "
                "Provide at least one message.",
            )
        if continue_final_message and add_generation_prompt:
            raise InvalidInputError(
                "continue_final_message",
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final "
                "message, and add_generation_prompt when you want to add a header that will "
                "prompt it to start a new assistant message instead.",
            )
        if tools is not None and not all(_as_mapping(tool) is not None for tool in tools):
            raise InvalidInputError(
                "tools",
                "Tools should either be a JSON schema, or a callable function with type hints "
                "and a docstring suitable for auto-conversion to a schema.",
            )
        if documents is not None and not all(_as_mapping(d) is not None for d in documents):
            raise InvalidInputError(
                "documents", "Documents should be a list of dicts with 'title' and 'text' keys!"
            )
        variables = cast("dict[str, object]", _plain({**self.special_tokens, **kwargs}))
        plain_tools = _plain(None if tools is None else list(tools))
        plain_documents = _plain(None if documents is None else list(documents))
        chat: list[dict[str, object]] = []
        for index, message in enumerate(cast("list[object]", _plain(list(conversation)))):
            item = _as_mapping(message)
            if item is None:
                raise InvalidInputError(
                    "messages",
                    f"messages[{index}]: Chat messages should be dicts, dataclasses or "
                    f"pydantic models, but got {message!r}.",
                )
            chat.append(cast("dict[str, object]", item))
        chat = _alias_reasoning_fields(chat)
        final_text = self._open_final_message(chat) if continue_final_message else None

        try:
            rendered = self._template.render(
                messages=chat,
                tools=plain_tools,
                documents=plain_documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRaised as exc:
            raise ChatTemplateRejectedError(
                "messages", str(exc.message), lineno=_template_line(exc)
            ) from exc
        except SecurityError as exc:
            line = _template_line(exc)
            raise ChatTemplateSecurityError(
                "messages",
                _at_line(f"the chat template broke the sandbox's rules: {exc}", line),
                lineno=line,
            ) from exc
        except MemoryError:
            raise
        except Exception as exc:
            line = _template_line(exc)
            what = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            raise ChatTemplateError(
                "messages", _at_line(f"the chat template failed: {what}", line), lineno=line
            ) from exc

        if final_text is not None:
            rendered = self._close_final_message(rendered, final_text)
        return rendered

    def _open_final_message(self, chat: list[dict[str, object]]) -> str:
        # transformers' continue_final_message, for the "content" field: a tag is added
        # to the final message's text, and the rendered text ends before it.
        final = chat[-1].get("content")
        if final is None:
            raise InvalidInputError(
                "continue_final_message",
                'continue_final_message is set but the final message has no "content" to continue!',
            )
        if "content" not in self.source:
            raise ChatTemplateError(
                "continue_final_message",
                'continue_final_message is set to "content" but this is not an accepted '
                "field in the chat_template",
            )
        blocks = _as_list(final)
        if blocks is None:
            if not isinstance(final, str):
                raise InvalidInputError(
                    "continue_final_message",
                    f"the final message's content must be text to continue, "
                    f"not {_type_name(final)}",
                )
            chat[-1]["content"] = final + _CONTINUE_TAG
            return final
        for block in reversed(blocks):
            part = _as_mapping(block)
            if part is not None and "text" in part:
                text = part["text"]
                if not isinstance(text, str):
                    break
                cast("dict[str, object]", part)["text"] = text + _CONTINUE_TAG
                return text
        raise InvalidInputError(
            "continue_final_message",
            "continue_final_message is set but we could not find any text to continue in the "
            "final message!",
        )

    def _close_final_message(self, rendered: str, final_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise ChatTemplateError(
                "continue_final_message",
                "continue_final_message is set but the final message does not appear in the "
                "chat after applying the chat template! This can happen if the chat template "
                "deletes portions of the final message.",
            )
        at = rendered.rindex(tag)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]  # the template keeps the message's spacing
        return rendered[:at].rstrip()  # it trimmed the message's trailing spacing


@final
class ChatTemplates:
    """A model's chat templates by name, each compiled once, and which one a request
    uses (transformers' ``get_chat_template``, as vLLM calls it).

    Args:
        templates: the templates' text by name (:attr:`Tokenizer.chat_templates
            <trio_enginecore.text.Tokenizer.chat_templates>`): ``{"default": ...}`` for
            a model with one, ``{"default": ..., "tool_use": ...}`` for named ones.
        special_tokens: as :class:`ChatTemplate` takes them.
        clock: as :class:`ChatTemplate` takes it.

    Raises:
        ChatTemplateSyntaxError: a template does not compile (all are compiled here).
    """

    def __init__(
        self,
        templates: Mapping[str, str],
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self._special_tokens = dict(special_tokens or {})
        self._clock = clock
        self.templates: dict[str, ChatTemplate] = {
            name: ChatTemplate(source, special_tokens=special_tokens, name=name, clock=clock)
            for name, source in templates.items()
        }
        # Request templates given as text (vLLM's --trust-request-chat-template), as
        # transformers caches them (128 most recent).
        self._compile_text = lru_cache(maxsize=128)(self._compile)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, *, clock: Callable[[], datetime] | None = None
    ) -> ChatTemplates:
        """The templates of a model directory's tokenizer, with its special tokens."""
        return cls(tokenizer.chat_templates, special_tokens=tokenizer.template_tokens, clock=clock)

    def __repr__(self) -> str:
        return f"<ChatTemplates {sorted(self.templates)}>"

    def _compile(self, source: str) -> ChatTemplate:
        return ChatTemplate(source, special_tokens=self._special_tokens, clock=self._clock)

    def select(self, chat_template: str | None = None, *, tools: bool = False) -> ChatTemplate:
        """The template a request uses.

        Args:
            chat_template: the request's template (or the server's
                ``--chat-template``): the name of one of the model's, or a template's
                text. ``None``: the model's own, ``"tool_use"`` if the request gives
                tools and the model has it, else ``"default"``.
            tools: whether the request gives tools.

        Raises:
            ChatTemplateError: the model has no template to use (``param`` is
                ``"chat_template"``).
            ChatTemplateSyntaxError: ``chat_template`` is a text that does not compile.
        """
        if chat_template is not None:
            named = self.templates.get(chat_template)
            return named if named is not None else self._compile_text(chat_template)
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if self.templates:
            names = ", ".join(map(repr, sorted(self.templates)))
            reason = (
                f"the model's chat templates ({names}) include no 'default'. {_MISSING_TEMPLATE}"
            )
        else:
            reason = f"the model has no chat template. {_MISSING_TEMPLATE}"
        raise ChatTemplateError("chat_template", reason)

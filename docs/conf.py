"""Sphinx configuration of the trio-enginecore documentation.

Build with ``nox -s docs`` (warnings are errors, broken references fail), or by hand:
``sphinx-build -W --keep-going -n -b html docs docs/_build/html``.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import types
from pathlib import Path
from typing import Any

import attrs
import msgspec
from sphinx.application import Sphinx

# Document the checkout this file belongs to, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio_enginecore

project = "trio-enginecore"
author = "The trio-enginecore developers"
copyright = "2026, The trio-enginecore developers"
release = trio_enginecore.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
# No intersphinx: the build must work without fetching inventories from the network.
# References to Trio, msgspec, numpy, pyzmq and the standard library are therefore
# plain text (see nitpick_ignore_regex below); references to our own names must resolve.

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# -- autodoc / napoleon -----------------------------------------------------------

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"
# A signature longer than this is shown one parameter per line: the configuration's
# thirteen fields with their defaults, instead of a wrapped wall of text.
python_maximum_signature_line_length = 88

napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections become attribute descriptions that :attr: can refer to; the
# API pages do not also list those attributes as members.
napoleon_use_ivar = False
napoleon_use_rtype = False

# -- cross-references ---------------------------------------------------------------

nitpicky = True
nitpick_ignore_regex = [
    # Third-party and standard-library names: no inventory to resolve them against.
    (
        r"py:.*",
        r"(trio|msgspec|numpy|np|npt|zmq|attrs|hypercorn|httpx|tokenizers|h11|jinja2"
        r"|prometheus_client|datetime)(\..*)?",
    ),
    (
        r"py:.*",
        r"(contextlib|collections\.abc|typing|types|enum|abc|threading|random|os|pathlib)\..*",
    ),
    # Type variables in signatures (``T``, ``F``...) are not documented objects.
    (r"py:class", r"(trio_enginecore(\.\w+)*\.)?[A-Z]"),
]
nitpick_ignore = [
    # Internal halves named by constructor signatures users never call: a stream is
    # made by client.stream(), a client by the openers.
    ("py:class", "trio_enginecore.client._core._stream.StreamFeed"),
    ("py:class", "trio_enginecore.client._sync_stream.Portal"),
    ("py:class", "trio_enginecore.client._core._policy.Fail"),
    ("py:class", "trio_enginecore.client._core._policy.RouteAround"),
    ("py:class", "trio_enginecore.client._core._router.DataParallelRole"),
    # The client's inner parts, named by ClientLink's fields: described in the
    # architecture guide, not API users build on (ClientLink's annotations stay
    # strings: its state's type is imported for the type checker only).
    ("py:class", "ClientState"),
    ("py:class", "WaveFollower"),
    # The data path a TrioMPClient may be given (``pipe=``): provisional, described in
    # the architecture guide.
    ("py:class", "trio_enginecore.client._multiprocess._pipe.MessagePipe"),
    ("py:class", "trio_enginecore._zmq.TrioSocket"),
    # The openers' ``**options``: ClientOptions' fields as keywords, documented there.
    ("py:class", "trio_enginecore.client._options.ClientOptionKeywords"),
    ("py:class", "trio_enginecore.client._options.InprocOptionKeywords"),
    ("py:class", "collections.deque"),
    # The reference engine's core, which TrioInprocClient.core returns: its API is
    # the engine's, documented by the protocol guide rather than as a class.
    ("py:class", "trio_enginecore.engine._core.EngineCore"),
    # The text layer's block objects (made by generate()) and per-sequence state:
    # described where they are made.
    ("py:class", "trio_enginecore.text._llm._GenerationBlock"),
    ("py:class", "trio_enginecore.text._sync.SyncGeneration"),
    ("py:class", "trio_enginecore.text._processor.SequenceState"),
    # Names the text layer's signatures use under TYPE_CHECKING-only imports.
    ("py:class", "Path"),
    ("py:class", "ClientOptionKeywords"),
]

# -- HTML ---------------------------------------------------------------------------

html_theme = "furo"
html_title = f"trio-enginecore {release}"
html_static_path = ["_static"]
# Wide code blocks and tables scroll sideways, with a visible scrollbar and a shadow on
# the side that has more to see (the reasons are in the stylesheet).
html_css_files = ["wide-content.css"]
html_js_files = ["wide-content.js"]


# -- docstring and signature fix-ups ------------------------------------------------


def _plain_attribute_docstrings(
    app: Sphinx, what: str, name: str, obj: object, options: Any, lines: list[str]
) -> None:
    """Keep napoleon from reading an attribute docstring as ``type: description``.

    Napoleon takes everything before the first colon of an attribute's docstring for
    its type. Our attribute docstrings are prose (the types come from annotations) and
    often contain a colon, so an empty reST comment (``..``) on the first line, which
    has no colon and renders as nothing, makes napoleon find no type.
    """
    if what in ("attribute", "data", "property") and lines and lines[0].strip():
        lines[:0] = ["..", ""]


def _struct_factory_defaults(
    app: Sphinx,
    what: str,
    name: str,
    obj: object,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str | None, str | None] | None:
    """Show msgspec ``default_factory`` defaults as a call (``list()``), not ``<factory>``.

    ``inspect.signature`` of a msgspec Struct writes ``= <factory>``, which is not
    Python, so Sphinx could not parse the signature.
    """
    if not (signature and "<factory>" in signature and isinstance(obj, type)):
        return None
    if not issubclass(obj, msgspec.Struct):
        return None
    for field in msgspec.structs.fields(obj):
        factory = field.default_factory
        if factory is msgspec.NODEFAULT:
            continue
        origin = factory.__origin__ if isinstance(factory, types.GenericAlias) else factory
        call = f"{getattr(origin, '__name__', 'factory')}()"
        pattern = rf"(\b{re.escape(field.name)}: [^=]*= )<factory>"
        signature = re.sub(pattern, lambda m, call=call: m.group(1) + call, signature)
    return signature, return_annotation


class _Expression:
    """A default shown as the Python expression ``text`` (autodoc writes its repr)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _attrs_class_of_init(function: object) -> type | None:
    """The attrs class whose generated ``__init__`` is ``function``, or None."""
    owner_name, _, method = getattr(function, "__qualname__", "").rpartition(".")
    if method != "__init__" or not owner_name or "<locals>" in owner_name:
        return None
    owner: object = sys.modules.get(getattr(function, "__module__", None) or "")
    for part in owner_name.split("."):
        owner = getattr(owner, part, None)
    if not (isinstance(owner, type) and attrs.has(owner)):
        return None
    return owner if vars(owner).get("__init__") is function else None


def _attrs_init_defaults(app: Sphinx, obj: object, bound_method: bool) -> None:
    """Give attrs classes their real defaults (``model: str = 'counter'``).

    With ``autodoc_preserve_defaults``, autodoc reads each default from the source of
    the function, and the ``__init__`` attrs generates is in the line cache: its source
    says ``model=attr_dict['model'].default``, which is what the pages showed. Its
    evaluated defaults are the right ones, so this drops the signature autodoc built
    from the source and uses the function's own, with ``factory=`` defaults
    (``NOTHING`` there) written as a call (``Random()``). It must run after autodoc's
    own fix-up: Sphinx 9 makes it before emitting this event, Sphinx 8 in a handler of
    this event at the default priority, hence the later priority in :func:`setup`.
    """
    cls = _attrs_class_of_init(obj)
    if cls is None:
        return
    vars(obj).pop("__signature__", None)
    by_alias = {field.alias: field for field in attrs.fields(cls)}
    signature = inspect.signature(obj)
    parameters = []
    for parameter in signature.parameters.values():
        field = by_alias.get(parameter.name)
        if field is not None and isinstance(field.default, attrs.Factory):
            name = getattr(field.default.factory, "__qualname__", "factory")
            parameter = parameter.replace(default=_Expression(f"{name}()"))
        parameters.append(parameter)
    obj.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]


def _attrs_field_default(
    app: Sphinx, what: str, name: str, obj: object, options: Any, lines: list[str]
) -> None:
    """End the description of an attrs field with its default (``Default: 'counter'``)."""
    if what != "attribute":
        return
    owner_name, _, field_name = name.rpartition(".")
    try:
        owner = _resolve_name(owner_name)
    except (ImportError, AttributeError):
        return
    if not (isinstance(owner, type) and attrs.has(owner)):
        return
    field = attrs.fields_dict(owner).get(field_name)
    if field is None or field.default is attrs.NOTHING:
        return
    if isinstance(field.default, attrs.Factory):
        factory = getattr(field.default.factory, "__qualname__", "factory")
        default = f"a new ``{factory}()``"
    else:
        default = f"``{field.default!r}``"
    lines.extend(["", f"Default: {default}."])


def _resolve_name(qualified_name: str) -> object:
    """The object named ``package.module.Class``, from the modules already imported."""
    parts = qualified_name.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        if module_name not in sys.modules:
            continue
        obj: object = sys.modules[module_name]
        for part in parts[split:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(qualified_name)


class _NoConfigurationDump(logging.Filter):
    """Drop the line of MyST's whole configuration (``myst v5.2.0: MdParserConfig(...)``).

    myst-parser logs its configuration, every field, at the start of every build: a
    2,000-character line that says nothing about the build. ``nox -s docs`` fails if
    such a dump shows again.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(type(arg).__name__ == "MdParserConfig" for arg in args)


# Sphinx's loggers are the standard library's, under "sphinx."; a filter on the one that
# logs the line drops it before any of Sphinx's handlers sees it.
logging.getLogger("sphinx.myst_parser.sphinx_ext.main").addFilter(_NoConfigurationDump())


def setup(app: Sphinx) -> None:
    # Before napoleon (priority 500), so that napoleon sees the empty comment.
    app.connect("autodoc-process-docstring", _plain_attribute_docstrings, priority=100)
    app.connect("autodoc-process-signature", _struct_factory_defaults)
    app.connect("autodoc-before-process-signature", _attrs_init_defaults, priority=900)
    app.connect("autodoc-process-docstring", _attrs_field_default)

"""Sphinx configuration of the trio-enginecore documentation.

Build with ``nox -s docs`` (warnings are errors, broken references fail), or by hand:
``sphinx-build -W --keep-going -n -b html docs docs/_build/html``.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import msgspec
from sphinx.application import Sphinx

# Document the checkout this file belongs to, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio_enginecore

project = "trio-enginecore"
author = "The trio-enginecore developers"
copyright = "the trio-enginecore developers"
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
    (r"py:.*", r"(trio|msgspec|numpy|np|npt|zmq|attrs)(\..*)?"),
    (
        r"py:.*",
        r"(contextlib|collections\.abc|typing|types|enum|abc|threading|random|os|pathlib)\..*",
    ),
    # Type variables in signatures (``T``, ``F``...) are not documented objects.
    (r"py:class", r"(trio_enginecore(\.\w+)*\.)?[A-Z]"),
]
nitpick_ignore = [
    # The private base class of the Trio clients, named by the return annotation of
    # open_engine_client(); its public methods are documented on TrioMPClient.
    ("py:class", "trio_enginecore.client._base.TrioClientBase"),
]

# -- HTML ---------------------------------------------------------------------------

html_theme = "furo"
html_title = f"trio-enginecore {release}"
html_static_path: list[str] = []


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


def setup(app: Sphinx) -> None:
    # Before napoleon (priority 500), so that napoleon sees the empty comment.
    app.connect("autodoc-process-docstring", _plain_attribute_docstrings, priority=100)
    app.connect("autodoc-process-signature", _struct_factory_defaults)

"""A keyword that does not exist, answered with the nearest one that does (pure).

An ``EngineConfig`` given ``max_num_seq=8`` should say ``did you mean
'max_num_seqs'?`` rather than only that the keyword is unexpected: the settings
classes, the openers' options and the sampling keywords of a request all take many
keywords, and a typo in one is the commonest mistake a new user makes with them.
Nothing here runs unless a call already failed, or a set of keywords has one that is
not known: a call that succeeds costs what it did.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Collection, Iterable
from typing import Any, Final, TypeVar

import attrs

__all__ = ["check_keywords", "known_keywords", "suggest_keywords", "unknown_keyword"]

_T = TypeVar("_T")

_CUTOFF: Final = 0.6
"""How alike a known keyword must be to be suggested (difflib's ratio)."""


def unknown_keyword(owner: str, name: str, known: Iterable[str]) -> TypeError:
    """The error for keyword ``name``, which ``owner`` (``"EngineConfig"``) does not
    take: Python's own message, and the nearest of ``known`` if one is near enough."""
    public = sorted({keyword for keyword in known if not keyword.startswith("_")})
    close = difflib.get_close_matches(name, public, n=1, cutoff=_CUTOFF)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"{owner}() got an unexpected keyword argument {name!r}{hint}")


def known_keywords(function: Callable[..., Any]) -> set[str]:
    """The names ``function`` (or a class) takes as keywords, but for ``**keywords``."""
    return {
        parameter.name
        for parameter in inspect.signature(function).parameters.values()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }


def check_keywords(owner: str, given: Iterable[str], known: Collection[str]) -> None:
    """Raise :func:`unknown_keyword`'s error for the first of ``given`` not ``known``."""
    for name in given:
        if name not in known:
            raise unknown_keyword(owner, name, known)


def suggest_keywords(cls: type[_T]) -> type[_T]:
    """Make an attrs class's unknown keywords name the nearest field.

    Apply it above the attrs decorator. The ``__init__`` attrs wrote is called as
    before (its signature is the class's, for ``help()`` and the docs); only a
    ``TypeError`` it raises is looked at, and replaced when a keyword was unknown.
    """
    init: Callable[..., None] = cls.__init__
    known: Final = frozenset(field.alias for field in attrs.fields(cls))  # type: ignore[arg-type]
    owner: Final = cls.__name__

    @functools.wraps(init)
    def init_suggesting(self: object, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except TypeError:
            unknown = [name for name in kwargs if name not in known]
            if unknown:
                raise unknown_keyword(owner, unknown[0], known) from None
            raise

    cls.__init__ = init_suggesting  # type: ignore[method-assign]
    return cls

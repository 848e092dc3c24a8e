"""Exception groups, flattened: what the library's programs and openers report of a
nursery's failure (pure)."""

from __future__ import annotations

from typing import cast

__all__ = ["leaves"]


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions in ``error`` that are no group themselves, in order, however
    deeply nested (``[error]`` for an exception that is not a group)."""
    if isinstance(error, BaseExceptionGroup):
        nested = cast("BaseExceptionGroup[BaseException]", error)
        return [leaf for sub in nested.exceptions for leaf in leaves(sub)]
    return [error]

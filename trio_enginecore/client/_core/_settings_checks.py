"""attrs validators shared by the client's settings objects (pure; requests are checked in
:mod:`._validate`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["positive_number"]


def positive_number(
    owner: str | None, *, optional: bool = False
) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    """A validator: the field is a finite number above 0 (or None, if ``optional``).

    Its ``ValueError`` names the field as ``owner.field`` (``field`` alone without an
    owner), so a user sees which setting of which object to fix.
    """

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not (
            isinstance(value, int | float) and math.isfinite(value) and value > 0
        ):
            name = attribute.name if owner is None else f"{owner}.{attribute.name}"
            raise ValueError(f"{name} must be a positive number, got {value!r}")

    return check

"""Suite-wide rules for the tests.

pytest-trio reports a test as passed when a ``trio.Cancelled`` escapes it: a client
that leaked the ``Cancelled`` caused by a failure in its background task would look
healthy. Here every async test fails instead when that happens.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio


def _fail_on_stray_cancelled(test: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(test)
    async def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return await test(*args, **kwargs)
        except trio.Cancelled as exc:
            raise AssertionError(
                "a trio.Cancelled escaped the test: no scope of the test was cancelled, "
                "so something let a cancellation out"
            ) from exc

    return checked


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.obj = _fail_on_stray_cancelled(item.obj)

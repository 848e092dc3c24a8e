"""Running a client for the duration of an ``async with`` block: the openers' part.

One rule for every opener: the block's own exception comes back as itself, a startup
failure as itself, an engine death as one ``EngineDeadError``, and no ExceptionGroup
ever escapes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import TypeVar

import trio

from .._groups import leaves
from ..errors import EngineCoreError, EngineDeadError
from ._client import TrioEngineClient

__all__ = ["run_client"]


C = TypeVar("C", bound=TrioEngineClient)


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception in a (nested) group, or None if there are several."""
    found = leaves(group)
    return found[0] if len(found) == 1 else None


def _first_failure(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The first exception in a (nested) group that is not a cancellation."""
    return next((e for e in leaves(group) if not isinstance(e, trio.Cancelled)), None)


async def _cancel_on_failure(client: TrioEngineClient, body: trio.CancelScope) -> None:
    try:
        await client.wait_failed()
    except trio.ClosedResourceError:
        return  # closed without failing: nothing to stop
    body.cancel()


@asynccontextmanager
async def run_client(client: C, *, cancel_on_failure: bool = False) -> AsyncGenerator[C, None]:
    """Run ``client`` inside its own nursery for the duration of an ``async with``.

    With ``cancel_on_failure``, the block's body is cancelled when the client fails
    (see ``wait_failed()``), so that a server running in it stops; the block then
    raises the one ``EngineDeadError``, not ``Cancelled``.

    ``client.start(nursery)`` returns once the client is usable. On the way out the
    client is closed (shielded) and its background tasks cancelled. The block's own
    exception, or ``Cancelled``, propagates as itself (identity, ``__context__`` and
    ``__cause__`` untouched); a startup failure propagates as itself; an engine death
    during a block that did not raise becomes one
    :class:`~trio_enginecore.errors.EngineDeadError`; a failure
    of a background task (a bug: they handle bad input themselves) raises one
    :class:`~trio_enginecore.errors.EngineCoreError` chained from it, in place of the
    ``Cancelled`` it caused in the block; an ExceptionGroup never escapes.
    """
    user_error: BaseException | None = None
    startup_error: BaseException | None = None
    background: BaseExceptionGroup[BaseException] | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                await client.start(nursery)
            except BaseException as exc:
                startup_error = exc
            else:
                body = trio.CancelScope()
                try:
                    with body:
                        if cancel_on_failure:
                            nursery.start_soon(_cancel_on_failure, client, body)
                        yield client
                except BaseException as exc:
                    user_error = exc
            finally:
                await client.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Background tasks never raise on purpose: this is an outer cancellation that
        # arrived during shutdown, or a bug. Either way the caller gets one exception.
        background = group
    # Raised outside any `except` block so the exception keeps its own __context__ and
    # __cause__: the caller's exception comes back exactly as it was.
    error = user_error or startup_error
    failure = _first_failure(background) if background is not None else None
    if failure is not None and (error is None or isinstance(error, trio.Cancelled)):
        # A background task failed, and the nursery cancelled the block because of it:
        # the failure is the news, not the Cancelled it caused.
        if isinstance(failure, EngineCoreError):
            raise failure
        raise EngineCoreError(
            f"the engine client failed in its background task: {failure!r}"
        ) from failure
    if error is None and background is not None:
        error = _single(background)
        if error is None and failure is None:
            # Only cancellations: an outer cancel scope was cancelled while the client
            # shut down (several tasks met it). That cancellation goes on up, as one.
            error = leaves(background)[0]
        if error is None:
            raise EngineDeadError("the engine client failed in the background") from background
    if error is not None:
        raise error
    if client.failure is not None:
        # Returns at once for a failed client; the shield keeps the error.
        with trio.CancelScope(shield=True):
            raise await client.wait_failed()

"""Running a data-parallel coordinator shared by several clients."""

from __future__ import annotations

import shutil
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
import zmq

from ..engine._coordinator import CoordinatorAddresses, run_coordinator
from ._launch import private_ipc_dir

__all__ = ["open_coordinator"]


@asynccontextmanager
async def open_coordinator(
    engines: int,
    *,
    addresses: CoordinatorAddresses | None = None,
    min_interval_s: float = 0.1,
) -> AsyncGenerator[CoordinatorAddresses, None]:
    """Run a data-parallel coordinator for ``engines`` engines as a task of this program.

    ``async with open_coordinator(2) as coordinator:`` then pass ``coordinator`` to
    each client of the group (``open_engine_client(config, coordinator=coordinator)``).
    Without ``addresses`` it binds ipc:// sockets in a new private (0700) directory,
    removed on exit; give TCP addresses to serve clients and engines on other hosts
    (``tcp://HOST:*`` picks free ports: the addresses yielded are the ones bound).
    The coordinator stops when the block ends; the block's exception (or
    ``Cancelled``) propagates as itself.

    Raises:
        ValueError: ``engines`` < 1.
        zmq.ZMQError: an address could not be bound (in use, invalid).
    """
    if engines < 1:
        raise ValueError(f"a coordinator needs at least one engine, got {engines}")
    directory = None
    if addresses is None:
        directory = private_ipc_dir()
        addresses = CoordinatorAddresses.in_directory(directory)
    ctx: zmq.Context[Any] = zmq.Context()
    error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                bound: CoordinatorAddresses = await nursery.start(
                    partial(
                        run_coordinator,
                        ctx,
                        engines=engines,
                        addresses=addresses,
                        min_interval_s=min_interval_s,
                    )
                )
                try:
                    yield bound
                except BaseException as exc:
                    error = exc
            except BaseException as exc:
                error = exc
            finally:
                nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    # Raised outside the nursery, so that it is not wrapped in an ExceptionGroup.
    if error is not None:
        raise error

"""Running a data-parallel coordinator shared by several clients: :func:`open_coordinator`."""

from __future__ import annotations

import logging
import shutil
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
import zmq

from .._curve import CurveRefusal, CurveServer, run_zap_handler
from .._ipc_dirs import private_ipc_dir
from ._addresses import CoordinatorAddresses
from ._serve import serve_coordinator

__all__ = ["open_coordinator"]

logger = logging.getLogger("trio_enginecore.coordinator")


def _log_refusal(refusal: CurveRefusal) -> None:
    logger.warning("coordinator refused a connection from %s", refusal)


@asynccontextmanager
async def open_coordinator(
    engines: int,
    *,
    addresses: CoordinatorAddresses | None = None,
    min_interval_s: float = 0.1,
    curve: CurveServer | None = None,
) -> AsyncGenerator[CoordinatorAddresses, None]:
    """Run a data-parallel coordinator for ``engines`` engines as a task of this program.

    ``async with open_coordinator(2) as coordinator:`` then pass ``coordinator`` to
    each client of the group (``open_engine_client(config, coordinator=coordinator)``).
    Without ``addresses`` it binds ipc:// sockets in a new private (0700) directory,
    removed on exit; give TCP addresses to serve clients and engines on other hosts
    (``tcp://HOST:*`` picks free ports: the addresses yielded are the ones bound).

    With ``curve``, every TCP socket of the coordinator is a CURVE server with the
    frontends' key pair (the one the clients of the group give as
    ``RemoteEngines(curve=...)``, and whose public key their engines hold): it admits
    the engines' public keys in ``curve.allowed`` and the clients, which prove they
    hold the same key pair.
    The coordinator stops when the block ends; the block's exception (or
    ``Cancelled``) propagates as itself.

    Raises:
        ValueError: ``engines`` < 1.
        AddressError: an address could not be bound (in use, malformed, an interface
            this host does not have); it names the address.
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
                if curve is not None:
                    # Before any CURVE socket is bound: without it libzmq admits anyone.
                    allowed = curve.allowed | {curve.keys.public}
                    await nursery.start(partial(run_zap_handler, ctx, allowed, _log_refusal))
                bound: CoordinatorAddresses = await nursery.start(
                    partial(
                        serve_coordinator,
                        ctx,
                        engines=engines,
                        addresses=addresses,
                        min_interval_s=min_interval_s,
                        curve=curve,
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

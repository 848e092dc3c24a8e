"""``trio-enginecore serve``: run one reference engine as a program.

This is an application entry point, so unlike the library it may own the process's
signals: SIGTERM and SIGINT start a graceful drain, a second one stops at once.

An engine launched by a client also stops, at once and without draining, when that
client is gone: the client holds the write end of a *lifeline* pipe whose read end the
engine gets (``--lifeline-fd``). The kernel closes the write end when the client
exits, however it exits (SIGKILL included), so the engine reads end-of-file: at the
start of :func:`serve` if the client died before, or from a task watching the pipe
afterwards. (Before :func:`serve`, while Python imports the package, the SIGIO the
client asked the kernel to send on that event ends the process at once.)
``--exit-with-parent`` (polling ``getppid()``) stays for engines started by hand.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any, Final

import trio
import zmq

from .._curve import CurveClient
from .._program import (
    EXIT_ADDRESS,
    EXIT_FATAL,
    EXIT_OK,
    EXIT_STARTUP,
    exit_when_orphaned,
    first_leaf,
    report_address_error,
)
from ..config import EngineConfig
from ..errors import AddressError, EngineStartupError
from ._core import FatalEngineError
from ._proc import EngineCoreProc, addresses_for, engine_handshake

__all__ = ["serve"]

logger = logging.getLogger("trio_enginecore.engine")

EXIT_CLIENT_GONE = 4
"""The client that launched this engine is gone (its lifeline pipe closed, or with
``--exit-with-parent`` the launching process exited): stopped at once, nothing drained."""

CLIENT_GONE: Final = "the client that launched this engine is gone"


def lifeline_closed(fd: int) -> bool:
    """Whether the write end of the lifeline pipe whose read end is ``fd`` is closed.

    Never blocks (``fd`` is made non-blocking). The client never writes on the pipe;
    anything it did write would be read and ignored.
    """
    os.set_blocking(fd, False)
    while True:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return False
        if not data:
            return True


async def _serve(
    ctx: zmq.Context[Any],
    config: EngineConfig,
    *,
    inputs: list[str],
    outputs: list[str],
    handshake_address: str | None,
    headless: bool,
    handshake_timeout_s: float,
    rejoin_timeout_s: float,
    exit_with_parent: bool,
    lifeline_fd: int | None,
    curve: CurveClient | None,
) -> int:
    engine = EngineCoreProc(config, ctx, curve=curve)
    gone: list[str] = []
    # A headless engine outlives its frontend: it joins the next one to bind the
    # handshake address (a fresh core each time), or exits after rejoin_timeout_s.
    watches_frontend = headless and handshake_address is not None
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            def client_gone(how: str) -> None:
                """Stop now: nobody is left to drain for or to deliver anything to."""
                if not gone:
                    gone.append(how)
                    logger.warning("%s (%s): stopping now, without draining", CLIENT_GONE, how)
                    engine.abandon()
                    nursery.cancel_scope.cancel()

            # First, so that a client that is already gone stops everything else.
            if lifeline_fd is not None:
                nursery.start_soon(_watch_lifeline, lifeline_fd, client_gone)

            async def watch_signals() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if engine.draining:
                        logger.warning("second %s: stopping now", name)
                        nursery.cancel_scope.cancel()
                        return
                    if not engine.serving:
                        # Still starting (a handshake, the coordinator's READY): there
                        # is nothing to drain.
                        logger.info("%s during startup: stopping", name)
                        nursery.cancel_scope.cancel()
                        return
                    logger.info("%s: draining", name)
                    engine.begin_drain()

            nursery.start_soon(watch_signals)
            if exit_with_parent:
                nursery.start_soon(exit_when_orphaned, client_gone)
            if handshake_address is None:
                await engine.run(addresses_for(inputs, outputs))
                nursery.cancel_scope.cancel()
                return EXIT_CLIENT_GONE if gone else EXIT_OK
            timeout_s = handshake_timeout_s
            while True:
                try:
                    handshake_socket, addresses = await engine_handshake(
                        ctx,
                        config,
                        handshake_address,
                        headless=headless,
                        timeout_s=timeout_s,
                        curve=curve,
                    )
                except EngineStartupError as exc:
                    if not engine.frontend_left:
                        raise
                    logger.warning(
                        "no frontend answered at %s within %g s after the last one left "
                        "(%s): exiting",
                        handshake_address,
                        timeout_s,
                        exc,
                    )
                    gone.append("no frontend rejoined")
                    break
                if engine.frontend_left:
                    engine = EngineCoreProc(config, ctx, curve=curve)
                await engine.run(
                    addresses,
                    handshake_socket=handshake_socket,
                    headless=headless,
                    until_frontend_leaves=watches_frontend,
                )
                if not engine.frontend_left or engine.draining:
                    break  # drained, or told to stop as the frontend left: not rejoining
                if rejoin_timeout_s <= 0:
                    gone.append("the frontend left")
                    break
                logger.warning(
                    "waiting up to %g s for a frontend at %s to join",
                    rejoin_timeout_s,
                    handshake_address,
                )
                timeout_s = rejoin_timeout_s
            nursery.cancel_scope.cancel()
    return EXIT_CLIENT_GONE if gone else EXIT_OK


async def _watch_lifeline(fd: int, client_gone: Callable[[str], None]) -> None:
    """Call ``client_gone`` once the lifeline pipe reads end-of-file."""
    while not lifeline_closed(fd):
        await trio.lowlevel.wait_readable(fd)
    client_gone("its lifeline pipe closed")


def serve(
    config: EngineConfig,
    *,
    inputs: list[str],
    outputs: list[str],
    handshake_address: str | None = None,
    headless: bool = False,
    handshake_timeout_s: float = 300.0,
    rejoin_timeout_s: float = 300.0,
    exit_with_parent: bool = False,
    lifeline_fd: int | None = None,
    curve: CurveClient | None = None,
) -> int:
    """Run an engine until it is drained; return the process exit code.

    An address ZeroMQ refuses (malformed, unknown transport, an interface this host
    does not have) is reported in one line on stderr, with exit code 2. With
    ``lifeline_fd`` (the read end of the launching client's lifeline pipe), the engine
    stops at once with exit code 4 when the pipe reads end-of-file, checked first of
    all, before the handshake; so does ``exit_with_parent`` when the parent exits.

    A ``headless`` engine whose frontend's connection closes (the frontend exited, was
    killed, or its host went away) drops that frontend's requests and goes back to the
    handshake: it joins the next frontend that binds ``handshake_address``, waiting up
    to ``rejoin_timeout_s`` for one, then exits with code 4 (0: exit when the frontend
    leaves).
    """
    if lifeline_fd is not None:
        # The client may have had the kernel send SIGIO when the pipe closes, which
        # ends an engine still importing; from here on, the pipe is watched instead.
        signal.signal(signal.SIGIO, signal.SIG_IGN)
        if lifeline_closed(lifeline_fd):
            logger.warning("%s (its lifeline pipe is closed): not starting", CLIENT_GONE)
            return EXIT_CLIENT_GONE
    ctx: zmq.Context[Any] = zmq.Context()
    exit_code = EXIT_OK
    try:
        exit_code = trio.run(
            lambda: _serve(
                ctx,
                config,
                inputs=inputs,
                outputs=outputs,
                handshake_address=handshake_address,
                headless=headless,
                handshake_timeout_s=handshake_timeout_s,
                rejoin_timeout_s=rejoin_timeout_s,
                exit_with_parent=exit_with_parent,
                lifeline_fd=lifeline_fd,
                curve=curve,
            )
        )
    except* FatalEngineError as group:
        logger.critical("engine died: %s", first_leaf(group))
        exit_code = EXIT_FATAL
    except* AddressError as group:
        report_address_error("serve", first_leaf(group))
        exit_code = EXIT_ADDRESS
    except* EngineStartupError as group:
        logger.critical("engine startup failed: %s", first_leaf(group))
        exit_code = EXIT_STARTUP
    except* Exception as group:
        logger.critical("engine crashed", exc_info=group)
        exit_code = EXIT_FATAL
    finally:
        if exit_code == EXIT_CLIENT_GONE:
            # Nobody is left to deliver queued outputs to: do not wait for them (the
            # sockets were closed with linger 0; this drops any other one's queue).
            ctx.destroy(linger=0)
        else:
            # Outside Trio now, so waiting for queued outputs (the sockets' linger) is
            # fine.
            ctx.term()
    if exit_code == EXIT_OK:
        logger.info("engine drained, exiting")
    elif exit_code == EXIT_CLIENT_GONE:
        logger.warning("engine stopped: %s (exit code %d)", CLIENT_GONE, EXIT_CLIENT_GONE)
    return exit_code

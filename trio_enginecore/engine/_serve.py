"""``trio-enginecore serve``: run one reference engine as a program.

This is an application entry point, so unlike the library it may own the process's
signals: SIGTERM and SIGINT start a graceful drain, a second one stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, cast

import trio
import zmq

from .._curve import CurveClient, CurveServer
from ..config import EngineConfig
from ..errors import AddressError, EngineStartupError
from ._coordinator import CoordinatorAddresses
from ._core import FatalEngineError
from ._proc import EngineCoreProc, addresses_for, engine_handshake

__all__ = ["serve"]

logger = logging.getLogger("trio_enginecore.engine")

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_ADDRESS = 2
"""An address given on the command line could not be bound or connected to."""
EXIT_STARTUP = 3


async def _serve(
    ctx: zmq.Context[Any],
    config: EngineConfig,
    *,
    inputs: list[str],
    outputs: list[str],
    handshake_address: str | None,
    headless: bool,
    handshake_timeout_s: float,
    exit_with_parent: bool,
    curve: CurveClient | None,
) -> None:
    engine = EngineCoreProc(config, ctx, curve=curve)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

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
                nursery.start_soon(_exit_when_orphaned, nursery.cancel_scope)
            handshake_socket = None
            if handshake_address is not None:
                handshake_socket, addresses = await engine_handshake(
                    ctx,
                    config,
                    handshake_address,
                    headless=headless,
                    timeout_s=handshake_timeout_s,
                    curve=curve,
                )
            else:
                addresses = addresses_for(inputs, outputs)
            await engine.run(addresses, handshake_socket=handshake_socket, headless=headless)
            nursery.cancel_scope.cancel()


PARENT_POLL_INTERVAL_S = 0.5


async def _exit_when_orphaned(scope: trio.CancelScope) -> None:
    """Stop the engine once the process that launched it is gone.

    A client killed with SIGKILL cannot stop its engines; without this they would run
    on as orphans (the kernel reparents them, which changes ``getppid()``).
    """
    parent = os.getppid()
    while os.getppid() == parent:  # noqa: ASYNC110 - no event exists for this
        await trio.sleep(PARENT_POLL_INTERVAL_S)
    logger.warning("the launching process (pid %d) is gone: stopping", parent)
    scope.cancel()


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    return _leaves(group)[0]


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        nested = cast("BaseExceptionGroup[BaseException]", error)
        return [leaf for sub in nested.exceptions for leaf in _leaves(sub)]
    return [error]


def serve(
    config: EngineConfig,
    *,
    inputs: list[str],
    outputs: list[str],
    handshake_address: str | None = None,
    headless: bool = False,
    handshake_timeout_s: float = 300.0,
    exit_with_parent: bool = False,
    curve: CurveClient | None = None,
) -> int:
    """Run an engine until it is drained; return the process exit code.

    An address ZeroMQ refuses (malformed, unknown transport, an interface this host
    does not have) is reported in one line on stderr, with exit code 2.
    """
    ctx: zmq.Context[Any] = zmq.Context()
    exit_code = EXIT_OK
    try:
        trio.run(
            lambda: _serve(
                ctx,
                config,
                inputs=inputs,
                outputs=outputs,
                handshake_address=handshake_address,
                headless=headless,
                handshake_timeout_s=handshake_timeout_s,
                exit_with_parent=exit_with_parent,
                curve=curve,
            )
        )
    except* FatalEngineError as group:
        logger.critical("engine died: %s", _first_leaf(group))
        exit_code = EXIT_FATAL
    except* AddressError as group:
        _report_address_error("serve", _first_leaf(group))
        exit_code = EXIT_ADDRESS
    except* EngineStartupError as group:
        logger.critical("engine startup failed: %s", _first_leaf(group))
        exit_code = EXIT_STARTUP
    except* Exception as group:
        logger.critical("engine crashed", exc_info=group)
        exit_code = EXIT_FATAL
    finally:
        # Outside Trio now, so waiting for queued outputs (the sockets' linger) is fine.
        ctx.term()
    if exit_code == EXIT_OK:
        logger.info("engine drained, exiting")
    return exit_code


def serve_coordinator(
    *,
    engines: int,
    addresses: CoordinatorAddresses,
    min_interval_s: float,
    exit_with_parent: bool,
    curve: CurveServer | None = None,
) -> int:
    """Run the data-parallel coordinator until SIGTERM/SIGINT; return the exit code.

    0 once stopped; 2, after one line on stderr, when an address cannot be bound (in
    use, malformed, an interface this host does not have).
    """
    from ..client._coordination import open_coordinator

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with open_coordinator(
                engines, addresses=addresses, min_interval_s=min_interval_s, curve=curve
            ) as bound:
                logger.info(
                    "coordinator of %d engine(s): stats %s, engines %s, clients %s",
                    engines,
                    bound.stats,
                    bound.engine_publish,
                    bound.publish,
                )
                async with trio.open_nursery() as nursery:
                    if exit_with_parent:
                        nursery.start_soon(_exit_when_orphaned, nursery.cancel_scope)
                    async for _ in signals:
                        nursery.cancel_scope.cancel()

    exit_code = EXIT_OK
    try:
        trio.run(main)
    except* AddressError as group:
        _report_address_error("coordinator", _first_leaf(group))
        exit_code = EXIT_ADDRESS
    except* zmq.ZMQError as group:
        logger.critical("coordinator startup failed: %s", _first_leaf(group))
        exit_code = EXIT_STARTUP
    return exit_code


def _report_address_error(command: str, error: BaseException) -> None:
    """The one line a command prints for an address it cannot use."""
    sys.stderr.write(f"trio-enginecore {command}: {error}\n")
    sys.stderr.flush()

"""``trio-enginecore coordinator``: run the data-parallel coordinator as a program.

This is an application entry point, so unlike the library it may own the process's
signals: SIGTERM and SIGINT stop the coordinator.
"""

from __future__ import annotations

import logging
import signal

import trio
import zmq

from .._curve import CurveServer
from .._program import (
    EXIT_ADDRESS,
    EXIT_OK,
    EXIT_STARTUP,
    exit_when_orphaned,
    first_leaf,
    report_address_error,
)
from ..errors import AddressError
from ._addresses import CoordinatorAddresses
from ._open import open_coordinator

__all__ = ["coordinator_command"]

logger = logging.getLogger("trio_enginecore.coordinator")


def coordinator_command(
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

                    def parent_gone(how: str) -> None:
                        logger.warning("%s: stopping", how)
                        nursery.cancel_scope.cancel()

                    if exit_with_parent:
                        nursery.start_soon(exit_when_orphaned, parent_gone)
                    async for _ in signals:
                        nursery.cancel_scope.cancel()

    exit_code = EXIT_OK
    try:
        trio.run(main)
    except* AddressError as group:
        report_address_error("coordinator", first_leaf(group))
        exit_code = EXIT_ADDRESS
    except* zmq.ZMQError as group:
        logger.critical("coordinator startup failed: %s", first_leaf(group))
        exit_code = EXIT_STARTUP
    return exit_code

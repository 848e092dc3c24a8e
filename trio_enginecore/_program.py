"""What the programs of the ``trio-enginecore`` command share: exit codes, the watch
for an exited parent, the one line printed for an address that cannot be used."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Final

import trio

from ._groups import leaves

__all__ = [
    "EXIT_ADDRESS",
    "EXIT_FATAL",
    "EXIT_OK",
    "EXIT_STARTUP",
    "PARENT_POLL_INTERVAL_S",
    "exit_when_orphaned",
    "first_leaf",
    "report_address_error",
]

EXIT_OK: Final = 0
EXIT_FATAL: Final = 1
EXIT_ADDRESS: Final = 2
"""An address given on the command line could not be bound or connected to."""
EXIT_STARTUP: Final = 3

PARENT_POLL_INTERVAL_S: Final = 0.5


async def exit_when_orphaned(parent_gone: Callable[[str], None]) -> None:
    """Call ``parent_gone`` once the process that launched this one is gone
    (``--exit-with-parent``).

    A client killed with SIGKILL cannot stop its engines; without this they would run
    on as orphans (the kernel reparents them, which changes ``getppid()``). A parent
    that was already gone when this started is not noticed: the lifeline pipe has no
    such gap.
    """
    parent = os.getppid()
    while os.getppid() == parent:  # noqa: ASYNC110 - no event exists for this
        await trio.sleep(PARENT_POLL_INTERVAL_S)
    parent_gone(f"the launching process, pid {parent}, exited")


def first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception of ``group`` that is no group itself."""
    return leaves(group)[0]


def report_address_error(command: str, error: BaseException) -> None:
    """The one line a command prints for an address it cannot use."""
    sys.stderr.write(f"trio-enginecore {command}: {error}\n")
    sys.stderr.flush()

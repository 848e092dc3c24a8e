"""Logging: silent by default, one relayed line per engine line, every step at DEBUG.

* The package logger has a ``NullHandler``: an application that configures no logging
  sees nothing from the library.
* A launched engine's log lines reach ``trio_enginecore.engine.rank<N>`` once each, at
  their own level, with no second timestamp.
* At DEBUG the client logs each step of an engine's life with its rank: bind, launch,
  handshake, ready, abort, shutdown.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys

import pytest
import trio

from trio_enginecore import EngineConfig, EngineCoreRequest, EngineDeadError, open_engine_client
from trio_enginecore.client import Restart
from trio_enginecore.client._multiprocess._launch import engine_log_level, parse_relayed_line

TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d")


def test_the_package_logger_has_a_null_handler_and_prints_nothing_by_default() -> None:
    handlers = logging.getLogger("trio_enginecore").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)
    # A program that configures no logging, whose engine logs an error: stderr stays
    # empty (before, Python's last-resort handler printed the engine's lines).
    program = (
        "import trio\n"
        "from trio_enginecore import *\n"
        "async def main():\n"
        "    config = EngineConfig(enable_fault_injection=True, step_time_s=0.002)\n"
        "    request = EngineCoreRequest.for_tokens([1], max_tokens=100_000)\n"
        "    try:\n"
        "        async with open_engine_client(config) as c, c.stream(request) as s:\n"
        "            await s.receive()\n"
        "            await c.call_utility('inject_fault')\n"
        "            async for _ in s: pass\n"
        "    except EngineDeadError as exc:\n"
        "        print('dead:', 'ENGINE_CORE_DEAD' in str(exc))\n"
        "trio.run(main)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "dead: True"
    assert done.stderr == ""


@pytest.mark.parametrize(
    ("line", "previous", "expected"),
    [
        ("INFO engine drained, exiting", None, (logging.INFO, "engine drained, exiting")),
        ("ERROR fatal: boom", logging.INFO, (logging.ERROR, "fatal: boom")),
        ("DEBUG x", None, (logging.DEBUG, "x")),
        ("CRITICAL y", None, (logging.CRITICAL, "y")),
        # A traceback continues the record before it, at its level.
        (
            '  File "x.py", line 3, in f',
            logging.ERROR,
            (logging.ERROR, '  File "x.py", line 3, in f'),
        ),
        # Something written outside logging, before any record: a warning.
        (
            "Fatal Python error: Segmentation fault",
            None,
            (logging.WARNING, "Fatal Python error: Segmentation fault"),
        ),
        ("information about", None, (logging.WARNING, "information about")),
    ],
)
def test_relayed_lines_keep_their_level(
    line: str, previous: int | None, expected: tuple[int, str]
) -> None:
    assert parse_relayed_line(line, previous) == expected


def test_a_launched_engine_logs_at_the_level_its_relay_logger_shows() -> None:
    relay = logging.getLogger("trio_enginecore.engine.rank7")
    try:
        for level, expected in [
            (logging.DEBUG, "DEBUG"),
            (logging.INFO, "INFO"),
            (logging.WARNING, "WARNING"),
            (logging.ERROR, "ERROR"),
            (logging.CRITICAL, "ERROR"),
            (15, "INFO"),
        ]:
            relay.setLevel(level)
            assert engine_log_level(7) == expected
    finally:
        relay.setLevel(logging.NOTSET)


async def test_at_debug_every_lifecycle_step_is_logged_and_engine_lines_come_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_enginecore")
    with trio.fail_after(30):
        async with open_engine_client(EngineConfig(step_time_s=0.01)) as client:
            with trio.move_on_after(0.2):
                request = EngineCoreRequest.for_tokens([1], max_tokens=10_000)
                async with client.stream(request) as outputs:
                    async for _ in outputs:
                        pass
    client_lines = [r.getMessage() for r in caplog.records if r.name == "trio_enginecore.client"]
    steps = [
        r"bound the input ROUTER at ipc://.* and the output PULL at ipc://",
        r"bound the handshake ROUTER at ipc://",
        r"started engine rank 0, pid \d+: .* serve .*--log-level DEBUG --log-format relay",
        r"handshake: engine rank 0 said HELLO",
        r"engine rank 0, pid \d+ is ready",
        r"handshake: engine rank 0 reported READY",
        r"engine rank 0: ABORT 1 request\(s\)",
        r"shutdown: sending SIGTERM to engine rank 0, pid \d+",
        r"shutdown: engine rank 0, pid \d+; exited with code 0",
        r"client closed",
    ]
    for step in steps:
        assert any(re.search(step, line) for line in client_lines), (step, client_lines)
    engine = [r for r in caplog.records if r.name == "trio_enginecore.engine.rank0"]
    messages = [r.getMessage() for r in engine]
    assert "engine drained, exiting" in messages
    # The engine was launched at DEBUG too: its own steps come at their level.
    engine_debug = [r.getMessage() for r in engine if r.levelno == logging.DEBUG]
    for step in ["handshake: sent HELLO to ipc://", "handshake: sent READY", "ABORT of 1"]:
        assert any(m.startswith(step) for m in engine_debug), (step, engine_debug)
    assert all(r.levelno == logging.INFO for r in engine if "drain" in r.getMessage())
    assert not any(TIMESTAMP.search(m) or m.startswith(("INFO", "DEBUG")) for m in messages)
    assert len(messages) == len(set(messages)), "an engine line was relayed twice"


async def test_an_engine_failure_is_relayed_once_at_its_own_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    config = EngineConfig(enable_fault_injection=True, step_time_s=0.002)
    with trio.fail_after(30), pytest.raises(EngineDeadError, match="ENGINE_CORE_DEAD"):
        async with (
            open_engine_client(config) as client,
            client.stream(EngineCoreRequest.for_tokens([1], max_tokens=100_000)) as outputs,
        ):
            await outputs.receive()
            await client.call_utility("inject_fault")
            async for _ in outputs:
                pass
    relayed = [
        r
        for r in caplog.records
        if r.name == "trio_enginecore.engine.rank0" and "fault injected" in r.getMessage()
    ]
    assert len(relayed) == 1, [r.getMessage() for r in relayed]
    assert relayed[0].levelno == logging.CRITICAL  # the engine logs it so
    assert not TIMESTAMP.search(relayed[0].getMessage())


async def test_an_engine_restart_is_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """A killed engine under ``on_engine_failure="restart"``: its death, its restart
    (one line, with the back-off and the engines in service meanwhile) and its return,
    each logged once; before, the restart was announced twice."""
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    with trio.fail_after(60):
        async with open_engine_client(
            EngineConfig(step_time_s=0.01), on_engine_failure=Restart(backoff_s=0.3)
        ) as client:
            (first,) = client.engine_pids
            assert first is not None
            os.kill(first, signal.SIGKILL)
            while client.statistics().engines[0].restarts < 1:
                await trio.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "trio_enginecore.client"]
    restarting = [line for line in lines if "restart" in line and "back in service" not in line]
    assert restarting == [
        f"restarting engine rank 0, pid {first} in 0.3 s; engine(s) [] in service"
    ], lines
    assert sum("died" in line for line in lines) == 1, lines
    assert sum("back in service (restart 1)" in line for line in lines) == 1, lines

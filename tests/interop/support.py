"""Running vLLM's side of an interop test: its processes, their logs, their reports.

The vLLM side (vLLM's clients, its engine launchers, the counter executor) runs in the
vLLM environment that ``nox -s interop`` builds, one per vLLM release, as subprocesses
of the test; the test itself and our client and engine run in the project's
environment. The two sides talk over ZeroMQ only, as real deployments do.

Which release is under test: ``TRIO_ENGINECORE_VLLM_RELEASE`` ("0.33", "0.34"), else
the version of the vLLM installed in ``TRIO_ENGINECORE_VLLM_PYTHON``'s environment;
tests that check something release-specific ask :func:`vllm_release` or
:func:`at_least`. ``TRIO_ENGINECORE_VLLM_PYTHONS`` (a JSON object, release -> Python)
names every release's environment that is built, for a test that needs two at once.

vLLM-side scripts print their reports on stdout as lines starting with ``@`` followed
by a JSON object, and log on stderr (``VLLM_LOGGING_STREAM``), which is kept in a file
so that a test can quote it when it fails and check it for ERROR lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

import pytest

VLLM_PYTHON_VARIABLE = "TRIO_ENGINECORE_VLLM_PYTHON"
VLLM_RELEASE_VARIABLE = "TRIO_ENGINECORE_VLLM_RELEASE"
VLLM_PYTHONS_VARIABLE = "TRIO_ENGINECORE_VLLM_PYTHONS"
VLLM_SIDE = Path(__file__).parent / "vllm_side"

_ERROR_LINE = re.compile(r"^(\(.*?\) )?ERROR ", re.MULTILINE)
_WARNING_LINE = re.compile(r"^(\(.*?\) )?WARNING ")
_ABOUT_THE_CONNECTION = re.compile(
    r"heartbeat|\bping|\bpong|disconnect|connection|liveness|timed? ?out|unresponsive|hung",
    re.IGNORECASE,
)


def vllm_python() -> Path | None:
    """The vLLM environment's Python, from ``TRIO_ENGINECORE_VLLM_PYTHON``."""
    value = os.environ.get(VLLM_PYTHON_VARIABLE)
    return Path(value) if value else None


def installed_vllm_version(python: Path) -> str:
    """The version of the vLLM installed in ``python``'s environment ("0.34.0"), read
    from its distribution metadata (vLLM is not imported: that takes seconds)."""
    found = sorted(python.parent.parent.glob("lib/python*/site-packages/vllm-*.dist-info"))
    if not found:
        raise AssertionError(f"no vLLM installed in the environment of {python}")
    return found[-1].name.removeprefix("vllm-").removesuffix(".dist-info")


def vllm_release() -> str:
    """The vLLM release under test, as major.minor ("0.33", "0.34")."""
    release = os.environ.get(VLLM_RELEASE_VARIABLE)
    if release:
        return release
    python = vllm_python()
    assert python is not None, f"{VLLM_PYTHON_VARIABLE} is not set"
    return ".".join(installed_vllm_version(python).split(".")[:2])


def vllm_version() -> str:
    """The version of the vLLM under test ("0.34.0"): what its engines report."""
    python = vllm_python()
    assert python is not None, f"{VLLM_PYTHON_VARIABLE} is not set"
    return installed_vllm_version(python)


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def at_least(release: str) -> bool:
    """Whether the release under test is ``release`` ("0.34") or newer."""
    return _release_key(vllm_release()) >= _release_key(release)


NEWEST_RELEASE = "0.34"
"""The newest release the suite tests: its session runs every test."""


def newest_release_only(why: str) -> None:
    """Skip the calling test module unless the release under test is the newest.

    For what does not depend on the engine's release: our frontend held to vLLM's
    newest frontend (text, chat templates, metrics, HTTP), and our own startup rules.
    The older releases' sessions run what their engines and clients meet: the wire both
    ways, liveness, launching, data parallelism. Keeps each session within its time.
    """
    if vllm_release() != NEWEST_RELEASE:
        pytest.skip(f"vLLM {NEWEST_RELEASE}'s session only: {why}", allow_module_level=True)


def on_the_newest_release() -> bool:
    """Whether the release under test is the newest (see :func:`newest_release_only`)."""
    return vllm_release() == NEWEST_RELEASE


def vllm_pythons() -> dict[str, Path]:
    """The Python of every release whose environment is built (this one's included)."""
    pythons = {
        release: Path(path)
        for release, path in json.loads(os.environ.get(VLLM_PYTHONS_VARIABLE) or "{}").items()
    }
    python = vllm_python()
    if python is not None:
        pythons.setdefault(vllm_release(), python)
    return pythons


def require_vllm() -> None:
    """Skip the calling test module unless a vLLM environment is given."""
    if vllm_python() is None:
        pytest.skip(
            f"{VLLM_PYTHON_VARIABLE} is not set: the vLLM interop tests run in "
            "`nox -s interop`, which builds the vLLM environment",
            allow_module_level=True,
        )


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment of a vLLM-side process: this one's, less this venv, plus vLLM's
    CPU platform and logging on stderr without colours."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_STREAM="ext://sys.stderr",
        VLLM_LOGGING_COLOR="0",
        NO_COLOR="1",
        # vLLM's engine answers a utility in the busy loop; never wait minutes for a
        # ready message in a test.
        VLLM_ENGINE_READY_TIMEOUT_S="120",
        # Telemetry and hub look-ups off: there is no network.
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.update(extra)
    return env


def project_command(*args: str) -> list[str]:
    """``trio-enginecore ARGS`` in the project's environment (this interpreter)."""
    return [sys.executable, "-m", "trio_enginecore", *args]


def error_lines(log: str) -> list[str]:
    """The lines of a vLLM log at ERROR level (vLLM's format: ``(proc pid=N) ERROR ...``)."""
    return [line for line in log.splitlines() if _ERROR_LINE.match(line)]


def trouble_lines(log: str) -> list[str]:
    """What must not be in the log of a run where nothing went wrong: ERROR lines,
    tracebacks, and warnings about the connection to the client (its heartbeats, pings,
    a disconnect, a timeout)."""
    return [
        line
        for line in log.splitlines()
        if _ERROR_LINE.match(line)
        or "Traceback (most recent call last)" in line
        or (_WARNING_LINE.match(line) and _ABOUT_THE_CONNECTION.search(line))
    ]


def reports(stdout: str) -> list[dict[str, Any]]:
    """The ``@{json}`` report lines of a vLLM-side script's output."""
    return [json.loads(line[1:]) for line in stdout.splitlines() if line.startswith("@{")]


class VllmProcess:
    """A vLLM-side script running in the vLLM environment.

    Its stdout is read line by line for reports; its stderr goes to ``log_path``.
    """

    def __init__(
        self,
        script: str,
        args: Sequence[str],
        log_path: Path,
        *,
        python: Path | None = None,
        **env: str,
    ) -> None:
        """``python``: another release's environment (default: the one under test)."""
        python = python or vllm_python()
        assert python is not None, f"{VLLM_PYTHON_VARIABLE} is not set"
        self.log_path = log_path
        self._log: IO[str] = log_path.open("w")
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            [str(python), str(VLLM_SIDE / script), *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=vllm_env(**env),
            start_new_session=True,  # its engine processes too can be signalled at once
        )
        self.reports: list[dict[str, Any]] = []

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def next_report(self, timeout_s: float) -> dict[str, Any]:
        """The next report line (blocking; run it in a thread from async code)."""
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(
                    f"{self.describe()} exited (code {self.process.wait()}) before "
                    f"reporting; its log ends:\n{self.log_tail()}"
                )
            if line.startswith("@{"):
                report: dict[str, Any] = json.loads(line[1:])
                self.reports.append(report)
                if report.get("event") == "error":
                    raise AssertionError(f"{self.describe()} failed: {report['message']}")
                return report
        raise AssertionError(f"{self.describe()}: no report within {timeout_s} s")

    def describe(self) -> str:
        return f"vLLM-side {Path(self.process.args[1]).name} (pid {self.pid})"

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (its own handler stops its engines), then SIGKILL to its group."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        # Whatever is left of its process group (engine processes) goes too.
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        code = self.process.wait()
        if self.process.stdout is not None:
            rest = self.process.stdout.read()
            self.reports.extend(reports(rest))
            self.process.stdout.close()
        self._log.close()
        return code


@contextmanager
def vllm_process(
    script: str, args: Sequence[str], log_path: Path, *, python: Path | None = None, **env: str
) -> Iterator[VllmProcess]:
    """Run a vLLM-side script for the duration of the block; always stopped and reaped."""
    process = VllmProcess(script, args, log_path, python=python, **env)
    try:
        yield process
    finally:
        process.stop()


def run_to_the_end(script: str, args: Sequence[str], log_path: Path, timeout_s: float) -> Any:
    """Run a vLLM-side script that works through its inputs and reports once: its
    report, which must say ``done``, with no ERROR line in its log."""
    process = VllmProcess(script, args, log_path)
    try:
        report = process.next_report(timeout_s)
    finally:
        process.stop()
    assert report["event"] == "done", report
    assert error_lines(process.log()) == []
    return report

"""The interop tests run only where a vLLM environment is given.

``nox -s interop`` builds a CPU-only environment for each vLLM release (0.33.0, 0.34.0)
and runs these tests once per release, naming that environment's Python in
``TRIO_ENGINECORE_VLLM_PYTHON`` and the release in ``TRIO_ENGINECORE_VLLM_RELEASE``.
Without them (a plain ``pytest`` or ``nox -s tests``) every test here is skipped, with
that reason. The vLLM side never runs in this process:
it runs in that environment's processes and talks to ours over ZeroMQ only. Each test
module calls ``support.require_vllm()``, which skips the whole module otherwise.
"""

from __future__ import annotations

import pytest

_TIMINGS: dict[str, float] = {}


@pytest.fixture
def timings() -> dict[str, float]:
    """Where a test records what it measured (seconds); printed at the end of the run."""
    return _TIMINGS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _TIMINGS:
        return
    terminalreporter.section("vLLM interop timings")
    for name, seconds in sorted(_TIMINGS.items()):
        terminalreporter.write_line(f"{name:<55} {seconds:8.3f} s")

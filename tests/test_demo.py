"""The README's first command: ``trio-enginecore demo`` runs the whole stack."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_the_whole_stack_and_exits_cleanly() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trio_enginecore", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Engine ready" in out
    for i in (1, 2, 3):
        assert f"[{i}] (seed {i})" in out
    assert "finish_reason='stop', stop_reason='.'" in out
    assert "[0] 'The river" in out
    assert "[1] 'The river" in out
    assert "the engine now has 0 waiting and 0 running requests" in out
    assert "is_sleeping() -> True" in out
    assert "0 requests in flight" in out
    assert out.rstrip().endswith("Done.")

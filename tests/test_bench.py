"""The benchmark harness keeps working (its figures are never asserted: machines differ).

Runs the comparison's ``--quick`` mode and ``trio-enginecore bench --quick`` on tiny
sizes and checks the shape of what they produce.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(240)


def test_the_quick_comparison_writes_json_and_markdown(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["quick"] is True
    workloads = {row["workload"] for row in data["medians"]}
    assert workloads == {"generate", "recv", "utility", "abort", "idle_streams", "array"}
    clients = {row["client"] for row in data["medians"] if row["workload"] == "generate"}
    assert clients == {"trio-batch", "trio-stream", "asyncio", "blocking"}
    for row in data["medians"]:
        if row["workload"] == "generate":
            assert row["output_tokens"] > 0
            assert row["cpu_us_per_token"] > 0
    report = (tmp_path / "results.md").read_text()
    assert "CPU/token ÷ asyncio" in report
    assert "## Receive path" in report
    assert "## Utility call round trip" in report


def test_trio_enginecore_bench_quick_prints_a_summary_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trio_enginecore", "bench", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    header, *lines = result.stdout.splitlines()
    assert header.split()[:4] == ["workload", "mode", "C", "tokens/s"]
    generate = [line for line in lines if line.startswith("generate")]
    assert len(generate) == 4  # batch and stream, at C = 1 and 16
    assert any(line.startswith("utility") for line in lines)
    rows = json.loads(result.stdout[result.stdout.index("[") :])
    assert all(row["output_tokens"] > 0 for row in rows if row["workload"] == "generate")

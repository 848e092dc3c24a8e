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


def _bench_quick(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "trio_enginecore", "bench", "--quick", *args],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def _table_rows(text: str) -> list[str]:
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("workload"))
    assert lines[header].split()[:4] == ["workload", "mode", "C", "tokens/s"]
    return lines[header + 1 :]


def test_trio_enginecore_bench_quick_prints_a_summary_table() -> None:
    result = _bench_quick()
    lines = _table_rows(result.stdout)
    generate = [line for line in lines if line.startswith("generate")]
    assert len(generate) == 4  # batch and stream, at C = 1 and 16
    assert any(line.startswith("utility") for line in lines)


def test_bench_json_prints_only_json_on_stdout_and_the_table_on_stderr() -> None:
    result = _bench_quick("--mode", "batch", "--json")
    rows = json.loads(result.stdout)  # the whole of stdout
    assert [row["concurrency"] for row in rows if row["workload"] == "generate"] == [1, 16]
    assert all(row["output_tokens"] > 0 for row in rows if row["workload"] == "generate")
    assert any(line.startswith("generate") for line in _table_rows(result.stderr))
    # stderr is not a terminal here: progress comes as plain lines, never redrawn.
    assert "\r" not in result.stderr

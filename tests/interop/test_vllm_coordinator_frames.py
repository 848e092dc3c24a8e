"""The golden coordinator frames are still what vLLM's coordinator sends.

``vllm_side/record_coordinator.py`` drives the real ``DPCoordinatorProc`` of the vLLM
release under test and records its frames; they must equal
``tests/data/vllm-0.33.0-coordinator/frames.json``, which the main suite checks our
coordinator and client against: recorded from 0.33, and 0.34's coordinator sends the
same frames.
"""

from __future__ import annotations

import json
from pathlib import Path

from .support import VllmProcess, error_lines, require_vllm, vllm_version

require_vllm()

STORED = Path(__file__).parents[1] / "data" / "vllm-0.33.0-coordinator" / "frames.json"


def test_vllms_coordinator_sends_the_stored_frames(tmp_path: Path) -> None:
    process = VllmProcess("record_coordinator.py", [], tmp_path / "coordinator.log")
    try:
        report = process.next_report(120)
    finally:
        process.stop()
    stored = json.loads(STORED.read_text())
    assert report["vllm_version"] == vllm_version()
    assert stored["vllm_version"] == "0.33.0"
    assert report["cases"] == stored["cases"]
    # vLLM's coordinator accepted the front-end message and logged no error.
    assert "scaled up from 2 to 3 engines" in process.log()
    assert error_lines(process.log()) == []

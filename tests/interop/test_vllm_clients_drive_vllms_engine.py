"""The reference: vLLM's own clients drive vLLM's own engine core, counter executor and all.

``vllm_side/drive_engine.py`` without addresses: vLLM's ``AsyncMPClient`` or
``SyncMPClient`` starts vLLM's engine core itself, as ``AsyncLLM`` and ``LLMEngine``
do, and runs the scenarios that ``test_vllm_clients_drive_our_engine.py`` runs against
our engine. Nothing of ours is involved, so this proves the harness (the counter
executor, the Triton answer that reaches vLLM 0.34's spawned engine, the driver) on
each release, and that the utility tables our engine is held to are vLLM's answers.
For vLLM 0.34's checkpoint cycle the engine is told that sleep mode is on
(``--sleep-mode``): vLLM refuses to prepare a checkpoint without it, and refuses sleep
mode on a CPU when it builds the config.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from ..support import expected
from .support import VllmProcess, at_least, require_vllm
from .test_vllm_clients_drive_our_engine import LENGTH, STOP, UTILITIES, UTILITIES_034

require_vllm()

SCENARIOS = ("exact", "long", "stop", "utilities", *(["utilities_034"] if at_least("0.34") else []))
only_034 = pytest.mark.skipif(not at_least("0.34"), reason="a vLLM 0.34 utility")
_FAILED_CALL = re.compile(r"Invocation of (\w+) method failed")


@dataclass
class ReferenceRun:
    client: str
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    log: str = ""


@pytest.fixture(scope="module", params=["async", "sync"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ReferenceRun:
    client: str = request.param
    tmp = tmp_path_factory.mktemp(f"reference-{client}")
    result = ReferenceRun(client)
    sleep_mode = ["--sleep-mode"] if at_least("0.34") else []
    driver = VllmProcess(
        "drive_engine.py", ["--client", client, *sleep_mode, *SCENARIOS], tmp / "driver.log"
    )
    try:
        deadline = time.monotonic() + 180
        while set(SCENARIOS) - result.reports.keys():
            report = driver.next_report(deadline - time.monotonic())
            if "scenario" in report:
                result.reports[report["scenario"]] = report
    finally:
        driver.stop()
        result.log = driver.log()
    return result


def _report(run: ReferenceRun, scenario: str) -> dict[str, Any]:
    report = run.reports[scenario]
    assert "crashed" not in report, report.get("traceback")
    return report


def test_vllms_engine_becomes_ready(run: ReferenceRun, timings: dict[str, float]) -> None:
    ready = run.reports["ready"]
    # The client starts the engine process (a spawned one) and waits for its READY.
    timings[f"vLLM {run.client} client + vLLM's engine: started -> ready"] = ready["ready_s"]
    assert ready["ready_s"] < 60


def test_exact_tokens_and_stop_tokens(run: ReferenceRun) -> None:
    exact, long, stop = _report(run, "exact"), _report(run, "long"), _report(run, "stop")
    assert exact["done"]
    assert long["done"]
    assert stop["done"]
    for request in exact["requests"]:
        assert request["tokens"] == expected(request["prompt"], request["max_tokens"]), request
        assert request["finish"] == LENGTH, request
    for request in long["requests"]:
        assert request["tokens"] == expected(request["prompt"], 8), request["id"]
        assert request["finish"] == LENGTH, request["id"]
    for request in stop["requests"]:
        prompt, token = request["prompt"], request["stop_token"]
        assert request["tokens"] == expected(prompt, token - prompt[-1]), request
        assert (request["finish"], request["stop_reason"]) == (STOP, token), request


@pytest.mark.parametrize(("utility", "result"), UTILITIES)
def test_utility(run: ReferenceRun, utility: str, result: Any) -> None:
    reply = _report(run, "utilities")[utility]
    if utility == "get_request_counts":  # our engine's utility, not vLLM's
        assert reply["message"].startswith("Call to get_request_counts method failed: ")
    else:
        assert reply == {"result": result}


@only_034
@pytest.mark.parametrize(("utility", "result"), UTILITIES_034)
def test_utility_034(run: ReferenceRun, utility: str, result: Any) -> None:
    assert _report(run, "utilities_034")[utility] == {"result": result}


@only_034
def test_sleep_is_refused_while_prepared_and_the_engine_serves_after(run: ReferenceRun) -> None:
    report = _report(run, "utilities_034")
    assert report["sleep_while_prepared"] == {
        "error": "builtins.Exception",
        "message": "Call to sleep method failed: "
        "Cannot sleep while the checkpoint state is prepared",
    }
    assert report["after"] == {"done": True, "tokens": expected([77], 6), "finish": LENGTH}


def test_only_the_refused_calls_were_logged_as_errors(run: ReferenceRun) -> None:
    assert "Resolved architecture: LlamaForCausalLM" in run.log  # vLLM logs here
    assert "x86 CPUs requires Triton" not in run.log  # 0.34 refused to build a config
    refused = ["get_request_counts", "no_such_method"]
    if at_least("0.34"):
        refused.append("sleep")
    assert _FAILED_CALL.findall(run.log) == refused

"""vLLM's own engine-core clients (of the release under test) drive our engine
(``trio-enginecore serve``).

vLLM's ``AsyncMPClient`` and ``SyncMPClient`` run in the vLLM environment
(``vllm_side/drive_engine.py``) and bind the input ROUTER and output PULL
(``client_addresses``); our engine, in this environment, attaches to them. For each
client one engine and one driver run every scenario in turn (starting vLLM costs tens
of seconds on two cores), the fault last since it kills the engine; each test below
checks one scenario's report. vLLM 0.34's clients send every prompt as an int32 array
and have utilities 0.33's have not (``utilities_034``, skipped under 0.33).

The utility tables below are what vLLM's own engine answers the same calls
(``test_vllm_clients_drive_vllms_engine.py`` checks that, with sleep mode on for the
checkpoint cycle), except where a row says otherwise.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from ..support import expected
from .support import VllmProcess, at_least, error_lines, project_command, require_vllm

require_vllm()

SCENARIOS = (
    "exact",
    "long",
    "stop",
    "abort",
    "utilities",
    *(["utilities_034"] if at_least("0.34") else []),
    "fault",
)
only_034 = pytest.mark.skipif(not at_least("0.34"), reason="a vLLM 0.34 utility")
LENGTH, STOP = 1, 0  # FinishReason values on the wire
ENGINE_DEAD = "vllm.v1.engine.exceptions.EngineDeadError"


@dataclass
class DriveRun:
    client: str
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    driver_log: str = ""
    engine_log: str = ""
    engine_exit: int | None = None


@pytest.fixture(scope="module", params=["async", "sync"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> DriveRun:
    """One engine of ours, driven through every scenario by one vLLM client."""
    client: str = request.param
    tmp = tmp_path_factory.mktemp(f"drive-{client}")
    input_address, output_address = f"ipc://{tmp}/input", f"ipc://{tmp}/output"
    result = DriveRun(client)
    engine_log = tmp / "engine.log"
    with engine_log.open("w") as log:
        engine = subprocess.Popen(
            project_command(
                "serve",
                "--input-address",
                input_address,
                "--output-address",
                output_address,
                "--enable-fault-injection",
                "--step-time-s",
                "0.005",
                "--log-level",
                "WARNING",
                "--exit-with-parent",
            ),
            stderr=log,
        )
        driver = VllmProcess(
            "drive_engine.py",
            [
                "--client",
                client,
                "--input-address",
                input_address,
                "--output-address",
                output_address,
                *SCENARIOS,
            ],
            tmp / "driver.log",
        )
        try:
            deadline = time.monotonic() + 240
            while set(SCENARIOS) - result.reports.keys():
                report = driver.next_report(deadline - time.monotonic())
                if "scenario" in report:
                    result.reports[report["scenario"]] = report
            # The fault was the last scenario: the engine exits with code 1 by itself.
            result.engine_exit = engine.wait(15)
        finally:
            driver.stop()
            if engine.poll() is None:
                engine.kill()
            engine.wait()
            result.driver_log = driver.log()
    result.engine_log = engine_log.read_text()
    return result


def _report(run: DriveRun, scenario: str) -> dict[str, Any]:
    report = run.reports[scenario]
    assert "crashed" not in report, report.get("traceback")
    return report


def test_vllm_client_becomes_ready(run: DriveRun, timings: dict[str, float]) -> None:
    ready = run.reports["ready"]
    # From the client's construction (it binds, then waits for our ready message).
    timings[f"vLLM {run.client} client: constructed -> ready"] = ready["ready_s"]
    assert ready["ready_s"] < 60


def test_concurrent_requests_get_exact_tokens_and_length(run: DriveRun) -> None:
    report = _report(run, "exact")
    assert report["done"]
    assert len(report["requests"]) == 32
    for request in report["requests"]:
        assert request["tokens"] == expected(request["prompt"], request["max_tokens"]), request
        assert request["finish"] == LENGTH, request


def test_long_prompts_get_exact_tokens(run: DriveRun) -> None:
    # 63, 64 and 1000 tokens: 0.34's clients send the last two as frames of their own.
    report = _report(run, "long")
    assert report["done"]
    assert [len(request["prompt"]) for request in report["requests"]] == [63, 64, 1000]
    for request in report["requests"]:
        assert request["tokens"] == expected(request["prompt"], 8), request["id"]
        assert request["finish"] == LENGTH, request["id"]


def test_stop_token_ids_stop_with_the_stop_token(run: DriveRun) -> None:
    report = _report(run, "stop")
    assert report["done"]
    for request in report["requests"]:
        prompt, stop = request["prompt"], request["stop_token"]
        # As vLLM's scheduler does: the stop token is the last token of the output.
        assert request["tokens"] == expected(prompt, stop - prompt[-1]), request
        assert request["finish"] == STOP, request
        assert request["stop_reason"] == stop, request


def test_abort_stops_outputs_and_the_engine_forgets_them(run: DriveRun) -> None:
    report = _report(run, "abort")
    assert report["started"]
    assert report["kept_finished"]
    assert report["kept_tokens"] == expected([7], 200)
    assert report["kept_finish"] == LENGTH
    for rid, total in report["tokens_total"].items():
        assert 0 < total < 1000, rid
        # Client-initiated aborts get no output from the engine (vLLM's rule).
        assert report["aborted_finish"][rid] is None
    # What was already on its way may still arrive, but nothing is produced once the
    # engine has processed the abort: none after the kept request's last output, ~190
    # steps later.
    assert report["last_output_after_abort_s"] < report["kept_finished_after_abort_s"]
    assert report["request_counts"] == [0, 0]


# (what the driver called, the result vLLM's client returns); in the driver's order,
# vLLM's typed client methods where it has them (sleep_async, wake_up_async, ...).
UTILITIES: list[Any] = [
    ("is_sleeping", False),
    ("sleep", None),
    ("is_sleeping_asleep", True),
    ("wake_up", True),
    ("is_sleeping_awake", False),
    ("reset_prefix_cache", True),
    ("get_supported_tasks", ["generate"]),
    ("list_loras_empty", []),
    ("add_lora", True),
    ("list_loras", [1]),
    ("pin_lora", True),
    ("remove_lora", True),
    ("list_loras_removed", []),
    ("execute_dummy_batch", None),
    ("set_weight_version", None),
    ("get_weight_version", "v7"),
    ("profile_start", None),
    ("profile_stop", None),
    ("pause_scheduler", None),
    ("is_scheduler_paused", True),
    ("is_sleeping_paused", True),  # vLLM: paused, or any memory asleep
    ("resume_scheduler", None),
    ("is_scheduler_paused_resumed", False),
    ("get_request_counts", [0, 0]),  # our engine's utility (vLLM's has none)
]

# vLLM 0.34's utilities, in the driver's order (scenario_utilities_034): the typed
# methods send 0.34's arguments (sleep 3, release_kv_cache_memory 1); pause_scheduler
# is sent with its third argument, reset_connector; checkpoint_state's result is a
# pair (state, reason). A whole checkpoint cycle: prepare, refusals while prepared,
# restore, each repeated once (a no-op); then the engine must serve again.
UTILITIES_034: list[Any] = [
    ("is_inference_ready", True),
    ("checkpoint_state", ["running", None]),
    ("sleep", None),
    ("is_sleeping_asleep", True),
    ("is_inference_ready_asleep", False),
    ("wake_up", True),
    ("is_inference_ready_awake", True),
    ("pause_scheduler", None),
    ("is_inference_ready_paused", False),
    ("release_kv_cache_memory", None),
    ("is_sleeping_released", True),
    ("wake_up_kv_cache", True),
    ("is_inference_ready_woken", True),
    ("checkpoint_prepare", None),  # None: not refused
    ("checkpoint_state_prepared", ["prepared", None]),
    ("is_inference_ready_prepared", False),
    ("checkpoint_prepare_again", None),
    ("checkpoint_restore", None),
    ("checkpoint_state_restored", ["running", None]),
    ("is_inference_ready_restored", True),
    ("checkpoint_restore_again", None),
]


@pytest.mark.parametrize(("utility", "result"), UTILITIES)
def test_utility(run: DriveRun, utility: str, result: Any) -> None:
    assert _report(run, "utilities")[utility] == {"result": result}


@only_034
@pytest.mark.parametrize(("utility", "result"), UTILITIES_034)
def test_utility_034(run: DriveRun, utility: str, result: Any) -> None:
    assert _report(run, "utilities_034")[utility] == {"result": result}


@only_034
def test_sleep_is_refused_while_prepared_for_a_checkpoint(run: DriveRun) -> None:
    reply = _report(run, "utilities_034")["sleep_while_prepared"]
    assert reply["error"] == "builtins.Exception", reply
    assert reply["message"].startswith("Call to sleep method failed: "), reply


@only_034
def test_the_engine_serves_after_a_checkpoint_cycle(run: DriveRun) -> None:
    after = _report(run, "utilities_034")["after"]
    assert after == {"done": True, "tokens": expected([77], 6), "finish": LENGTH}


def test_unknown_utility_fails_that_call_only(run: DriveRun) -> None:
    reply = _report(run, "utilities")["no_such_method"]
    # vLLM's client raises a plain Exception carrying the engine's failure text.
    assert reply["error"] == "builtins.Exception"
    assert reply["message"].startswith("Call to no_such_method method failed: ")


def test_engine_core_dead_reaches_the_vllm_client_as_engine_dead_error(
    run: DriveRun, timings: dict[str, float]
) -> None:
    report = _report(run, "fault")
    timings[f"vLLM {run.client} client: inject_fault -> EngineDeadError"] = report[
        "detected_after_s"
    ]
    assert report["inject_fault"] == {"result": None}
    assert report["error"] == ENGINE_DEAD, report
    assert report["detected_after_s"] < 5
    # From then on vLLM's client refuses work itself.
    assert report["add_after_death"]["error"] == ENGINE_DEAD
    assert run.engine_exit == 1, run.engine_log


def test_no_error_in_vllm_logs(run: DriveRun) -> None:
    assert "Resolved architecture: LlamaForCausalLM" in run.driver_log  # vLLM logs here
    assert error_lines(run.driver_log) == []

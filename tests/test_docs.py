"""The documentation: its tutorials run, and its API reference covers the public names.

Every program in ``docs/tutorials/`` is run the way a reader runs it (``python
docs/tutorials/<name>.py`` from the repository root, against real engine processes) and
must exit 0 and print what its page says it prints. The Sphinx build itself (``nox -s
docs``) checks every reference; these tests check what a build cannot: that every
public name has an autodoc directive, and that the page for vLLM users maps every
method of vLLM's clients.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import trio_enginecore

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIALS = DOCS / "tutorials"
API = DOCS / "api"

TUTORIAL_TIMEOUT_S = 60

# What each tutorial must print on stdout: these fragments, in this order. A new
# tutorial needs an entry here (the test says so); keep the fragments to what does not
# vary between runs (no pids, no timings).
EXPECTED_OUTPUT: dict[str, list[str]] = {
    "testing": [
        "passed: test_collects_every_token_and_the_finish_reason",
        "passed: test_gives_up_after_the_timeout_and_aborts_the_request",
        "the client's block raised EngineDeadError: engine rank 0 died: the GPU fell off",
        "passed: test_reports_an_engine_death",
    ],
    "first_steps": [
        "engine ready (pid ",
        "generated 80 tokens, finish reason: length",
        "text: The river",
        "rejected: the prompt has 6000 tokens, but max_model_len is 4096",
        "engine stopped",
    ],
    "many_requests": [
        "streams: 4 generations in ",
        "stream-0: 'The scheduler",
        "stream-1: 'A good test",
        "stream-2: 'The river",
        "stream-3: 'Every request",
        "batch API: 4 requests, 160 tokens in ",
    ],
    "cancellation": [
        "1. a stream under move_on_after(0.2)",
        "while streaming, the engine has (0, 1)",
        "timed out: True, after ",
        "after the timeout, (waiting, running) = (0, 0)",
        "requests in flight on the client: 0",
        "2. a utility call under move_on_after(0.1)",
        "timed out: True",
        "once the request finished, is_scheduler_paused() = True",
        "after resume_scheduler(), is_scheduler_paused() = False",
    ],
    "deadlines": [
        "1. a running request under move_on_after(0.3)",
        "deadline hit: True, after ",
        "tokens 4, 5, 6, ... as the counter model predicts: True",
        "afterwards, (waiting, running) = (0, 0)",
        "requests in flight on the client: 0",
        "2. a queued request under move_on_after(0.5)",
        "'long' is running: it holds the only slot (max_num_seqs=1)",
        "while 'queued' waits, (waiting, running) = (1, 1)",
        "deadline hit: True, after 0 tokens",
        "afterwards, (waiting, running) = (0, 1): only 'long' is left",
        "once 'long' is cancelled too, (waiting, running) = (0, 0)",
        "requests in flight on the client: 0",
        "3. fail_after(0.3): the same deadline, as an exception",
        "raised TooSlowError: True",
        "afterwards, (waiting, running) = (0, 0)",
        "requests in flight on the client: 0",
    ],
    "engine_death": [
        "1. the engine reports a fatal error",
        "the stream raised EngineDeadError after ",
        "died: the engine reported a fatal error (ENGINE_CORE_DEAD)",
        "later calls raise EngineDeadError too (is_dead=True)",
        "leaving the client's block raised EngineDeadError",
        "2. the engine process is killed",
        "get_output() raised EngineDeadError: engine rank 0, pid ",
        "died: was killed by signal 9",
        "3. restarting means opening a new client",
        "generated [4, 5, 6, 7, 8]",
    ],
    "several_engines": [
        "1. one client balancing over three engines",
        "client class: DPLBTrioMPClient",
        "requests per engine while all 90 ran: [",
        "pinned to rank 2: [4, 5, 6]",
        "engines running: False, a wave has ended: True",
        "2. two clients, one engine each, sharing a coordinator",
        "rank 0 saw wave 0 start: True",
        "rank 0 saw wave 0 end",
        "rank 1 saw wave 0 start: True",
        "rank 1 saw wave 0 end",
        "3. an engine joining over TCP, authenticated with CURVE",
        "launched by the client: (None,)",
        "generated over CURVE: [4, 5, 6, 7, 8]",
    ],
    "sync_and_inproc": [
        "1. SyncMPClient, called from plain threads",
        "thread-1: [101, 102, 103, 104]",
        "thread-2: [201, 202, 203, 204]",
        "thread-3: [301, 302, 303, 304]",
        "engine counts (waiting, running): (0, 0)",
        "client class: InprocClient",
        "tokens [10, 11, 12, 13, 14], as the counter model predicts: True",
        "idle engine: get_output() returns 0 outputs",
        "client class: TrioInprocClient, engine pids: (None,)",
        "streamed [42, 43, 44]",
    ],
    "serving_http": [
        "serving on http://127.0.0.1:",
        "1. POST /generate, streamed to the end",
        "200 text/event-stream",
        'first event: {"token_ids":[',
        'finish event: {"finish_reason":"length","num_tokens":80}',
        "text: The river",
        "2. a client that disconnects mid-stream",
        'while streaming, GET /health: 200 {"status":"ok","waiting":0,"running":1}',
        "read 5 events, then closed the connection",
        'dropped the request: GET /health: 200 {"status":"ok","waiting":0,"running":0}',
        "3. the engine process is killed",
        'GET /health: 503 {"status":"dead","error":"engine rank 0, pid ',
        "died: was killed by signal 9",
        'POST /generate: 503 {"error":',
        "leaving the engine client's block raised EngineDeadError",
    ],
    "from_asyncio": [
        "engine ready (pid ",
        "1. three asyncio tasks, one stream each",
        "task 1: [101, 102, 103, 104]",
        "task 2: [201, 202, 203, 204]",
        "task 3: [301, 302, 303, 304]",
        "2. cancelling a task mid-generation",
        "while streaming, the engine has (waiting, running) = (0, 1)",
        "cancelled: True, after ",
        "after the cancellation, (waiting, running) = (0, 0)",
        "the next request: [10, 11, 12, 13, 14], as the counter model predicts: True",
        "3. asyncio.timeout() around a stream",
        "timed out: True",
        "after the timeout, (waiting, running) = (0, 0)",
        "engine stopped",
    ],
}

TUTORIAL_PROGRAMS = sorted(TUTORIALS.glob("*.py"))


def run_tutorial(program: Path) -> subprocess.CompletedProcess[str]:
    """Run a tutorial program as a reader would, from the repository root."""
    return subprocess.run(
        [sys.executable, str(program)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TUTORIAL_TIMEOUT_S,
        check=False,
    )


def check_tutorial(program: Path, expected: list[str]) -> None:
    """Run ``program``; it must exit 0 and print ``expected`` in order."""
    result = run_tutorial(program)
    report = f"--- stdout:\n{result.stdout}\n--- stderr:\n{result.stderr}"
    assert result.returncode == 0, f"{program.name} exited with {result.returncode}\n{report}"
    position = 0
    for fragment in expected:
        found = result.stdout.find(fragment, position)
        assert found >= 0, f"{program.name} did not print {fragment!r} (in order)\n{report}"
        position = found + len(fragment)


# ----------------------------------------------------------------------- tutorials


def test_there_are_tutorials() -> None:
    assert TUTORIAL_PROGRAMS, f"no tutorial programs in {TUTORIALS}"


@pytest.mark.parametrize("program", TUTORIAL_PROGRAMS, ids=lambda path: path.stem)
def test_tutorial_runs(program: Path) -> None:
    expected = EXPECTED_OUTPUT.get(program.stem)
    assert expected is not None, (
        f"add what {program.name} prints to EXPECTED_OUTPUT in {Path(__file__).name}"
    )
    check_tutorial(program, expected)


def test_expectations_name_existing_tutorials() -> None:
    assert set(EXPECTED_OUTPUT) <= {program.stem for program in TUTORIAL_PROGRAMS}


def test_every_tutorial_program_is_shown_on_a_page() -> None:
    pages = [*DOCS.rglob("*.md"), *DOCS.rglob("*.rst")]
    included: set[Path] = set()
    for page in pages:
        if "_build" in page.parts:
            continue
        for target in re.findall(r"literalinclude(?:\}|::)\s*(\S+)", page.read_text()):
            included.add((page.parent / target).resolve())
    missing = [p.name for p in TUTORIAL_PROGRAMS if p.resolve() not in included]
    assert not missing, f"tutorial programs no page includes with literalinclude: {missing}"


# ------------------------------------------------------------------- API reference

_DIRECTIVE = re.compile(
    r"^\.\. (?:py:)?(?P<kind>auto\w+|module|currentmodule)::\s*(?P<target>\S+)", re.MULTILINE
)


def _resolve(qualified_name: str) -> Any:
    """The object named ``package.module.Name`` (or a module)."""
    parts = qualified_name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise LookupError(qualified_name)


def documented_names() -> dict[str, Any]:
    """Every object an autodoc directive of the API reference documents, by full name."""
    documented: dict[str, Any] = {}
    for page in sorted(API.glob("*.rst")):
        module = ""
        for match in _DIRECTIVE.finditer(page.read_text()):
            kind, target = match["kind"], match["target"]
            if kind in ("module", "currentmodule", "automodule"):
                module = target
                if kind != "automodule":
                    continue
            name = target if target.startswith("trio_enginecore") else f"{module}.{target}"
            documented[name] = _resolve(name)
    return documented


def test_every_public_name_of_the_package_is_documented() -> None:
    documented = documented_names()
    missing = [
        name
        for name in trio_enginecore.__all__
        if not any(obj is getattr(trio_enginecore, name) for obj in documented.values())
    ]
    assert not missing, f"names in trio_enginecore.__all__ with no autodoc directive: {missing}"


@pytest.mark.parametrize(
    "module_name", ["config", "curve", "dialects", "errors", "protocol", "serial"]
)
def test_every_public_name_of_a_public_module_is_documented(module_name: str) -> None:
    module = importlib.import_module(f"trio_enginecore.{module_name}")
    documented = documented_names()
    assert module.__name__ in documented, f"no automodule directive for {module.__name__}"
    missing = [name for name in module.__all__ if f"{module.__name__}.{name}" not in documented]
    assert not missing, f"names in {module.__name__}.__all__ with no autodoc directive: {missing}"


def test_all_lists_every_public_reexport() -> None:
    assert len(set(trio_enginecore.__all__)) == len(trio_enginecore.__all__)
    for name in trio_enginecore.__all__:
        assert hasattr(trio_enginecore, name), name
    public = {
        name
        for name, value in vars(trio_enginecore).items()
        if not name.startswith("_")
        and not isinstance(value, ModuleType)  # submodules, imported or not
        and name != "annotations"  # from __future__ import annotations
    }
    assert public <= set(trio_enginecore.__all__)


# The wire plumbing and the CURVE keys: not at the top level (issue 15), in their own
# modules.
WIRE_PLUMBING = {
    "protocol": [
        "ENGINE_CORE_DEAD",
        "EngineCoreEvent",
        "EngineCoreEventType",
        "EngineCoreReadyResponse",
        "EngineCoreRequestType",
        "EngineHandshakeMetadata",
        "EngineZmqAddresses",
        "HandshakeHello",
        "HandshakeMessage",
        "HandshakeReady",
        "Tensor",
        "UtilityOutput",
        "UtilityResult",
    ],
    "serial": ["MsgpackDecoder", "MsgpackEncoder"],
    "curve": ["CurveClient", "CurveKeyPair", "CurveServer", "write_key_pair"],
}


def test_the_wire_plumbing_is_in_its_modules_not_at_the_top_level() -> None:
    for module_name, names in WIRE_PLUMBING.items():
        module = importlib.import_module(f"trio_enginecore.{module_name}")
        for name in names:
            assert name in module.__all__, f"{module.__name__}.{name}"
            assert name not in trio_enginecore.__all__, name
            assert not hasattr(trio_enginecore, name), name


def test_engine_consensus_error_is_one_class_with_the_other_errors() -> None:
    from trio_enginecore import client, errors

    assert errors.EngineConsensusError.__module__ == "trio_enginecore.errors"
    assert issubclass(errors.EngineConsensusError, errors.EngineCoreError)
    assert trio_enginecore.EngineConsensusError is errors.EngineConsensusError
    assert client.EngineConsensusError is errors.EngineConsensusError


# -------------------------------------------------------------- coming from vLLM

# The public methods of vLLM's EngineCoreClient family (EngineCoreClient, InprocClient,
# MPClient, SyncMPClient, AsyncMPClient and the data-parallel clients).
VLLM_CLIENT_METHODS = [
    "make_client",
    "make_async_mp_client",
    "shutdown",
    "get_output",
    "get_output_async",
    "add_request",
    "add_request_async",
    "abort_requests",
    "abort_requests_async",
    "call_utility",
    "call_utility_async",
    "get_supported_tasks",
    "get_supported_tasks_async",
    "profile",
    "profile_async",
    "reset_mm_cache",
    "reset_mm_cache_async",
    "reset_prefix_cache",
    "reset_prefix_cache_async",
    "reset_encoder_cache",
    "reset_encoder_cache_async",
    "sleep",
    "sleep_async",
    "wake_up",
    "wake_up_async",
    "is_sleeping",
    "is_sleeping_async",
    "execute_dummy_batch",
    "execute_dummy_batch_async",
    "set_weight_version",
    "set_weight_version_async",
    "get_weight_version",
    "get_weight_version_async",
    "add_lora",
    "add_lora_async",
    "remove_lora",
    "remove_lora_async",
    "list_loras",
    "list_loras_async",
    "pin_lora",
    "pin_lora_async",
    "save_sharded_state",
    "save_sharded_state_async",
    "collective_rpc",
    "collective_rpc_async",
    "dp_engines_running",
    "pause_scheduler_async",
    "resume_scheduler_async",
    "is_scheduler_paused_async",
    # vLLM 0.34
    "checkpoint_prepare_async",
    "checkpoint_restore_async",
    "checkpoint_state_async",
    "engine_status",
    "ensure_alive",
    "start_engine_core_monitor",
    "validate_alive",
    "prepare_elastic_ep",
    "commit_elastic_ep",
    "abort_elastic_ep",
    "get_external_elastic_ep_phase",
    "handle_fault",
    "get_status",
]


def test_the_vllm_page_maps_every_vllm_client_method() -> None:
    page = (DOCS / "guide" / "from_vllm.md").read_text()
    mentioned = set(re.findall(r"\b(\w+)\(", page)) | set(re.findall(r"`(\w+)`", page))
    missing = [name for name in VLLM_CLIENT_METHODS if name not in mentioned]
    assert not missing, f"from_vllm.md does not mention: {missing}"

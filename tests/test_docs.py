"""The documentation: its tutorials run, and its API reference covers the public names.

Every program in ``docs/tutorials/`` is run the way a reader runs it (``python
docs/tutorials/<name>.py`` from the repository root, against real engine processes) and
must exit 0 and print what its page says it prints. The Sphinx build itself (``nox -s
docs``) checks every reference; these tests check what a build cannot: that every
public name has an autodoc directive, and that the page for vLLM users maps every
method of vLLM's clients.
"""

from __future__ import annotations

import html
import importlib
import inspect
import re
import shutil
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
    "openai_server": [
        "server: http://127.0.0.1:",
        "completion: ' wer runs is stead and your bridge' stop 35",
        "chat finished: length",
        "usage chunk: 42 24",
        "chat: 'hrequeste side in for ow'",
        "refused: 400 n must be at least 1, got 0",
        "curl: ' wer run'",
        'metrics: vllm:request_success_total{engine="0",finished_reason="stop",'
        'model_name="ngram"} 1.0',
        "exit code: 0",
    ],
    "text": [
        "complete: 'The river which that frame dies",
        "stream: 'Tea ishes stoeses its will waitinside",
        "finished: stop on '.'",
        "sample 0: ' frograme down.'",
        "sample 1: ",
        "refused (stop): stop: item 0 must be a string, got int 42",
    ],
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
        # The program configures logging: the client's log lines are in its output.
        "ERROR trio_enginecore.client: engine rank 0, pid ",
        "died: was killed by signal 9",
        "get_output() raised EngineDeadError: engine rank 0, pid ",
        "died: was killed by signal 9",
        '3. on_engine_failure="restart": the client launches the engine again',
        "ERROR trio_enginecore.client: engine rank 0, pid ",
        "died: was killed by signal 9",
        "WARNING trio_enginecore.client: restarting engine rank 0, pid ",
        "the stream raised EngineDeadError: engine rank 0, pid ",
        "died: was killed by signal 9",
        "engine rank 0 is 'restarting'; client.is_dead=False",
        "is back in service (restart 1)",
        "engine rank 0 is 'alive', restarts=1, new pid: True",
        "the request sent again generated [4, 5, 6, 7, 8]",
        "leaving the client's block raised nothing: the client never failed",
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
        "4. on_engine_failure=Restart(...): rank 1 of two is killed",
        "ERROR trio_enginecore.client: engine rank 1, pid ",
        "died: was killed by signal 9",
        "WARNING trio_enginecore.client: restarting engine rank 1, pid ",
        "the stream on rank 0: 20 tokens; on rank 1: EngineDeadError",
        "engine states: ['alive', 'restarting'], client.is_dead=False",
        "pinned to rank 1: EngineDeadError: data_parallel_rank 1 is out of service "
        "(it is restarting)",
        "not pinned: [4, 5, 6]",
        "WARNING trio_enginecore.client: engine rank 1, pid ",
        "is back in service (restart 1)",
        "rank 1 is back: pinned to rank 1: [4, 5, 6], restarts per engine: [0, 1]",
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
        "ERROR trio_enginecore.client: engine rank 0, pid ",
        "died: was killed by signal 9",
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

NEEDS_VLLM = {"real_vllm"}
"""Tutorials that run vLLM itself: the interop sessions run them
(``tests/interop/test_client_launches_vllm.py``), against each vLLM release."""
TUTORIAL_PROGRAMS = sorted(
    program for program in TUTORIALS.glob("*.py") if program.stem not in NEEDS_VLLM
)


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


@pytest.mark.parametrize(
    "module_name", ["client", "coordinator", "engine", "testing", "text", "server"]
)
def test_every_public_name_of_a_subpackage_is_documented(module_name: str) -> None:
    """As for the top level: each name of the namespace's ``__all__`` (held by
    ``tests/test_layout.py``) has an autodoc directive, under whichever name."""
    module = importlib.import_module(f"trio_enginecore.{module_name}")
    whole = f".. automodule:: {module.__name__}\n   :members:\n"
    if any(whole in page.read_text() for page in API.glob("*.rst")):
        return  # autodoc documents every name of the module's __all__
    documented = documented_names()
    missing = [
        name
        for name in module.__all__
        if not any(obj is getattr(module, name) for obj in documented.values())
    ]
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
    # Once, with the errors: not also among the client's names.
    assert not hasattr(client, "EngineConsensusError")


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


# ------------------------------------------------- docs that agree with the code
#
# What a test can tell of the documentation's claims about the code: the options and
# their defaults, the keywords the examples pass, the failure policies, how the package
# is installed, and a few statements found wrong before (issue 29).

README = ROOT / "README.md"
PACKAGE = ROOT / "trio_enginecore"


def doc_pages() -> list[Path]:
    """The pages of the documentation (its sources, not the build)."""
    return sorted(
        page
        for page in [*DOCS.rglob("*.md"), *DOCS.rglob("*.rst")]
        if "_build" not in page.relative_to(DOCS).parts
    )


def package_sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


# The texts a claim may be in: the pages (the README with them), the tutorials'
# programs, and the package's docstrings and messages.
TEXT_SCOPES = {
    "docs": lambda: [README, ROOT / "CHANGELOG.md", *doc_pages(), *TUTORIALS.glob("*.py")],
    "package": package_sources,
}


def _options_defaults() -> dict[str, Any]:
    import attrs

    from trio_enginecore.client import ClientOptions

    return {field.name: field.default for field in attrs.fields(ClientOptions)}


def docstring_args(function: Any) -> dict[str, str]:
    """The entries of a Google-style docstring's ``Args:`` section, by name, each
    entry's text on one line."""
    doc = inspect.getdoc(function) or ""
    assert "\nArgs:\n" in doc, f"{function.__name__}'s docstring has no Args: section"
    section = doc.split("\nArgs:\n", 1)[1]
    section = re.split(r"\n(?=\S)", section, maxsplit=1)[0]  # up to the next section
    return {
        match["name"]: " ".join(match["text"].split())
        for match in re.finditer(
            r"^    (?P<name>\w+): (?P<text>.*?)(?=^    \w+: |\Z)", section, re.M | re.S
        )
    }


def test_open_engine_client_documents_every_option_with_its_default() -> None:
    """``help(open_engine_client)`` shows each option (they come as ``**keywords``,
    which the signature cannot show): its name in ``Args:``, ending ``(default
    ``VALUE``)`` with VALUE the ClientOptions field's default."""
    from trio_enginecore.client import Liveness, Restart

    function = trio_enginecore.open_engine_client
    entries = docstring_args(function)
    defaults = {
        # The keyword-only parameters of the signature, then the options.
        parameter.name: parameter.default
        for parameter in inspect.signature(function).parameters.values()
        if parameter.kind is parameter.KEYWORD_ONLY
    }
    defaults |= _options_defaults()
    problems: list[str] = []
    for name, default in defaults.items():
        text = entries.get(name)
        if text is None:
            problems.append(f"{name}: not in Args")
            continue
        shown = re.search(r"\(default ``(?P<value>[^`]+)``\)", text)
        if shown is None:
            problems.append(f"{name}: no '(default ``...``)' in {text!r}")
            continue
        namespace = {"__builtins__": {}, "Liveness": Liveness, "Restart": Restart}
        value = eval(shown["value"], namespace)  # our own docstring's text
        if value != default or type(value) is not type(default):
            problems.append(f"{name}: documented default {shown['value']}, really {default!r}")
    assert not problems, "open_engine_client's docstring:\n" + "\n".join(problems)


def _keywords_of(function: Any) -> set[str] | None:
    """The keyword names ``function`` accepts (None: any)."""
    import typing

    names: set[str] = set()
    signature = inspect.signature(function)
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            annotated = function.__init__ if inspect.isclass(function) else function
            hints = typing.get_type_hints(annotated, include_extras=True)
            hint = hints.get(parameter.name)
            if typing.get_origin(hint) is typing.Unpack:
                (typed_dict,) = typing.get_args(hint)
                names |= set(typing.get_type_hints(typed_dict))
            else:
                return None
        elif parameter.kind is not parameter.VAR_POSITIONAL:
            names.add(parameter.name)
    return names


def documented_callables() -> dict[str, set[str]]:
    """The callables the pages call with keywords, and the keywords each accepts."""
    from trio_enginecore import client, config, coordinator
    from trio_enginecore.client import ClientOptions

    callables: dict[str, set[str]] = {}
    for name, function in {
        "make_client": trio_enginecore.make_client,
        "SyncMPClient": trio_enginecore.SyncMPClient,
        "open_engine_client": trio_enginecore.open_engine_client,
        "connect_engine_client": trio_enginecore.connect_engine_client,
        "open_ray_engine_client": client.open_ray_engine_client,
        "open_coordinator": coordinator.open_coordinator,
        "ClientOptions": ClientOptions,
        "EngineConfig": config.EngineConfig,
        "Liveness": client.Liveness,
        "Restart": client.Restart,
        "RemoteEngines": client.RemoteEngines,
        "VllmEngines": client.VllmEngines,
        "RayEngines": client.RayEngines,
    }.items():
        keywords = _keywords_of(function)
        assert keywords is not None, name
        callables[name] = keywords
    return callables


def _call_arguments(text: str, start: int) -> str:
    """The text between the parenthesis at ``start`` and its match (or the rest of the
    text, for a call cut short)."""
    depth = 0
    for position in range(start, len(text)):
        if text[position] in "([{":
            depth += 1
        elif text[position] in ")]}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : position]
    return text[start + 1 :]


def _top_level_keywords(arguments: str) -> list[str]:
    """The ``name=`` keywords of a call's arguments, not those of calls inside them."""
    keywords: list[str] = []
    depth = 0
    for match in re.finditer(r"[([{]|[)\]}]|\b(\w+)\s*=(?!=)", arguments):
        token = match[0]
        if token in "([{":
            depth += 1
        elif token in ")]}":
            depth -= 1
        elif depth == 0:
            keywords.append(match[1])
    return keywords


def test_the_keywords_the_docs_pass_exist() -> None:
    """Every ``Name(keyword=...)`` the pages, the README and the docstrings show, for
    the openers and the settings classes, names a keyword they accept."""
    callables = documented_callables()
    call = re.compile(
        r"(?<![\w.])(?<!def )(?P<qualifier>(?:\w+\.)*)(?P<name>" + "|".join(callables) + r")\("
    )
    wrong: list[str] = []
    for page in [README, *doc_pages(), *package_sources()]:
        text = page.read_text()
        for match in call.finditer(text):
            if match["qualifier"] and not match["qualifier"].startswith("trio_enginecore."):
                continue  # vLLM's (EngineCoreClient.make_client), or another library's
            arguments = _call_arguments(text, match.end() - 1)
            for keyword in _top_level_keywords(arguments):
                if keyword not in callables[match["name"]]:
                    line = text.count("\n", 0, match.start()) + 1
                    wrong.append(f"{page.relative_to(ROOT)}:{line}: {match['name']}({keyword}=")
    assert not wrong, "keywords the code does not accept:\n" + "\n".join(wrong)


def test_every_failure_policy_the_docs_name_exists() -> None:
    """``on_engine_failure="VALUE"``, in a page, a tutorial or a docstring: VALUE is
    one of the policies (the other values are ``Restart(...)``, a placeholder or a
    variable)."""
    from trio_enginecore.client._core._policy import POLICY_NAMES

    wrong: list[str] = []
    for page in [README, *doc_pages(), *TUTORIAL_PROGRAMS, *package_sources()]:
        text = page.read_text()
        for match in re.finditer(r"on_engine_failure\s*=\s*\\?(['\"])(?P<value>.*?)\\?\1", text):
            if match["value"] not in POLICY_NAMES:
                line = text.count("\n", 0, match.start()) + 1
                wrong.append(f"{page.relative_to(ROOT)}:{line}: {match[0]}")
    assert not wrong, "failure policies that do not exist:\n" + "\n".join(wrong)


@pytest.mark.parametrize("page_name", ["engine_death", "several_engines"])
def test_the_engine_death_tutorials_cover_every_failure_policy(page_name: str) -> None:
    """A reader looking for ``on_engine_failure`` finds both tutorials about deaths, and
    each names all three policies."""
    from trio_enginecore.client._core._policy import POLICY_NAMES

    text = (TUTORIALS / f"{page_name}.md").read_text()
    assert "on_engine_failure" in text
    missing = [policy for policy in POLICY_NAMES if f'"{policy}"' not in text]
    assert not missing, f"{page_name}.md does not name the policies {missing}"
    assert "never restarts" not in text, f"{page_name}.md says a client never restarts"


# Statements the code contradicts: a pattern, and what is true instead.
FALSE_STATEMENTS = {
    "coordinator-process": (
        r"coordinator\s+process",
        "the client runs the coordinator as one of its tasks, not as a process",
    ),
    "no-logging-configured": (
        r"no\s+logging\s+configured",
        "the package adds a NullHandler: with no logging configured, nothing of the "
        "library's logging shows (say that the program must configure logging)",
    ),
    # The README's forms are from a checkout ("/path/to/trio-enginecore[ray]",
    # ".[ray]") or from git ("trio-enginecore @ git+..."): the package is not on PyPI.
    "pip-install-from-pypi": (
        r"pip install\s+['\"]?trio-enginecore(?!\s*@)",
        "trio-enginecore is not on PyPI: install it (and its extras) as the README does",
    ),
}


@pytest.mark.parametrize("scope", sorted(TEXT_SCOPES))
@pytest.mark.parametrize("statement", sorted(FALSE_STATEMENTS))
def test_no_text_makes_a_statement_the_code_contradicts(statement: str, scope: str) -> None:
    pattern, truth = FALSE_STATEMENTS[statement]
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: {match[0]!r}"
        for path in TEXT_SCOPES[scope]()
        for text in [path.read_text()]
        for match in re.finditer(pattern, text, re.IGNORECASE)
    ]
    assert not found, f"{truth}:\n" + "\n".join(found)


def test_tutorials_that_show_the_librarys_log_lines_configure_logging() -> None:
    """The package logs to a NullHandler: a program shows the client's log lines (a
    death, a restart) only once it configures logging, so every tutorial whose page
    names the client's logger does so."""
    silent = [
        program.name
        for program in TUTORIAL_PROGRAMS
        if re.search(r"`trio_enginecore\.[\w.]+` logger", program.with_suffix(".md").read_text())
        and "logging.basicConfig(" not in program.read_text()
    ]
    assert not silent, f"tutorials showing log lines with no logging configured: {silent}"


# ------------------------------------------------------- what a new user reads first
#
# A new user's trial of the README and the docs: the first screen, the set-up commands
# and how long they take, what the liveness rules mean for a slow model, no link to a
# repository that is not published, no reference to the project's internal tracker,
# a docs column wide enough for the code, the lifecycle guide's first answers.


def readme_first_screen() -> str:
    """The README up to its first section."""
    text = README.read_text()
    return text[: text.index("\n## ")]


def test_the_readmes_first_screen_is_a_pitch_an_example_two_commands_and_links() -> None:
    """The example and its output are run by ``tests/server/test_readme_example.py``."""
    screen = readme_first_screen()
    assert len(screen.splitlines()) <= 45, "the first screen is longer than a screen"
    assert screen.index("```python\n") < screen.index("```text\n"), "an example, then its output"
    commands = [
        line.split("#")[0].strip() for line in screen.splitlines() if line.startswith("nox")
    ]
    assert commands == ["nox -s demo", "nox"], "the demo, then the tests"
    for target in ["docs/index.md", "docs/tutorials/first_steps.md", "docs/tutorials/real_vllm.md"]:
        assert f"]({target})" in screen, f"the first screen does not link {target}"


def test_the_readmes_first_screen_names_the_vllm_releases_it_speaks() -> None:
    from trio_enginecore.dialects import DIALECTS

    screen = readme_first_screen()
    releases = {".".join(dialect.tested_version.split(".")[:2]) for dialect in DIALECTS}
    missing = [release for release in sorted(releases) if f"vLLM {release}" not in screen]
    assert not missing, f"the README's first screen does not name vLLM {missing}"


def test_every_relative_link_of_the_readme_names_a_file_of_the_repository() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    broken = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not broken, f"README links to files that do not exist: {broken}"


def test_the_readme_says_how_long_the_tests_take() -> None:
    text = README.read_text()
    assert re.search(r"^nox .*\(\d+ minutes on \d+ cores\)", readme_first_screen(), re.M)
    assert re.search(r"The default run takes about \d+ minutes on a \d-core machine", text)
    assert re.search(r"`nox -s interop`[^`]*(`[^`]*`[^`]*)*about \d+ minutes per release", text)


def test_the_readme_says_when_a_slow_engine_counts_as_hung_and_how_to_raise_it() -> None:
    from trio_enginecore.client import Liveness

    text = README.read_text()
    default = re.search(r"`progress_timeout_s` \((\d+) s\)", text)
    assert default is not None, "the README does not give progress_timeout_s's default"
    assert float(default[1]) == Liveness().progress_timeout_s
    assert re.search(r"one\s+step\s+longer\s+than\s+that", text)
    assert "Liveness(progress_timeout_s=" in text


def test_no_page_points_at_a_repository_that_is_not_published() -> None:
    """The repository's address is not known yet: the pages say to install from a
    checkout, and show no placeholder address (``github.com/OWNER/...``)."""
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: {match[0]!r}"
        for path in [README, ROOT / "pyproject.toml", *doc_pages()]
        for text in [path.read_text()]
        for match in re.finditer(r"\bOWNER\b|git\+https?://|git clone", text)
    ]
    assert not found, "install from a checkout instead:\n" + "\n".join(found)


INTERNAL_REFERENCES = re.compile(
    r"\b[Ii]ssues? #?\d+|\b[Ii]ssue \d+'s|\bthe issue\b|\b(?:this|that|a later|the next) session\b"
)


@pytest.mark.parametrize("scope", sorted(TEXT_SCOPES))
def test_no_text_refers_to_the_projects_internal_tracker(scope: str) -> None:
    """Users cannot read the project's issues: a page, a tutorial, a docstring or a
    message says what it means instead of "issue 17's goals"."""
    paths = TEXT_SCOPES[scope]()
    if scope == "docs":
        paths = [*paths, *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: {match[0]!r}"
        for path in paths
        for text in [path.read_text()]
        for match in INTERNAL_REFERENCES.finditer(text)
    ]
    assert not found, "internal references in user-facing text:\n" + "\n".join(found)


def test_the_docs_say_which_config_fields_count_for_engines_started_elsewhere() -> None:
    """Attached and remote engines run their own settings: the docs name the three
    fields of ``EngineConfig`` a client still reads (``tests/test_factory.py`` holds
    the code to it)."""
    from trio_enginecore.config import EngineConfig

    shape = ["data_parallel_size", "data_parallel_external_lb", "data_parallel_rank"]
    for documented in [trio_enginecore.open_engine_client, EngineConfig]:
        doc = inspect.getdoc(documented) or ""
        missing = [name for name in shape if name not in doc]
        assert not missing, f"{documented.__name__}'s docstring does not name {missing}"
        assert "ignored" in doc


def test_the_lifecycle_guide_first_says_how_to_stop_and_what_a_death_does() -> None:
    text = (DOCS / "guide" / "lifecycle.md").read_text()
    opening = text[: text.index("\n## Launched by the client")]
    for answer in [
        "leave its block",
        "shutdown_timeout_s",
        "EngineDeadError",
        'on_engine_failure="fail"',
        '"route_around"',
        '"restart"',
        "Liveness(progress_timeout_s=",
    ]:
        assert answer in opening, f"the lifecycle guide's opening does not say {answer!r}"


# Furo's code: 81.25 % of a 16 px font, a monospace column about 0.6 of it, and
# 0.875rem of padding each side of a block.
CODE_COLUMNS = 100
COLUMN_EM = 0.8125 * 0.6
CODE_PADDING_EM = 2 * 0.875
WINDOW_EM = 1280 / 16
WIDE_CONTENT_CSS = DOCS / "_static" / "wide-content.css"


def _css_rules(css: str) -> dict[float, dict[str, dict[str, str]]]:
    """The rules of each ``@media (min-width: Nem)`` block: {N: {selector: {property:
    value}}} (0 for the rules outside such blocks)."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    rules: dict[float, dict[str, dict[str, str]]] = {}
    for media in re.finditer(
        r"@media \(min-width: ([\d.]+)em\) \{((?:[^{}]*\{[^{}]*\})*)\s*\}", css
    ):
        block = rules.setdefault(float(media[1]), {})
        for rule in re.finditer(r"([^{}]+)\{([^{}]*)\}", media[2]):
            pairs = (part.split(":", 1) for part in rule[2].split(";") if ":" in part)
            block[rule[1].strip()] = {name.strip(): value.strip() for name, value in pairs}
    return rules


def test_the_content_column_fits_100_column_code_at_1280_px() -> None:
    """Furo's 46em column cut the tutorials' 100-column lines at 1280 px; the
    stylesheet widens it where the window has room."""
    rules = _css_rules(WIDE_CONTENT_CSS.read_text())
    applying = [width for width in rules if width <= WINDOW_EM and ".content" in rules[width]]
    assert applying, "no rule widens the content column at 1280 px"
    content = rules[max(applying)][".content"]
    assert content.get("width") == "auto"
    assert content.get("min-width") == "0", "a wide line would push the page wider"
    max_width = re.fullmatch(r"([\d.]+)em", content.get("max-width", ""))
    assert max_width is not None
    needed = CODE_COLUMNS * COLUMN_EM + CODE_PADDING_EM
    assert float(max_width[1]) >= needed, f"{max_width[0]} holds less than {needed}em"
    assert rules[max(applying)].get(".main", {}).get("min-width") == "0"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BUILT_DOCS = DOCS / "_build" / "html"


def _widest_code_line(page: str, *, at_most: int) -> int:
    """The longest line, of ``at_most`` columns or fewer, of the code blocks in HTML."""
    widths = [
        len(line)
        for block in re.finditer(r"<pre([^>]*)>(.*?)</pre>", page, re.S)
        for line in html.unescape(re.sub(r"<[^>]+>", "", block[2])).splitlines()
    ]
    return max((width for width in widths if width <= at_most), default=0)


def test_no_code_block_of_100_columns_scrolls_at_1280_px(tmp_path: Path) -> None:
    """In a real browser, at 1280 px, where ``wide-content.js`` marks a code block wider
    than its box (``te-more-right``): the two tutorial pages of the last docs build
    with the widest lines of 100 columns or fewer. Needs Chromium and a build of the
    current stylesheet (``nox -s docs``)."""
    if CHROMIUM is None:
        pytest.skip("no Chromium to render the pages with")
    built = BUILT_DOCS / "_static" / "wide-content.css"
    if not built.exists() or built.read_text() != WIDE_CONTENT_CSS.read_text():
        pytest.skip("no docs build of the current stylesheet (nox -s docs)")
    pages = sorted(
        (BUILT_DOCS / "tutorials").glob("*.html"),
        key=lambda page: _widest_code_line(page.read_text(), at_most=CODE_COLUMNS),
    )[-2:]
    scrolling: list[str] = []
    for page in pages:
        dom = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={tmp_path / 'profile'}",
                "--window-size=1280,900",
                "--virtual-time-budget=500",
                "--dump-dom",
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert "wide-content.js" in dom, page.name
        for block in re.finditer(r"<pre([^>]*)>(.*?)</pre>", dom, re.S):
            if "te-more-right" in block[1]:
                widest = _widest_code_line(block[0], at_most=CODE_COLUMNS)
                code = html.unescape(re.sub(r"<[^>]+>", "", block[2]))
                if max(len(line) for line in code.splitlines()) <= CODE_COLUMNS:
                    scrolling.append(f"{page.name}: a block of {widest} columns")
    assert not scrolling, "code blocks that scroll at 1280 px:\n" + "\n".join(scrolling)

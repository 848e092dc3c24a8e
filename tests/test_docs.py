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
import inspect
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


@pytest.mark.parametrize("module_name", ["client", "coordinator", "engine", "testing", "text"])
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
    "docs": lambda: [README, *doc_pages(), *TUTORIAL_PROGRAMS],
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

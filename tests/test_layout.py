"""The package's layout holds: the client's pure core does no I/O, the rooms import
downward only, and each public namespace's ``__all__`` is exactly what it exports.

The import checks read the source (``ast``) rather than ``sys.modules``: importing any
module of the package runs ``trio_enginecore/__init__.py``, which imports everything,
so what a *module* depends on is only visible in its own import statements, followed
through the package's modules.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest

import trio_enginecore

PACKAGE = Path(trio_enginecore.__file__).parent
CLIENT = PACKAGE / "client"

# Modules of the standard library and third parties that do I/O: sockets, processes,
# signals, file descriptors, ZeroMQ, Ray.
IO_MODULES = frozenset(
    {
        "fcntl",
        "multiprocessing",
        "os",
        "ray",
        "select",
        "selectors",
        "signal",
        "socket",
        "subprocess",
        "zmq",
    }
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_path(name: str) -> Path | None:
    base = PACKAGE.parent.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """The package modules and the other top-level modules ``path`` imports, anywhere
    in its body (function-local and ``TYPE_CHECKING`` imports included: they are
    dependencies all the same)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    internal: set[str] = set()
    external: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("trio_enginecore"):
                    internal.add(alias.name)
                else:
                    external.add(alias.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                assert node.module is not None
                if not node.module.startswith("trio_enginecore"):
                    external.add(node.module.partition(".")[0])
                    continue
                target = node.module
            else:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            # ``from .x import y`` may import the module x.y, or the name y of x.
            found = [f"{target}.{a.name}" for a in node.names if _module_path(f"{target}.{a.name}")]
            internal.update(found or [target])
    return internal, external


def _closure(start: str) -> tuple[set[str], set[str]]:
    """Every package module ``start`` depends on, through its modules' own imports
    (a package's ``__init__`` is followed only when it is imported by name), and the
    other top-level modules those import."""
    seen: set[str] = set()
    external: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_path(name)
        assert path is not None, name
        internal, outside = _imports(path)
        external |= outside
        todo += internal - seen
    return seen, external


CORE_MODULES = sorted(
    _module_name(p) for p in (CLIENT / "_core").glob("*.py") if p.name != "__init__.py"
)


def test_the_core_has_the_modules_the_architecture_guide_names() -> None:
    assert {name.rpartition(".")[2] for name in CORE_MODULES} == {
        "_calls",
        "_collector",
        "_engines",
        "_lb",
        "_lifecycle",
        "_liveness_rules",
        "_policy",
        "_router",
        "_settings_checks",
        "_state",
        "_statistics",
        "_stream",
        "_utilities",
    }


@pytest.mark.parametrize("module", CORE_MODULES)
def test_a_core_module_depends_on_nothing_that_does_io(module: str) -> None:
    depends_on, external = _closure(module)
    assert not external & IO_MODULES, f"{module} reaches {sorted(external & IO_MODULES)}"
    io_rooms = [
        name
        for name in depends_on
        if name.startswith(("trio_enginecore.client._multiprocess", "trio_enginecore.client._ray"))
        or name in ("trio_enginecore._zmq", "trio_enginecore._curve", "trio_enginecore.engine")
    ]
    assert not io_rooms, f"{module} depends on {sorted(io_rooms)}"


@pytest.mark.parametrize("module", CORE_MODULES)
def test_a_core_module_imports_only_the_core_and_the_pure_top_level(module: str) -> None:
    internal, _ = _imports(_module_path(module) or Path())
    above = [
        name
        for name in internal
        if name.startswith("trio_enginecore.client.")
        and not name.startswith("trio_enginecore.client._core")
    ]
    assert not above, f"{module} imports from above the core: {sorted(above)}"


@pytest.mark.parametrize(
    "module",
    ["trio_enginecore.client._client", "trio_enginecore.client._transport"],
)
def test_the_transport_agnostic_client_depends_on_no_transport(module: str) -> None:
    depends_on, external = _closure(module)
    transports = sorted(
        name
        for name in depends_on
        if name.startswith(("trio_enginecore.client._multiprocess", "trio_enginecore.client._ray"))
    )
    assert not transports, f"{module} depends on {transports}"
    assert not external & IO_MODULES, f"{module} reaches {sorted(external & IO_MODULES)}"


TEXT = PACKAGE / "text"
TEXT_PURE_MODULES = [
    f"trio_enginecore.text.{name}"
    for name in ("_tokenizer", "_detokenizer", "_logprobs", "_outputs", "_processor", "_inputs")
]


def test_the_text_room_is_its_pure_parts_and_its_io() -> None:
    modules = {p.stem for p in TEXT.glob("*.py") if p.name != "__init__.py"}
    io_modules = {"_model_dir", "_llm", "_sync"}
    assert modules == {name.rpartition(".")[2] for name in TEXT_PURE_MODULES} | io_modules


@pytest.mark.parametrize("module", TEXT_PURE_MODULES)
def test_a_pure_text_module_does_no_io_and_needs_no_trio(module: str) -> None:
    depends_on, external = _closure(module)
    assert not external & (IO_MODULES | {"trio"}), f"{module} reaches {sorted(external)}"
    faces = sorted(
        name
        for name in depends_on
        if name.startswith("trio_enginecore.client")
        or name
        in {
            "trio_enginecore.text._llm",
            "trio_enginecore.text._sync",
            "trio_enginecore.text._model_dir",
        }
    )
    assert not faces, f"{module} depends on {faces}"


SERVER = PACKAGE / "server"
SERVER_PURE_MODULES = [
    f"trio_enginecore.server.{name}"
    for name in (
        "_chat_template",
        "_http_messages",
        "_metrics",
        "_openai_requests",
        "_openai_responses",
    )
]
SERVER_IO_MODULES = {"_http", "_openai_app", "_command"}


def test_the_server_room_is_its_pure_parts_and_its_io() -> None:
    modules = {p.stem for p in SERVER.glob("*.py") if p.name != "__init__.py"}
    assert modules == {name.rpartition(".")[2] for name in SERVER_PURE_MODULES} | (
        SERVER_IO_MODULES
    )


@pytest.mark.parametrize("module", SERVER_PURE_MODULES)
def test_a_pure_server_module_does_no_io_and_needs_no_trio(module: str) -> None:
    depends_on, external = _closure(module)
    assert not external & (IO_MODULES | {"trio", "h11"}), f"{module} reaches {sorted(external)}"
    faces = sorted(
        name
        for name in depends_on
        if name.startswith("trio_enginecore.client")
        or name.rpartition(".")[2] in SERVER_IO_MODULES | {"_llm", "_sync", "_model_dir"}
    )
    assert not faces, f"{module} depends on {faces}"


def test_the_io_check_sees_io() -> None:
    """The checks above can fail: the ZeroMQ transport is caught by them."""
    _, external = _closure("trio_enginecore.client._multiprocess._receive")
    assert "zmq" in external
    internal, _ = _imports(CLIENT / "_mp.py")
    assert any(name.startswith("trio_enginecore.client._multiprocess") for name in internal)


# ------------------------------------------------------------------ public names

EXPORTS = {
    "trio_enginecore.text": {
        "BUILTIN_TOKENIZER_DIR",
        "AsyncLLM",
        "CompletionOutput",
        "GenerationStream",
        "IncrementalDetokenizer",
        "InvalidInputError",
        "Logprob",
        "ModelDirectoryError",
        "PromptInput",
        "RequestOutput",
        "SyncLLM",
        "TextPrompt",
        "TextRequestState",
        "Tokenizer",
        "TokensPrompt",
        "builtin_tokenizer",
        "load_tokenizer",
        "open_llm",
    },
    "trio_enginecore.server": {
        "ApiError",
        "ChatTemplate",
        "ChatTemplateError",
        "ChatTemplateRejectedError",
        "ChatTemplateSecurityError",
        "ChatTemplateSyntaxError",
        "ChatTemplates",
        "Headers",
        "HttpLimits",
        "HttpServer",
        "HttpServerStatistics",
        "OpenAIApp",
        "Request",
        "RequestLimits",
        "Response",
        "ServerSettings",
        "VllmMetrics",
        "serve_http",
    },
    "trio_enginecore.client": {
        "AsyncEngineCoreClient",
        "ClientLink",
        "ClientOptions",
        "ClientStatistics",
        "DPLBTrioMPClient",
        "DPTrioMPClient",
        "EngineCoreClient",
        "EngineHandle",
        "EngineLoad",
        "EngineRestarter",
        "EngineStatus",
        "FailurePolicy",
        "InprocClient",
        "LeastLoaded",
        "Liveness",
        "LoadBalancer",
        "PowerOfTwoChoices",
        "RayEngines",
        "RemoteEngines",
        "RequestStream",
        "Restart",
        "RestartedEngine",
        "SyncMPClient",
        "SyncRequestStream",
        "Transport",
        "TrioEngineClient",
        "TrioInprocClient",
        "TrioMPClient",
        "VllmEngines",
        "connect_engine_client",
        "make_client",
        "open_engine_client",
        "open_ray_engine_client",
        "run_client",
    },
    "trio_enginecore.coordinator": {
        "CoordinatorAddresses",
        "CoordinatorState",
        "open_coordinator",
        "serve_coordinator",
        "start_wave_frames",
    },
    "trio_enginecore.testing": {
        "FakeEngine",
        "FakeTransport",
        "ScriptedResponse",
        "open_fake_engine_client",
    },
    "trio_enginecore.engine": {
        "CounterModel",
        "EngineCore",
        "EngineCoreProc",
        "FatalEngineError",
        "Model",
        "NgramModel",
        "SamplingState",
        "Score",
        "addresses_for",
        "engine_handshake",
        "identity_for_rank",
        "make_model",
        "utility",
    },
}


@pytest.mark.parametrize("module_name", sorted(EXPORTS))
def test_a_public_namespace_exports_exactly_its_all(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = list(module.__all__)
    assert len(set(exported)) == len(exported), "a name twice in __all__"
    assert set(exported) == EXPORTS[module_name]
    for name in exported:
        assert hasattr(module, name), name
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, ModuleType)
        and name != "annotations"
        # Defined in this namespace (a module's own imports are not its exports).
        and getattr(value, "__module__", "").startswith(module_name)
    }
    assert public <= set(exported), f"public but not in __all__: {sorted(public - set(exported))}"


def test_the_top_level_takes_its_client_names_from_the_client() -> None:
    import trio_enginecore.client as client

    for name in trio_enginecore.__all__:
        if name in client.__all__:
            assert getattr(trio_enginecore, name) is getattr(client, name), name


# ------------------------------------------------------------ the architecture guide

GUIDE = PACKAGE.parent / "docs" / "guide" / "architecture.md"

ROOM_HEADINGS = {
    ".": "### The face: `client/`",
    "_core": "### The pure core: `client/_core/`",
    "_multiprocess": "### Engines in other processes: `client/_multiprocess/`",
    "_ray": "### Engines Ray places: `client/_ray/`",
}


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start)
    following = text.find("\n### ", start + len(heading))
    ends = [i for i in (end, following) if i != -1]
    return text[start : min(ends) if ends else len(text)]


@pytest.mark.parametrize("room", sorted(ROOM_HEADINGS))
def test_the_architecture_guide_lists_every_file_of_each_room(room: str) -> None:
    section = _section(GUIDE.read_text(), ROOM_HEADINGS[room])
    files = sorted(p.name for p in (CLIENT / room).glob("*.py") if p.name != "__init__.py")
    if room == ".":
        files.append("__init__.py")
    missing = [name for name in files if f"`{name}`" not in section]
    assert not missing, f"client/{room} files the guide's table does not name: {missing}"


def test_the_architecture_guide_names_every_other_module_of_the_package() -> None:
    text = GUIDE.read_text()
    others = [
        p for p in PACKAGE.rglob("*.py") if CLIENT not in p.parents and p.name != "__init__.py"
    ]
    missing = [str(p.relative_to(PACKAGE)) for p in others if p.name not in text]
    assert not missing, f"modules the architecture guide does not name: {missing}"


def test_only_the_lifecycle_writes_where_an_engine_stands() -> None:
    """An engine's state has one writer (``client/_core/_lifecycle.py``): what notices
    a death or a recovery reports it, and the state decides."""
    writers: set[str] = set()
    for path in CLIENT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign | ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Attribute) and t.attr == "state" for t in targets):
                writers.add(str(path.relative_to(CLIENT)))
    assert writers == {"_core/_lifecycle.py"}

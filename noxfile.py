"""Developer sessions for trio-enginecore.

A bare ``nox`` runs the default set: lint, typecheck, tests and docs. ``nox -l`` lists
every session with its description. ``nox -s interop`` (not in the default set) runs
the tests against real vLLM, once for each release (0.33.0 and 0.34.0); ``nox -s ray``
(not in it either) the tests of engines placed by Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "tests", "docs"]

PYPROJECT = nox.project.load_toml("pyproject.toml")


def _group(name: str) -> list[str]:
    return list(nox.project.dependency_groups(PYPROJECT, name))


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (real engine processes and ZMQ sockets on loopback/ipc)."""
    session.install("-e", ".", *_group("test"))
    # Most of the suite's time is waiting (engines' steps, deadlines, processes
    # starting), so files run in parallel: one worker per core, at most 4 (the
    # liveness tests hold on a loaded host, which this makes it, not on an overloaded
    # one). `--dist loadfile` keeps a file's tests, and its module fixtures (servers,
    # engines), in one worker.
    workers = str(min(os.cpu_count() or 1, 4))
    session.run("pytest", "-n", workers, "--dist", "loadfile", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint (including the flake8-async rules) and format check."""
    session.install(*_group("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict and pyright (strict) on the package."""
    session.install("-e", ".", *_group("typecheck"))
    session.run("mypy", "trio_enginecore", "noxfile.py")
    session.run("pyright", "trio_enginecore")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation with Sphinx; any warning (a broken reference too) fails it.

    Writes docs/_build/html. The tutorials' programs are run by the tests session. A
    page showing a default as attrs' generated code (``attr_dict['model'].default``)
    instead of its value fails the build too: Sphinx does not warn about that; so does a
    configuration dumped into the build's output. The output shows once the build ends.
    """
    session.install("-e", ".[server]", *_group("docs"))
    output = session.run(
        "sphinx-build",
        "-E",
        "-W",
        "--keep-going",
        "-n",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        silent=True,
    )
    sys.stdout.write(output or "")
    # A configuration printed whole (MyST's MdParserConfig(...) was): docs/conf.py drops it.
    if re.search(r"\b\w*Config\(\w+=", output or ""):
        session.error("the docs build printed a configuration dump (see above)")
    unrendered = [
        str(page)
        for page in Path("docs/_build/html").rglob("*.html")
        if "attr_dict[" in page.read_text(encoding="utf-8")
    ]
    if unrendered:
        session.error(f"defaults shown as attrs' code instead of values in: {unrendered}")


@nox.session
def ray(session: nox.Session) -> None:
    """The Ray tests (tests/test_ray*.py) with the ``ray`` extra; not part of the default run.

    They start a local Ray cluster of 2 CPUs on this machine. ``ray[default]`` adds the
    dashboard, which serves the state API the tests check the clean-up with.
    """
    session.install("-e", ".[ray]", "ray[default]", *_group("test"))
    session.run("pytest", "tests/test_ray.py", "tests/test_ray_nodes.py", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Run the demo against the built-in reference engine (text in, text out)."""
    session.install("-e", ".[text]")
    session.run("trio-enginecore", "demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The side-by-side benchmark (Trio vs vLLM's AsyncMPClient, asyncio, blocking pyzmq).

    Writes benchmarks/results/results.{json,md,png}. vLLM 0.33's real ``AsyncMPClient``
    is measured when the vLLM 0.33 environment that ``nox -s "interop(vllm='0.33')"``
    builds is complete (nothing is built here, and the 0.34 environment is never used:
    benchmarks/vllm_worker.py is written for 0.33); without it the report says so.
    ``-- --quick`` is a smoke run: it writes a new temporary directory instead (named
    on stderr), never the committed results; ``-- --out DIR`` writes DIR, for either.
    ``-- --redraw benchmarks/results/results.json`` only draws the chart again.
    """
    session.install("-e", ".", *_group("bench"))
    vllm = []
    env_dir = _vllm_env_dir(BENCH_VLLM_RELEASE)
    if (env_dir / "recipe.json").exists():
        vllm = ["--vllm-python", str(env_dir / "bin" / "python")]
    else:
        session.log(f"no vLLM environment at {env_dir}: `nox -s interop` builds it")
    session.run("python", "-m", "benchmarks.run", *vllm, *session.posargs)


@nox.session
def bench_releases(session: nox.Session) -> None:
    """The Trio client's CPU per token against an engine of each vLLM release (0.33's
    prompts as lists, 0.34's packed as int32 arrays), alternating in one run.

    Writes benchmarks/results/releases.{json,md}; ``-- --rounds N --duration-s S``
    (5 rounds of 2 s by default: about 2 minutes on 2 cores), ``-- --out DIR``.
    """
    session.install("-e", ".")
    session.run("python", "-m", "benchmarks.releases", *session.posargs)


@nox.session
def bench_text(session: nox.Session) -> None:
    """Text streams' frontend CPU per output token: trio_enginecore.text.AsyncLLM over our
    client against vLLM 0.34's own AsyncLLM, each on vLLM 0.34's real engine core (the
    counter executor, zero step cost), C = 64 and 512, alternating in one run.

    Needs the vLLM 0.34 environment that ``nox -s "interop(vllm='0.34')"`` builds (or,
    when that is not built, the Python in ``$TRIO_ENGINECORE_VLLM_PYTHON``: an environment
    with ``vllm serve``'s dependencies); nothing is built here (without either the
    session fails, saying so). Writes
    benchmarks/results/text.{json,md}: about 4 minutes on 2 cores. Run it on a quiet
    machine: the report states the load, and a measurement that other programs disturbed
    is taken again. ``-- --quick`` is a smoke run into a new temporary directory;
    ``-- --rounds N``, ``-- --out DIR``, ``-- --no-profile``.
    """
    env_dir = _vllm_env_dir(BENCH_TEXT_VLLM_RELEASE)
    if not (env_dir / "recipe.json").exists():
        session.error(
            f"no vLLM {BENCH_TEXT_VLLM_RELEASE} environment at {env_dir}: "
            f"`nox -s \"interop(vllm='{BENCH_TEXT_VLLM_RELEASE}')\"` builds it"
        )
    session.install("-e", ".[text]")
    session.run(
        "python",
        "-m",
        "benchmarks.text",
        "--vllm-python",
        str(env_dir / "bin" / "python"),
        *session.posargs,
    )


@nox.session
def bench_server(session: nox.Session) -> None:
    """OpenAI servers side by side: ours (``trio-enginecore api-server --vllm``), vLLM's
    Python server (``vllm serve``, one API server) and its Rust frontend (``vllm-rs
    serve``), each on vLLM 0.34's real engine core (the counter executor, zero step
    cost), the same load generator for all: streamed 32/512 completions at C = 64 and
    256, non-streamed 32/16 at C = 64. Requests/s, tokens/s, TTFT, inter-token latency,
    frontend CPU per output token, tokens per SSE event; ours ÷ each other frontend.

    Needs the vLLM 0.34 environment that ``nox -s "interop(vllm='0.34')"`` builds (or,
    when that is not built, the Python in ``$TRIO_ENGINECORE_VLLM_PYTHON``: an environment
    with ``vllm serve``'s dependencies); nothing is built here (without either the
    session fails, saying so). Writes
    benchmarks/results/openai_server.{json,md,png}: about 10 minutes on 2 cores. Run it
    on a quiet machine: three frontends, an engine and the load generator share the
    cores. ``-- --quick`` is a smoke run (about 2 minutes, most of it the three servers
    starting) into a new temporary directory; ``-- --rounds N``, ``-- --out DIR``,
    ``-- --frontends ours vllm vllm-rs``.
    """
    env_dir = _vllm_env_dir(BENCH_SERVER_VLLM_RELEASE)
    vllm = ["--vllm-python", str(env_dir / "bin" / "python")]
    if not (env_dir / "recipe.json").exists():
        given = os.environ.get("TRIO_ENGINECORE_VLLM_PYTHON")
        if not given:
            session.error(
                f"no vLLM {BENCH_SERVER_VLLM_RELEASE} environment at {env_dir}: "
                f"`nox -s \"interop(vllm='{BENCH_SERVER_VLLM_RELEASE}')\"` builds it"
            )
        session.log(f"no environment at {env_dir}: using $TRIO_ENGINECORE_VLLM_PYTHON, {given}")
        vllm = ["--vllm-python", given]
    # matplotlib (the chart) from the bench group; py-spy is not needed here.
    chart = [r for r in _group("bench") if r.startswith("matplotlib")]
    session.install("-e", ".[server]", *chart)
    session.run("python", "-m", "benchmarks.openai_server", *vllm, *session.posargs)


# The CPU-only vLLM environments of the interop session, one per vLLM release: vLLM's
# engine core and clients run for real, only the model executor is ours
# (tests/interop/vllm_side/). vLLM pins a CUDA torch: the CPU build is installed first
# and vLLM itself without its dependencies, then only what the engine-core and client
# imports need. xgrammar without its dependencies too (its triton is about 1 GB and
# GPU-only). Any change to a release's recipe changes its environment's directory
# name, so the next run builds that one afresh.
VLLM_ENV_PYTHON = "3.11"  # the CPU torch wheel is cp311
_VLLM_033_DEPS = [
    "packaging",
    "numpy",
    "msgspec",
    "pyzmq>=25",
    "cloudpickle",
    "psutil",
    "pydantic>=2.12",
    "pillow>=13",
    "regex",
    "cbor2",
    "cachetools",
    "pybase64",
    "py-cpuinfo",
    "uvloop",
    "prometheus_client>=0.18",
    "partial-json-parser",
    "requests>=2.33",
    "transformers>=5.16.1,<5.21",
    "huggingface_hub>=1.31",
    "tokenizers>=0.23.2",
    "aiohttp>=3.14.4",
    "openai>=2.25",
    "oss-harmony>=0.0.11",
    "fastapi>=0.133,<0.137",
    "starlette>=1.0.1",
    "llguidance>=1.7,<1.8",
    "apache-tvm-ffi==0.1.11",
    "einops",
    # vLLM's command-line interface (`vllm serve --headless`, which the client launches
    # for VllmEngines) imports its HTTP server's modules even headless.
    "uvicorn",
    "watchfiles",
    "orjson",
    # vLLM's OpenAI server itself (`vllm serve` with its API server, which the HTTP
    # differential tests run: tests/interop/vllm_server.py) imports these too; both
    # releases declare them.
    "prometheus-fastapi-instrumentator>=8.0.0",
    "model-hosting-container-standards>=0.1.14,<1.0.0",
]
# What vLLM 0.34.0 raised of what these environments install (filelock comes with torch).
_VLLM_034_RAISED = [
    "transformers>=5.16.1,<5.23.0",
    "huggingface_hub>=2.0.0",
    "tokenizers>=0.23.3",
    "filelock>=4.2.4",
]


def _raise_requirements(deps: list[str], raised: list[str]) -> list[str]:
    """``deps`` with each requirement of ``raised`` put in place of the one of the same
    project (appended where ``deps`` has none)."""

    def project(requirement: str) -> str:
        return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    new = {project(requirement): requirement for requirement in raised}
    result = [new.pop(project(requirement), requirement) for requirement in deps]
    return result + list(new.values())


VLLM_RECIPES: dict[str, dict[str, list[str]]] = {
    "0.33": {
        "torch": ["torch==2.13.0+cpu"],
        "deps": _VLLM_033_DEPS,
        "no_deps": ["vllm==0.33.0", "xgrammar==0.2.8"],
    },
    # vLLM 0.34 still pins torch 2.14.0; CPU torch 2.13.0 serves the engine core as it
    # does for 0.33. Its CPU platform refuses to build a config on x86 without Triton:
    # the tests answer that check themselves (tests/interop/vllm_side/triton_check.py).
    "0.34": {
        "torch": ["torch==2.13.0+cpu"],
        "deps": _raise_requirements(_VLLM_033_DEPS, _VLLM_034_RAISED),
        "no_deps": ["vllm==0.34.0", "xgrammar==0.2.8"],
    },
}
VLLM_RELEASES = list(VLLM_RECIPES)
BENCH_VLLM_RELEASE = "0.33"  # benchmarks/vllm_worker.py is written for 0.33's client
BENCH_TEXT_VLLM_RELEASE = "0.34"  # benchmarks/vllm_text_worker.py: 0.34's AsyncLLM
BENCH_SERVER_VLLM_RELEASE = "0.34"  # benchmarks/openai_server.py: the 0.34 API our server frames
_VLLM_ENV_CHECK = (
    "from vllm.v1.engine.core_client import AsyncMPClient, SyncMPClient; "
    "from vllm.v1.engine.core import EngineCoreProc; "
    "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
)
# Environments named before there was more than one release: .nox/vllm-<hash>, 0.33's.
_UNVERSIONED_ENV = re.compile(r"vllm-[0-9a-f]{12}")


def _vllm_recipe(release: str) -> dict[str, Any]:
    return {"python": VLLM_ENV_PYTHON, **VLLM_RECIPES[release]}


def _vllm_env_dir(release: str) -> Path:
    """Where the environment of ``release``'s current recipe lives:
    ``.nox/vllm-<release>-<hash of the recipe>``."""
    recipe = json.dumps(_vllm_recipe(release), sort_keys=True).encode()
    digest = hashlib.sha256(recipe).hexdigest()[:12]
    return Path(".nox").resolve() / f"vllm-{release}-{digest}"


def _built_vllm_pythons() -> dict[str, str]:
    """The Python of every release whose environment is complete (built already)."""
    return {
        release: str(_vllm_env_dir(release) / "bin" / "python")
        for release in VLLM_RELEASES
        if (_vllm_env_dir(release) / "recipe.json").exists()
    }


def _vllm_env(session: nox.Session, release: str) -> Path:
    """The Python of ``release``'s vLLM environment, built unless a complete one is cached.

    It lives in ``.nox/vllm-<release>-<hash of the recipe>``; a build that did not
    finish leaves no ``recipe.json`` and is built again. Environments of the same
    release's older recipes are removed (2.2 GB each), never another release's.
    """
    recipe = _vllm_recipe(release)
    target = _vllm_env_dir(release)
    python = target / "bin" / "python"
    marker = target / "recipe.json"
    if marker.exists():
        session.log(f"reusing the vLLM {release} environment {target}")
        return python
    stale = [path for path in target.parent.glob(f"vllm-{release}-*") if path != target]
    if release == "0.33":
        stale += [p for p in target.parent.glob("vllm-*") if _UNVERSIONED_ENV.fullmatch(p.name)]
    for path in stale:
        session.log(f"removing {path}")
        shutil.rmtree(path)
    start = time.monotonic()
    # The stdlib venv gives the environment its own pip: pip (not uv) resolves the CPU
    # torch from this machine's find-links, where uv would fetch a CUDA build.
    session.run("python", "-m", "venv", str(target))
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    session.run(*pip, *recipe["torch"], *recipe["deps"], external=True)
    session.run(*pip, "--no-deps", "--only-binary", ":all:", *recipe["no_deps"], external=True)
    session.run(
        str(python), "-c", _VLLM_ENV_CHECK, external=True, env={"VLLM_TARGET_DEVICE": "cpu"}
    )
    elapsed = time.monotonic() - start
    marker.write_text(json.dumps({**recipe, "build_seconds": round(elapsed)}, indent=2) + "\n")
    session.log(f"built the vLLM {release} environment {target} in {elapsed:.0f} s")
    return python


@nox.session(python=VLLM_ENV_PYTHON)
@nox.parametrize("vllm", VLLM_RELEASES)
def interop(session: nox.Session, vllm: str) -> None:
    """Interop tests against real vLLM (CPU-only; not part of the default run).

    One session per vLLM release (``nox -s "interop(vllm='0.34')"``); ``nox -s interop``
    runs every release's in turn, oldest first. Each builds (once; then reused) a
    separate environment with that vLLM and a CPU torch, then runs tests/interop:
    vLLM's own clients and engine core, in that environment's processes, against ours
    in this session's, over ZeroMQ only. A first build downloads about 500 MB and
    takes a few minutes.

    The tests get the release's Python in ``TRIO_ENGINECORE_VLLM_PYTHON``, the release
    in ``TRIO_ENGINECORE_VLLM_RELEASE`` and, in ``TRIO_ENGINECORE_VLLM_PYTHONS``, a
    JSON object of the Python of every release whose environment is built already
    (this one's included): a test that needs two releases at once skips unless both
    are there. No session builds another release's environment; ``nox -s interop``
    has built the older one by the time the newer one's session runs.
    """
    vllm_python = _vllm_env(session, vllm)
    session.install("-e", ".", *_group("test"))
    session.run(
        "pytest",
        "tests/interop",
        *session.posargs,
        env={
            "TRIO_ENGINECORE_VLLM_PYTHON": str(vllm_python),
            "TRIO_ENGINECORE_VLLM_RELEASE": vllm,
            "TRIO_ENGINECORE_VLLM_PYTHONS": json.dumps(_built_vllm_pythons(), sort_keys=True),
        },
    )

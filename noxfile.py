"""Developer sessions for trio-enginecore.

A bare ``nox`` runs the default set: lint, typecheck, tests and docs. ``nox -l`` lists
every session with its description. ``nox -s interop`` (not in the default set) runs
the tests against real vLLM 0.33.0; ``nox -s ray`` (not in it either) the tests of
engines placed by Ray.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

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
    session.run("pytest", *session.posargs)


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
    instead of its value fails the build too: Sphinx does not warn about that.
    """
    session.install("-e", ".", *_group("docs"))
    session.run(
        "sphinx-build", "-E", "-W", "--keep-going", "-n", "-b", "html", "docs", "docs/_build/html"
    )
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
    """Run the demo against the built-in reference engine."""
    session.install("-e", ".")
    session.run("trio-enginecore", "demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The side-by-side benchmark (Trio vs vLLM's AsyncMPClient, asyncio, blocking pyzmq).

    Writes benchmarks/results/results.{json,md,png}. vLLM 0.33's real ``AsyncMPClient``
    is measured when the interop environment that ``nox -s interop`` builds is complete
    (nothing is built here); without it the report says so. ``-- --quick`` is a smoke
    run: it writes a new temporary directory instead (named on stderr), never the
    committed results; ``-- --out DIR`` writes DIR, for either. ``-- --redraw
    benchmarks/results/results.json`` only draws the chart again.
    """
    session.install("-e", ".", *_group("bench"))
    vllm = []
    env_dir = _vllm_env_dir()
    if (env_dir / "recipe.json").exists():
        vllm = ["--vllm-python", str(env_dir / "bin" / "python")]
    else:
        session.log(f"no vLLM environment at {env_dir}: `nox -s interop` builds it")
    session.run("python", "-m", "benchmarks.run", *vllm, *session.posargs)


# The CPU-only vLLM 0.33.0 environment of the interop session: vLLM's engine core and
# clients run for real, only the model executor is ours (tests/interop/vllm_side/).
# vLLM pins a CUDA torch: the CPU build is installed first and vLLM itself without its
# dependencies, then only what the engine-core and client imports need. xgrammar
# without its dependencies too (its triton is about 1 GB and GPU-only). Any change
# here changes the environment's directory name, so the next run builds it afresh.
VLLM_ENV_PYTHON = "3.11"  # the CPU torch wheel is cp311
VLLM_ENV_RECIPE: dict[str, list[str]] = {
    "torch": ["torch==2.13.0+cpu"],
    "deps": [
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
    ],
    "no_deps": ["vllm==0.33.0", "xgrammar==0.2.8"],
}
_VLLM_ENV_CHECK = (
    "from vllm.v1.engine.core_client import AsyncMPClient, SyncMPClient; "
    "from vllm.v1.engine.core import EngineCoreProc; "
    "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
)


def _vllm_env_dir() -> Path:
    """Where the vLLM environment of the current recipe lives: ``.nox/vllm-<hash>``."""
    recipe = {"python": VLLM_ENV_PYTHON, **VLLM_ENV_RECIPE}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return Path(".nox").resolve() / f"vllm-{digest}"


def _vllm_env(session: nox.Session) -> Path:
    """The vLLM environment's directory, built unless a complete one is cached.

    It lives in ``.nox/vllm-<hash of the recipe>``; a build that did not finish leaves
    no ``recipe.json`` and is built again, and environments of older recipes are
    removed (2.2 GB each).
    """
    recipe = {"python": VLLM_ENV_PYTHON, **VLLM_ENV_RECIPE}
    target = _vllm_env_dir()
    cache = target.parent
    python = target / "bin" / "python"
    marker = target / "recipe.json"
    if marker.exists():
        session.log(f"reusing the vLLM environment {target}")
        return python
    for stale in cache.glob("vllm-*"):
        session.log(f"removing {stale}")
        shutil.rmtree(stale)
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
    session.log(f"built the vLLM environment {target} in {elapsed:.0f} s")
    return python


@nox.session(python=VLLM_ENV_PYTHON)
def interop(session: nox.Session) -> None:
    """Interop tests against real vLLM 0.33.0 (CPU-only; not part of the default run).

    Builds (once; then reused) a separate environment with vLLM 0.33.0 and a CPU
    torch, then runs tests/interop: vLLM's own clients and engine core, in that
    environment's processes, against ours in this session's, over ZeroMQ only. The
    first run downloads about 500 MB and takes a few minutes.
    """
    vllm_python = _vllm_env(session)
    session.install("-e", ".", *_group("test"))
    session.run(
        "pytest",
        "tests/interop",
        *session.posargs,
        env={"TRIO_ENGINECORE_VLLM_PYTHON": str(vllm_python)},
    )

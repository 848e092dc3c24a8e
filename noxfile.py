"""Developer sessions for trio-enginecore.

A bare ``nox`` runs the default set: lint, typecheck, tests and docs. ``nox -l`` lists
every session with its description.
"""

from __future__ import annotations

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
def demo(session: nox.Session) -> None:
    """Run the demo against the built-in reference engine."""
    session.install("-e", ".")
    session.run("trio-enginecore", "demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The side-by-side benchmark (Trio vs vLLM-style asyncio vs blocking pyzmq).

    Writes benchmarks/results/results.{json,md,png}. ``-- --quick`` is a smoke run: it
    writes a new temporary directory instead (named on stderr), never the committed
    results; ``-- --out DIR`` writes DIR, for either. ``-- --redraw
    benchmarks/results/results.json`` only draws the chart again.
    """
    session.install("-e", ".", *_group("bench"))
    session.run("python", "-m", "benchmarks.run", *session.posargs)

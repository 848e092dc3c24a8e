"""The README's first screen: `trio-enginecore api-server`, the curl call and the
`openai` program, run as a reader would, against a real server process."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SHOWN_URL = "http://127.0.0.1:8000"


def first_screen() -> str:
    text = README.read_text()
    return text[: text.index("\n## ")]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """`trio-enginecore api-server` as the README starts it, on a free port."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_enginecore", "api-server", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    url = None
    for line in process.stderr:
        if line.startswith("trio-enginecore api-server: serving"):
            url = line.split()[-1]
            break
    try:
        assert url is not None, f"the server exited with code {process.wait()}"
        yield url
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0
        process.stderr.close()


def test_the_readme_starts_the_server_with_the_command_it_shows() -> None:
    screen = first_screen()
    assert "$ trio-enginecore api-server" in screen
    assert f"serving 'ngram' on {SHOWN_URL}" in screen


def test_the_readmes_openai_program_prints_what_the_readme_says(
    server_url: str, tmp_path: Path
) -> None:
    shown = re.search(
        r"```python\n(?P<program>.*?)```\n.*?```text\n(?P<output>.*?)```", first_screen(), re.S
    )
    assert shown is not None
    assert len(shown["program"].splitlines()) <= 12
    assert SHOWN_URL in shown["program"]
    script = tmp_path / "readme_example.py"
    script.write_text(shown["program"].replace(SHOWN_URL, server_url))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout == shown["output"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_readmes_curl_call_answers_what_the_readme_shows(server_url: str) -> None:
    screen = first_screen()
    call = re.search(r"^\$ (curl .*?)\n(?P<answer>\{.*)$", screen, re.S | re.M)
    assert call is not None
    command = call.group(1).replace("\\\n", " ").replace("localhost:8000", server_url)
    answer = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    # The README elides what changes from run to run (ids, times) and the tail with "…".
    shown = call["answer"].splitlines()[0]
    pattern = ".*?".join(re.escape(part) for part in shown.split("…"))
    assert re.match(pattern, answer), f"{answer!r} does not match the README's {shown!r}"

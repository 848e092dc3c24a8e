"""benchmarks/profile_summary.py reads py-spy's collapsed stacks into shares by function."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.profile_summary import frame_name, main, read_samples, summarise

# Three stacks in py-spy's ``--format raw`` form: frames outermost first, then a count.
_MODULE = "<module> (trio-enginecore:8)"
_RUN = "run (trio/_core/_run.py:2520)"
_RECEIVE = "receive_outputs (trio_enginecore/client/_receive.py:57)"
PROFILE = "\n".join(
    [
        f"{_MODULE};{_RUN};{_RECEIVE};decode (trio_enginecore/serial.py:240) 6",
        f"{_MODULE};{_RUN};{_RECEIVE};push (trio_enginecore/client/_stream.py:95) 3",
        f"{_MODULE};_find_and_load (<frozen importlib._bootstrap>:1176) 1",
    ]
)


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.txt"
    path.write_text(PROFILE)
    return path


def test_a_frame_is_named_by_its_function_and_file() -> None:
    assert frame_name("push (trio_enginecore/client/_stream.py:95)") == "push (_stream.py)"
    assert frame_name("<unknown>") == "<unknown>"


def test_self_counts_go_to_the_innermost_frame_and_totals_to_every_frame(profile: Path) -> None:
    kept, own, total = summarise(read_samples(profile))
    assert kept == 10
    assert own["decode (serial.py)"] == 6
    assert own["push (_stream.py)"] == 3
    assert total["receive_outputs (_receive.py)"] == 9
    assert total["<module> (trio-enginecore)"] == 10


def test_under_keeps_the_samples_through_a_function_and_drop_leaves_some_out(
    profile: Path,
) -> None:
    kept, own, _ = summarise(read_samples(profile), under="receive_outputs")
    assert kept == 9
    assert "_find_and_load (<frozen importlib._bootstrap>)" not in own
    kept, _, total = summarise(read_samples(profile), drop=("_find_and_load",))
    assert kept == 9
    assert "_find_and_load (<frozen importlib._bootstrap>)" not in total


def test_the_command_prints_shares_of_the_samples_kept(
    profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(profile), "--under", "receive_outputs"]) == 0
    printed = capsys.readouterr().out
    assert "9 samples under receive_outputs" in printed
    assert " 66.7 %  decode (serial.py)" in printed
    assert main([str(profile), "--under", "nothing_by_that_name"]) == 1


def test_the_command_piped_into_a_reader_that_stops_early_ends_without_a_traceback(
    tmp_path: Path,
) -> None:
    # Far more output than a pipe holds, so that the writer meets the closed pipe.
    many = tmp_path / "many.txt"
    many.write_text("\n".join(f"{_MODULE};function_{i} (a/b.py:1) 1" for i in range(5000)))
    repo = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "benchmarks.profile_summary", str(many), "--top", "5000"]
    with subprocess.Popen(
        command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as reader:
        assert reader.stdout is not None
        assert reader.stderr is not None
        assert reader.stdout.readline() == b"5000 samples\n"
        reader.stdout.close()  # as `| head -1` does
        stderr = reader.stderr.read()
    assert b"Traceback" not in stderr
    assert reader.returncode == 1

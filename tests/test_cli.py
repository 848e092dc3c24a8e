"""The ``trio-enginecore`` command line: Ctrl-C, unusable addresses, bad arguments, keys.

The commands run as real processes (``python -m trio_enginecore ...``); the library's
side of the same rules (the typed ``AddressError``, ``write_key_pair``'s refusals) is
checked in-process beside them.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio

from benchmarks import run
from trio_enginecore import (
    CoordinatorAddresses,
    EngineConfig,
    RemoteEngines,
    open_coordinator,
    open_engine_client,
)
from trio_enginecore._bench import ProgressLine
from trio_enginecore._curve import CurveKeyPair, write_key_pair
from trio_enginecore.errors import AddressError, EngineStartupError
from trio_enginecore.protocol import EngineCoreRequest

from .support import children_of, expected, process_is_running

CLI = [sys.executable, "-m", "trio_enginecore"]

# No local interface has an address of TEST-NET-1 (RFC 5737): binding it fails.
UNBINDABLE = "tcp://192.0.2.1:5555"


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


@contextmanager
def tcp_port_in_use() -> Iterator[str]:
    """A loopback TCP address another program is listening on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield f"tcp://127.0.0.1:{holder.getsockname()[1]}"


def ipc(tmp_path: Path, name: str) -> str:
    return f"ipc://{tmp_path}/{name}"


# --------------------------------------------------------------------------- Ctrl-C


class Interrupted:
    """What a command did after SIGINT: its exit code, its output, its children."""

    def __init__(self, code: int, stdout: str, stderr: str, children: list[int]) -> None:
        self.code = code
        self.stdout = stdout
        self.stderr = stderr
        self.children = children


async def interrupt_when_running(
    args: list[str], running: str, *, whole_group: bool
) -> Interrupted:
    """Start the command, wait until its stdout or stderr shows ``running``, note its
    children, send SIGINT (to the process, or to its process group as a terminal's
    Ctrl-C does) and collect everything until it exits."""
    process = await trio.lowlevel.open_process(
        [*CLI, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    output = {"stdout": bytearray(), "stderr": bytearray()}
    seen = trio.Event()
    children: list[int] = []
    try:
        async with trio.open_nursery() as nursery:

            async def pump(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
                async for chunk in stream:
                    into += chunk
                    if running.encode() in output["stdout"] + output["stderr"]:
                        seen.set()

            assert process.stdout is not None
            assert process.stderr is not None
            nursery.start_soon(pump, process.stdout, output["stdout"])
            nursery.start_soon(pump, process.stderr, output["stderr"])
            with trio.fail_after(90):
                await seen.wait()
            children = children_of(process.pid)
            if whole_group:
                os.killpg(process.pid, signal.SIGINT)
            else:
                process.send_signal(signal.SIGINT)
            with trio.fail_after(60):
                await process.wait()
            # The pumps end at the pipes' end of file; a child left holding them would
            # keep them open (and fail the test's check of the children anyway).
            nursery.cancel_scope.deadline = trio.current_time() + 5
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return Interrupted(
        process.returncode,
        output["stdout"].decode(errors="replace"),
        output["stderr"].decode(errors="replace"),
        children,
    )


COMMANDS_TO_INTERRUPT = {
    # (arguments, what shows it is running: the engine is up)
    "demo": (["demo"], "Engine ready"),
    "bench": (["bench", "--duration-s", "60", "--concurrency", "4"], "engine ready"),
    "bench-tcp": (
        ["bench", "--duration-s", "60", "--concurrency", "4", "--transport", "tcp"],
        "engine ready",
    ),
}


@pytest.mark.parametrize(
    ("command", "whole_group"),
    [("demo", False), ("demo", True), ("bench", False), ("bench", True), ("bench-tcp", False)],
    ids=["demo", "demo-process-group", "bench", "bench-process-group", "bench-tcp"],
)
async def test_ctrl_c_exits_130_with_one_line_and_leaves_no_child_process(
    command: str, whole_group: bool
) -> None:
    args, running = COMMANDS_TO_INTERRUPT[command]
    result = await interrupt_when_running(args, running, whole_group=whole_group)
    assert result.children, "the engine was running when the signal was sent"
    assert result.code == 130, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 3, result.stderr
    assert lines[-1] == f"trio-enginecore {args[0]}: interrupted"
    assert "Traceback" not in result.stderr
    assert [pid for pid in result.children if process_is_running(pid)] == []


def test_bench_refuses_a_concurrency_below_1_as_a_usage_error() -> None:
    result = run_cli("bench", "--concurrency", "0")
    assert result.returncode == 2
    assert "argument --concurrency: must be at least 1, got 0" in result.stderr
    assert "interrupted" not in result.stderr


# ------------------------------------------------------------- unusable addresses


async def _serves_a_request_exactly() -> None:
    async with open_engine_client(EngineConfig()) as client:
        prompt = [7, 8, 9]
        tokens: list[int] = []
        async with client.stream(EngineCoreRequest.for_tokens(prompt, max_tokens=5)) as outputs:
            async for output in outputs:
                tokens += output.new_token_ids
        assert tokens == expected(prompt, 5)


@pytest.mark.parametrize(
    ("where", "address", "reason"),
    [
        ("input", UNBINDABLE, "Cannot assign requested address"),
        ("input", "bogus://x", "Protocol not supported"),
        ("output", "tcp://127.0.0.1:notaport", "Invalid argument"),
    ],
)
async def test_a_client_given_an_unusable_address_raises_address_error_naming_it(
    tmp_path: Path, where: str, address: str, reason: str
) -> None:
    addresses = {"input": ipc(tmp_path, "in"), "output": ipc(tmp_path, "out"), where: address}
    with pytest.raises(AddressError) as caught:
        async with open_engine_client(
            EngineConfig(),
            input_address=addresses["input"],
            output_address=addresses["output"],
            ready_timeout_s=5,
        ):
            pytest.fail("the client must not start")
    error = caught.value
    assert isinstance(error, EngineStartupError)
    assert (error.address, error.reason) == (address, reason)
    assert where in error.role
    assert f"cannot use address {address!r}" in str(error)
    await _serves_a_request_exactly()


async def test_a_client_given_a_port_in_use_raises_address_error_then_another_serves(
    tmp_path: Path,
) -> None:
    with tcp_port_in_use() as busy, pytest.raises(AddressError) as caught:
        async with open_engine_client(
            EngineConfig(), input_address=busy, output_address=ipc(tmp_path, "out")
        ):
            pytest.fail("the client must not start")
    assert caught.value.address == busy
    assert caught.value.reason == "Address already in use"
    await _serves_a_request_exactly()


async def test_remote_engines_on_an_interface_this_host_lacks_raise_address_error() -> None:
    remote = RemoteEngines(UNBINDABLE)
    with pytest.raises(AddressError) as caught:
        async with open_engine_client(EngineConfig(), remote=remote, ready_timeout_s=5):
            pytest.fail("the client must not start")
    assert caught.value.address.startswith("tcp://192.0.2.1:")
    assert caught.value.reason == "Cannot assign requested address"
    await _serves_a_request_exactly()


async def test_a_coordinator_given_a_port_in_use_raises_address_error(tmp_path: Path) -> None:
    with tcp_port_in_use() as busy:
        addresses = CoordinatorAddresses(
            stats=ipc(tmp_path, "stats"), engine_publish=ipc(tmp_path, "engines"), publish=busy
        )
        with pytest.raises(AddressError) as caught:
            async with open_coordinator(1, addresses=addresses):
                pytest.fail("the coordinator must not start")
    assert (caught.value.address, caught.value.reason) == (busy, "Address already in use")
    assert caught.value.role == "coordinator publish"


async def test_a_client_given_a_malformed_coordinator_address_raises_address_error(
    tmp_path: Path,
) -> None:
    config = EngineConfig(data_parallel_size=2, data_parallel_external_lb=True)
    coordinator = CoordinatorAddresses(
        stats=ipc(tmp_path, "stats"), engine_publish=ipc(tmp_path, "engines"), publish="bogus://x"
    )
    with pytest.raises(AddressError) as caught:
        async with open_engine_client(
            config,
            coordinator=coordinator,
            input_address=ipc(tmp_path, "in"),
            output_address=ipc(tmp_path, "out"),
            ready_timeout_s=5,
        ):
            pytest.fail("the client must not start")
    assert (caught.value.address, caught.value.reason) == ("bogus://x", "Protocol not supported")


@pytest.mark.parametrize(
    ("args", "address", "reason"),
    [
        (["--input-address", "bogus://x", "--output-address", "ipc:///tmp/te-o"], "bogus://x",
         "Protocol not supported"),
        (["--input-address", "ipc:///tmp/te-i", "--output-address", "tcp://127.0.0.1:notaport"],
         "tcp://127.0.0.1:notaport", "Invalid argument"),
        (["--handshake-address", "bogus://x"], "bogus://x", "Protocol not supported"),
    ],
    ids=["input", "output", "handshake"],
)  # fmt: skip
def test_serve_given_an_unusable_address_says_so_in_one_line_and_exits_2(
    args: list[str], address: str, reason: str
) -> None:
    result = run_cli("serve", *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"trio-enginecore serve: cannot use address {address!r}")
    assert result.stderr.rstrip().endswith(reason)


@pytest.mark.parametrize("address", [UNBINDABLE, "bogus://x", "busy"])
def test_coordinator_given_an_unusable_address_says_so_in_one_line_and_exits_2(
    tmp_path: Path, address: str
) -> None:
    with tcp_port_in_use() as busy:
        stats = busy if address == "busy" else address
        result = run_cli(
            "coordinator", "--engines", "1", "--stats-address", stats,
            "--engine-publish-address", ipc(tmp_path, "engines"),
            "--publish-address", ipc(tmp_path, "clients"),
        )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(
        f"trio-enginecore coordinator: cannot use address {stats!r} (coordinator stats): "
    )


def test_help_texts_give_exit_code_2_for_addresses() -> None:
    serve = run_cli("serve", "--help").stdout
    assert "2 bad command line or an address" in " ".join(serve.split())
    coordinator = " ".join(run_cli("coordinator", "--help").stdout.split())
    assert "2 bad command line or an address that cannot be bound" in coordinator


# --------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("engines", ["0", "-1", "two"])
def test_coordinator_needs_at_least_one_engine_as_a_usage_error(
    tmp_path: Path, engines: str
) -> None:
    result = run_cli(
        "coordinator", f"--engines={engines}", "--stats-address", ipc(tmp_path, "s"),
        "--engine-publish-address", ipc(tmp_path, "e"), "--publish-address", ipc(tmp_path, "p"),
    )  # fmt: skip
    assert result.returncode == 2
    assert "usage: trio-enginecore coordinator" in result.stderr
    assert "argument --engines:" in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- keygen


def test_keygen_writes_a_pair_and_refuses_to_overwrite_it_without_force(
    tmp_path: Path,
) -> None:
    written = run_cli("keygen", "client", "--directory", str(tmp_path))
    assert written.returncode == 0, written.stderr
    public, secret = tmp_path / "client.key", tmp_path / "client.key_secret"
    keys = CurveKeyPair.load(secret)
    assert oct(secret.stat().st_mode & 0o777) == oct(0o600)
    before = (public.read_bytes(), secret.read_bytes())

    refused = run_cli("keygen", "client", "--directory", str(tmp_path))
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert "already exists; pass --force" in refused.stderr
    assert (public.read_bytes(), secret.read_bytes()) == before

    forced = run_cli("keygen", "client", "--directory", str(tmp_path), "--force")
    assert forced.returncode == 0, forced.stderr
    assert CurveKeyPair.load(secret).public != keys.public
    assert oct(secret.stat().st_mode & 0o777) == oct(0o600)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../escape"])
def test_keygen_refuses_a_name_that_is_not_a_file_name_stem(tmp_path: Path, name: str) -> None:
    result = run_cli("keygen", name, "--directory", str(tmp_path / "keys"))
    assert result.returncode == 2
    assert "usage: trio-enginecore keygen" in result.stderr
    assert "argument name:" in result.stderr
    assert not (tmp_path / "keys").exists()


def test_keygen_help_says_what_each_exit_code_means() -> None:
    text = " ".join(run_cli("keygen", "--help").stdout.split())
    assert "--force" in text
    assert "1 a file of the pair already exists (nothing written)" in text
    assert "2 bad command line" in text


def test_write_key_pair_refuses_existing_files_and_bad_names(tmp_path: Path) -> None:
    public, secret = write_key_pair(tmp_path, "engine-1")
    first = CurveKeyPair.load(secret)
    with pytest.raises(FileExistsError, match="not overwriting") as caught:
        write_key_pair(tmp_path, "engine-1")
    assert caught.value.filename == str(secret)
    assert CurveKeyPair.load(secret) == first
    # Half a pair left by someone else is not replaced either, nor completed.
    public.unlink()
    (tmp_path / "engine-2.key").write_text("someone else's\n")
    with pytest.raises(FileExistsError):
        write_key_pair(tmp_path, "engine-2")
    assert not (tmp_path / "engine-2.key_secret").exists()
    assert (tmp_path / "engine-2.key").read_text() == "someone else's\n"

    again_public, again_secret = write_key_pair(tmp_path, "engine-1", overwrite=True)
    assert (again_public, again_secret) == (public, secret)
    assert CurveKeyPair.load(secret) != first
    for name in ["", ".", "..", "a/b"]:
        with pytest.raises(ValueError, match="name"):
            write_key_pair(tmp_path, name)


# ------------------------------------------------------------------- bench progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_line_on_a_terminal() -> None:
    stream = Terminal()
    progress = ProgressLine(stream)
    progress.note("batch C=1")
    for n in range(3):
        progress.update(f"  {n} tokens")
    progress.done("  3 tokens")
    assert stream.getvalue() == "batch C=1\n\r  0 tokens\r  1 tokens\r  2 tokens\r  3 tokens\n"


def test_progress_off_a_terminal_is_plain_lines_a_few_seconds_apart() -> None:
    stream = io.StringIO()
    progress = ProgressLine(stream, interval_s=3600)
    progress.note("batch C=1")
    for n in range(100):
        progress.update(f"  {n} tokens")
    progress.done("  100 tokens")
    assert stream.getvalue() == "batch C=1\n"
    assert "\r" not in stream.getvalue()


# ------------------------------------------------------- benchmarks/run.py (nox -s bench)

COMMITTED = run.RESULTS_DIR


def committed_results() -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(COMMITTED.iterdir())}


def test_a_quick_comparison_writes_a_temporary_directory_and_says_where(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = committed_results()
    measured = json.loads((COMMITTED / "results.json").read_text())["runs"]
    # The measurements themselves are the quick comparison's test (test_bench.py).
    monkeypatch.setattr(run, "execute", lambda groups, repeats: measured)
    assert run.main(["--quick"]) == 0
    where = capsys.readouterr().err.strip().splitlines()[-1]
    assert where.startswith("results written to ")
    out = Path(where.removeprefix("results written to "))
    try:
        assert out.resolve() != COMMITTED
        assert {"results.json", "results.md"} <= {path.name for path in out.iterdir()}
        assert json.loads((out / "results.json").read_text())["quick"] is True
    finally:
        shutil.rmtree(out)
    assert committed_results() == before


def test_a_quick_comparison_never_writes_the_committed_results(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        run.main(["--quick", "--out", str(COMMITTED)])
    assert exited.value.code == 2
    assert "does not replace the committed figures" in capsys.readouterr().err


def test_a_full_comparison_writes_the_committed_results_unless_told_otherwise(
    tmp_path: Path,
) -> None:
    assert run.output_dir(None, quick=False) == COMMITTED
    assert run.output_dir(tmp_path, quick=False) == tmp_path
    assert run.output_dir(tmp_path, quick=True) == tmp_path


def test_the_chart_says_which_way_is_better_and_when_and_where_it_was_measured() -> None:
    machine = json.loads((COMMITTED / "results.json").read_text())["machine"]
    assert "lower is better" in run.panel_title(0.002)
    caption = run.figure_caption(machine, quick=False)
    assert machine["date"] in caption
    assert f"{machine['cpus']} CPUs ({machine['processor']})" in caption
    assert machine["platform"] in caption
    assert "Quick mode" in run.figure_caption(machine, quick=True)


def test_the_chart_is_redrawn_from_an_existing_results_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert run.main(["--redraw", str(COMMITTED / "results.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.png").read_bytes().startswith(b"\x89PNG")

"""The client launches vLLM's own engine cores (``VllmEngines``) and owns them.

For each rank the client runs ``COMMAND serve MODEL --headless --data-parallel-address
127.0.0.1 --data-parallel-rpc-port PORT [rank flags] ARGUMENTS`` in a session of its
own: vLLM's launcher, whose child is the engine core, one process group. What the
client promises of them:

- the command line and environment are exactly what ``VllmEngines`` says, and the
  flags the client sets itself cannot be given twice;
- the engines serve; they stop with the client's block, and with the client's
  process killed with SIGKILL (the lifeline's SIGIO reaches the whole group);
- an engine core that dies, or a launcher that dies leaving its engine core orphaned,
  is an ``EngineDeadError`` naming the rank, and nothing of the group is left;
- the ``restart`` policy restarts a rank from a new launcher;
- a vLLM that refuses to start is an ``EngineStartupError`` quoting vLLM's exception;
- vLLM's log lines reach ``trio_enginecore.engine.rank<N>`` at their own levels.

The processes here are ``tests/fake_vllm_cli.py``, a fake of vLLM's command line with
the real reference engine as its engine core; the real ``vllm serve --headless`` is
tested in the interop sessions (``tests/interop/test_client_launches_vllm.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    EngineStartupError,
    RemoteEngines,
    VllmEngines,
    open_engine_client,
)
from trio_enginecore.client import TrioMPClient
from trio_enginecore.client._multiprocess._vllm import (
    SET_BY_THE_CLIENT,
    parse_vllm_line,
    vllm_error_line,
)

from .support import (
    children_of,
    children_of_this_process,
    expected,
    process_is_running,
    read_line,
    stream_tokens,
)

FAKE_VLLM = Path(__file__).with_name("fake_vllm_cli.py").resolve()
LAUNCHER = "its vLLM launcher (vllm serve --headless)"
HANDSHAKE = "tcp://127.0.0.1:5555"


def fake_vllm(*arguments: str, **changes: Any) -> VllmEngines:
    """``VllmEngines`` running the fake vLLM CLI (``arguments``: its flags, the
    reference engine's among them; ``changes``: more of ``VllmEngines``'s fields)."""
    return VllmEngines("m", arguments, command=(sys.executable, str(FAKE_VLLM)), **changes)


def group_members(leader: int) -> list[int]:
    """The live processes of the process group ``leader`` leads (zombies aside)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == leader and fields[0] != "Z":
                members.append(int(entry.name))
    return members


async def gone_within(leaders: list[int], seconds: float) -> None:
    """Wait until no process of the groups ``leaders`` lead is left; fail after
    ``seconds``."""
    with trio.move_on_after(seconds):
        while any(group_members(leader) for leader in leaders):
            await trio.sleep(0.02)
    assert {leader: group_members(leader) for leader in leaders} == {
        leader: [] for leader in leaders
    }


def launchers(client: TrioMPClient) -> list[int]:
    """The pid of each rank's launcher, by rank."""
    pids = [engine.pid for engine in client.statistics().engines]
    assert None not in pids, pids
    return [pid for pid in pids if pid is not None]


def engine_core_of(launcher: int) -> int:
    """The launcher's one child: its engine core."""
    (child,) = children_of(launcher)
    return child


def kill_groups(leaders: list[int]) -> None:
    """Whatever a failed test left of these groups."""
    for leader in leaders:
        for pid in group_members(leader):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------ the command line


def test_one_engine_is_told_where_to_say_hello_and_nothing_of_ranks() -> None:
    vllm = VllmEngines("Qwen/Qwen3-0.6B", ["--max-model-len", "4096"])
    assert vllm.serve_command(0, "tcp://127.0.0.1:40123") == [
        "vllm",
        "serve",
        "Qwen/Qwen3-0.6B",
        "--headless",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        "40123",
        "--max-model-len",
        "4096",
    ]


def test_each_of_two_ranks_is_one_local_engine_starting_at_its_rank() -> None:
    vllm = VllmEngines(
        "m", ("--enforce-eager",), data_parallel_size=2, command=("/opt/vllm/bin/vllm",)
    )
    for rank in (0, 1):
        assert vllm.serve_command(rank, "tcp://127.0.0.1:40123") == [
            "/opt/vllm/bin/vllm",
            "serve",
            "m",
            "--headless",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            "40123",
            "--data-parallel-size",
            "2",
            "--data-parallel-size-local",
            "1",
            "--data-parallel-start-rank",
            str(rank),
            "--enforce-eager",
        ]


def test_a_command_given_as_one_word_is_one_word() -> None:
    vllm = VllmEngines("m", command="/opt/vllm/bin/vllm")
    assert vllm.command == ("/opt/vllm/bin/vllm",)
    assert vllm.serve_command(0, HANDSHAKE)[:3] == ["/opt/vllm/bin/vllm", "serve", "m"]


def test_engines_say_hello_over_tcp_only() -> None:
    with pytest.raises(ValueError, match="over TCP"):
        VllmEngines("m").serve_command(0, "ipc:///tmp/handshake")


@pytest.mark.parametrize("flag", SET_BY_THE_CLIENT)
@pytest.mark.parametrize("form", ["words", "equals", "underscores"])
def test_a_flag_the_client_sets_is_refused_in_arguments(flag: str, form: str) -> None:
    """In every spelling vLLM's parser reads: ``--flag value``, ``--flag=value``, and
    with underscores (``--data_parallel_size``)."""
    arguments = {
        "words": ["--enforce-eager", flag, "1"],
        "equals": [f"{flag}=1"],
        "underscores": ["--enforce-eager", "--" + flag[2:].replace("-", "_"), "1"],
    }[form]
    with pytest.raises(ValueError, match=f"arguments sets {flag}, which the client sets itself"):
        VllmEngines("m", arguments)


@pytest.mark.parametrize(
    ("alias", "flag"),
    [
        ("-dp", "--data-parallel-size"),
        ("-dpl", "--data-parallel-size-local"),
        ("-dpr", "--data-parallel-rank"),
        ("-dpn", "--data-parallel-rank"),
        ("-dpa", "--data-parallel-address"),
        ("-dpp", "--data-parallel-rpc-port"),
        ("-asc", "--api-server-count"),
        ("-dpe", "--data-parallel-external-lb"),
        ("-dph", "--data-parallel-hybrid-lb"),
    ],
)
def test_vllms_short_aliases_of_those_flags_are_refused_too(alias: str, flag: str) -> None:
    with pytest.raises(ValueError, match=f"arguments sets {flag}, which the client sets itself"):
        VllmEngines("m", [alias, "2"])


def test_other_flags_and_values_are_passed_as_they_are() -> None:
    arguments = ["--max_model_len=4096", "--served-model-name", "my_model", "--enforce-eager"]
    assert VllmEngines("m", arguments).serve_command(0, HANDSHAKE)[-4:] == arguments


def test_arguments_are_words_not_one_string() -> None:
    with pytest.raises(TypeError, match="a sequence of command-line words"):
        VllmEngines("m", "--max-model-len 4096")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": ""}, "Length of 'model' must be >= 1"),
        ({"command": ()}, "VllmEngines.command must be non-empty strings"),
        ({"command": ""}, "VllmEngines.command must be non-empty strings"),
        ({"command": ("python", "")}, "VllmEngines.command must be non-empty strings"),
        ({"data_parallel_size": 0}, "VllmEngines.data_parallel_size must be a positive integer"),
        ({"data_parallel_size": 2.0}, "VllmEngines.data_parallel_size must be a positive integer"),
    ],
)
def test_an_empty_model_or_command_or_no_rank_is_refused(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        VllmEngines(**{"model": "m", **fields})


@pytest.mark.parametrize("rank", [2, -1])
def test_rank_env_for_a_rank_there_is_not_is_refused(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"rank_env names rank\(s\) \[{rank}\].*\[0, 1\]"):
        VllmEngines(
            "m", data_parallel_size=2, rank_env={0: {}, rank: {"CUDA_VISIBLE_DEVICES": "1"}}
        )


@pytest.mark.parametrize(
    ("wrong", "right"),
    [
        ("argumnts", "arguments"),
        ("data_paralel_size", "data_parallel_size"),
        ("rank_envs", "rank_env"),
    ],
)
def test_a_misspelt_keyword_names_the_right_one(wrong: str, right: str) -> None:
    with pytest.raises(TypeError, match=rf"VllmEngines\(\).*'{wrong}'; did you mean '{right}'\?"):
        VllmEngines("m", **{wrong: 1})


def test_the_environment_is_the_clients_then_the_defaults_then_env_then_rank_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FROM_THE_CLIENT", "client")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")  # the client's own: replaced
    monkeypatch.setenv("OVERRIDDEN", "client")
    vllm = VllmEngines(
        "m",
        data_parallel_size=2,
        env={"OVERRIDDEN": "env", "NO_COLOR": "0", "PER_RANK": "env"},
        rank_env={1: {"PER_RANK": "rank 1", "NO_COLOR": "rank 1"}},
    )
    rank0 = vllm.environment(0, "DEBUG")
    rank1 = vllm.environment(1, "INFO")
    assert rank0["FROM_THE_CLIENT"] == rank1["FROM_THE_CLIENT"] == "client"
    assert rank0["PATH"] == os.environ["PATH"]
    assert (rank0["VLLM_LOGGING_LEVEL"], rank1["VLLM_LOGGING_LEVEL"]) == ("DEBUG", "INFO")
    for environment in (rank0, rank1):
        assert environment["VLLM_LOGGING_COLOR"] == "0"
        assert environment["PYTHONUNBUFFERED"] == "1"
        assert environment["OVERRIDDEN"] == "env"
    assert (rank0["NO_COLOR"], rank1["NO_COLOR"]) == ("0", "rank 1")
    assert (rank0["PER_RANK"], rank1["PER_RANK"]) == ("env", "rank 1")
    # The relay's level is a default: env may set vLLM's own.
    chatty = VllmEngines("m", env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    assert chatty.environment(0, "WARNING")["VLLM_LOGGING_LEVEL"] == "DEBUG"


# ------------------------------------------------------------ vLLM's log lines


@pytest.mark.parametrize(
    ("line", "level", "message"),
    [
        (
            "INFO 12-06 22:22:08 [serve.py:239] Launching 1 data parallel engine(s)",
            logging.INFO,
            "[serve.py:239] Launching 1 data parallel engine(s)",
        ),
        (
            "(EngineCore_DP0 pid=7851) INFO 12-06 22:22:08 [core.py:93] Initializing",
            logging.INFO,
            "(EngineCore_DP0 pid=7851) [core.py:93] Initializing",
        ),
        (
            "(APIServer pid=7850) DEBUG 12-06 22:22:08.123 [utils.py:1] detail",
            logging.DEBUG,
            "(APIServer pid=7850) [utils.py:1] detail",
        ),
        ("WARNING 12-06 22:22:08 [x.py:1] careful", logging.WARNING, "[x.py:1] careful"),
        (
            "(EngineCore pid=1) ERROR 12-06 22:22:08 [core.py:708] EngineCore failed to start.",
            logging.ERROR,
            "(EngineCore pid=1) [core.py:708] EngineCore failed to start.",
        ),
        ("CRITICAL 12-06 22:22:08 [x.py:2] gone", logging.CRITICAL, "[x.py:2] gone"),
        (
            "W1206 22:22:08.147000 7851 torch/_library/triton.py:53] Triton not available",
            logging.WARNING,
            "torch/_library/triton.py:53] Triton not available",
        ),
        ("I1206 22:22:08.1 7851 c10/x.cpp:1] hello", logging.INFO, "c10/x.cpp:1] hello"),
        (
            "(EngineCore_DP0 pid=9) W1206 22:22:08.147000 9 torch/x.py:53] Triton not available",
            logging.WARNING,
            "(EngineCore_DP0 pid=9) torch/x.py:53] Triton not available",
        ),
        ("E1206 22:22:08.147000 7851 x.cpp:2] bad", logging.ERROR, "x.cpp:2] bad"),
        ("F1206 22:22:08.147000   12 x.cpp:3] fatal", logging.CRITICAL, "x.cpp:3] fatal"),
    ],
)
def test_vllm_lines_and_glog_lines_keep_their_level(line: str, level: int, message: str) -> None:
    assert parse_vllm_line(line, None) == (level, message)
    assert parse_vllm_line(line, logging.DEBUG) == (level, message)


@pytest.mark.parametrize(
    "line",
    [
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.12/site-packages/vllm/engine/arg_utils.py", line 1',
        "ValueError: no such model",
        "INFO no timestamp is no vLLM line",
    ],
)
def test_other_lines_continue_the_previous_record_or_are_warnings(line: str) -> None:
    assert parse_vllm_line(line, logging.ERROR) == (logging.ERROR, line)
    assert parse_vllm_line(line, logging.DEBUG) == (logging.DEBUG, line)
    assert parse_vllm_line(line, None) == (logging.WARNING, line)


TRACEBACK = [
    "(EngineCore_DP0 pid=7851) ERROR 12-06 22:22:08 [core.py:708] EngineCore failed to start.",
    "Traceback (most recent call last):",
    '  File "/venv/lib/python3.12/site-packages/vllm/config/model.py", line 17, in check',
    "    raise ValueError(message)",
]


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ([*TRACEBACK, "ValueError: no such model"], "ValueError: no such model"),
        (
            [
                *TRACEBACK,
                "huggingface_hub.errors.HFValidationError: Repo id must be in the form "
                "'repo_name' or 'namespace/repo_name': '/no/such'.",
                "(MainProcess pid=7850) INFO 12-06 22:22:09 [launcher.py:1] Shutting down.",
            ],
            "huggingface_hub.errors.HFValidationError: Repo id must be in the form "
            "'repo_name' or 'namespace/repo_name': '/no/such'.",
        ),
        (
            [
                "(EngineCore_DP1 pid=7851) Traceback (most recent call last):",
                "(EngineCore_DP1 pid=7851)   RuntimeError: first",
                "(EngineCore_DP1 pid=7851) torch.OutOfMemoryError: CUDA out of memory.",
            ],
            "torch.OutOfMemoryError: CUDA out of memory.",
        ),
        (["KeyboardInterrupt"], "KeyboardInterrupt"),
        (
            [
                *TRACEBACK,
                "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
                "  Value error, Invalid repository ID or local directory specified: '/no/such'.",
                "    For further information visit https://errors.pydantic.dev/2.12/v/value_error",
            ],
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
            "Value error, Invalid repository ID or local directory specified: '/no/such'. "
            "For further information visit https://errors.pydantic.dev/2.12/v/value_error",
        ),
        (
            [
                "(MainProcess pid=1) INFO 12-06 22:22:08 [serve.py:239] Launching",
                "(EngineCore pid=2) ERROR 12-06 22:22:08 [core.py:708] EngineCore failed.",
                "W1206 22:22:08.147000 7851 torch/_library/triton.py:53] Triton not available",
                *TRACEBACK[1:],
            ],
            None,
        ),
        ([], None),
    ],
)
def test_what_vllm_said_is_its_last_exception_line(lines: list[str], said: str | None) -> None:
    assert vllm_error_line(lines) == said


# ------------------------------------------------------------ refused options


async def test_an_engine_config_beside_vllm_is_refused() -> None:
    with pytest.raises(ValueError, match="give no EngineConfig"):
        async with open_engine_client(EngineConfig(max_num_seqs=8), vllm=fake_vllm()):
            pass  # pragma: no cover
    assert children_of_this_process() == []


@pytest.mark.parametrize(
    "elsewhere",
    [
        {"remote": RemoteEngines("tcp://127.0.0.1:5555")},
        {"input_address": "ipc:///tmp/tve-in", "output_address": "ipc:///tmp/tve-out"},
    ],
)
async def test_vllm_with_engines_started_elsewhere_is_refused(elsewhere: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="vllm= launches vLLM's engine cores here"):
        async with open_engine_client(vllm=fake_vllm(), **elsewhere):
            pass  # pragma: no cover
    assert children_of_this_process() == []


# ------------------------------------------------------------ launched engines


async def test_the_engine_core_serves_in_its_launchers_group_and_ends_with_the_block() -> None:
    before = children_of_this_process()
    with trio.fail_after(30):
        async with open_engine_client(vllm=fake_vllm()) as client:
            (launcher,) = launchers(client)
            assert launcher in children_of_this_process()
            engine_core = engine_core_of(launcher)
            # The launcher leads a session of its own; its engine core is in its group.
            assert os.getsid(launcher) == os.getpgid(launcher) == launcher
            assert os.getpgid(engine_core) == launcher
            assert sorted(group_members(launcher)) == sorted([launcher, engine_core])
            prompt = [7, 8, 9]
            request = EngineCoreRequest.for_tokens(prompt, max_tokens=6)
            assert await stream_tokens(client, request) == expected(prompt, 6)
    # The client waited for its launcher, which waited for its engine core.
    assert group_members(launcher) == []
    assert children_of_this_process() == before


_KILLABLE_CLIENT = """
import json, sys, trio
from trio_enginecore import VllmEngines, open_engine_client

async def main():
    vllm = VllmEngines("m", command=json.loads(sys.argv[1]))
    async with open_engine_client(vllm=vllm) as client:
        print(client.statistics().engines[0].pid, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_a_client_killed_with_sigkill_leaves_no_process_of_the_group() -> None:
    """The lifeline: the kernel closes the pipe of a SIGKILLed client, and its SIGIO
    ends the launcher and its engine core, which never heard of the pipe."""
    command = json.dumps([sys.executable, str(FAKE_VLLM)])
    client = await trio.lowlevel.open_process(
        [sys.executable, "-c", _KILLABLE_CLIENT, command],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    launcher: int | None = None
    try:
        assert client.stdout is not None
        with trio.fail_after(20):
            launcher = int(await read_line(client.stdout, what="the client"))
        assert len(group_members(launcher)) == 2  # the launcher and its engine core
    finally:
        client.kill()
        await client.wait()
        if client.stdout is not None:
            await client.stdout.aclose()
    assert launcher is not None
    try:
        await gone_within([launcher], 5)
    finally:
        kill_groups([launcher])


async def test_an_engine_core_killed_is_dead_naming_its_rank_and_its_group_goes() -> None:
    before = children_of_this_process()
    with trio.fail_after(30), pytest.raises(EngineDeadError) as block:
        async with open_engine_client(vllm=fake_vllm("--step-time-s", "0.01")) as client:
            (launcher,) = launchers(client)
            engine_core = engine_core_of(launcher)
            request = EngineCoreRequest.for_tokens([1], max_tokens=100_000)
            with pytest.raises(EngineDeadError, match="rank 0") as stream:
                async with client.stream(request) as outputs:
                    await outputs.receive()
                    os.kill(engine_core, signal.SIGKILL)
                    async for _ in outputs:
                        pass
            await gone_within([launcher], 5)
    # vLLM's launcher exits with code 0 when its engine core ends, however it ended:
    # its last lines say more.
    died = f"engine rank 0, pid {launcher} died: {LAUNCHER} exited with code 0"
    assert str(stream.value).startswith(died)
    assert "Engine core proc EngineCore_DP0 died unexpectedly" in str(stream.value)
    assert str(block.value).startswith(died)
    assert children_of_this_process() == before


async def test_a_killed_launcher_is_noticed_and_its_orphaned_engine_core_killed() -> None:
    before = children_of_this_process()
    with trio.fail_after(30), pytest.raises(EngineDeadError) as block:
        async with open_engine_client(vllm=fake_vllm("--step-time-s", "0.01")) as client:
            (launcher,) = launchers(client)
            engine_core = engine_core_of(launcher)
            try:
                request = EngineCoreRequest.for_tokens([1], max_tokens=100_000)
                with pytest.raises(EngineDeadError, match="rank 0") as stream:
                    async with client.stream(request) as outputs:
                        await outputs.receive()
                        os.kill(launcher, signal.SIGKILL)
                        async for _ in outputs:
                            pass
                await gone_within([launcher], 5)
            finally:
                kill_groups([launcher])
    assert not process_is_running(engine_core)
    died = f"engine rank 0, pid {launcher} died: {LAUNCHER} was killed by signal 9"
    assert str(stream.value).startswith(died)
    assert str(block.value).startswith(died)
    assert children_of_this_process() == before


async def test_a_vllm_that_refuses_to_start_is_a_startup_error_quoting_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_enginecore.engine.rank0")
    with trio.fail_after(30), pytest.raises(EngineStartupError) as caught:
        async with open_engine_client(vllm=fake_vllm("--fail-with", "no such model")):
            pass  # pragma: no cover
    message = str(caught.value)
    assert f"{LAUNCHER} exited with code 1" in message
    assert "it said: ValueError: no such model" in message
    # The traceback continues vLLM's ERROR line, and is relayed at its level.
    relayed = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "trio_enginecore.engine.rank0"
    ]
    assert (logging.ERROR, "Traceback (most recent call last):") in relayed
    assert (logging.ERROR, "ValueError: no such model") in relayed
    assert children_of_this_process() == []


@pytest.mark.parametrize(
    ("victim", "ended"),
    [("launcher", "was killed by signal 9"), ("engine core", "exited with code 0")],
)
async def test_a_launch_killed_while_loading_is_a_startup_error_and_leaves_nothing(
    victim: str, ended: str
) -> None:
    """Killed while the engine core loads its model (60 s here): the startup fails at
    once, naming how the launcher ended, and nothing of the group is left."""
    before = children_of_this_process()
    launched: list[int] = []

    async def kill_while_loading() -> None:
        while not (new := [pid for pid in children_of_this_process() if pid not in before]):
            await trio.sleep(0.01)
        launched.extend(new)
        while not children_of(new[0]):
            await trio.sleep(0.01)
        os.kill(new[0] if victim == "launcher" else engine_core_of(new[0]), signal.SIGKILL)

    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_while_loading)
                with pytest.raises(EngineStartupError) as caught:
                    async with open_engine_client(vllm=fake_vllm("--load-time-s", "60")):
                        pass  # pragma: no cover
        (launcher,) = launched
        assert f"engine rank 0, pid {launcher}; {LAUNCHER} {ended}" in str(caught.value)
        await gone_within([launcher], 5)
        assert children_of_this_process() == before
    finally:
        kill_groups(launched)


@pytest.mark.parametrize("command", ["/no/such/dir/vllm", "no-such-vllm-command-here"])
async def test_a_vllm_command_that_cannot_run_is_a_startup_error_saying_so(command: str) -> None:
    with trio.fail_after(10), pytest.raises(EngineStartupError) as caught:
        async with open_engine_client(vllm=VllmEngines("m", command=command)):
            pass  # pragma: no cover
    message = str(caught.value)
    assert f"cannot run vLLM's command {command!r}" in message
    assert "VllmEngines(command=...)" in message
    assert children_of_this_process() == []


async def test_a_restarted_rank_comes_back_from_a_new_launcher_while_the_other_serves() -> None:
    before = children_of_this_process()
    leaders: list[int] = []
    served_meanwhile = 0
    try:
        with trio.fail_after(30):
            async with open_engine_client(
                vllm=fake_vllm(data_parallel_size=2), on_engine_failure="restart"
            ) as client:
                leaders += launchers(client)
                back = trio.Event()

                async def rank0_throughout() -> None:
                    nonlocal served_meanwhile
                    while not back.is_set():
                        prompt = [100 + served_meanwhile]
                        request = EngineCoreRequest.for_tokens(
                            prompt, max_tokens=4, data_parallel_rank=0
                        )
                        assert await stream_tokens(client, request) == expected(prompt, 4)
                        served_meanwhile += 1

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(rank0_throughout)
                    os.kill(engine_core_of(leaders[1]), signal.SIGKILL)
                    await gone_within([leaders[1]], 5)
                    # Back in service: a new launcher's engine core, ready.
                    while (status := client.statistics().engines[1]).state != "alive" or (
                        status.pid == leaders[1]
                    ):
                        await trio.sleep(0.02)
                    back.set()
                engines = client.statistics().engines
                assert [(e.state, e.restarts) for e in engines] == [("alive", 0), ("alive", 1)]
                new = launchers(client)
                assert new[0] == leaders[0]
                assert new[1] not in leaders
                leaders.append(new[1])
                assert len(group_members(new[1])) == 2
                prompt = [42]
                pinned = EngineCoreRequest.for_tokens(prompt, max_tokens=5, data_parallel_rank=1)
                assert await stream_tokens(client, pinned) == expected(prompt, 5)
        assert served_meanwhile >= 1
        assert children_of_this_process() == before
    finally:
        await gone_within(leaders, 5)


async def test_vllm_lines_are_relayed_at_their_own_levels(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay logger's level is vLLM's (``VLLM_LOGGING_LEVEL``): at DEBUG, the
    launcher's DEBUG line is written and relayed. Lines keep their process prefix;
    glog lines get their letter's level."""
    caplog.set_level(logging.DEBUG, logger="trio_enginecore.engine.rank0")
    caplog.set_level(logging.DEBUG, logger="trio_enginecore.client")
    with trio.fail_after(30):
        async with open_engine_client(vllm=fake_vllm()) as client:
            (launcher,) = launchers(client)
            engine_core = engine_core_of(launcher)
    relayed = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "trio_enginecore.engine.rank0"
    ]
    ours = f"(MainProcess pid={launcher}) "
    theirs = f"(EngineCore_DP0 pid={engine_core}) "
    assert (logging.WARNING, "torch/_library/triton.py:53] Triton not available") in relayed
    assert (
        logging.DEBUG,
        f"{ours}[__init__.py:38] No plugins for group vllm.platform_plugins found.",
    ) in relayed
    assert (
        logging.WARNING,
        f"{ours}[interface.py:522] Pin memory is not available on this platform.",
    ) in relayed
    assert (
        logging.INFO,
        f"{ours}[utils.py:837] Started EngineCore_DP0: engine core pid={engine_core}",
    ) in relayed
    # The engine core's own lines, at their levels: DEBUG, and INFO.
    core = {
        (level, message.split("] ", 1)[1])
        for level, message in relayed
        if message.startswith(theirs)
    }
    assert (logging.INFO, "engine rank 0 serving model 'counter' (1 input(s), 1 output(s))") in core
    assert any(level == logging.DEBUG for level, _ in core)
    # Leaving the block: SIGTERM, forwarded by the launcher, drained the engine core,
    # and the launcher exited with code 0.
    assert (logging.INFO, "SIGTERM: draining") in core
    assert (logging.INFO, f"{ours}[launcher.py:101] Shutting down.") in relayed
    assert any(
        f"{LAUNCHER} exited with code 0" in r.getMessage()
        for r in caplog.records
        if r.name == "trio_enginecore.client"
    )


async def test_open_llm_over_launched_engines_reads_the_tokenizer_of_the_directory_served(
    tmp_path: Path,
) -> None:
    """``open_llm(vllm=...)`` with no tokenizer: the model directory vLLM serves holds
    it (here the built-in tokenizer's files; the fake's engine is the counter model)."""
    from trio_enginecore.text import BUILTIN_TOKENIZER_DIR, open_llm

    model = tmp_path / "model"
    model.mkdir()
    for source in BUILTIN_TOKENIZER_DIR.iterdir():
        (model / source.name).write_bytes(source.read_bytes())
    vllm = attrs.evolve(fake_vllm(), model=str(model))
    async with open_llm(vllm=vllm) as llm:
        output = await llm.complete("abc", max_tokens=3)
    assert output.outputs[0].text == "def"  # the counter model: each byte plus one

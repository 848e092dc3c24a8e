"""Our client launches vLLM's own engine cores (``VllmEngines``) and owns them.

Each engine is ``vllm serve MODEL --headless`` (see ``launched.py``), serving the tiny
llama with the counter executor. What the client promises of the engines it launches
holds for these too:

- they serve exact streams (data parallel: ``test_our_client_drives_vllm_dp.py``'s
  ``launched`` mode, where ranks are also killed, stopped and routed around);
- they die with the client: at the end of its block, and when the client's process is
  killed with SIGKILL (the lifeline reaches vLLM's launcher and its engine core, one
  process group);
- a killed engine core is an ``EngineDeadError`` naming it, and is restarted; a
  stopped one (SIGSTOP) is dead within 3 s and its processes killed;
- an engine that fails to load is an ``EngineStartupError`` quoting vLLM.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_enginecore import (
    EngineCoreRequest,
    EngineDeadError,
    EngineStartupError,
    FinishReason,
    TrioMPClient,
    open_engine_client,
)
from trio_enginecore.text import load_tokenizer

from ..support import expected
from .launched import (
    SERVE_ARGUMENTS,
    gone_within,
    group_members,
    vllm_command,
    vllm_engines,
    write_model,
)
from .support import VLLM_SIDE, at_least, require_vllm, vllm_env, vllm_release
from .workloads import exact_streams, generate

require_vllm()

pytestmark = pytest.mark.timeout(600)


async def rpc_all(client: TrioMPClient, method: str, *args: Any) -> list[Any]:
    """``collective_rpc`` of every engine in service's counter executor, by rank."""
    results = await client.call_utility_all("collective_rpc", method, None, list(args))
    return [result[0] for result in results]


def launched_pids(client: TrioMPClient) -> list[int]:
    """The pid of each rank's ``vllm serve --headless`` (a process group's leader)."""
    pids = [engine.pid for engine in client.statistics().engines]
    assert all(pid is not None for pid in pids), pids
    return [pid for pid in pids if pid is not None]


@asynccontextmanager
async def launched(tmp_path: Path, **options: Any) -> AsyncIterator[TrioMPClient]:
    vllm = options.pop("vllm", None) or vllm_engines(write_model("llama", tmp_path / "llama"))
    async with open_engine_client(vllm=vllm, ready_timeout_s=240, **options) as client:
        yield client


async def test_a_launched_vllm_engine_core_serves_is_restarted_and_leaves_nothing(
    tmp_path: Path, timings: dict[str, float]
) -> None:
    """One engine, announcing ``"dev"`` as vLLM run from a source tree does: exact
    streams; its engine core killed mid-stream (the stream fails naming it, its
    launcher and all are gone, it is restarted and serves exact streams again); then
    stopped with SIGSTOP (dead within 3 s, its processes killed); the block's end,
    with the second restart under way, leaves no process of any launch."""
    release = vllm_release()
    model = write_model("llama", tmp_path / "llama")
    vllm = vllm_engines(model, env={"TRIO_ENGINECORE_ANNOUNCE_VERSION": "dev"})
    leaders: list[int] = []
    start = trio.current_time()
    async with launched(tmp_path, vllm=vllm, on_engine_failure="restart") as client:
        timings[f"VllmEngines ready ({release})"] = trio.current_time() - start
        (ready,) = client.engines
        assert ready is not None
        assert ready.vllm_version == "dev"
        leaders += launched_pids(client)
        await exact_streams(client, count=32)
        (engine_pid,) = await rpc_all(client, "executor_pid")
        # vLLM's engine core is a child of its launcher, in the launcher's group.
        assert engine_pid in group_members(leaders[0])

        # Killed mid-stream.
        await rpc_all(client, "set_step_delay", 0.02)
        prompt = [100]
        request = EngineCoreRequest.for_tokens(prompt, max_tokens=150)
        with pytest.raises(EngineDeadError, match="rank 0"):
            async with client.stream(request) as outputs:
                await outputs.receive()
                killed_at = trio.current_time()
                os.kill(engine_pid, signal.SIGKILL)
                async for _ in outputs:
                    pass
        await gone_within(leaders, 5)  # its launcher and all
        timings[f"VllmEngines killed engine core -> all gone ({release})"] = (
            trio.current_time() - killed_at
        )

        # Restarted: a new launch serves exact streams.
        with trio.fail_after(240):
            while client.statistics().engines[0].state != "alive":
                await trio.sleep(0.2)
        timings[f"VllmEngines restart, kill to back in service ({release})"] = (
            trio.current_time() - killed_at
        )
        leaders += launched_pids(client)
        assert leaders[1] != leaders[0]
        prompt = [4000]
        request = EngineCoreRequest.for_tokens(prompt, max_tokens=20)
        assert await generate(client, request) == (expected(prompt, 20), FinishReason.LENGTH)

        # Stopped: dead within 3 s and killed, launcher and all; the block then ends
        # while its restart is under way.
        (engine_pid,) = await rpc_all(client, "executor_pid")
        stopped_at = trio.current_time()
        os.kill(engine_pid, signal.SIGSTOP)
        with trio.fail_after(3):
            while client.statistics().engines[0].state == "alive":
                await trio.sleep(0.05)
        timings[f"VllmEngines stopped engine core -> dead ({release})"] = (
            trio.current_time() - stopped_at
        )
        await gone_within(leaders, 5)
        with trio.fail_after(60):
            while client.statistics().engines[0].pid == leaders[1]:
                await trio.sleep(0.1)
        leaders += launched_pids(client)
    await gone_within(leaders, 10)


_KILLABLE_CLIENT = """
import json, sys, trio
from trio_enginecore import VllmEngines, open_engine_client

async def main():
    vllm = VllmEngines(**json.loads(sys.argv[1]))
    async with open_engine_client(vllm=vllm, ready_timeout_s=240) as client:
        pid = client.statistics().engines[0].pid
        print(json.dumps({"launcher": pid}), flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


async def test_a_client_killed_with_sigkill_leaves_no_vllm_process(tmp_path: Path) -> None:
    """The lifeline: the kernel closes the pipe of a SIGKILLed client, and its SIGIO
    ends vLLM's launcher and its engine core, which never heard of it."""
    vllm = vllm_engines(write_model("llama", tmp_path / "llama"))
    settings = {
        "model": vllm.model,
        "arguments": list(vllm.arguments),
        "command": list(vllm.command),
        "env": dict(vllm.env),
    }
    client = await trio.lowlevel.open_process(
        [sys.executable, "-c", _KILLABLE_CLIENT, json.dumps(settings)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert client.stdout is not None
        line = b""
        with trio.fail_after(240):
            while not line.endswith(b"\n"):
                chunk = await client.stdout.receive_some()
                assert chunk, "the client exited before its engine was ready"
                line += chunk
        leader = json.loads(line)["launcher"]
        assert len(group_members(leader)) >= 2  # vLLM's launcher and its engine core
    finally:
        client.kill()
        await client.wait()
        if client.stdout is not None:
            await client.stdout.aclose()
    await gone_within([leader], 5)


async def test_a_vllm_engine_that_cannot_load_its_model_is_a_startup_error_quoting_vllm(
    tmp_path: Path,
) -> None:
    model = tmp_path / "not-a-model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # no architecture: vLLM refuses it
    start = time.monotonic()
    with pytest.raises(EngineStartupError) as caught:
        async with launched(tmp_path, vllm=vllm_engines(model)):
            pass
    message = str(caught.value)
    assert "its vLLM launcher (vllm serve --headless) exited with code 1" in message
    # vLLM's own words: the exception it raised, on a line of its own.
    said = message.split("it said: ", 1)[1].split("; last stderr lines", 1)[0]
    assert "Error" in said, message
    assert time.monotonic() - start < 120


@pytest.mark.skipif(
    not at_least("0.34"),
    reason="run in the newest release's session: the program is the same for every "
    "release, and two more vLLM startups per session cost a minute",
)
def test_the_real_vllm_tutorial_runs(tmp_path: Path) -> None:
    """``docs/tutorials/real_vllm.py`` as its page runs it, the model directory being
    the built-in tokenizer's and the tiny llama's configuration (the counter model then
    writes the bytes after the prompt's last one), vLLM's CLI the one under test and
    the counter executor's flags after ``--``."""
    from trio_enginecore.text import BUILTIN_TOKENIZER_DIR

    model = write_model("llama", tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (model / name).write_bytes((BUILTIN_TOKENIZER_DIR / name).read_bytes())
    vocab = load_tokenizer(model).vocab_size
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    program = Path(__file__).parents[2] / "docs" / "tutorials" / "real_vllm.py"
    command = [sys.executable, str(program), str(model), "--vllm", shlex.join(vllm_command())]
    env = vllm_env(PYTHONPATH=str(VLLM_SIDE))
    result = subprocess.run(
        [*command, "--", *SERVE_ARGUMENTS],
        capture_output=True,
        text=True,
        env=env,
        timeout=480,
        check=False,
    )
    report = f"--- stdout:\n{result.stdout}\n--- stderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    release = vllm_release()
    # The counter model continues "... is" with the bytes after "s": "tuvwxyz{|}~".
    text = "   16 tokens, finish reason length:\n   'tuvwxyz{|}~"
    expected = [
        "1. the client launches vLLM's engine core\n",
        f"   ready: vLLM {release}",
        text,
        "   the block is over: vLLM's processes are gone with it\n",
        "2. vLLM's engine core started by hand joins the client\n",
        f"   $ vllm serve {model} --headless --data-parallel-address 127.0.0.1",
        f"   joined: vLLM {release}",
        text,
        "   stopped by hand\n",
    ]
    position = 0
    for fragment in expected:
        found = result.stdout.find(fragment, position)
        assert found >= 0, f"the tutorial did not print {fragment!r} (in order)\n{report}"
        position = found + len(fragment)

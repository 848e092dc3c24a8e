"""Our client and one vLLM engine core, ready: what every single-engine interop test opens.

vLLM's ``EngineCoreProc`` runs as shipped, with only the model executor replaced by
``vllm_side/fake_executor.py`` (the counter model). Two ways in, both stock vLLM:

- ``headless``: vLLM's ``CoreEngineProcManager(local_client=False)`` (what ``vllm serve
  --headless`` runs) joins our client's handshake address
  (``open_engine_client(remote=RemoteEngines(...))``);
- ``attach``: our client binds its ROUTER and PULL (``input_address`` /
  ``output_address``) and vLLM's supervisor ``launch_core_engines`` starts the engine
  for it, handshaking with it on its own private socket.

The client's liveness checks are the defaults unless a test passes ``liveness=``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from trio_enginecore import (
    EngineConfig,
    EngineStartupError,
    RemoteEngines,
    TrioMPClient,
    open_engine_client,
)

from ..support import free_port
from .support import VllmProcess, vllm_process

MODES = ["headless", "attach"]


@dataclass
class VllmEngine:
    mode: str
    client: TrioMPClient
    launcher: VllmProcess
    ready_s: float
    engine_pid: int
    """vLLM's ``EngineCore`` process (the executor runs in it), not its launcher."""

    async def rpc(self, method: str, *args: Any) -> Any:
        """``collective_rpc`` of the fake executor: vLLM returns one result per worker."""
        results = await self.client.call_utility("collective_rpc", method, None, list(args))
        assert isinstance(results, list)
        assert len(results) == 1
        return results[0]

    def send_signal(self, sig: signal.Signals) -> None:
        """Send the engine core (not its launcher) ``sig``."""
        os.kill(self.engine_pid, sig)

    def kill(self) -> None:
        """SIGKILL the engine core, if it is still there (a stopped or hung engine
        would hold its launcher's shutdown for seconds)."""
        with suppress(ProcessLookupError):
            os.kill(self.engine_pid, signal.SIGKILL)


@asynccontextmanager
async def vllm_engine(
    mode: str,
    tmp_path: Path,
    *,
    python: Path | None = None,
    model_dir: Path | None = None,
    announce_version: str | None = None,
    **options: Any,
) -> AsyncIterator[VllmEngine]:
    """A vLLM engine core started by ``mode``'s launcher, and our client, ready.

    ``python``: the environment of another vLLM release than the one under test;
    ``model_dir``: the model to serve (a directory with a ``config.json`` the counter
    executor can serve; default: the launcher's tiny llama);
    ``announce_version``: the version the engine core announces in its ready message
    instead of vLLM's own (``"dev"``, as vLLM run from a source tree);
    ``options``: more of ``open_engine_client``'s options (``liveness``, say)."""
    client_args: dict[str, Any]
    if mode == "headless":
        address = f"tcp://127.0.0.1:{free_port()}"
        script, args = "launch_headless.py", ["--handshake-address", address]
        client_args = {"remote": RemoteEngines(address)}
    else:
        inputs, outputs = f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/output"
        script, args = "launch_attach.py", ["--input-address", inputs, "--output-address", outputs]
        client_args = {"input_address": inputs, "output_address": outputs}
    if model_dir is not None:
        args += ["--model-dir", str(model_dir)]
    if announce_version is not None:
        args += ["--announce-version", announce_version]
    with vllm_process(script, args, tmp_path / f"vllm-{mode}.log", python=python) as launcher:
        start = trio.current_time()
        try:
            async with open_engine_client(
                EngineConfig(), ready_timeout_s=90, **client_args, **options
            ) as client:
                ready_s = trio.current_time() - start
                started = await trio.to_thread.run_sync(launcher.next_report, 30)
                assert started["event"] == "started", started
                (engine_pid,) = started["pids"]
                yield VllmEngine(mode, client, launcher, ready_s, engine_pid)
        except EngineStartupError as exc:
            raise AssertionError(f"{exc}\nvLLM's log ends:\n{launcher.log_tail()}") from exc

"""vLLM's engine cores as our client launches them (``VllmEngines``), for the interop tests.

Each rank is ``vllm serve MODEL --headless``: vLLM 0.33's real ``vllm`` executable;
0.34's same CLI entry point behind ``vllm_side/vllm_cli.py``, which only answers its
Triton check. The model is one of ``vllm_side/common.py``'s tiny configurations
(no weights, no tokenizer), served by the counter executor.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import trio

from trio_enginecore import VllmEngines

from .support import VLLM_SIDE, vllm_env, vllm_python, vllm_release

SERVE_ARGUMENTS = (
    "--distributed-executor-backend",
    "fake_executor.CounterExecutor",
    "--skip-tokenizer-init",
    "--load-format",
    "dummy",
    "--enforce-eager",
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--disable-log-stats",
)
"""What ``vllm_side/common.engine_args`` sets, as ``vllm serve`` flags."""


def vllm_command() -> tuple[str, ...]:
    """How to run vLLM's CLI in the environment under test."""
    python = vllm_python()
    assert python is not None
    if vllm_release() == "0.33":
        return (str(python.parent / "vllm"),)
    return (str(python), str(VLLM_SIDE / "vllm_cli.py"))


def write_model(kind: str, directory: Path) -> Path:
    """The ``config.json`` of ``vllm_side/common.py``'s model ``kind`` ("llama",
    "mixtral") in ``directory`` (that module's own writer: its top level is stdlib)."""
    spec = importlib.util.spec_from_file_location("vllm_side_common", VLLM_SIDE / "common.py")
    assert spec is not None
    assert spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    directory.mkdir(parents=True, exist_ok=True)
    common.write_model(kind, str(directory))
    return directory


def vllm_engines(model: Path, **changes: Any) -> VllmEngines:
    """``VllmEngines`` serving ``model`` with the counter executor (``changes``: more
    of its fields: ``data_parallel_size``, ``moe``, ``env``...)."""
    env = vllm_env(PYTHONPATH=str(VLLM_SIDE), **changes.pop("env", {}))
    return VllmEngines(str(model), SERVE_ARGUMENTS, command=vllm_command(), env=env, **changes)


def group_members(leader: int) -> list[int]:
    """The live processes of the process group ``leader`` leads (zombies aside)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with suppress(OSError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            state, pgid = fields[0], int(fields[2])
            if pgid == leader and state != "Z":
                members.append(int(entry.name))
    return members


async def gone_within(leaders: list[int], seconds: float) -> float:
    """Wait until no process of the groups of ``leaders`` is left; how long it took."""
    start = trio.current_time()
    while any(group_members(leader) for leader in leaders):
        elapsed = trio.current_time() - start
        assert elapsed < seconds, {leader: group_members(leader) for leader in leaders}
        await trio.sleep(0.1)
    return trio.current_time() - start


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@contextmanager
def relayed_engine_lines() -> Iterator[list[str]]:
    """The launched engines' log lines, as the client relays them ("LEVEL message"),
    for the checks ``support.trouble_lines`` makes of a launcher's own log."""
    handler = _Lines()
    engines = logging.getLogger("trio_enginecore.engine")
    engines.addHandler(handler)
    try:
        yield handler.lines
    finally:
        engines.removeHandler(handler)

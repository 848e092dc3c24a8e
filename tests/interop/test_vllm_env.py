"""The vLLM environment is the one the interop tests mean: vLLM 0.33.0 on a CPU torch."""

from __future__ import annotations

import json
import subprocess

from .support import VLLM_SIDE, require_vllm, vllm_env, vllm_python

require_vllm()

_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, vllm
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.engine.core_client import AsyncMPClient, SyncMPClient
import fake_executor
print("@" + json.dumps({
    "vllm": vllm.__version__,
    "torch": torch.__version__,
    "cuda": torch.cuda.is_available(),
    "executor": fake_executor.CounterExecutor.__mro__[1].__module__,
}))
"""


def test_vllm_033_on_a_cpu_torch() -> None:
    python = vllm_python()
    assert python is not None
    result = subprocess.run(
        [str(python), "-c", _PROBE, str(VLLM_SIDE)],
        capture_output=True,
        text=True,
        env=vllm_env(),
        timeout=120,
        check=True,
    )
    line = next(line for line in result.stdout.splitlines() if line.startswith("@"))
    probe = json.loads(line[1:])
    assert probe == {
        "vllm": "0.33.0",
        "torch": "2.13.0+cpu",
        "cuda": False,
        "executor": "vllm.v1.executor.abstract",
    }

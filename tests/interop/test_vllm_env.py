"""The vLLM environment is the one the interop tests mean: the release under test (0.33.0
or 0.34.0) on a CPU torch, with vLLM 0.34's Triton check answered by the tests."""

from __future__ import annotations

import json
import subprocess

from .support import VLLM_SIDE, at_least, require_vllm, vllm_env, vllm_python, vllm_release

require_vllm()

_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, vllm
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.engine.core_client import AsyncMPClient, SyncMPClient
import vllm.triton_utils
import fake_executor
from common import vllm_config, write_model
config = vllm_config(write_model("llama"))
print("@" + json.dumps({
    "vllm": vllm.__version__,
    "torch": torch.__version__,
    "cuda": torch.cuda.is_available(),
    "executor": fake_executor.CounterExecutor.__mro__[1].__module__,
    "has_triton": vllm.triton_utils.HAS_TRITON,  # after building the config
    "triton_check_answered": fake_executor.answer_triton_check(),
    "max_model_len": config.model_config.max_model_len,
}))
"""


def test_vllm_release_on_a_cpu_torch() -> None:
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
        "vllm": f"{vllm_release()}.0",
        "torch": "2.13.0+cpu",
        "cuda": False,
        "executor": "vllm.v1.executor.abstract",
        # No Triton in either environment: 0.33 only warns about it when it builds a
        # config; 0.34 refuses, unless vllm_side/triton_check.py answers the check,
        # which leaves the flag false for everything else.
        "has_triton": False,
        "triton_check_answered": at_least("0.34"),
        "max_model_len": 1024,
    }

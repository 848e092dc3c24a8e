"""Test-only: answer vLLM 0.34's Triton check, since no Triton kernel ever runs here.

vLLM 0.34's CPU platform refuses to build or re-check a ``VllmConfig`` on an x86 CPU
when ``vllm.triton_utils.HAS_TRITON`` is false (``CpuPlatform.check_and_update_config``
raises "vLLM on x86 CPUs requires Triton (triton-cpu)"; 0.33 only warned). The CPU
wheel of Triton it wants is on no package index, and vLLM's engines here run the
counter executor, which computes nothing with torch or Triton. So this module wraps that one
method: while it runs, ``HAS_TRITON`` reads true; before and after, it is what vLLM
found (false), so nothing else in the process believes in Triton. A wheel whose check
only warns (0.33) is left alone.

Applied on import of ``fake_executor``, which every process that builds or re-checks
a config for our executor imports first: the vLLM-side scripts (``common.engine_args``
imports it before building a config) and every engine process vLLM starts. vLLM's CPU
platform makes those ``multiprocessing`` *spawn* children (it sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn``): a fresh interpreter that unpickles its
arguments, the executor class ``fake_executor.CounterExecutor`` among them, which
imports this module, before the engine re-runs ``VllmConfig.__post_init__`` after its
handshake (answered in the launching process only, an engine process dies there with
the Triton error). Never part of the ``trio_enginecore`` package.
"""

from __future__ import annotations

import inspect
from typing import Any

_REFUSAL = "requires Triton"  # in the 0.34 check's error message


def answer_triton_check() -> bool:
    """Wrap ``CpuPlatform.check_and_update_config`` where it refuses without Triton
    (idempotent). Returns whether the check is answered here."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config
    if getattr(check, "answers_triton_check", False):
        return True
    if triton_utils.HAS_TRITON or _REFUSAL not in inspect.getsource(check):
        return False
    original = check.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        # The method reads the flag from the module when it runs.
        triton_utils.HAS_TRITON = True
        try:
            original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    check_and_update_config.answers_triton_check = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True

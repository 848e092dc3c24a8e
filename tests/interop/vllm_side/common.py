"""What every vLLM-side script shares: the tiny models and vLLM's configuration.

Runs inside the vLLM environment only (``tests/interop/vllm_side`` on ``sys.path``).
No weights are loaded and nothing is downloaded: a model is a ``config.json`` in a
temporary directory, ``load_format="dummy"``, no tokenizer, and the executor is
:class:`fake_executor.CounterExecutor`.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

VOCAB_SIZE = 32000

_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

# For the data-parallel MoE tests to come: a MoE model is what makes vLLM run
# DPEngineCoreProc with request waves.
_MIXTRAL: dict[str, Any] = {
    **_LLAMA,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}

MODELS = {"llama": _LLAMA, "mixtral": _MIXTRAL}


def write_model(kind: str, directory: str | None = None) -> str:
    """Write the ``config.json`` of model ``kind`` to ``directory`` (default: a new
    temporary directory, removed when this process exits) and return the directory."""
    if directory is None:
        directory = tempfile.mkdtemp(prefix=f"tec-{kind}-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    Path(directory, "config.json").write_text(json.dumps(MODELS[kind], indent=2))
    return directory


def engine_args(model_dir: str, **overrides: Any) -> Any:
    """vLLM ``EngineArgs`` for a tiny model served by the counter executor."""
    from fake_executor import CounterExecutor
    from vllm.engine.arg_utils import EngineArgs

    settings: dict[str, Any] = {
        "model": model_dir,
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 1024,
        "distributed_executor_backend": CounterExecutor,
        "disable_log_stats": True,
    }
    settings.update(overrides)
    return EngineArgs(**settings)


def vllm_config(model_dir: str, *, headless: bool = False, **overrides: Any) -> Any:
    """The ``VllmConfig`` vLLM builds for :func:`engine_args`."""
    from vllm.usage.usage_lib import UsageContext

    args = engine_args(model_dir, **overrides)
    return args.create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=headless
    )


ANNOUNCE_VERSION_VARIABLE = "TRIO_ENGINECORE_ANNOUNCE_VERSION"
"""The version vLLM's engine core announces in its ready message, if set (a launcher's
``--announce-version``), instead of its own."""


def announce_version_from_environment() -> None:
    """Make vLLM's engine core announce ``$TRIO_ENGINECORE_ANNOUNCE_VERSION`` in its
    ready message, as vLLM run from a source tree announces ``"dev"`` (its
    ``vllm/version.py`` falls back to it). The engine core reads the version from
    ``vllm.v1.engine.core.VLLM_VERSION``, bound from ``vllm.version.__version__``
    when it is imported: that binding is replaced, in each process that imports the
    executor (``fake_executor`` calls this), so a spawned engine process does too."""
    version = os.environ.get(ANNOUNCE_VERSION_VARIABLE)
    if version:
        import vllm.v1.engine.core

        vllm.v1.engine.core.VLLM_VERSION = version


def exit_with_parent() -> None:
    """SIGTERM this process when the one that started it (the test) is gone, so that
    nothing of vLLM's outlives a test run that was killed: a launcher's own handler
    then stops its engines."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def say(**fields: Any) -> None:
    """One JSON line on stdout for the test that runs this script (vLLM logs to
    stderr... and sometimes stdout: a test reads only lines starting with ``@``)."""
    print("@" + json.dumps({"t": time.monotonic(), **fields}), flush=True)


def fail(message: str) -> None:
    say(event="error", message=message)
    sys.exit(1)

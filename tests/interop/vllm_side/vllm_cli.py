"""vLLM's command-line interface, as its ``vllm`` console script runs it, for vLLM 0.34.

The console script is ``vllm.entrypoints.cli.main:main``; this runs the same function
with the same arguments. The only difference: it first imports ``fake_executor``,
which answers vLLM 0.34's Triton check (``triton_check.py``): ``vllm serve`` builds the
engine's configuration in its own process, before any engine process imports the
executor, and vLLM 0.34 refuses to build one on an x86 CPU without Triton. vLLM 0.33's
check only warns: its tests run the real ``vllm`` executable.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import fake_executor  # noqa: F401  (answers the Triton check on import)
from vllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

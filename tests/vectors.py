"""Access to vLLM's golden wire vectors in ``tests/data/vllm-0.33.0``.

The vectors were produced by vLLM 0.33.0's own encoder and are kept, unchanged, in this
repository so that a clone needs nothing beside it. Set ``TRIO_ENGINECORE_VECTORS`` to
read another folder of the same layout instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VECTORS_DIR = Path(
    os.environ.get("TRIO_ENGINECORE_VECTORS", REPO / "tests" / "data" / "vllm-0.33.0")
)


class VectorsMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Frame:
    role: str
    data: bytes


@dataclass(frozen=True)
class Case:
    name: str
    msg_type: str
    spec: dict[str, Any]
    frames: tuple[Frame, ...]

    @property
    def identity(self) -> bytes | None:
        return next((f.data for f in self.frames if f.role.startswith("identity")), None)

    @property
    def request_type(self) -> tuple[str, bytes] | None:
        for f in self.frames:
            if f.role.startswith("request_type"):
                return f.role.split()[1], f.data
        return None

    @property
    def message_frames(self) -> list[bytes]:
        """The payload frame and aux frames, as the codec sees them."""
        return [f.data for f in self.frames if f.role.startswith(("payload", "aux"))]

    @property
    def python_value(self) -> Any:
        return self.spec["python_value"]


@cache
def index() -> dict[str, Any]:
    path = VECTORS_DIR / "index.json"
    if not path.is_file():
        raise VectorsMissing(
            f"vLLM golden vectors not found at {path}: they ship in tests/data/vllm-0.33.0 "
            "(is TRIO_ENGINECORE_VECTORS pointing somewhere else?)"
        )
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def case_names() -> list[str]:
    try:
        return [c["name"] for c in index()["cases"]]
    except VectorsMissing:
        # Still produce one parameter so the test runs and fails with the reason.
        return ["<vectors missing>"]


@cache
def load_case(name: str) -> Case:
    spec = next((c for c in index()["cases"] if c["name"] == name), None)
    if spec is None:
        raise VectorsMissing(f"no vector case named {name!r}")
    frames = []
    for frame in spec["frames"]:
        data = (VECTORS_DIR / frame["file"]).read_bytes()
        assert len(data) == frame["len"], f"{frame['file']}: length differs from index.json"
        digest = hashlib.sha256(data).hexdigest()
        assert digest == frame["sha256"], f"{frame['file']}: sha256 differs from index.json"
        frames.append(Frame(frame["role"], data))
    return Case(name, spec["msg_type"], spec, tuple(frames))

"""Access to vLLM's golden wire vectors in ``tests/data/vllm-<version>/``.

Each release's vectors were produced by that release's own encoder and are kept,
unchanged, in this repository so that a clone needs nothing beside it. A case is
named by its release and its name (``"0.34.0/add_request_default_sampling"``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from trio_enginecore.dialects import DIALECTS, Dialect, choose_dialect

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "tests" / "data"
RELEASES: tuple[str, ...] = tuple(dialect.tested_version for dialect in DIALECTS)
"""Every supported release's vectors: one folder each."""


def vectors_dir(release: str) -> Path:
    return DATA_DIR / f"vllm-{release}"


class VectorsMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Frame:
    role: str
    data: bytes


@dataclass(frozen=True)
class Case:
    release: str
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

    @property
    def dialect(self) -> Dialect:
        return choose_dialect(self.release).dialect


@cache
def index(release: str) -> dict[str, Any]:
    path = vectors_dir(release) / "index.json"
    if not path.is_file():
        raise VectorsMissing(
            f"vLLM {release} golden vectors not found at {path}: they ship in "
            f"tests/data/vllm-{release}"
        )
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def case_ids() -> list[str]:
    """``"<release>/<name>"`` of every case of every release."""
    ids: list[str] = []
    for release in RELEASES:
        try:
            ids += [f"{release}/{c['name']}" for c in index(release)["cases"]]
        except VectorsMissing:
            # Still produce one parameter so the test runs and fails with the reason.
            ids.append(f"{release}/<vectors missing>")
    return ids


@cache
def load_case(case_id: str) -> Case:
    release, name = case_id.split("/", 1)
    spec = next((c for c in index(release)["cases"] if c["name"] == name), None)
    if spec is None:
        raise VectorsMissing(f"no vLLM {release} vector case named {name!r}")
    frames = []
    for frame in spec["frames"]:
        data = (vectors_dir(release) / frame["file"]).read_bytes()
        assert len(data) == frame["len"], f"{frame['file']}: length differs from index.json"
        digest = hashlib.sha256(data).hexdigest()
        assert digest == frame["sha256"], f"{frame['file']}: sha256 differs from index.json"
        frames.append(Frame(frame["role"], data))
    return Case(release, name, spec["msg_type"], spec, tuple(frames))

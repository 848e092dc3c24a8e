"""Random messages, vLLM's and ours, round trip through both codecs.

vLLM (the release under test) builds random requests and step outputs with its own
classes and encodes them (prompts packed as its clients pack them); we decode each with
our codec and encode it again in that release's dialect, which must give vLLM's frames
byte for byte; then vLLM decodes ours and encodes them again, which must give its own
frames back: each side reads exactly what the other wrote. "Byte for byte" but for the
order of a set's elements (``SamplingParams._all_stop_token_ids``), which no decoder
keeps, vLLM's included: both sides compare messages with that set sorted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trio_enginecore.dialects import choose_dialect
from trio_enginecore.protocol import EngineCoreOutputs, EngineCoreRequest
from trio_enginecore.serial import MsgpackDecoder, MsgpackEncoder, outputs_for, request_for

from .support import VllmProcess, error_lines, require_vllm, vllm_version
from .vllm_side.canonical import canonical

require_vllm()

SEED = 2027
COUNT = 200
"""Of each kind: requests and step outputs."""


def frames_of(directory: Path, name: str) -> list[bytes]:
    frames = []
    while (path := directory / f"{name}-{len(frames)}.bin").exists():
        frames.append(path.read_bytes())
    return frames


def run(script_args: list[str], log: Path) -> dict[str, Any]:
    process = VllmProcess("random_frames.py", script_args, log)
    try:
        return process.next_report(120)
    finally:
        process.stop()
        assert error_lines(process.log()) == []


def test_random_messages_read_the_same_on_both_sides(tmp_path: Path) -> None:
    made = run(["make", str(tmp_path), str(SEED), str(COUNT)], tmp_path / "make.log")
    assert (made["event"], made["count"]) == ("made", COUNT)
    dialect = choose_dialect(vllm_version()).dialect
    theirs, ours = tmp_path / "vllm", tmp_path / "ours"
    ours.mkdir()
    requests, outputs = MsgpackDecoder(EngineCoreRequest), MsgpackDecoder(EngineCoreOutputs)
    encoder = MsgpackEncoder()
    differ: list[str] = []
    reordered = 0
    for i in range(COUNT):
        for name, encode in (
            (f"request-{i}", lambda f: request_for(dialect, requests.decode(f))),
            (f"outputs-{i}", lambda f: outputs_for(dialect, outputs.decode(f))),
        ):
            original = frames_of(theirs, name)
            again = [bytes(frame) for frame in encoder.encode(encode(original))]
            if canonical(again) != canonical(original):
                differ.append(name)
            elif again != original:
                reordered += 1
            for k, frame in enumerate(again):
                (ours / f"{name}-{k}.bin").write_bytes(frame)
    assert differ == [], "our encoding differs from vLLM's"
    assert reordered < COUNT // 4  # only requests with several stop tokens
    checked = run(["check", str(tmp_path)], tmp_path / "check.log")
    assert (checked["event"], checked["mismatches"]) == ("checked", [])
    assert checked["checked"] == 2 * COUNT

"""Random requests and outputs built and encoded by vLLM, and vLLM's reading of ours.

Runs inside the vLLM environment only. Two steps, one process each:

``random_frames.py make DIR SEED COUNT``
    Builds COUNT random ``EngineCoreRequest``\\ s and COUNT random
    ``EngineCoreOutputs`` with vLLM's own classes (seeded: the same seed gives the same
    messages), encodes each with vLLM's ``MsgpackEncoder`` (a request's prompt packed
    first where the release's clients pack it, ``_with_packed_prompt`` in 0.34) and
    writes its frames to ``DIR/vllm/<kind>-<i>-<frame>.bin``.

``random_frames.py check DIR``
    Decodes every message in ``DIR/ours/`` (the same names: what the other side
    re-encoded) with vLLM's ``MsgpackDecoder`` and encodes it again with vLLM's
    encoder: the frames must be vLLM's original ones, so vLLM read back exactly what
    it sent. Byte for byte but for one thing (``canonical.py``): the order of a set's
    elements, which a set decoded from the wire does not keep (vLLM's own decode and
    encode reorder ``SamplingParams._all_stop_token_ids`` as ours does). Reports the
    mismatches.

Reports are ``@{json}`` lines on stdout.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
from canonical import canonical
from common import say
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from vllm.v1.outputs import LogprobsLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

try:  # 0.34 on: how its clients send every ADD
    from vllm.v1.engine.core_client import (
        _with_packed_prompt as packed,  # pyright: ignore[reportPrivateUsage]
    )
except ImportError:  # 0.33 sends the list as it is

    def packed(request: EngineCoreRequest) -> EngineCoreRequest:
        return request


REQUEST_FIELDS = set(EngineCoreRequest.__struct_fields__)
OUTPUT_FIELDS = set(EngineCoreOutput.__struct_fields__)


def random_sampling(rng: random.Random) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": rng.randint(1, 4096)}
    if rng.random() < 0.5:
        kwargs["temperature"] = rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])
    if rng.random() < 0.4:
        kwargs["top_p"] = rng.choice([0.5, 0.9, 0.95])
    if rng.random() < 0.4:
        kwargs["top_k"] = rng.randint(1, 100)
    if rng.random() < 0.3:
        kwargs["min_p"] = 0.05
    if rng.random() < 0.4:
        kwargs["seed"] = rng.randint(0, 2**32)
    if rng.random() < 0.4:
        kwargs["stop_token_ids"] = [rng.randint(0, 50_000) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.3:
        kwargs["ignore_eos"] = True
    if rng.random() < 0.3:
        kwargs["min_tokens"] = rng.randint(0, 8)
    if rng.random() < 0.3:
        kwargs["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.2:
        kwargs["presence_penalty"] = 0.5
        kwargs["frequency_penalty"] = 0.25
    if rng.random() < 0.2:
        kwargs["repetition_penalty"] = 1.1
    if rng.random() < 0.2:
        kwargs["logit_bias"] = {rng.randint(0, 1000): rng.choice([-5.0, 2.5])}
    if rng.random() < 0.2:
        kwargs["extra_args"] = {"tag": rng.randint(0, 9), "name": "x"}
    return SamplingParams(**kwargs)


def random_request(rng: random.Random, index: int) -> EngineCoreRequest:
    length = rng.choice([0, 1, 7, 63, 64, 65, rng.randint(1, 3000)])
    prompt = [rng.randint(0, 2**31 - 1) for _ in range(length)] if length else [0]
    fields: dict[str, Any] = {
        "request_id": f"rnd-{index}-{rng.getrandbits(32):08x}",
        "prompt_token_ids": prompt,
        "mm_features": None,
        "sampling_params": random_sampling(rng),
        "pooling_params": None,
        "arrival_time": rng.uniform(1.6e9, 1.8e9),
        "lora_request": (
            LoRARequest(f"adapter-{index}", rng.randint(1, 9), f"/loras/{index}")
            if rng.random() < 0.2
            else None
        ),
        "cache_salt": f"salt-{index}" if rng.random() < 0.2 else None,
        "data_parallel_rank": rng.choice([None, 0, 1]),
        "priority": rng.choice([0, 0, 1, -3]),
        "client_index": rng.choice([0, 0, 2]),
        "current_wave": rng.choice([0, 0, 5]),
        "trace_headers": {"traceparent": f"00-{index:032x}-01"} if rng.random() < 0.2 else None,
    }
    if "block_hashes" in REQUEST_FIELDS and rng.random() < 0.3:
        fields["block_hashes"] = [rng.randbytes(32) for _ in range(rng.randint(1, 4))]
    return EngineCoreRequest(**fields)


def random_logprobs(rng: random.Random, rows: int) -> LogprobsLists:
    columns = rng.randint(1, 5)
    np_rng = np.random.default_rng(rng.getrandbits(32))
    return LogprobsLists(
        np_rng.integers(0, 50_000, (rows, columns), dtype=np.int32),
        np_rng.standard_normal((rows, columns)).astype(np.float32),
        np_rng.integers(0, 10, rows, dtype=np.int32),
    )


def random_output(rng: random.Random, index: int, j: int) -> EngineCoreOutput:
    tokens = [rng.randint(0, 150_000) for _ in range(rng.choice([0, 1, 1, 1, 4]))]
    finish = rng.choice([None, None, None, *FinishReason])
    fields: dict[str, Any] = {
        "request_id": f"rnd-{index}-{j}",
        "new_token_ids": tokens,
        "finish_reason": finish,
        "stop_reason": rng.choice([None, 13, "</s>"]) if finish == FinishReason.STOP else None,
        "num_nans_in_logits": rng.choice([0, 0, 2]),
    }
    if tokens and rng.random() < 0.3:
        fields["new_logprobs"] = random_logprobs(rng, len(tokens))
    if rng.random() < 0.2:
        fields["events"] = [
            EngineCoreEvent(EngineCoreEventType.QUEUED, rng.uniform(0, 1e5)),
            EngineCoreEvent(EngineCoreEventType.SCHEDULED, rng.uniform(0, 1e5)),
        ]
    if rng.random() < 0.1:
        fields["kv_transfer_params"] = {"remote_block_ids": [1, 2, 3], "do_remote_prefill": True}
    if "watermarking" in OUTPUT_FIELDS and rng.random() < 0.3:
        fields["watermarking"] = rng.choice([True, False])
    return EngineCoreOutput(**fields)


def random_outputs(rng: random.Random, index: int) -> EngineCoreOutputs:
    outputs = [random_output(rng, index, j) for j in range(rng.randint(0, 6))]
    finished = {outputs[0].request_id} if outputs and rng.random() < 0.3 else None
    return EngineCoreOutputs(
        engine_index=rng.choice([0, 1, 3]),
        outputs=outputs,
        timestamp=rng.uniform(1.0, 1e6),
        # Sets travel in iteration order: at most one element keeps the bytes stable.
        finished_requests=finished,
        wave_complete=rng.choice([None, None, 4]),
    )


def write(directory: Path, name: str, frames: list[Any]) -> None:
    for k, frame in enumerate(frames):
        (directory / f"{name}-{k}.bin").write_bytes(bytes(frame))


def read(directory: Path, name: str) -> list[bytes]:
    frames = []
    while (path := directory / f"{name}-{len(frames)}.bin").exists():
        frames.append(path.read_bytes())
    return frames


def make(directory: Path, seed: int, count: int) -> None:
    rng = random.Random(seed)
    out = directory / "vllm"
    out.mkdir(parents=True)
    encoder = MsgpackEncoder()
    for i in range(count):
        write(out, f"request-{i}", encoder.encode(packed(random_request(rng, i))))
        write(out, f"outputs-{i}", encoder.encode(random_outputs(rng, i)))
    say(event="made", count=count)


def check(directory: Path) -> None:
    theirs, ours = directory / "vllm", directory / "ours"
    decoders = {
        "request": MsgpackDecoder(EngineCoreRequest),
        "outputs": MsgpackDecoder(EngineCoreOutputs),
    }
    encoder = MsgpackEncoder()
    checked = 0
    mismatches: list[str] = []
    for path in sorted(theirs.glob("*-0.bin")):
        name = path.name.removesuffix("-0.bin")
        kind = name.split("-")[0]
        original = read(theirs, name)
        try:
            decoded = decoders[kind].decode(read(ours, name))
            again = [bytes(frame) for frame in encoder.encode(decoded)]
        except Exception as exc:  # reported, not raised: every message is checked
            mismatches.append(f"{name}: vLLM could not read ours: {exc!r}")
            continue
        checked += 1
        if canonical(again) != canonical(original):
            mismatches.append(f"{name}: vLLM read ours as something else")
    say(event="checked", checked=checked, mismatches=mismatches)


def main() -> int:
    command, directory = sys.argv[1], Path(sys.argv[2])
    if command == "make":
        make(directory, int(sys.argv[3]), int(sys.argv[4]))
    else:
        check(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())

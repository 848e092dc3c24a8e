"""The reference engine process serves clients of every supported vLLM release.

Whichever release it presents itself as (``--vllm-version``), it reads ADDs in every
release's form: the golden ADD frames of vLLM 0.33 (prompts as lists) and 0.34
(prompts packed as int32 arrays, inline or in an aux frame) are served exactly; what it
writes (its ready message, its outputs) has the fields of the release it presents.
A malformed packed prompt fails that request alone.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import trio

from trio_enginecore.dialects import DIALECTS, choose_dialect
from trio_enginecore.engine import CounterModel
from trio_enginecore.protocol import EngineCoreRequestType, FinishReason
from trio_enginecore.serial import MsgpackDecoder

from .enginepeer import EnginePeer, make_request, running_engine, tokens_of
from .vectors import RELEASES, load_case

# Golden ADDs of each release: small prompts inline, a 2048-token prompt in an aux frame.
GOLDEN_ADDS = [
    f"{release}/{name}"
    for release in RELEASES
    for name in ("add_request_default_sampling", "add_request_nondefault_sampling")
] + ["0.34.0/add_request_long_prompt_aux", "0.34.0/add_request_prompt_64_tokens_aux"]


@pytest.mark.parametrize("presents", [d.tested_version for d in DIALECTS])
async def test_golden_adds_of_every_release_are_served_exactly(presents: str) -> None:
    dialect = choose_dialect(presents).dialect
    cases = [load_case(case_id) for case_id in GOLDEN_ADDS]
    with trio.fail_after(60):
        async with running_engine("--vllm-version", presents, "--vocab-size", "200000") as peer:
            assert peer.ready is not None
            assert peer.ready.vllm_version == presents
            # Requests with equal ids in two releases' vectors: one in flight at a time.
            results = {}
            for case in cases:
                await peer.send_raw([b"\x00", *case.message_frames])
                request_id = case.python_value["request_id"]
                results[case.name, case.release] = (await peer.collect({request_id}))[request_id]
            raw = await _raw_outputs(peer)
    for case in cases:
        outputs = results[case.name, case.release]
        prompt = _prompt_values(case.python_value["prompt_token_ids"])
        max_tokens = case.python_value["sampling_params"]["max_tokens"]
        stop = set(case.python_value["sampling_params"]["stop_token_ids"])
        expected = CounterModel.expected_tokens(prompt, max_tokens, vocab_size=200000)
        if stop & set(expected):
            expected = expected[: next(i for i, t in enumerate(expected) if t in stop) + 1]
        assert tokens_of(outputs) == expected, case.name
        assert outputs[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    # The outputs have the fields of the release the engine presents itself as.
    assert {len(output) for output in raw} == {dialect.output_fields}


async def _raw_outputs(peer: EnginePeer) -> list[list[object]]:
    """One more request, its outputs read as plain msgpack (each output's fields)."""
    await peer.add(make_request("raw", [5], max_tokens=2))
    generic = MsgpackDecoder()
    fields: list[list[object]] = []
    finished = False
    while not finished:
        for frames in await peer.pull.drain():
            for output in generic.decode(frames)[1]:
                fields.append(output)
                finished = finished or output[5] is not None
    return fields


def _prompt_values(node: object) -> list[int]:
    if isinstance(node, dict):
        values: list[int] = node["values"]
        return values
    assert isinstance(node, list)
    return node


async def test_a_malformed_packed_prompt_fails_that_request_alone() -> None:
    base = make_request("bad", [1, 2, 3], max_tokens=3)
    fields = list(msgspec.structs.astuple(base))
    with trio.fail_after(30):
        async with running_engine() as peer:
            await peer.add(make_request("before", [10], max_tokens=3))
            # A packed prompt whose data is 2 bytes for 3 int32s; one that refers to a
            # frame that is not there; one of floats.
            for request_id, prompt in (
                ("short", ["<i4", [3], msgspec.msgpack.Ext(3, b"12")]),
                ("no-frame", ["<i4", [300], 1]),
                ("floats", np.zeros(3, np.float32)),
            ):
                fields[0], fields[1] = request_id, prompt
                payload = peer.encoder.encode(fields)
                await peer.send_raw([EngineCoreRequestType.ADD.value, *payload])
            await peer.add(make_request("after", [20], max_tokens=3))
            results = await peer.collect({"before", "after", "short", "no-frame", "floats"})
    assert tokens_of(results["before"]) == [11, 12, 13]
    assert tokens_of(results["after"]) == [21, 22, 23]
    for request_id in ("short", "no-frame", "floats"):
        (output,) = results[request_id]
        assert output.finish_reason is FinishReason.ERROR
        assert output.error is not None
        assert "prompt_token_ids" in output.error.message

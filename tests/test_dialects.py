"""The dialect table: which form each vLLM release reads, chosen from a version string,
and the codec writing and reading each form (pure, no sockets)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from trio_enginecore.dialects import (
    DIALECTS,
    NEWEST,
    OLDEST,
    VLLM_0_33,
    VLLM_0_34,
    choose_dialect,
    choose_group_dialects,
    parse_release,
)
from trio_enginecore.errors import ProtocolError
from trio_enginecore.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
)
from trio_enginecore.serial import (
    MsgpackDecoder,
    MsgpackEncoder,
    outputs_for,
    ready_for,
    request_for,
)

# ------------------------------------------------------------------ versions


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("0.33.0", (0, 33)),
        ("0.34.0", (0, 34)),
        ("0.34.2", (0, 34)),
        ("0.34.0rc1", (0, 34)),
        ("0.34.0+cpu", (0, 34)),
        ("0.35.0.dev12+g1234abc", (0, 35)),
        ("1.0", (1, 0)),
    ],
)
def test_a_release_is_major_and_minor(version: str, release: tuple[int, int]) -> None:
    assert parse_release(version) == release


@pytest.mark.parametrize("version", ["", "dev", "0", "x.y.z", "0.x", "034"])
def test_a_version_without_major_and_minor_is_refused(version: str) -> None:
    with pytest.raises(ValueError, match="not a vLLM version"):
        parse_release(version)


def test_every_supported_release_gets_its_own_dialect() -> None:
    assert choose_dialect("0.33.0").dialect is VLLM_0_33
    assert choose_dialect("0.33.1").dialect is VLLM_0_33
    assert choose_dialect("0.34.0").dialect is VLLM_0_34
    for dialect in DIALECTS:
        choice = choose_dialect(dialect.tested_version)
        assert choice.dialect is dialect
        assert not choice.untested
        assert choice.warning() is None


def test_a_newer_release_gets_the_newest_dialect_and_a_warning_naming_the_tested_ones() -> None:
    choice = choose_dialect("0.35.1")
    assert choice.dialect is NEWEST
    assert choice.untested
    warning = choice.warning()
    assert warning is not None
    assert "0.35.1" in warning
    for dialect in DIALECTS:
        assert dialect.tested_version in warning


@pytest.mark.parametrize("version", ["0.32.9", "0.10.2", "0.1.dev1+gabc"])
def test_an_older_release_is_refused_naming_the_supported_ones(version: str) -> None:
    with pytest.raises(ValueError, match="older than any release") as caught:
        choose_dialect(version)
    assert version in str(caught.value)
    assert "vLLM 0.33" in str(caught.value)


def test_a_group_of_one_release_speaks_it() -> None:
    choices = choose_group_dialects(
        [("engine rank 0", "0.34.0", None), ("engine rank 1", "0.34.1", None)]
    )
    assert [choice.dialect for choice in choices] == [VLLM_0_34, VLLM_0_34]


def test_a_group_mixing_releases_is_refused_naming_each_engine() -> None:
    with pytest.raises(ValueError, match="different vLLM releases") as caught:
        choose_group_dialects(
            [("engine rank 0", "0.33.0", None), ("engine rank 1", "0.34.0", None)]
        )
    assert "engine rank 0 runs vLLM 0.33.0" in str(caught.value)
    assert "engine rank 1 runs vLLM 0.34.0" in str(caught.value)


def test_a_group_with_an_unsupported_engine_names_it() -> None:
    with pytest.raises(ValueError, match=r"engine rank 1: vLLM 0\.30\.0 is older"):
        choose_group_dialects(
            [("engine rank 0", "0.33.0", None), ("engine rank 1", "0.30.0", None)]
        )


# --------------------------------------------------------------- utilities


def test_a_utility_new_in_a_release_is_refused_for_older_ones() -> None:
    problem = VLLM_0_33.utility_problem("is_inference_ready", 0)
    assert problem == "vLLM 0.33, which has no utility 'is_inference_ready' (new in vLLM 0.34)"
    assert VLLM_0_34.utility_problem("is_inference_ready", 0) is None


def test_an_argument_a_release_does_not_take_is_refused() -> None:
    assert VLLM_0_33.utility_problem("sleep", 2) is None
    problem = VLLM_0_33.utility_problem("sleep", 3)
    assert problem is not None
    assert "sleep(level, mode)" in problem
    assert VLLM_0_34.utility_problem("sleep", 3) is None
    assert VLLM_0_33.utility_problem("release_kv_cache_memory", 1) is not None
    assert VLLM_0_34.utility_problem("release_kv_cache_memory", 1) is None


def test_utilities_the_table_does_not_know_pass_through() -> None:
    for dialect in DIALECTS:
        assert dialect.utility_problem("collective_rpc", 4) is None
        assert dialect.utility_problem("my_own_method", 9) is None


# ------------------------------------------------------------------- codec


def request(prompt: list[int] | None = None, **fields: Any) -> EngineCoreRequest:
    built = EngineCoreRequest.for_tokens(
        [1, 2, 3] if prompt is None else prompt, request_id="r", arrival_time=1.0, max_tokens=4
    )
    return msgspec.structs.replace(built, **fields)


def generic(frames: list[Any]) -> Any:
    return MsgpackDecoder().decode(frames)


def test_a_033_request_carries_a_list_and_22_fields() -> None:
    frames = MsgpackEncoder().encode(request_for(VLLM_0_33, request([5, 6, 7])))
    payload = generic(frames)
    assert len(frames) == 1
    assert len(payload) == 22
    assert payload[1] == [5, 6, 7]


def test_a_034_request_carries_an_int32_array_and_23_fields() -> None:
    frames = MsgpackEncoder().encode(request_for(VLLM_0_34, request([5, 6, 7])))
    payload = generic(frames)
    assert len(payload) == 23
    dtype, shape, data = payload[1]
    assert (dtype, shape) == ("<i4", [3])
    assert np.frombuffer(data, "<i4").tolist() == [5, 6, 7]


def test_a_long_034_prompt_travels_in_an_aux_frame() -> None:
    prompt = list(range(64))  # 256 bytes: not below the inline threshold
    frames = MsgpackEncoder().encode(request_for(VLLM_0_34, request(prompt)))
    assert len(frames) == 2
    assert generic(frames)[1] == ["<i4", [64], 1]
    assert np.frombuffer(frames[1], "<i4").tolist() == prompt


def test_block_hashes_go_to_034_engines_only() -> None:
    hashes = [b"\x01" * 32, b"\x02" * 32]
    with_hashes = request(block_hashes=hashes)
    assert generic(MsgpackEncoder().encode(request_for(VLLM_0_34, with_hashes)))[22] == hashes
    assert len(generic(MsgpackEncoder().encode(request_for(VLLM_0_33, with_hashes)))) == 22


def test_a_request_without_a_prompt_is_not_packed() -> None:
    embeds = request(prompt_token_ids=None)
    assert generic(MsgpackEncoder().encode(request_for(VLLM_0_34, embeds)))[1] is None


def test_a_token_id_beyond_int32_cannot_be_packed() -> None:
    with pytest.raises(ValueError, match="int32"):
        request_for(VLLM_0_34, request([1, 2**31]))


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
@pytest.mark.parametrize("length", [0, 1, 63, 64, 2048])
def test_a_decoder_reads_every_releases_prompt_as_a_list(dialect: Any, length: int) -> None:
    sent = request(list(range(1000, 1000 + length)))
    decoded = MsgpackDecoder(EngineCoreRequest).decode(
        MsgpackEncoder().encode(request_for(dialect, sent))
    )
    assert type(decoded.prompt_token_ids) is list
    assert decoded == sent


def _with_prompt(prompt: object) -> list[Any]:
    values: list[Any] = list(msgspec.structs.astuple(request()))
    values[1] = prompt
    return MsgpackEncoder().encode(values)


@pytest.mark.parametrize(
    ("prompt", "complaint"),
    [
        ([1, "a"], r"Expected `int`, got `str` - at `\$\[1\]\[1\]`"),
        ([1, True], r"Expected `int`, got `bool` - at `\$\[1\]\[1\]`"),
        ("abc", r"Expected `array`, got `str` - at `\$\[1\]`"),
        ({"a": 1}, r"- at `\$\[1\]`"),
        (np.zeros((2, 2), np.int32), r"1-d integer array, got dtype <i4 and shape \(2, 2\)"),
        (np.zeros(3, np.float32), r"1-d integer array, got dtype <f4"),
        (["<i4", [3], b"12"], r"needs 12 bytes, its buffer has 2"),
        (["<i4", [3], 7], r"refers to frame 7"),
        (["|O", [1], b"\x00" * 8], r"not allowed on the wire"),
        (["<i4"], r"expected an array as `\[dtype, shape, data\]`"),
    ],
)
def test_a_malformed_prompt_is_a_protocol_error_naming_the_field(
    prompt: object, complaint: str
) -> None:
    with pytest.raises(ProtocolError, match=complaint) as caught:
        MsgpackDecoder(EngineCoreRequest).decode(_with_prompt(prompt))
    assert "prompt_token_ids" in str(caught.value)


def test_a_decoder_survives_a_bad_prompt_and_reads_the_next_request() -> None:
    decoder = MsgpackDecoder(EngineCoreRequest)
    with pytest.raises(ProtocolError):
        decoder.decode(_with_prompt(["<i4", [3], 7]))
    assert decoder.decode(MsgpackEncoder().encode(request_for(VLLM_0_34, request()))) == request()


def test_033_outputs_have_19_fields_and_034_outputs_20() -> None:
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [1], watermarking=True)], timestamp=1.0
    )
    old = generic(MsgpackEncoder().encode(outputs_for(VLLM_0_33, outputs)))
    new = generic(MsgpackEncoder().encode(outputs_for(VLLM_0_34, outputs)))
    assert len(old[1][0]) == 19
    assert len(new[1][0]) == 20
    assert new[1][0][19] is True
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(
        MsgpackEncoder().encode(outputs_for(VLLM_0_33, outputs))
    )
    assert decoded.outputs[0].watermarking is None  # what a 0.33 engine never sends


def test_ready_responses_have_each_releases_keys() -> None:
    counts = ("world_size", "data_parallel_size", "tensor_parallel_size", "max_num_seqs")
    sizes = ("pipeline_parallel_size", "decode_context_parallel_size", "max_num_batched_tokens")
    ready = EngineCoreReadyResponse(
        **dict.fromkeys(("max_model_len", "num_gpu_blocks", "block_size"), 0),
        **dict.fromkeys((*counts, *sizes), 1),
        dp_stats_address=None,
        dtype="float32",
        vllm_version="0.33.0",
        data_parallel_rank=0,
        instance_id="i",
        supports_lora=False,
        max_loras=0,
    )
    for dialect in DIALECTS:
        keys = generic(MsgpackEncoder().encode(ready_for(dialect, ready)))
        assert len(keys) == dialect.ready_keys
        assert list(keys) == list(EngineCoreReadyResponse.__struct_fields__[: dialect.ready_keys])


def test_the_table_is_ordered_oldest_first() -> None:
    assert OLDEST is DIALECTS[0]
    assert NEWEST is DIALECTS[-1]
    assert [d.release for d in DIALECTS] == sorted(d.release for d in DIALECTS)

"""EngineConfig: working defaults, validation naming the field, immutability."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from trio_enginecore.config import MODELS, EngineConfig


def test_defaults_describe_a_working_counter_engine() -> None:
    config = EngineConfig()
    assert config.model == "counter"
    assert config.vocab_size is None
    assert config.max_num_seqs == 256
    assert config.max_model_len == 4096
    assert config.max_loras == 4
    assert config.max_logprobs == 20
    assert config.step_time_s == 0.0
    assert config.seed == 0
    assert config.log_stats is False
    assert config.drain_timeout_s == 30.0
    assert (config.data_parallel_size, config.data_parallel_rank) == (1, 0)
    assert config.enable_fault_injection is False
    assert MODELS == ("counter", "ngram")


@pytest.mark.parametrize(
    "changes",
    [
        {"model": "ngram", "vocab_size": 300},
        {"max_num_seqs": 1, "max_model_len": 1},
        {"max_loras": 0, "seed": 0},
        {"max_logprobs": 0},
        {"max_logprobs": -1},
        {"step_time_s": 0, "drain_timeout_s": 0.0},
        {"step_time_s": 0.25, "drain_timeout_s": 5},
        {"data_parallel_size": 4, "data_parallel_rank": 3},
        {"log_stats": True, "enable_fault_injection": True},
        {"vllm_version": "0.33.0"},
        {"vllm_version": "0.34.0"},
        {"vllm_version": "dev"},
        {"vllm_version": "my-engine 1.0", "wire_release": "0.33"},
        {"vllm_version": "0.34.0", "wire_release": "0.34"},
    ],
)
def test_valid_values_are_accepted(changes: dict[str, Any]) -> None:
    config = EngineConfig(**changes)
    for field, value in changes.items():
        assert getattr(config, field) == value


BAD_VALUES = [
    ("max_num_seqs", 0),
    ("max_num_seqs", -3),
    ("max_num_seqs", 2.0),
    ("max_num_seqs", True),
    ("max_num_seqs", "8"),
    ("max_model_len", 0),
    ("max_model_len", None),
    ("vocab_size", 0),
    ("vocab_size", 1.5),
    ("max_loras", -1),
    ("max_loras", False),
    ("max_logprobs", -2),
    ("max_logprobs", 1.0),
    ("max_logprobs", None),
    ("seed", -1),
    ("step_time_s", -1),
    ("step_time_s", math.nan),
    ("step_time_s", math.inf),
    ("step_time_s", "0.1"),
    ("step_time_s", True),
    ("drain_timeout_s", -0.5),
    ("drain_timeout_s", math.nan),
    ("data_parallel_size", 0),
    ("data_parallel_rank", -1),
    ("model", "gpt"),
    ("model", ""),
    # The reference engine presents itself as a release it speaks, or as a version
    # that names none ("dev"), no other.
    ("vllm_version", "0.32.0"),
    ("vllm_version", "0.35.0"),
    ("vllm_version", "0.35.0.dev12+g1234"),
    ("vllm_version", ""),
    ("vllm_version", " "),
    ("vllm_version", 0.34),
    ("wire_release", "0.35"),
    ("wire_release", "dev"),
    ("wire_release", 0.33),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_values_raise_value_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"\bEngineConfig\.{field}\b") as info:
        EngineConfig(**{field: value})
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("changes", "speaks"),
    [
        ({}, "0.34"),
        ({"vllm_version": "0.33.0"}, "0.33"),
        ({"vllm_version": "dev"}, "0.34"),  # the newest, as a source tree is
        ({"vllm_version": "dev", "wire_release": "0.33"}, "0.33"),
        ({"vllm_version": "dev", "wire_release": "0.34.0"}, "0.34"),
    ],
)
def test_the_engine_speaks_the_release_its_version_names_else_wire_release(
    changes: dict[str, Any], speaks: str
) -> None:
    assert EngineConfig(**changes).dialect.name == f"vLLM {speaks}"


def test_a_wire_release_other_than_the_version_is_refused() -> None:
    with pytest.raises(ValueError, match=r"wire_release \(0\.33\) contradicts vllm_version"):
        EngineConfig(vllm_version="0.34.0", wire_release="0.33")


def test_an_unknown_model_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="model") as info:
        EngineConfig(model="gpt")
    assert "counter" in str(info.value)
    assert "ngram" in str(info.value)
    assert "'gpt'" in str(info.value)


@pytest.mark.parametrize(("size", "rank"), [(1, 1), (2, 2), (2, 5)])
def test_the_data_parallel_rank_must_be_below_the_size(size: int, rank: int) -> None:
    with pytest.raises(ValueError, match="data_parallel_rank") as info:
        EngineConfig(data_parallel_size=size, data_parallel_rank=rank)
    assert "data_parallel_size" in str(info.value)
    assert f"({rank})" in str(info.value)
    assert f"({size})" in str(info.value)


def test_the_data_parallel_rank_must_fit_in_two_bytes() -> None:
    assert EngineConfig(data_parallel_size=0x10000, data_parallel_rank=0xFFFF)
    with pytest.raises(ValueError, match=r"data_parallel_rank must fit in two bytes"):
        EngineConfig(data_parallel_size=0x10001, data_parallel_rank=0x10000)


def test_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        EngineConfig("ngram")  # type: ignore[misc]


def test_the_config_is_frozen_and_hashable() -> None:
    config = EngineConfig(max_num_seqs=4)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.max_num_seqs = 8  # type: ignore[misc]
    assert config.max_num_seqs == 4
    assert config == EngineConfig(max_num_seqs=4)
    assert hash(config) == hash(EngineConfig(max_num_seqs=4))
    assert config != EngineConfig()


def test_evolve_returns_a_changed_copy_and_validates_again() -> None:
    config = EngineConfig(max_num_seqs=4)
    changed = config.evolve(max_num_seqs=8, model="ngram")
    assert (changed.max_num_seqs, changed.model) == (8, "ngram")
    assert (config.max_num_seqs, config.model) == (4, "counter")
    with pytest.raises(ValueError, match="max_num_seqs"):
        config.evolve(max_num_seqs=0)
    with pytest.raises(ValueError, match="step_time_s"):
        config.evolve(step_time_s=math.nan)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        config.evolve(data_parallel_rank=1)
    assert config.evolve(data_parallel_size=2).evolve(data_parallel_rank=1).data_parallel_rank == 1


def test_the_ngram_model_needs_a_vocabulary_of_at_least_257() -> None:
    """Bytes 0-255 plus EOS 256: a smaller vocabulary must fail here, not at engine start."""
    assert EngineConfig(model="ngram", vocab_size=257).vocab_size == 257
    with pytest.raises(ValueError, match=r"EngineConfig\.vocab_size") as info:
        EngineConfig(model="ngram", vocab_size=256)
    assert "ngram" in str(info.value)
    assert "257" in str(info.value)
    with pytest.raises(ValueError, match="vocab_size"):
        EngineConfig(vocab_size=100).evolve(model="ngram")
    assert EngineConfig(model="counter", vocab_size=2).vocab_size == 2

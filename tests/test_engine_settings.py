"""The engine's settings come from one table: EngineConfig's field metadata.

The serve command's options, the configuration it builds from them, and the flags a
client gives an engine it launches are all derived from it; these tests hold the three
together (and to the flags engines were launched with before the table existed).
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import attrs
import pytest

import trio_enginecore.engine
from trio_enginecore._cli import _parser, _serve_parser as _serve_parser_of
from trio_enginecore.client._multiprocess._launch import serve_arguments
from trio_enginecore.config import FLAG, EngineConfig, Flag, config_from_flags

WHERE = ("--input-address", "ipc:///tmp/in", "--output-address", "ipc:///tmp/out")

CONFIGS = [
    EngineConfig(),
    EngineConfig(
        model="ngram",
        vocab_size=300,
        max_num_seqs=3,
        max_model_len=77,
        max_loras=0,
        step_time_s=0.002,
        seed=9,
        log_stats=True,
        drain_timeout_s=1.5,
        data_parallel_size=3,
        data_parallel_rank=2,
        vllm_version="0.33.0",
        enable_fault_injection=True,
        max_logprobs=5,
    ),
    EngineConfig(step_time_s=1, drain_timeout_s=0, vocab_size=5, max_loras=7, max_logprobs=-1),
    EngineConfig(data_parallel_size=2, data_parallel_rank=1, log_stats=True),
]

# Not a setting of the engine process: decided by the clients, never passed on.
CLIENT_ONLY = {"data_parallel_external_lb"}


def _serve(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["serve", *WHERE, *argv])


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    _serve_parser_of(parser)
    return parser


def _flags() -> dict[str, Flag]:
    return {
        field.name: field.metadata[FLAG]
        for field in attrs.fields(EngineConfig)
        if field.metadata[FLAG] is not None
    }


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_the_serve_command_rebuilds_the_config_a_launched_engine_is_given(
    config: EngineConfig,
) -> None:
    assert config_from_flags(_serve(*serve_arguments(config))) == config


def test_the_serve_command_defaults_are_the_configs_defaults() -> None:
    assert config_from_flags(_serve()) == EngineConfig()


def test_every_field_has_a_flag_or_is_a_client_setting_on_purpose() -> None:
    missing = [field.name for field in attrs.fields(EngineConfig) if FLAG not in field.metadata]
    assert not missing, f"give these EngineConfig fields a flag (or FLAG: None): {missing}"
    without = {field.name for field in attrs.fields(EngineConfig) if field.metadata[FLAG] is None}
    assert without == CLIENT_ONLY


def test_a_client_only_setting_is_not_read_by_the_engine() -> None:
    sources = list(pathlib.Path(trio_enginecore.engine.__file__).parent.glob("*.py"))
    for name in CLIENT_ONLY:
        assert not [path.name for path in sources if name in path.read_text()]


def test_flags_are_distinct_and_each_is_an_option_of_serve() -> None:
    names = [flag.name for flag in _flags().values()]
    assert len(set(names)) == len(names)
    options = {o for action in _serve_parser()._actions for o in action.option_strings}
    assert set(names) <= options


def test_the_flags_are_those_engines_were_always_launched_with() -> None:
    # As serve_arguments wrote them by hand before they came from the table.
    expected: list[tuple[Any, ...]] = [
        ("--model", "ngram"),
        ("--rank", "2"),
        ("--data-parallel-size", "3"),
        ("--max-num-seqs", "3"),
        ("--max-model-len", "77"),
        ("--max-loras", "0"),
        ("--step-time-s", "0.002"),
        ("--seed", "9"),
        ("--drain-timeout-s", "1.5"),
        ("--vllm-version", "0.33.0"),
        ("--vocab-size", "300"),
        ("--log-stats",),
        ("--enable-fault-injection",),
        ("--max-logprobs", "5"),  # since engines send logprobs
    ]
    assert _pairs(serve_arguments(CONFIGS[1])) == sorted(expected)
    # None and False are left out: the flag's default.
    assert "--vocab-size" not in serve_arguments(EngineConfig())
    assert "--log-stats" not in serve_arguments(EngineConfig())


def _pairs(arguments: list[str]) -> list[tuple[str, ...]]:
    pairs: list[tuple[str, ...]] = []
    for argument in arguments:
        if argument.startswith("--"):
            pairs.append((argument,))
        else:
            pairs[-1] = (*pairs[-1], argument)
    return sorted(pairs)


def test_help_gives_each_setting_with_its_default() -> None:
    text = " ".join(_serve_parser().format_help().split())
    defaults = EngineConfig()
    for name, flag in _flags().items():
        assert flag.name in text
        if "%(default)s" in flag.help:
            value = getattr(defaults, name)
            assert f"(default: {value})" in text, name

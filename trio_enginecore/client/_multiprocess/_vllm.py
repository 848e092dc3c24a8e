"""vLLM's own engine cores as the client's children: ``vllm serve MODEL --headless``.

vLLM's supported way to start engine cores for a frontend in another process is its
headless server: ``vllm serve MODEL --headless`` starts one engine-core process per
local data-parallel rank (vLLM's ``CoreEngineProcManager``), which say HELLO at
``tcp://<--data-parallel-address>:<--data-parallel-rpc-port>``, receive the addresses
to serve, load the model and report READY. The client binds that address on the
loopback interface and launches one such process per rank (``--data-parallel-size-local
1 --data-parallel-start-rank R``), so that each rank lives, dies and is restarted on
its own, as a reference engine does.

Each launch is a small tree: vLLM's launcher and its engine-core child (and, with
tensor parallelism, that one's workers). The launcher is started in a session of its
own, and everything the client does to "the engine" it does to that process group:
the lifeline (the kernel's SIGIO when the client is gone, however it went) and the
final SIGKILL reach the engine core as well as its launcher, which is what makes an
orphan impossible even when the client is killed with SIGKILL.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final, final

import attrs

from ..._keywords import suggest_keywords
from ._remote import torch_group_config

__all__ = [
    "SET_BY_THE_CLIENT",
    "VllmEngines",
    "parse_vllm_line",
    "vllm_error_line",
]

SET_BY_THE_CLIENT: Final = (
    "--headless",
    "--data-parallel-address",
    "--data-parallel-rpc-port",
    "--data-parallel-size",
    "--data-parallel-size-local",
    "--data-parallel-start-rank",
    "--data-parallel-rank",
    "--api-server-count",
    "--data-parallel-external-lb",
    "--data-parallel-hybrid-lb",
)
"""``vllm serve`` flags the client sets itself (each rank's place in the group and the
handshake address), and the load-balancing modes it is not, refused in
``VllmEngines.arguments``."""
_SHORT_FLAGS: Final = {
    "-dp": "--data-parallel-size",
    "-dpl": "--data-parallel-size-local",
    "-dpr": "--data-parallel-rank",
    "-dpn": "--data-parallel-rank",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-asc": "--api-server-count",
    "-dpe": "--data-parallel-external-lb",
    "-dph": "--data-parallel-hybrid-lb",
}
"""vLLM's short aliases of those flags."""

_LEVELS: Final = logging.getLevelNamesMapping()
# vLLM's own format: an optional "(EngineCore pid=N) " or "(EngineCore_DP1 pid=N) "
# prefix naming the process, the level, "MM-DD HH:MM:SS", "[file.py:line]", the message.
_VLLM_LINE: Final = re.compile(
    r"^(?P<process>\([^)]*\) )?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? (?P<rest>.*)$"
)
# glog's format, which torch's C++ side and some libraries use: "W1206 22:22:08.147 ..."
_GLOG_LINE: Final = re.compile(
    r"^(?P<process>\([^)]*\) )?(?P<letter>[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (?P<rest>.*)$"
)
_GLOG_LEVELS: Final = {
    "I": logging.INFO,
    "W": logging.WARNING,
    "E": logging.ERROR,
    "F": logging.CRITICAL,
}
# The last line of a Python traceback: "ValueError: ...", "vllm.x.SomeError: ...".
_EXCEPTION_LINE: Final = re.compile(
    r"^(?:\([^)]*\) )?(?P<line>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b.*)$"
)


def _positive_int(_: object, attribute: attrs.Attribute[int], value: object) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"VllmEngines.{attribute.name} must be a positive integer, got {value!r}")


def _arguments(arguments: Sequence[str]) -> tuple[str, ...]:
    if isinstance(arguments, str):
        raise TypeError(
            "VllmEngines.arguments is a sequence of command-line words, "
            f"like ['--max-model-len', '4096'], not one string: {arguments!r}"
        )
    return tuple(arguments)


def _command(command: Sequence[str]) -> tuple[str, ...]:
    if isinstance(command, str):
        return (command,)
    return tuple(command)


def _environment(env: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(env))


def _rank_environments(
    envs: Mapping[int, Mapping[str, str]],
) -> Mapping[int, Mapping[str, str]]:
    return MappingProxyType({rank: MappingProxyType(dict(env)) for rank, env in envs.items()})


def _no_client_flags(
    _: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
) -> None:
    for word in value:
        flag = word.split("=", 1)[0].replace("_", "-")  # vLLM reads --data_parallel_size too
        flag = _SHORT_FLAGS.get(flag, flag)
        if flag in SET_BY_THE_CLIENT:
            raise ValueError(
                f"VllmEngines.arguments sets {flag}, which the client sets itself for each "
                "rank (data parallelism is VllmEngines.data_parallel_size)"
            )


def _non_empty(
    _: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
) -> None:
    if not value or not all(word for word in value):
        raise ValueError(f"VllmEngines.{attribute.name} must be non-empty strings, got {value!r}")


@final
@suggest_keywords
@attrs.frozen
class VllmEngines:
    """vLLM's own engine cores, launched and owned by the client.

    ``open_engine_client(vllm=VllmEngines("Qwen/Qwen3-0.6B"))`` starts, for each
    data-parallel rank, ``vllm serve MODEL --headless`` pointed at the client's
    handshake address (on the loopback interface), with ``arguments`` added: vLLM's
    own engine core, whatever its hardware. The client owns those processes as it
    owns reference engines: they stop with the client's block (and with the client's
    process, even killed with SIGKILL), their death is an
    :class:`~trio_enginecore.errors.EngineDeadError` with vLLM's last log lines, the
    ``route_around`` and ``restart`` policies apply to them, and a startup that
    fails is an :class:`~trio_enginecore.errors.EngineStartupError` quoting what vLLM
    said. Their log lines go to the logger ``trio_enginecore.engine.rank<N>`` at
    their own levels.

    Attributes:
        model: the model, as ``vllm serve`` takes it: a Hugging Face name or a
            directory.
        arguments: more ``vllm serve`` flags, as words (``["--max-model-len",
            "4096", "--gpu-memory-utilization", "0.8"]``). The flags that place each
            rank (``--headless``, ``--data-parallel-*``) are the client's.
        data_parallel_size: how many engine cores (ranks), each its own
            ``vllm serve --headless`` process; the client balances requests over them.
        command: how to run vLLM's command-line interface: ``("vllm",)`` finds it on
            ``PATH``; give the path of another environment's ``vllm`` executable,
            or ``(python, "-m", "vllm.entrypoints.cli.main")``.
        env: environment variables for vLLM's processes, added to the client's
            (``{"HF_HOME": "/models"}``); ``VLLM_LOGGING_LEVEL`` is set from the
            relay logger's level unless given here.
        rank_env: more environment variables for one rank's processes, by rank,
            added to ``env``: each rank's devices on a host with several
            (``{0: {"CUDA_VISIBLE_DEVICES": "0"}, 1: {"CUDA_VISIBLE_DEVICES": "1"}}``).
            Each ``vllm serve`` sees itself as its host's only rank, and takes the
            first devices it can see.
        moe: the model is a mixture of experts, whose ranks form one torch
            data-parallel group (vLLM's ``DPEngineCoreProc``, request waves): the
            client then tells every rank where the group meets, on this host, as
            vLLM's own frontend does. Leave it ``False`` for dense models, whose
            ranks are independent.

    Raises:
        ValueError: an empty model or command, ``data_parallel_size`` below 1,
            ``arguments`` setting a flag the client sets, or ``rank_env`` naming a
            rank there is not.
        TypeError: ``arguments`` given as one string.
    """

    model: str = attrs.field(validator=attrs.validators.min_len(1))
    arguments: tuple[str, ...] = attrs.field(
        default=(), converter=_arguments, validator=_no_client_flags
    )
    data_parallel_size: int = attrs.field(default=1, validator=_positive_int)
    command: tuple[str, ...] = attrs.field(
        default=("vllm",), converter=_command, validator=_non_empty
    )
    # Compared, not hashed (a mapping is not hashable): equal objects still hash equal.
    env: Mapping[str, str] = attrs.field(factory=dict[str, str], converter=_environment, hash=False)
    rank_env: Mapping[int, Mapping[str, str]] = attrs.field(
        factory=dict[int, Mapping[str, str]], converter=_rank_environments, hash=False
    )
    moe: bool = False

    def __attrs_post_init__(self) -> None:
        unknown = sorted(
            rank for rank in self.rank_env if rank not in range(self.data_parallel_size)
        )
        if unknown:
            raise ValueError(
                f"VllmEngines.rank_env names rank(s) {unknown}, but the ranks are "
                f"{list(range(self.data_parallel_size))}"
            )

    def serve_command(self, rank: int, handshake_address: str) -> list[str]:
        """The command line that starts rank ``rank``'s engine core, saying HELLO at
        ``handshake_address`` (``tcp://HOST:PORT``, as the client bound it).

        Raises:
            ValueError: ``handshake_address`` is not ``tcp://HOST:PORT``.
        """
        host, port = _host_and_port(handshake_address)
        placement = ["--data-parallel-address", host, "--data-parallel-rpc-port", port]
        if self.data_parallel_size > 1:
            # Without data parallelism vLLM refuses the rank flags.
            placement += [
                "--data-parallel-size",
                str(self.data_parallel_size),
                "--data-parallel-size-local",
                "1",
                "--data-parallel-start-rank",
                str(rank),
            ]
        return [*self.command, "serve", self.model, "--headless", *placement, *self.arguments]

    def environment(self, rank: int, log_level: str) -> dict[str, str]:
        """The environment of rank ``rank``'s processes: the client's, a log level
        matching the relay logger's, no colours (the lines are parsed), ``env`` and
        the rank's ``rank_env``."""
        settings = {
            "VLLM_LOGGING_LEVEL": log_level,
            "VLLM_LOGGING_COLOR": "0",
            "NO_COLOR": "1",
            "PYTHONUNBUFFERED": "1",
        }
        return {**os.environ, **settings, **self.env, **self.rank_env.get(rank, {})}

    def group_parallel_config(self, data_parallel_size: int) -> dict[str, int | str | list[int]]:
        """What the handshake tells the ranks of a MoE model about their torch group
        (empty for a dense model): where it meets on this host, on ports free now."""
        if not self.moe or data_parallel_size <= 1:
            return {}
        return torch_group_config("127.0.0.1", None, data_parallel_size)


def _host_and_port(address: str) -> tuple[str, str]:
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"vLLM's headless engines say HELLO over TCP, not at {address!r}")
    return host.strip("[]"), port


def parse_vllm_line(line: str, previous: int | None) -> tuple[int, str]:
    """The level and message of one stderr line of a vLLM process.

    vLLM's own lines keep the process they came from and the source location and
    lose the level and timestamp (the relay logger has its own); glog lines (torch's
    C++ side) get their letter's level. Any other line continues the previous record
    (a traceback) at its level, or, with none, is WARNING (something written outside
    logging).
    """
    match = _VLLM_LINE.match(line)
    if match is not None:
        return _LEVELS[match["level"]], (match["process"] or "") + match["rest"]
    match = _GLOG_LINE.match(line)
    if match is not None:
        return _GLOG_LEVELS[match["letter"]], (match["process"] or "") + match["rest"]
    return (logging.WARNING if previous is None else previous), line


def vllm_error_line(lines: Sequence[str]) -> str | None:
    """The last exception a vLLM process printed among ``lines`` (the last line of
    its last traceback, ``"ValueError: ..."``), if any: usually why it failed."""
    for index in range(len(lines) - 1, -1, -1):
        match = _EXCEPTION_LINE.match(lines[index].strip())
        if match is not None:
            said = match["line"]
            # pydantic's "1 validation error for ModelConfig" gives its reason on the
            # next, indented line(s): "  Value error, ...".
            if "validation error" in said:
                said += " " + " ".join(line.strip() for line in lines[index + 1 : index + 3])
            return said.strip()
    return None


def vllm_not_found(command: Sequence[str], error: OSError) -> str:
    """Why vLLM's command could not be run, and what to do."""
    reason = error.strerror or str(error)
    return (
        f"cannot run vLLM's command {command[0]!r} ({reason}): install vLLM "
        f"(`{sys.executable} -m pip install vllm`) or give VllmEngines(command=...) the "
        "path of its `vllm` executable"
    )

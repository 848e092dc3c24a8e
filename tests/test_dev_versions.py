"""Engines whose version names no release: known by their ready message's keys.

vLLM run from a source tree announces ``vllm_version="dev"``, and other engines that
speak the protocol announce their own strings. Such an engine is given the release
whose ready message has the keys its own has (vLLM 0.33's 28, or 0.34's 33 with the
five 0.34 added), and the client warns once, naming what was announced, what it
inferred and why. A ready message that is no release's is refused at startup, saying
what it had and why each release's does not fit.

* A version that names a release decides, whatever the keys: a parseable dev build
  (``"0.35.0.dev12+g1234"``) is a future release, spoken to in the newest form with
  the usual warning.
* In a data-parallel group, an engine whose version names no release belongs with
  release engines whose release its ready message is, and is refused with any other.
* The warning is logged once per client: not per engine of a group, not again when an
  engine restarts; a second client warns again.
* The reference engine announces ``"dev"`` too (``EngineConfig(vllm_version="dev",
  wire_release=...)``) and is served end to end in each release's form.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import msgspec
import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineDeadError,
    EngineStartupError,
    UtilityCallError,
    open_engine_client,
)
from trio_enginecore.client._core._engines import EngineHandle
from trio_enginecore.client._core._policy import Restart
from trio_enginecore.client._multiprocess._startup import EngineDialects
from trio_enginecore.dialects import (
    DIALECTS,
    NEWEST,
    OLDEST,
    VLLM_0_33,
    VLLM_0_34,
    Dialect,
    choose_dialect,
    choose_group_dialects,
    dialect_of_ready,
)
from trio_enginecore.engine import EngineCore
from trio_enginecore.protocol import EngineCoreReadyResponse

from .hostile import attached_to_hostile_engine, attached_to_serving_engines
from .support import expected, stream_tokens

PROMPT = [7, 8, 9]
NOT_RELEASES = ["dev", "my-engine 1.0"]
FIELDS = EngineCoreReadyResponse.__struct_fields__
DATA = Path(__file__).parent / "data"


def keys_of(dialect: Dialect) -> frozenset[str]:
    """The keys of ``dialect``'s ready message, as its engines send it."""
    return frozenset(FIELDS[: dialect.ready_keys])


KEYS_0_33 = keys_of(VLLM_0_33)
KEYS_0_34 = keys_of(VLLM_0_34)
NEITHER = KEYS_0_33 | {"vllm_config", "config_hash"}
"""30 keys: 0.33's and two of the five 0.34 added."""


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "trio_enginecore.client" and record.levelno == logging.WARNING
    ]


# ------------------------------------------------------------- the table


def test_each_release_names_the_ready_keys_new_in_it() -> None:
    # The oldest names all of its own; each later one what it appended, in order.
    names = [key for dialect in DIALECTS for key in dialect.ready_keys_added]
    assert len(names) == len(set(names))
    for dialect in DIALECTS:
        through = [
            key for d in DIALECTS if d.release <= dialect.release for key in d.ready_keys_added
        ]
        assert tuple(through) == FIELDS[: dialect.ready_keys]
    assert VLLM_0_34.ready_keys_added == (
        "vllm_config",
        "prefix_hash_config",
        "cache_config_info",
        "config_hash",
        "enable_expert_parallel",
    )


def test_a_ready_message_is_the_release_whose_keys_it_has() -> None:
    assert dialect_of_ready(KEYS_0_33) is VLLM_0_33
    assert dialect_of_ready(KEYS_0_34) is VLLM_0_34
    # Keys no release has do not count against it (a build newer than the table).
    assert dialect_of_ready(KEYS_0_34 | {"new_in_main"}) is VLLM_0_34
    assert dialect_of_ready(KEYS_0_33 | {"new_in_main"}) is VLLM_0_33
    assert dialect_of_ready(NEITHER) is None
    assert dialect_of_ready(KEYS_0_33 - {"coord_store_port"}) is None
    assert dialect_of_ready(KEYS_0_34 - {"vllm_config"}) is None
    assert dialect_of_ready(set()) is None


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_the_ready_message_vllm_itself_sends_is_known_by_its_keys(dialect: Dialect) -> None:
    # The golden frame each release's own engine core wrote (tests/data).
    frame = DATA / f"vllm-{dialect.tested_version}" / "engine_ready_response" / "frame_00.bin"
    keys = msgspec.msgpack.decode(frame.read_bytes(), type=dict[str, msgspec.Raw])
    assert len(keys) == dialect.ready_keys
    assert dialect_of_ready(keys) is dialect
    assert choose_dialect("dev", keys).dialect is dialect


# ------------------------------------------------- one engine's version


@pytest.mark.parametrize("version", NOT_RELEASES)
@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_a_version_naming_no_release_gets_the_release_of_its_keys_and_a_warning(
    version: str, dialect: Dialect
) -> None:
    choice = choose_dialect(version, keys_of(dialect))
    assert choice.dialect is dialect
    assert not choice.untested
    warning = choice.warning()
    assert warning is not None
    assert f"announced vLLM version {version!r}, which names no release" in warning
    assert f"speaking {dialect.name}'s wire format" in warning
    assert f"has {dialect.name}'s {dialect.ready_keys} keys" in warning
    # Why: 0.34's five keys are there, or they are not.
    assert "vllm_config, prefix_hash_config" in warning


def test_the_warning_names_keys_no_release_has() -> None:
    warning = choose_dialect("dev", KEYS_0_34 | {"zeta", "alpha"}).warning()
    assert warning is not None
    assert "plus 2 that no release in the table has (alpha, zeta)" in warning


def test_a_ready_message_of_no_release_is_refused_saying_why() -> None:
    with pytest.raises(ValueError, match="names no release") as caught:
        choose_dialect("my-engine 1.0", NEITHER)
    message = str(caught.value)
    assert "vLLM version 'my-engine 1.0' names no release" in message
    assert "its ready message (30 keys) is that of no release" in message
    # Each release tried, and why it is not that one.
    assert (
        "not vLLM 0.33's (28 keys): it has 2 that a later release added "
        "(vllm_config, config_hash)" in message
    )
    assert (
        "not vLLM 0.34's (33 keys): it lacks 3 of them "
        "(prefix_hash_config, cache_config_info, enable_expert_parallel)" in message
    )


def test_a_version_naming_no_release_without_a_ready_message_is_refused() -> None:
    with pytest.raises(ValueError, match="not a vLLM version: 'dev'"):
        choose_dialect("dev")


@pytest.mark.parametrize("keys", [KEYS_0_33, KEYS_0_34, NEITHER], ids=["0.33", "0.34", "neither"])
def test_a_parseable_dev_build_is_its_release_whatever_its_keys(keys: frozenset[str]) -> None:
    # setuptools-scm's version of a build after 0.34: the next release, 0.35, which
    # the table does not know yet: the newest form, with the untested-release warning.
    choice = choose_dialect("0.35.0.dev12+g1234", keys)
    assert (choice.dialect, choice.untested, choice.shape) == (NEWEST, True, None)
    warning = choice.warning()
    assert warning is not None
    assert "vLLM 0.35.0.dev12+g1234, newer than any release" in warning
    # A dev build of a known release is that release, with no warning.
    choice = choose_dialect("0.34.1.dev3+gabc", keys)
    assert (choice.dialect, choice.untested, choice.warning()) == (VLLM_0_34, False, None)


# --------------------------------------------------------------- groups


def test_an_engine_naming_no_release_joins_a_group_of_its_release() -> None:
    choices = choose_group_dialects(
        [("engine rank 0", "0.34.0", KEYS_0_34), ("engine rank 1", "dev", KEYS_0_34)]
    )
    assert [choice.dialect for choice in choices] == [VLLM_0_34, VLLM_0_34]
    assert choices[0].warning() is None
    assert choices[1].warning() is not None


@pytest.mark.parametrize(
    ("engines", "each"),
    [
        (
            [("0.34.0", KEYS_0_34), ("dev", KEYS_0_33)],
            "engine rank 0 runs vLLM 0.34.0, engine rank 1 runs 'dev' with vLLM 0.33's "
            "ready message",
        ),
        (
            [("dev", KEYS_0_33), ("dev", KEYS_0_34)],
            "engine rank 0 runs 'dev' with vLLM 0.33's ready message, engine rank 1 runs "
            "'dev' with vLLM 0.34's ready message",
        ),
    ],
)
def test_an_engine_naming_no_release_is_refused_in_a_group_of_another(
    engines: list[tuple[str, frozenset[str]]], each: str
) -> None:
    named = [(f"engine rank {rank}", v, keys) for rank, (v, keys) in enumerate(engines)]
    with pytest.raises(ValueError, match="different vLLM releases") as caught:
        choose_group_dialects(named)
    assert each in str(caught.value)


# ------------------------------------------------ one client's engines


def handles(*shapes: tuple[str, frozenset[str]]) -> list[EngineHandle]:
    base = EngineCore(EngineConfig()).ready_response()
    engines = [EngineHandle.for_rank(rank) for rank in range(len(shapes))]
    for engine, (version, keys) in zip(engines, shapes, strict=True):
        engine.ready = msgspec.structs.replace(base, vllm_version=version)
        engine.ready_keys = keys
    return engines


def test_a_client_warns_once_for_its_engines_and_their_restarts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    dialects = EngineDialects()
    engines = handles(("dev", KEYS_0_33), ("dev", KEYS_0_33), ("dev", KEYS_0_33))
    dialects.settle(engines)
    assert [engine.dialect for engine in engines] == [VLLM_0_33] * 3
    (warning,) = warnings_of(caplog)
    assert "'dev'" in warning
    assert "vLLM 0.33" in warning
    # A rank restarts, as the same build: nothing new to say.
    (again,) = handles(("dev", KEYS_0_33))
    dialects.adopt(again)
    assert again.dialect is VLLM_0_33
    assert len(warnings_of(caplog)) == 1
    # Another client warns for its own engines.
    EngineDialects().settle(handles(("dev", KEYS_0_33)))
    assert len(warnings_of(caplog)) == 2


def test_a_client_with_engines_of_releases_does_not_warn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    engines = handles(("0.33.0", KEYS_0_33), ("0.33.1", KEYS_0_33))
    EngineDialects().settle(engines)
    assert [engine.dialect for engine in engines] == [VLLM_0_33] * 2
    assert warnings_of(caplog) == []


def test_a_startup_refuses_an_engine_whose_ready_message_is_no_releases() -> None:
    engines = handles(("0.34.0", KEYS_0_34), ("my-engine 1.0", NEITHER))
    with pytest.raises(EngineStartupError) as caught:
        EngineDialects().settle(engines)
    message = str(caught.value)
    assert message.startswith("engines refused: engine rank 1: vLLM version 'my-engine 1.0'")
    assert "(30 keys)" in message
    assert "not vLLM 0.33's" in message
    assert "not vLLM 0.34's" in message


def test_an_engine_that_comes_back_naming_no_release_is_given_its_keys_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    dialects = EngineDialects()
    (engine,) = handles(("0.34.0", KEYS_0_34))
    dialects.settle([engine])
    assert warnings_of(caplog) == []
    (back,) = handles(("dev", KEYS_0_33))
    engine.ready, engine.ready_keys = back.ready, back.ready_keys
    dialects.adopt(engine)
    assert engine.dialect is VLLM_0_33
    first, second = warnings_of(caplog)
    assert "'dev', which names no release" in first
    assert "came back as 'dev' with vLLM 0.33's ready message (was vLLM 0.34)" in second


# ----------------------------------------- over sockets, a scripted engine


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
async def test_a_dev_engine_is_sent_the_form_of_its_ready_messages_release(
    dialect: Dialect, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    with trio.fail_after(30):
        async with attached_to_hostile_engine(vllm_version="dev", ready_keys=keys_of(dialect)) as (
            engine,
            client,
        ):
            await client.add_request(EngineCoreRequest.for_tokens(PROMPT, request_id="a"))
            await engine.expect_adds("a")
            form = "int32 array" if dialect.packed_prompts else "list"
            assert engine.prompt_forms == {"a": form}
            ready = client.engines[0]
            assert ready is not None
            assert ready.vllm_version == "dev"
    (warning,) = warnings_of(caplog)
    assert f"speaking {dialect.name}'s wire format" in warning


async def test_a_dev_engine_serves_in_a_group_with_an_engine_of_its_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    with trio.fail_after(30):
        async with attached_to_serving_engines(
            2, vllm_versions=["0.33.0", "dev"], ready_keys=[KEYS_0_33, KEYS_0_33]
        ) as peers:
            for rank, engine in enumerate(peers.engines):
                request_id = f"r{rank}"
                await peers.client.add_request(
                    EngineCoreRequest.for_tokens(
                        PROMPT, request_id=request_id, data_parallel_rank=rank
                    )
                )
                await engine.expect_adds(request_id)
                assert engine.prompt_forms == {request_id: "list"}
    (warning,) = warnings_of(caplog)
    assert "'dev'" in warning


async def test_a_dev_engine_in_a_group_of_another_release_is_refused_at_startup() -> None:
    with trio.fail_after(30), pytest.raises(EngineStartupError) as caught:
        async with attached_to_serving_engines(
            2, vllm_versions=["0.34.0", "dev"], ready_keys=[None, KEYS_0_33]
        ):
            pytest.fail("the client must not start")
    message = str(caught.value)
    assert "different vLLM releases" in message
    assert "engine rank 1 runs 'dev' with vLLM 0.33's ready message" in message


async def test_an_engine_whose_ready_message_is_no_releases_is_refused_at_startup() -> None:
    with trio.fail_after(30), pytest.raises(EngineStartupError) as caught:
        async with attached_to_hostile_engine(vllm_version="my-engine 1.0", ready_keys=NEITHER):
            pytest.fail("the client must not start")
    message = str(caught.value)
    assert "vLLM version 'my-engine 1.0' names no release" in message
    assert "(30 keys)" in message
    assert "not vLLM 0.33's" in message
    assert "not vLLM 0.34's" in message


# ------------------------------------------- the reference engine, as "dev"


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
async def test_reference_engines_announcing_dev_are_served_in_their_release(
    dialect: Dialect, caplog: pytest.LogCaptureFixture
) -> None:
    """Two engine processes announcing "dev" with one release's ready message: exact
    streams (0.34's packed prompts, long ones in an aux frame, or 0.33's lists), what
    the release lacks refused before it is sent, and one warning for the client."""
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    release = f"{dialect.release[0]}.{dialect.release[1]}"
    config = EngineConfig(vllm_version="dev", wire_release=release, data_parallel_size=2)
    with trio.fail_after(60):
        async with open_engine_client(config) as client:
            assert [ready.vllm_version for ready in client.engines if ready] == ["dev", "dev"]
            for prompt in (PROMPT, list(range(1000, 1300))):
                for rank in (0, 1):
                    request = EngineCoreRequest.for_tokens(
                        prompt, max_tokens=4, data_parallel_rank=rank
                    )
                    assert await stream_tokens(client, request) == expected(prompt, 4)
            if dialect is OLDEST:
                with pytest.raises(UtilityCallError, match=r"not sent.*new in vLLM 0\.34"):
                    await client.is_inference_ready()
            else:
                assert await client.is_inference_ready() is True
    (warning,) = warnings_of(caplog)
    assert f"announced vLLM version 'dev', which names no release: speaking {dialect.name}'s" in (
        warning
    )


async def test_an_in_process_engine_announcing_dev_speaks_its_wire_release() -> None:
    config = EngineConfig(vllm_version="dev", wire_release="0.33")
    async with open_engine_client(config, multiprocess=False) as client:
        assert await stream_tokens(client, EngineCoreRequest.for_tokens(PROMPT, max_tokens=3)) == (
            expected(PROMPT, 3)
        )
        with pytest.raises(UtilityCallError, match=r"not sent.*new in vLLM 0\.34"):
            await client.is_inference_ready()


async def test_a_restarted_dev_engine_keeps_its_form_and_is_not_warned_of_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    config = EngineConfig(vllm_version="dev", wire_release="0.33", step_time_s=0.01)
    with trio.fail_after(60):
        async with open_engine_client(config, on_engine_failure=Restart(backoff_s=0.2)) as client:
            (first,) = client.engine_pids
            assert first is not None
            victim = EngineCoreRequest.for_tokens([5], request_id="v", max_tokens=100_000)
            with pytest.raises(EngineDeadError):
                async with client.stream(victim) as outputs:
                    await outputs.receive()
                    os.kill(first, signal.SIGKILL)
                    async for _ in outputs:
                        pass
            # Waits for the restarted engine: 0.33's form again, exact.
            request = EngineCoreRequest.for_tokens(PROMPT, max_tokens=5)
            assert await stream_tokens(client, request) == expected(PROMPT, 5)
            assert client.statistics().engines[0].restarts == 1
    dev = [warning for warning in warnings_of(caplog) if "'dev'" in warning]
    assert len(dev) == 1

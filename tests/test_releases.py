"""One client, engines of several vLLM releases: each engine is sent the form its
release reads, decided from its ready message.

* An engine whose ready message names vLLM 0.33 gets prompts as lists of ints; one
  naming 0.34 gets int32 arrays; both from clients in one process, and the reference
  engine presenting itself as either release serves exact streams.
* A release newer than any known gets the newest form and one warning naming the
  tested releases; an older one is refused at startup, and so is a group that mixes
  releases, naming each engine's.
* Utilities a release does not have, or arguments it does not take, are refused before
  anything is sent, naming the release; the engine keeps serving.
"""

from __future__ import annotations

import logging
from functools import partial

import msgspec
import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    EngineStartupError,
    UtilityCallError,
    open_engine_client,
)
from trio_enginecore.client._core._engines import EngineHandle
from trio_enginecore.client._multiprocess._startup import EngineDialects
from trio_enginecore.dialects import DIALECTS, VLLM_0_33, VLLM_0_34
from trio_enginecore.engine import EngineCore

from .hostile import attached_to_hostile_engine, attached_to_serving_engines, fence
from .support import expected, stream_tokens

PROMPT = [7, 8, 9]


async def test_each_release_gets_its_own_prompt_form_from_clients_in_one_process() -> None:
    with trio.fail_after(30):
        async with (
            attached_to_hostile_engine(vllm_version="0.33.0") as (old, old_client),
            attached_to_hostile_engine(vllm_version="0.34.0") as (new, new_client),
        ):
            await old_client.add_request(EngineCoreRequest.for_tokens(PROMPT, request_id="a"))
            await new_client.add_request(EngineCoreRequest.for_tokens(PROMPT, request_id="b"))
            await old.expect_adds("a")
            await new.expect_adds("b")
            assert old.prompt_forms == {"a": "list"}
            assert new.prompt_forms == {"b": "int32 array"}
            assert old.added["a"].prompt_token_ids == new.added["b"].prompt_token_ids == PROMPT


@pytest.mark.parametrize("version", [d.tested_version for d in DIALECTS])
async def test_the_reference_engine_presenting_either_release_serves_exact_streams(
    version: str,
) -> None:
    with trio.fail_after(60):
        async with open_engine_client(EngineConfig(vllm_version=version)) as client:
            assert client.statistics().engines[0].state == "alive"
            tokens = await stream_tokens(client, EngineCoreRequest.for_tokens(PROMPT, max_tokens=5))
            assert tokens == expected(PROMPT, 5)
            # Long prompts take an aux frame in 0.34's form.
            long_prompt = list(range(1000, 1300))
            tokens = await stream_tokens(
                client, EngineCoreRequest.for_tokens(long_prompt, max_tokens=3)
            )
            assert tokens == expected(long_prompt, 3)


async def test_engines_of_both_releases_serve_side_by_side_in_one_process() -> None:
    results: dict[str, list[int]] = {}

    async def serve(version: str) -> None:
        async with open_engine_client(EngineConfig(vllm_version=version)) as client:
            results[version] = await stream_tokens(
                client, EngineCoreRequest.for_tokens(PROMPT, max_tokens=6)
            )

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for dialect in DIALECTS:
                nursery.start_soon(serve, dialect.tested_version)
    assert results == {d.tested_version: expected(PROMPT, 6) for d in DIALECTS}


async def test_a_newer_release_gets_the_newest_form_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    with trio.fail_after(30):
        async with attached_to_hostile_engine(vllm_version="0.35.0") as (engine, client):
            await client.add_request(EngineCoreRequest.for_tokens(PROMPT, request_id="a"))
            await client.add_request(EngineCoreRequest.for_tokens(PROMPT, request_id="b"))
            await engine.expect_adds("a", "b")
            assert engine.prompt_forms == {"a": "int32 array", "b": "int32 array"}
    warnings = [r.getMessage() for r in caplog.records if "0.35.0" in r.getMessage()]
    assert len(warnings) == 1
    for dialect in DIALECTS:
        assert dialect.tested_version in warnings[0]


async def test_an_older_release_is_refused_at_startup_naming_it() -> None:
    with trio.fail_after(30), pytest.raises(EngineStartupError, match=r"vLLM 0\.32\.1 is older"):
        async with attached_to_hostile_engine(vllm_version="0.32.1"):
            pytest.fail("the client must not start")


async def test_a_group_mixing_releases_is_refused_naming_each_engine() -> None:
    with trio.fail_after(30), pytest.raises(EngineStartupError) as caught:
        async with attached_to_serving_engines(2, vllm_versions=["0.33.0", "0.34.0"]):
            pytest.fail("the client must not start")
    message = str(caught.value)
    assert "different vLLM releases" in message
    assert "engine rank 0 runs vLLM 0.33.0" in message
    assert "engine rank 1 runs vLLM 0.34.0" in message


async def test_a_utility_the_release_lacks_is_refused_before_sending() -> None:
    with trio.fail_after(30):
        async with attached_to_hostile_engine(vllm_version="0.33.0") as (engine, client):
            with pytest.raises(UtilityCallError, match=r"not sent.*vLLM 0\.33.*new in vLLM 0\.34"):
                await client.is_inference_ready()
            with pytest.raises(UtilityCallError, match=r"sleep\(level, mode\) does not take 3"):
                await client.sleep(1, "abort", reset_connector=True)
            await fence(engine, client)
            assert engine.calls == []
            # What the release has still goes through.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.sleep, 1, "abort")
                call = await engine.expect_utility()
                assert (call.method, call.args) == ("sleep", (1, "abort"))
                await engine.reply(call)


async def test_a_034_engine_takes_the_new_arguments() -> None:
    with trio.fail_after(30):
        async with (
            attached_to_hostile_engine(vllm_version="0.34.0") as (engine, client),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(partial(client.sleep, 1, "abort", reset_connector=False))
            call = await engine.expect_utility()
            assert (call.method, call.args) == ("sleep", (1, "abort", False))
            await engine.reply(call)


async def test_checkpoint_wrappers_merge_two_engines_answers() -> None:
    with trio.fail_after(60):
        async with open_engine_client(EngineConfig(data_parallel_size=2)) as client:
            assert await client.is_inference_ready() is True
            assert await client.checkpoint_state() == ("running", None)
            # Rank 0 alone goes to sleep (call_utility asks rank 0): it refuses to
            # prepare, rank 1 prepares; the wrapper gives the refusal, and the merged
            # state is the transition under way.
            await client.call_utility("sleep", 1)
            assert await client.is_inference_ready() is False
            reason = await client.checkpoint_prepare("abort")
            assert reason == "Preparing for a checkpoint requires an awake engine"
            assert await client.call_utility_all("checkpoint_state") == [
                ["running", None],
                ["prepared", None],
            ]
            assert await client.checkpoint_state() == ("restoring", None)
            with pytest.raises(UtilityCallError, match="checkpoint state is prepared"):
                await client.wake_up()
            await client.checkpoint_restore()
            assert await client.wake_up() is True
            assert await client.checkpoint_state() == ("running", None)
            assert await client.is_inference_ready() is True
            for _ in range(4):  # both engines serve again
                request = EngineCoreRequest.for_tokens(PROMPT, max_tokens=3)
                assert await stream_tokens(client, request) == expected(PROMPT, 3)


def test_an_engine_that_comes_back_is_spoken_to_in_its_new_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = EngineHandle.for_rank(0)
    adopt_dialect = EngineDialects().adopt
    base = EngineCore(EngineConfig()).ready_response()
    engine.ready = msgspec.structs.replace(base, vllm_version="0.33.0")
    adopt_dialect(engine)
    assert engine.dialect is VLLM_0_33
    caplog.set_level(logging.WARNING, logger="trio_enginecore")
    engine.ready = msgspec.structs.replace(base, vllm_version="0.34.1")
    adopt_dialect(engine)
    assert engine.dialect is VLLM_0_34
    assert "came back as vLLM 0.34.1 (was vLLM 0.33)" in caplog.text
    engine.ready = msgspec.structs.replace(base, vllm_version="0.20.0")
    adopt_dialect(engine)  # unsupported: logged, and its last known form kept
    assert engine.dialect is VLLM_0_34
    assert "came back unsupported" in caplog.text

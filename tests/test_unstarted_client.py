"""A client that was never started says so, from every method.

``async with TrioMPClient(EngineConfig()) as client:`` looks right and starts nothing:
the constructors build a client, and ``open_engine_client`` (or ``start(nursery)``)
starts it. Every public method of a client that was never started, ``async with``
included, raises ``RuntimeError`` saying what to do, instead of answering as if it had
no work (``get_request_counts() == (0, 0)``) and failing later from deep inside.
Closing one is fine, and a closed one cannot be started.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import trio

from trio_enginecore import (
    DPLBTrioMPClient,
    DPTrioMPClient,
    EngineConfig,
    EngineCoreRequest,
    TrioInprocClient,
    TrioMPClient,
)
from trio_enginecore.client import ClientOptions, TrioEngineClient
from trio_enginecore.coordinator import CoordinatorAddresses
from trio_enginecore.protocol import LoRARequest
from trio_enginecore.testing import FakeEngine, FakeTransport

from .support import children_of_this_process

NEVER_STARTED = (
    r"was never started, so it has no engine: open a client with "
    r"`async with open_engine_client\(config\) as client:`"
)

CONSTRUCTORS: dict[str, Callable[[], TrioEngineClient]] = {
    "TrioMPClient": lambda: TrioMPClient(EngineConfig()),
    "DPTrioMPClient": lambda: DPTrioMPClient(
        EngineConfig(data_parallel_size=2, data_parallel_external_lb=True),
        ClientOptions(coordinator=CoordinatorAddresses.in_directory("/tmp/never-used")),
    ),
    "DPLBTrioMPClient": lambda: DPLBTrioMPClient(EngineConfig(data_parallel_size=2)),
    "TrioInprocClient": lambda: TrioInprocClient(EngineConfig()),
    "over the fake transport": lambda: TrioEngineClient(
        FakeTransport(FakeEngine()), EngineConfig()
    ),
}

# Arguments that would be fine for a started client, by method name.
ARGUMENTS: dict[str, tuple[Any, ...]] = {
    "add_request": (EngineCoreRequest.for_tokens([1]),),
    "add_requests": ([EngineCoreRequest.for_tokens([1])],),
    "abort_requests": (["a"],),
    "stream": (EngineCoreRequest.for_tokens([1]),),
    "call_utility": ("is_sleeping",),
    "call_utility_all": ("is_sleeping",),
    "add_lora": (LoRARequest("adapter", 1),),
    "remove_lora": (1,),
    "pin_lora": (1,),
    "set_weight_version": ("v1",),
    "observe_outputs": (print,),
}
# Not calls on the engines: starting and closing the client.
LIFECYCLE = {"start", "aclose"}


def public_methods() -> list[str]:
    """Every public method of the Trio client, the interface's typed wrappers included."""
    return sorted(
        name
        for name, member in inspect.getmembers(TrioEngineClient)
        if not name.startswith("_") and callable(member) and name not in LIFECYCLE
    )


def test_the_list_of_methods_is_the_whole_interface() -> None:
    methods = public_methods()
    assert {"add_request", "get_output", "stream", "statistics", "is_sleeping"} <= set(methods)
    assert len(methods) > 30


@pytest.fixture(params=list(CONSTRUCTORS))
def client(request: pytest.FixtureRequest) -> TrioEngineClient:
    return CONSTRUCTORS[str(request.param)]()


@pytest.mark.parametrize("method", public_methods())
async def test_every_method_of_an_unstarted_client_says_to_start_it(
    client: TrioEngineClient, method: str
) -> None:
    call = getattr(client, method)
    with trio.fail_after(5), pytest.raises(RuntimeError, match=NEVER_STARTED):
        result = call(*ARGUMENTS.get(method, ()))
        if inspect.isawaitable(result):
            await result
    await client.aclose()


async def test_async_with_on_an_unstarted_client_says_to_start_it(
    client: TrioEngineClient,
) -> None:
    with pytest.raises(RuntimeError, match=NEVER_STARTED) as raised:
        async with client:
            pytest.fail("the block must not be entered")
    assert type(client).__name__ in str(raised.value) or "TrioEngineClient" in str(raised.value)
    assert children_of_this_process() == []


async def test_an_unstarted_client_can_be_closed_and_then_cannot_be_started() -> None:
    client = TrioMPClient(EngineConfig(), ClientOptions())
    await client.aclose()
    await client.aclose()
    async with trio.open_nursery() as nursery:
        with pytest.raises(trio.ClosedResourceError, match="closed"):
            await client.start(nursery)
    assert children_of_this_process() == []


async def test_a_started_client_serves_after_async_with_enters() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            client = TrioMPClient(EngineConfig(step_time_s=0.001))
            await client.start(nursery)
            async with client:
                tokens: list[int] = []
                async with client.stream(EngineCoreRequest.for_tokens([5], max_tokens=3)) as out:
                    async for output in out:
                        tokens += output.new_token_ids
                assert tokens == [6, 7, 8]
    assert children_of_this_process() == []

"""Client selection and the factory functions: open_engine_client and make_client."""

from __future__ import annotations

import signal
import tempfile
import threading
import time
import typing
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreClient,
    EngineCoreRequest,
    EngineDeadError,
    InprocClient,
    SyncMPClient,
    TrioInprocClient,
    make_client,
    open_engine_client,
)
from trio_enginecore.client import (
    ClientOptions,
    DPLBTrioMPClient,
    DPTrioMPClient,
    LeastLoaded,
    PowerOfTwoChoices,
    TrioMPClient,
    connect_engine_client,
)
from trio_enginecore.client._core._router import DataParallelRole
from trio_enginecore.client._mp import new_mp_client
from trio_enginecore.client._options import ClientOptionKeywords
from trio_enginecore.coordinator import CoordinatorAddresses
from trio_enginecore.engine import CounterModel
from trio_enginecore.errors import EngineStartupError

from .enginepeer import serve_command
from .support import children_of_this_process, expected

pytestmark = pytest.mark.timeout(60)


def generate(client: EngineCoreClient, request_id: str, prompt: list[int], n: int) -> list[int]:
    """Run one request to completion through the blocking batch API."""
    client.add_request(EngineCoreRequest.for_tokens(prompt, request_id=request_id, max_tokens=n))
    tokens: list[int] = []
    deadline = time.monotonic() + 20
    while True:
        assert time.monotonic() < deadline
        for output in client.get_output().outputs:
            assert output.request_id == request_id
            tokens += output.new_token_ids
            if output.finish_reason is not None:
                return tokens


# ------------------------------------------------------------------ selection
# One pure function answers "which engines, which routing" (DataParallelRole.for_config);
# new_mp_client maps its answer to vLLM's class names, and every opener goes through it.


def test_one_engine_is_a_single_role_and_a_trio_mp_client() -> None:
    role = DataParallelRole.for_config(EngineConfig())
    assert (role.kind, role.ranks, role.load_balancer, role.data_parallel) == (
        "single",
        range(1),
        None,
        False,
    )
    assert type(new_mp_client(EngineConfig(), ClientOptions())) is TrioMPClient


def test_internal_load_balancing_balances_every_rank_with_least_loaded_by_default() -> None:
    config = EngineConfig(data_parallel_size=3)
    role = DataParallelRole.for_config(config)
    assert role.kind == "balanced"
    assert role.ranks == range(3)
    assert role.data_parallel
    assert isinstance(role.load_balancer, LeastLoaded)
    assert role.launches_coordinator
    assert type(new_mp_client(config, ClientOptions())) is DPLBTrioMPClient


def test_a_given_load_balancer_and_coordinator_are_the_roles() -> None:
    balancer = PowerOfTwoChoices()
    coordinator = CoordinatorAddresses("ipc:///tmp/a", "ipc:///tmp/b", "ipc:///tmp/c")
    role = DataParallelRole.for_config(
        EngineConfig(data_parallel_size=2), load_balancer=balancer, coordinator=coordinator
    )
    assert role.load_balancer is balancer
    assert role.coordinator is coordinator


def test_external_load_balancing_owns_its_one_rank() -> None:
    config = EngineConfig(
        data_parallel_size=4, data_parallel_rank=2, data_parallel_external_lb=True
    )
    role = DataParallelRole.for_config(config)
    assert (role.kind, role.ranks, role.load_balancer) == ("one_rank", range(2, 3), None)
    assert role.data_parallel
    assert not role.launches_coordinator
    options = ClientOptions(input_address="tcp://127.0.0.1:0", output_address="tcp://127.0.0.1:0")
    assert type(new_mp_client(config, options)) is DPTrioMPClient


def test_a_coordinator_for_one_engine_is_refused() -> None:
    coordinator = CoordinatorAddresses("ipc:///tmp/a", "ipc:///tmp/b", "ipc:///tmp/c")
    with pytest.raises(ValueError, match="only used with data_parallel_size > 1"):
        DataParallelRole.for_config(EngineConfig(), coordinator=coordinator)


@pytest.mark.parametrize("blocking", [False, True])
def test_data_parallel_needs_engine_processes(blocking: bool) -> None:
    config = EngineConfig(data_parallel_size=2)
    with pytest.raises(NotImplementedError, match="data_parallel_size=2"):
        if blocking:
            make_client(config, multiprocess=False)
        else:
            open_engine_client(config, multiprocess=False)


@pytest.mark.parametrize("external_lb", [False, True])
def test_blocking_data_parallel_runs_the_data_parallel_trio_client(external_lb: bool) -> None:
    config = EngineConfig(
        data_parallel_size=2, data_parallel_rank=1, data_parallel_external_lb=external_lb
    )
    expected = DPTrioMPClient if external_lb else DPLBTrioMPClient
    options = ClientOptions(input_address="tcp://127.0.0.1:0", output_address="tcp://127.0.0.1:0")
    assert type(new_mp_client(config, options)) is expected


def test_role_for_config_takes_keywords_only() -> None:
    with pytest.raises(TypeError):
        DataParallelRole.for_config(EngineConfig(), LeastLoaded())  # type: ignore[misc]


# ---------------------------------------------------------- open_engine_client


def test_open_engine_client_refuses_unsupported_data_parallel_before_launching_anything() -> None:
    before = children_of_this_process()
    with pytest.raises(NotImplementedError, match="data_parallel_size"):
        open_engine_client(EngineConfig(data_parallel_size=2), multiprocess=False)
    with pytest.raises(ValueError, match="open_coordinator"):
        open_engine_client(EngineConfig(data_parallel_size=2, data_parallel_external_lb=True))
    assert children_of_this_process() == before


@pytest.mark.parametrize(
    "addresses",
    [
        {"input_address": "ipc:///tmp/x"},
        {"output_address": "ipc:///tmp/x"},
        {"input_address": "ipc:///tmp/x", "output_address": "ipc:///tmp/y"},
    ],
)
def test_an_inproc_client_cannot_attach_to_addresses(addresses: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="in-process"):
        open_engine_client(multiprocess=False, **addresses)  # type: ignore[call-overload]


def test_open_engine_client_launches_nothing_until_entered() -> None:
    before = children_of_this_process()
    manager = open_engine_client(EngineConfig())
    assert children_of_this_process() == before
    del manager


async def test_open_engine_client_in_process_gives_a_working_trio_inproc_client() -> None:
    before = children_of_this_process()
    with trio.fail_after(20):
        async with open_engine_client(multiprocess=False) as client:
            assert isinstance(client, TrioInprocClient)
            assert client.engine_pids == (None,)
            tokens: list[int] = []
            async with client.stream(
                EngineCoreRequest.for_tokens([10], request_id="r", max_tokens=5)
            ) as outputs:
                async for output in outputs:
                    tokens += output.new_token_ids
            assert tokens == CounterModel.expected_tokens([10], 5)
            assert client.statistics().requests_in_flight == 0
            assert children_of_this_process() == before  # no engine process


async def test_open_engine_client_passes_its_options_to_the_inproc_client() -> None:
    config = EngineConfig(max_loras=1)
    with trio.fail_after(20):
        async with open_engine_client(
            config, multiprocess=False, client_index=3, max_pending_outputs=2
        ) as client:
            assert isinstance(client, TrioInprocClient)
            assert client.config is config
            assert client.client_index == 3
            assert await client.get_supported_tasks() == ("generate",)


# ------------------------------------------------------------------ make_client


def test_make_client_in_process_takes_no_options() -> None:
    with pytest.raises(TypeError, match="ready_timeout_s"):
        make_client(multiprocess=False, ready_timeout_s=1)


def test_make_client_refuses_in_process_data_parallel_before_launching_anything() -> None:
    before = children_of_this_process()
    with pytest.raises(NotImplementedError, match="data_parallel_size"):
        make_client(EngineConfig(data_parallel_size=2), multiprocess=False)
    assert children_of_this_process() == before


def test_make_client_with_data_parallel_runs_the_dp_client_on_its_thread() -> None:
    config = EngineConfig(data_parallel_size=2)
    with make_client(config) as client:
        assert isinstance(client, SyncMPClient)
        assert len([pid for pid in client.engine_pids if pid]) == 2
        for i in range(6):
            assert generate(client, f"r{i}", [i + 3], 5) == CounterModel.expected_tokens([i + 3], 5)
        # Both engines answer utility calls, and they agree.
        assert client.is_sleeping() is False
    assert children_of_this_process() == []


def test_make_client_in_process_gives_a_working_inproc_client() -> None:
    config = EngineConfig()
    before = children_of_this_process()
    with make_client(config, multiprocess=False) as client:
        assert isinstance(client, InprocClient)
        assert client.config is config
        assert generate(client, "r", [7], 6) == CounterModel.expected_tokens([7], 6)
        assert client.statistics().requests_in_flight == 0
        assert children_of_this_process() == before  # no engine process


def test_make_client_defaults_to_a_working_sync_mp_client() -> None:
    before = children_of_this_process()
    with make_client(shutdown_timeout_s=5) as client:
        assert isinstance(client, SyncMPClient)
        engine_pid = client.engine_pids[0]
        assert engine_pid is not None
        assert engine_pid in children_of_this_process()
        assert generate(client, "r", [7], 6) == CounterModel.expected_tokens([7], 6)
        assert client.get_supported_tasks() == ("generate",)
        assert client.statistics().requests_in_flight == 0
    assert children_of_this_process() == before
    with pytest.raises(EngineDeadError, match="the engine client was closed"):
        client.get_output()


@pytest.mark.parametrize("build", [make_client, SyncMPClient], ids=["make_client", "SyncMPClient"])
def test_a_misspelt_option_fails_before_any_thread_or_engine_starts(
    build: Callable[..., EngineCoreClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_thread(thread: threading.Thread) -> None:
        raise AssertionError(f"a thread was started: {thread.name}")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    before = children_of_this_process()
    with pytest.raises(TypeError, match="ready_timout_s"):
        build(EngineConfig(), ready_timout_s=3)
    with pytest.raises(ValueError, match="ready_timeout_s"):
        build(EngineConfig(), ready_timeout_s=-1)
    assert children_of_this_process() == before


def test_the_blocking_faces_options_are_typed() -> None:
    """``make_client(cfg, ready_timout_s=3)`` is a type checker's error, not a run's."""
    for function in (make_client, SyncMPClient.__init__):
        hints = typing.get_type_hints(function, include_extras=True)
        assert hints["keywords"] == typing.Unpack[ClientOptionKeywords], function


def test_the_in_process_blocking_client_takes_no_options() -> None:
    with pytest.raises(TypeError, match="InprocClient takes no options"):
        make_client(EngineConfig(), multiprocess=False, ready_timeout_s=3)
    with pytest.raises(TypeError, match="InprocClient takes no options"):
        make_client(EngineConfig(), multiprocess=False, cancel_on_failure=True)


# The same configurations through both Trio openers: the same answer (one judge,
# new_mp_client and plan_topology, behind both).
EXTERNAL_LB = EngineConfig(
    data_parallel_size=2, data_parallel_rank=1, data_parallel_external_lb=True
)
ATTACH = {"input_address": "tcp://127.0.0.1:0", "output_address": "tcp://127.0.0.1:0"}
SAME_ANSWER: dict[str, tuple[EngineConfig, dict[str, Any], type[Exception], str]] = {
    "external load balancing launching with no coordinator": (
        EXTERNAL_LB,
        {},
        ValueError,
        "shares one coordinator",
    ),
    "a coordinator for one engine": (
        EngineConfig(),
        {"coordinator": CoordinatorAddresses.in_directory("/tmp/never-used")},
        ValueError,
        "only used with data_parallel_size > 1",
    ),
    "a client index for launched engines": (
        EngineConfig(),
        {"client_index": 1},
        ValueError,
        "client_index=1 needs engines",
    ),
    "restart for attached engines": (
        EngineConfig(),
        {**ATTACH, "on_engine_failure": "restart"},
        ValueError,
        "restarts engines",
    ),
    # Attached engines announce their coordinator: accepted by both, and then no
    # engine comes.
    "external load balancing attached, no engine comes": (
        EXTERNAL_LB,
        {**ATTACH, "ready_timeout_s": 0.5},
        EngineStartupError,
        "ready",
    ),
}


@pytest.mark.parametrize("case", list(SAME_ANSWER))
async def test_both_trio_openers_give_the_same_answer(case: str) -> None:
    config, options, error, message = SAME_ANSWER[case]
    before = children_of_this_process()
    with trio.fail_after(20):
        with pytest.raises(error, match=message):
            async with open_engine_client(config, **options):
                pytest.fail("opened")
        async with trio.open_nursery() as nursery:
            with pytest.raises(error, match=message):
                await connect_engine_client(nursery, config, **options)
    assert children_of_this_process() == before


async def test_an_attached_client_reads_only_the_groups_shape_of_its_config() -> None:
    """Engines started elsewhere run their own settings (as the docs of
    ``open_engine_client`` and ``EngineConfig`` say): a client attached with a
    configuration unlike its engine in every field but the group's shape serves it, at
    the engine's own settings (its model, its ``max_model_len``, its step time, its
    release)."""
    tmp = tempfile.mkdtemp(prefix="tec-", dir="/tmp")
    inp, out = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
    command = serve_command(
        "--input-address", inp, "--output-address", out, "--max-model-len", "512"
    )
    unlike = EngineConfig(
        model="ngram",
        vocab_size=300,
        max_num_seqs=1,
        max_model_len=64,
        step_time_s=5.0,
        seed=9,
        vllm_version="0.33.0",
    )
    async with trio.open_nursery() as nursery:
        process = await nursery.start(partial(trio.run_process, command, check=False))
        try:
            with trio.fail_after(30):
                async with open_engine_client(
                    unlike, input_address=inp, output_address=out
                ) as client:
                    (ready,) = client.engines
                    assert ready is not None
                    assert ready.max_model_len == 512
                    request = EngineCoreRequest.for_tokens([1, 2, 3], max_tokens=100)
                    async with client.stream(request) as outputs:
                        tokens = [t async for o in outputs for t in o.new_token_ids]
                    assert tokens == expected([1, 2, 3], 100)  # the counter model's
        finally:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()

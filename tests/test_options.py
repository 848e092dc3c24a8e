"""The openers' one path: options in one frozen object, a client you can start yourself,
and clients that close themselves as Trio resources."""

from __future__ import annotations

import math
import re
import typing

import attrs
import pytest
import trio

from trio_enginecore import (
    EngineConfig,
    EngineCoreRequest,
    Liveness,
    connect_engine_client,
    open_engine_client,
)
from trio_enginecore.client import (
    ClientOptions,
    Restart,
    TrioEngineClient,
    TrioMPClient,
    run_client,
)
from trio_enginecore.client._options import ClientOptionKeywords, InprocOptionKeywords

from .support import children_of_this_process, expected, open_fds


@pytest.mark.parametrize("field", ["ready_timeout_s", "shutdown_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf])
def test_a_timeout_that_is_not_a_positive_number_is_refused_by_name(
    field: str, value: float
) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be a positive number, got {value!r}"):
        ClientOptions(**{field: value})


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda v: Liveness(heartbeat_interval_s=v), "Liveness.heartbeat_interval_s"),
        (lambda v: Liveness(heartbeat_timeout_s=v), "Liveness.heartbeat_timeout_s"),
        (lambda v: Liveness(progress_timeout_s=v), "Liveness.progress_timeout_s"),
        (lambda v: Restart(backoff_s=v), "Restart.backoff_s"),
        (lambda v: Restart(wait_s=v), "Restart.wait_s"),
    ],
)
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "1"])
def test_every_settings_object_refuses_a_duration_that_is_not_a_positive_number_by_name(
    make: typing.Callable[[object], object], name: str, value: object
) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(name)} must be a positive number, got "):
        make(value)


def test_an_optional_interval_may_be_none_but_not_zero() -> None:
    assert Liveness(heartbeat_interval_s=None).heartbeat_interval_s is None
    assert Liveness(progress_timeout_s=None).progress_timeout_s is None
    with pytest.raises(ValueError, match=r"Liveness\.heartbeat_interval_s"):
        Liveness(heartbeat_interval_s=0)


def test_options_are_frozen_and_keyword_only() -> None:
    options = ClientOptions(ready_timeout_s=3.0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        options.ready_timeout_s = 4.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        ClientOptions(None)  # type: ignore[misc]
    assert attrs.evolve(options, client_index=2).client_index == 2


def test_the_openers_keywords_are_exactly_the_options_fields_with_their_types() -> None:
    """The keywords of ``open_engine_client(**options)`` are declared once, beside the
    options; they cannot drift apart."""
    hints = typing.get_type_hints(ClientOptionKeywords)
    fields = typing.get_type_hints(ClientOptions)
    assert hints == {field.name: fields[field.name] for field in attrs.fields(ClientOptions)}
    inproc = typing.get_type_hints(InprocOptionKeywords)
    assert inproc == {name: hints[name] for name in ("max_pending_outputs", "client_index")}


async def test_open_engine_client_takes_options_bundled_or_as_keywords_never_both() -> None:
    options = ClientOptions(max_pending_outputs=8, shutdown_timeout_s=2.0)
    with trio.fail_after(30):
        async with open_engine_client(EngineConfig(), options) as client:
            assert client.options is options
            assert await client.is_sleeping() is False
    with pytest.raises(TypeError, match="not both"):
        open_engine_client(EngineConfig(), options, client_index=1)
    assert children_of_this_process() == []


@pytest.mark.parametrize(
    "option",
    [
        {"ready_timeout_s": 3.0},
        {"liveness": Liveness(heartbeat_interval_s=1.0, progress_timeout_s=2.0)},
        {"liveness": None},
        {"input_address": "ipc:///tmp/x"},
    ],
)
def test_an_in_process_client_refuses_the_options_of_processes_by_name(
    option: dict[str, typing.Any],
) -> None:
    (name,) = option
    with pytest.raises(ValueError, match=rf"in-process client takes only .* got \['{name}'\]"):
        open_engine_client(multiprocess=False, **option)


async def test_options_and_keywords_together_are_refused_before_anything_starts() -> None:
    fds_before = open_fds()
    async with trio.open_nursery() as nursery:
        with pytest.raises(TypeError, match=r"not both \(got \['client_index'\]\)"):
            await connect_engine_client(nursery, EngineConfig(), ClientOptions(), client_index=1)
    assert children_of_this_process() == []
    assert open_fds() - fds_before == set()


async def test_a_client_index_engines_joining_the_handshake_cannot_answer_is_refused() -> None:
    """The handshake names one output address: an engine it launches would drop the
    outputs of any other client index, and the client would wait for ever."""
    async with trio.open_nursery() as nursery:
        with pytest.raises(ValueError, match="client_index=3 needs engines started elsewhere"):
            await connect_engine_client(nursery, EngineConfig(), client_index=3)
    assert children_of_this_process() == []


async def test_a_client_connected_with_options_serves_and_closes_as_a_trio_resource() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            client = await connect_engine_client(
                nursery,
                EngineConfig(),
                ClientOptions(max_pending_outputs=8, shutdown_timeout_s=2.0),
            )
            assert isinstance(client, trio.abc.AsyncResource)
            async with client:
                assert client.shutdown_timeout_s == 2.0
                request = EngineCoreRequest.for_tokens([4], request_id="r", max_tokens=5)
                async with client.stream(request) as outputs:
                    tokens = [t async for o in outputs for t in o.new_token_ids]
                assert tokens == expected([4], 5)
                (pid,) = client.engine_pids
            # Leaving `async with client:` closed it: the engine is gone, and every
            # background task in our nursery ended, so the nursery closes at once.
            assert pid not in children_of_this_process()
            with pytest.raises(trio.ClosedResourceError):
                await client.add_request(EngineCoreRequest.for_tokens([1]))


async def test_a_client_constructed_by_hand_runs_with_run_client_and_starts_once() -> None:
    client = TrioMPClient(EngineConfig(), ClientOptions(ready_timeout_s=20))
    assert isinstance(client, TrioEngineClient)
    with trio.fail_after(30):
        async with run_client(client) as running:
            assert running is client
            assert await client.is_sleeping() is False
            async with trio.open_nursery() as nursery:
                with pytest.raises(RuntimeError, match="already started"):
                    await client.start(nursery)
    assert children_of_this_process() == []

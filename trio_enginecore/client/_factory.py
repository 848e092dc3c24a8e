"""Choosing and opening the right client for a configuration, in one place."""

from __future__ import annotations

import enum
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, overload

from .._listeners import ListenerFd
from ..config import EngineConfig
from ..coordinator import CoordinatorAddresses
from ._client import TrioEngineClient
from ._inproc import InprocClient, TrioInprocClient, open_trio_inproc_client
from ._lb import LoadBalancer
from ._mp import TrioMPClient, open_trio_mp_client
from ._remote import DEFAULT_LIVENESS, Liveness, RemoteEngines
from ._sync import EngineCoreClient, SyncMPClient
from ._topology import EXTERNAL_LB_NEEDS_COORDINATOR

__all__ = ["ClientKind", "make_client", "open_engine_client", "select_client_kind"]


class ClientKind(enum.Enum):
    """The client classes a configuration can select."""

    TRIO_MP = "TrioMPClient"
    DP_TRIO_MP = "DPTrioMPClient"
    DPLB_TRIO_MP = "DPLBTrioMPClient"
    TRIO_INPROC = "TrioInprocClient"
    SYNC_MP = "SyncMPClient"
    INPROC = "InprocClient"


def select_client_kind(config: EngineConfig, *, multiprocess: bool, blocking: bool) -> ClientKind:
    """Which client serves ``config``: the whole selection logic (pure).

    One engine: the Trio or blocking, multiprocess or in-process client asked for.
    Several (``data_parallel_size > 1``): the Trio multiprocess
    :class:`~trio_enginecore.client.DPTrioMPClient` owning rank
    ``data_parallel_rank`` with external load balancing
    (``data_parallel_external_lb``), else the
    :class:`~trio_enginecore.client.DPLBTrioMPClient` balancing over all ranks. The
    blocking :class:`~trio_enginecore.SyncMPClient` runs whichever of those the
    configuration selects on its thread, so it serves data parallelism too.

    Raises:
        NotImplementedError: in-process data-parallel clients (one process cannot hold
            several engines).
    """
    if config.data_parallel_size > 1:
        if not multiprocess:
            raise NotImplementedError(
                f"data_parallel_size={config.data_parallel_size} needs engine processes "
                "(multiprocess=True)"
            )
        if blocking:
            return ClientKind.SYNC_MP
        if config.data_parallel_external_lb:
            return ClientKind.DP_TRIO_MP
        return ClientKind.DPLB_TRIO_MP
    if blocking:
        return ClientKind.SYNC_MP if multiprocess else ClientKind.INPROC
    return ClientKind.TRIO_MP if multiprocess else ClientKind.TRIO_INPROC


@overload
def open_engine_client(
    config: EngineConfig | None = None,
    *,
    multiprocess: Literal[True] = True,
    input_address: str | ListenerFd | None = None,
    output_address: str | ListenerFd | None = None,
    ready_timeout_s: float = 60.0,
    shutdown_timeout_s: float = 5.0,
    max_pending_outputs: int = 64,
    client_index: int = 0,
    coordinator: CoordinatorAddresses | None = None,
    load_balancer: LoadBalancer | None = None,
    remote: RemoteEngines | None = None,
    liveness: Liveness | None = DEFAULT_LIVENESS,
    cancel_on_failure: bool = False,
) -> AbstractAsyncContextManager[TrioMPClient]: ...


@overload
def open_engine_client(
    config: EngineConfig | None = None,
    *,
    multiprocess: Literal[False],
    input_address: None = None,
    output_address: None = None,
    ready_timeout_s: float = 60.0,
    shutdown_timeout_s: float = 5.0,
    max_pending_outputs: int = 64,
    client_index: int = 0,
    coordinator: None = None,
    load_balancer: None = None,
    remote: None = None,
    liveness: Liveness | None = DEFAULT_LIVENESS,
    cancel_on_failure: bool = False,
) -> AbstractAsyncContextManager[TrioInprocClient]: ...


@overload
def open_engine_client(
    config: EngineConfig | None = None,
    *,
    multiprocess: bool,
    input_address: str | ListenerFd | None = None,
    output_address: str | ListenerFd | None = None,
    ready_timeout_s: float = 60.0,
    shutdown_timeout_s: float = 5.0,
    max_pending_outputs: int = 64,
    client_index: int = 0,
    coordinator: CoordinatorAddresses | None = None,
    load_balancer: LoadBalancer | None = None,
    remote: RemoteEngines | None = None,
    liveness: Liveness | None = DEFAULT_LIVENESS,
    cancel_on_failure: bool = False,
) -> AbstractAsyncContextManager[TrioEngineClient]: ...


def open_engine_client(
    config: EngineConfig | None = None,
    *,
    multiprocess: bool = True,
    input_address: str | ListenerFd | None = None,
    output_address: str | ListenerFd | None = None,
    ready_timeout_s: float = 60.0,
    shutdown_timeout_s: float = 5.0,
    max_pending_outputs: int = 64,
    client_index: int = 0,
    coordinator: CoordinatorAddresses | None = None,
    load_balancer: LoadBalancer | None = None,
    remote: RemoteEngines | None = None,
    liveness: Liveness | None = DEFAULT_LIVENESS,
    cancel_on_failure: bool = False,
) -> AbstractAsyncContextManager[TrioEngineClient]:
    """Open a Trio engine client: ``async with open_engine_client(config) as client:``.

    With ``multiprocess=True`` (the default) it launches the engine(s) described by
    ``config`` as child processes (the built-in reference engine), performs the startup
    handshake over ipc:// sockets in a private directory, and returns a
    :class:`~trio_enginecore.TrioMPClient` once every engine is ready. With
    ``input_address`` and ``output_address`` it instead binds those addresses and
    attaches to engines started elsewhere (vLLM's ``client_addresses``), launching
    nothing and waiting for the ready message of each of the
    ``config.data_parallel_size`` engines; an attached engine's death is detected when
    it reports ``ENGINE_CORE_DEAD`` or stops answering the ``liveness`` checks (there
    is no process to watch). With ``multiprocess=False`` the engine runs
    as a task of the client (:class:`~trio_enginecore.TrioInprocClient`): no process,
    no sockets.

    Leaving the block aborts in-flight requests, stops launched engines (SIGTERM, then
    SIGKILL after ``shutdown_timeout_s``), closes the sockets and removes the private
    directory, whether the block ended normally, with an exception or by cancellation.
    The block's own exception (or ``Cancelled``) propagates unchanged; if an engine died
    meanwhile and the block did not raise, it raises one ``EngineDeadError``.

    Args:
        config: the engine configuration (default: ``EngineConfig()``).
        multiprocess: run the engine in its own process (True) or in this one.
        input_address: attach mode: the address to bind the request ROUTER on, or a
            :class:`~trio_enginecore.ListenerFd`: a listening socket bound by another
            process, which the client adopts (and then owns) instead of binding.
        output_address: attach mode: the address to bind the output PULL on, or a
            :class:`~trio_enginecore.ListenerFd`.
        ready_timeout_s: how long engines may take to become ready.
        shutdown_timeout_s: how long launched engines may take to exit.
        max_pending_outputs: messages kept for ``get_output()`` before they are
            merged (never dropped).
        client_index: this client's index among the engine's clients.
        coordinator: data parallel: the addresses of a coordinator shared with other
            clients (:func:`~trio_enginecore.open_coordinator`); required with
            external load balancing, optional with internal (which otherwise
            launches its own).
        load_balancer: internal load balancing: the policy choosing an engine per
            request (default :class:`~trio_enginecore.client.LeastLoaded`).
        remote: launch nothing; the engines start on other hosts
            (``trio-enginecore serve --headless``) and join over TCP, optionally
            authenticated with CURVE (see :class:`~trio_enginecore.RemoteEngines`).
        liveness: how often to check that each launched or attached engine still
            answers, and how long it may take (:class:`~trio_enginecore.Liveness`,
            every 0.4 s within 1.2 s by default): an engine that does not answer in
            time is declared dead, and a launched one killed. ``None``: no checks,
            and a hang of a launched engine, or a ``kill -9`` or a hang of an
            attached one, goes unnoticed. Remote engines have their own, on
            :class:`~trio_enginecore.RemoteEngines`.
        cancel_on_failure: cancel the block's body when the client fails (an
            engine died), so that a server running in it stops; the block then
            raises the one ``EngineDeadError``. Without it, the body learns of the
            failure from its calls, or from ``await client.wait_failed()``.

    Raises:
        EngineStartupError: an engine failed to start or was not ready in time; the
            message names the engine and includes its exit code and last stderr lines.
            Its subclass :exc:`~trio_enginecore.errors.AddressError`: an address could
            not be bound, or a ``ListenerFd`` is not a listening stream socket.
        NotImplementedError: a configuration whose client is not available yet
            (see :func:`~trio_enginecore.client.select_client_kind`).
        ValueError: attach addresses with ``multiprocess=False``; external load
            balancing without ``coordinator``.
    """
    config = config if config is not None else EngineConfig()
    kind = select_client_kind(config, multiprocess=multiprocess, blocking=False)
    if kind is ClientKind.TRIO_INPROC:
        if input_address is not None or output_address is not None:
            raise ValueError("an in-process client cannot attach to engines at addresses")
        if coordinator is not None or load_balancer is not None or remote is not None:
            raise ValueError("coordinator, load_balancer and remote are for multiprocess clients")
        return open_trio_inproc_client(
            config,
            max_pending_outputs=max_pending_outputs,
            client_index=client_index,
            cancel_on_failure=cancel_on_failure,
        )
    if kind is ClientKind.DP_TRIO_MP and coordinator is None:
        raise ValueError(EXTERNAL_LB_NEEDS_COORDINATOR)
    return open_trio_mp_client(
        config,
        input_address=input_address,
        output_address=output_address,
        ready_timeout_s=ready_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
        max_pending_outputs=max_pending_outputs,
        client_index=client_index,
        coordinator=coordinator,
        load_balancer=load_balancer,
        remote=remote,
        liveness=liveness,
        cancel_on_failure=cancel_on_failure,
    )


def make_client(
    config: EngineConfig | None = None, *, multiprocess: bool = True, **open_kwargs: Any
) -> EngineCoreClient:
    """Create a blocking engine client (vLLM's ``EngineCoreClient.make_client``).

    ``multiprocess=True`` gives a :class:`~trio_enginecore.SyncMPClient` (the engine in
    its own process; ``open_kwargs`` as for :func:`open_engine_client`), ``False`` an
    :class:`~trio_enginecore.InprocClient` (the engine steps inside ``get_output()``).
    Use the result as a context manager.

    Raises:
        NotImplementedError: as :func:`open_engine_client`.
        TypeError: ``open_kwargs`` given for an in-process client.
    """
    config = config if config is not None else EngineConfig()
    kind = select_client_kind(config, multiprocess=multiprocess, blocking=True)
    if kind is ClientKind.INPROC:
        if open_kwargs:
            raise TypeError(f"InprocClient takes no options, got {sorted(open_kwargs)}")
        return InprocClient(config)
    return SyncMPClient(config, **open_kwargs)

"""Choosing and opening the right client for a configuration, in one place."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Literal, Unpack, overload

import attrs

from ..config import EngineConfig
from ._client import TrioEngineClient
from ._inproc import InprocClient, TrioInprocClient, open_trio_inproc_client
from ._interface import EngineCoreClient
from ._mp import TrioMPClient, new_mp_client
from ._options import (
    ClientOptionKeywords,
    ClientOptions,
    InprocOptionKeywords,
    check_option_keywords,
    options_from,
)
from ._running import run_client
from ._sync import SyncMPClient

__all__ = ["make_client", "open_engine_client"]


def _check_in_process(config: EngineConfig) -> None:
    """An in-process client holds one engine: refuse data parallelism.

    Raises:
        NotImplementedError: ``data_parallel_size > 1`` in one process.
    """
    if config.data_parallel_size > 1:
        raise NotImplementedError(
            f"data_parallel_size={config.data_parallel_size} needs engine processes "
            "(multiprocess=True)"
        )


@overload
def open_engine_client(
    config: EngineConfig | None = None,
    options: ClientOptions | None = None,
    *,
    multiprocess: Literal[True] = True,
    cancel_on_failure: bool = False,
    **keywords: Unpack[ClientOptionKeywords],
) -> AbstractAsyncContextManager[TrioMPClient]: ...


@overload
def open_engine_client(
    config: EngineConfig | None = None,
    options: None = None,
    *,
    multiprocess: Literal[False],
    cancel_on_failure: bool = False,
    **keywords: Unpack[InprocOptionKeywords],
) -> AbstractAsyncContextManager[TrioInprocClient]: ...


@overload
def open_engine_client(
    config: EngineConfig | None = None,
    options: ClientOptions | None = None,
    *,
    multiprocess: bool,
    cancel_on_failure: bool = False,
    **keywords: Unpack[ClientOptionKeywords],
) -> AbstractAsyncContextManager[TrioEngineClient]: ...


def open_engine_client(
    config: EngineConfig | None = None,
    options: ClientOptions | None = None,
    *,
    multiprocess: bool = True,
    cancel_on_failure: bool = False,
    **keywords: Unpack[ClientOptionKeywords],
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

    Engines started elsewhere (attached with ``input_address`` and ``output_address``,
    or joining with ``remote``) run their own settings, not ``config``'s: of ``config``
    only three fields count, the group's shape. ``data_parallel_size`` is how many
    engines the client waits for; with ``data_parallel_external_lb=True`` the client
    serves one rank of them, ``data_parallel_rank``. Every other field is ignored, so
    ``EngineConfig(data_parallel_size=2)`` (or no ``config``, for one engine) is all
    such a client needs. The exception: ranks that a client with
    ``RemoteEngines(ranks=...)`` launches itself are reference engines run from the
    whole of ``config``.

    Leaving the block aborts in-flight requests, stops launched engines (SIGTERM, then
    SIGKILL after ``shutdown_timeout_s``), closes the sockets and removes the private
    directory, whether the block ended normally, with an exception or by cancellation.
    The block's own exception (or ``Cancelled``) propagates unchanged; if an engine died
    meanwhile and the block did not raise, it raises one ``EngineDeadError``.

    The client's options come as one :class:`~trio_enginecore.client.ClientOptions`
    (``options``) or as its fields given as keywords, never both. The signature shows
    them as ``**keywords``; each is listed below, from ``input_address`` to
    ``on_engine_failure``, with its default (a test checks them against
    ``ClientOptions``).

    Args:
        config: the engine configuration (default: ``EngineConfig()``).
        options: the client's options, bundled (default: the keywords below).
        multiprocess: run the engine in its own process (True) or in this one
            (default ``True``).
        cancel_on_failure: cancel the block's body when the client fails (an
            engine died), so that a server running in it stops; the block then
            raises the one ``EngineDeadError``. Without it, the body learns of the
            failure from its calls, or from ``await client.wait_failed()``
            (default ``False``).
        input_address: attach mode: the address to bind the request ROUTER on, or a
            :class:`~trio_enginecore.ListenerFd`: a listening socket bound by another
            process, which the client adopts (and then owns) instead of binding
            (default ``None``).
        output_address: attach mode: the address to bind the output PULL on, or a
            :class:`~trio_enginecore.ListenerFd` (default ``None``).
        remote: launch nothing; the engines start on other hosts
            (``trio-enginecore serve --headless``) and join over TCP, optionally
            authenticated with CURVE (see :class:`~trio_enginecore.RemoteEngines`)
            (default ``None``).
        vllm: launch vLLM's own engine cores instead of the reference engine,
            ``vllm serve MODEL --headless`` per rank, owned as reference engines are
            (see :class:`~trio_enginecore.VllmEngines`); give no ``config`` with it
            (default ``None``).
        liveness: how the client notices that an engine, of any kind, died,
            stopped or hung (:class:`~trio_enginecore.Liveness`): its connection
            under ZeroMQ heartbeats (a killed, stopped or cut-off engine is dead
            within about 2.3 s by default, whatever its step length), and its
            progress (an engine with work that sends nothing for 60 s is hung); a
            launched engine found either way is killed. ``None``: no checks, and
            only a launched engine's exit is seen (default ``Liveness()``).
        coordinator: data parallel: the addresses of a coordinator shared with other
            clients (:func:`~trio_enginecore.open_coordinator`); required with
            external load balancing when the client launches its rank (attached
            engines announce theirs), optional with internal (which otherwise runs
            its own, as a task of the client) (default ``None``).
        load_balancer: internal load balancing: the policy choosing an engine per
            request; ``None`` is :class:`~trio_enginecore.client.LeastLoaded`
            (default ``None``).
        ready_timeout_s: how long, in seconds, engines may take to become ready
            (default ``60.0``).
        shutdown_timeout_s: how long, in seconds, launched engines may take to exit
            (default ``5.0``).
        max_pending_outputs: messages kept for ``get_output()`` before they are
            merged (never dropped) (default ``64``).
        client_index: this client's index among the engine's clients
            (default ``0``).
        on_engine_failure: what an engine's death does to the client (a launched
            engine's exit, a lost connection, no progress, ``ENGINE_CORE_DEAD``).
            ``"fail"`` (the default, as vLLM): the client fails; with several
            engines, its requests on the other engines keep streaming until the
            block ends, which raises one ``EngineDeadError``. ``"route_around"``:
            the engine is taken out of routing. Its requests fail, naming it (a
            stream raises ``EngineDeadError``; a request of ``add_request`` ends
            with a local ``FinishReason.ERROR`` output whose ``error.code`` is
            ``"engine_dead"``); so do the utility calls it owed. Every other
            request, stream and call goes on untouched, new requests go to the
            engines left (one naming the dead rank raises ``EngineDeadError``),
            ``call_utility_all`` and the typed utilities ask those, and the client
            fails only when no engine is left (with one engine, at once).
            ``"restart"`` (or a :class:`~trio_enginecore.client.Restart` with its
            settings; for engines this client launched, and remote ones with a
            :class:`~trio_enginecore.client.EngineRestarter`, Ray's included): as
            ``"route_around"``, and the engine is started again after a back-off,
            handshaken, and put back into routing once ready; while no engine is
            in service new requests and utility calls wait for one (bounded); an
            engine that needs too many restarts in a window is given up.
            ``statistics().engines`` shows each engine's state and restarts
            (default ``"fail"``).

    Raises:
        EngineStartupError: an engine failed to start or was not ready in time; the
            message names the engine and includes its exit code and last stderr lines.
            Its subclass :exc:`~trio_enginecore.errors.AddressError`: an address could
            not be bound, or a ``ListenerFd`` is not a listening stream socket.
        NotImplementedError: ``data_parallel_size > 1`` with ``multiprocess=False``
            (one process holds one engine).
        ValueError: an option only multiprocess clients have (addresses, remote
            engines, a coordinator, a load balancer, timeouts, liveness, a failure
            policy) with ``multiprocess=False``; external load balancing launching
            its engine with no ``coordinator`` (attached engines announce theirs);
            a timeout that is not a positive number; an ``on_engine_failure`` that
            is not a policy, or ``"restart"`` for engines started elsewhere that
            have no restarter.
        TypeError: both ``options`` and keywords, or a keyword that is not an
            option.
    """
    config = config if config is not None else EngineConfig()
    options = options_from(options, keywords, opener=open_engine_client)
    if not multiprocess:
        _check_in_process(config)
        inproc = ClientOptions(
            max_pending_outputs=options.max_pending_outputs, client_index=options.client_index
        )
        if options != inproc:
            raise ValueError(
                "an in-process client takes only max_pending_outputs and client_index; "
                f"got {_changed(options)}"
            )
        return open_trio_inproc_client(
            config,
            max_pending_outputs=options.max_pending_outputs,
            client_index=options.client_index,
            cancel_on_failure=cancel_on_failure,
        )
    # Which class, which ranks, which routing: judged here, before anything starts,
    # by what judges connect_engine_client's and Ray's (new_mp_client, which asks
    # DataParallelRole.for_config), so the openers cannot disagree. The client holds
    # nothing until it is started.
    return run_client(new_mp_client(config, options), cancel_on_failure=cancel_on_failure)


def _changed(options: ClientOptions) -> list[str]:
    """The options set to something other than their defaults."""
    defaults = ClientOptions()
    return [
        field.name
        for field in attrs.fields(ClientOptions)
        if getattr(options, field.name) != getattr(defaults, field.name)
    ]


def make_client(
    config: EngineConfig | None = None,
    options: ClientOptions | None = None,
    *,
    multiprocess: bool = True,
    cancel_on_failure: bool = False,
    **keywords: Unpack[ClientOptionKeywords],
) -> EngineCoreClient:
    """Create a blocking engine client (vLLM's ``EngineCoreClient.make_client``).

    ``multiprocess=True`` gives a :class:`~trio_enginecore.SyncMPClient` (the engine in
    its own process; ``options`` or its fields as keywords, and ``cancel_on_failure``,
    as for :func:`open_engine_client`), ``False`` an
    :class:`~trio_enginecore.InprocClient` (the engine steps inside ``get_output()``).
    Use the result as a context manager.

    Raises:
        NotImplementedError: as :func:`open_engine_client`.
        TypeError: an option that does not exist, or options given for an in-process
            client.
    """
    config = config if config is not None else EngineConfig()
    check_option_keywords(keywords, make_client)
    if not multiprocess:
        _check_in_process(config)
        given = sorted(keywords) + (["options"] if options is not None else [])
        if given or cancel_on_failure:
            raise TypeError(f"InprocClient takes no options, got {given or 'cancel_on_failure'}")
        return InprocClient(config)
    return SyncMPClient(config, options, cancel_on_failure=cancel_on_failure, **keywords)

"""Choosing and opening the right client for a configuration."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from ..config import EngineConfig
from ._mp import TrioMPClient, open_trio_mp_client

__all__ = ["open_engine_client"]


def open_engine_client(
    config: EngineConfig | None = None,
    *,
    input_address: str | None = None,
    output_address: str | None = None,
    ready_timeout_s: float = 60.0,
    shutdown_timeout_s: float = 5.0,
    max_pending_outputs: int = 64,
    client_index: int = 0,
) -> AbstractAsyncContextManager[TrioMPClient]:
    """Open an engine client: ``async with open_engine_client(config) as client:``.

    By default it launches the engine(s) described by ``config`` as child processes
    (the built-in reference engine), performs the startup handshake over ipc:// sockets
    in a private directory, and returns once every engine is ready. With
    ``input_address`` and ``output_address`` it instead binds those addresses and
    attaches to engines started elsewhere (vLLM's ``client_addresses``), launching
    nothing and waiting for the ready message of each of the
    ``config.data_parallel_size`` engines.

    Leaving the block aborts in-flight requests, stops launched engines (SIGTERM, then
    SIGKILL after ``shutdown_timeout_s``), closes the sockets and removes the private
    directory, whether the block ended normally, with an exception or by cancellation.
    The block's own exception (or ``Cancelled``) propagates unchanged; if an engine died
    meanwhile and the block did not raise, it raises one ``EngineDeadError``.

    Args:
        config: the engine configuration (default: ``EngineConfig()``).
        input_address: attach mode: the address to bind the request ROUTER on.
        output_address: attach mode: the address to bind the output PULL on.
        ready_timeout_s: how long engines may take to become ready.
        shutdown_timeout_s: how long launched engines may take to exit.
        max_pending_outputs: messages kept for ``get_output()`` before they are
            merged (never dropped).
        client_index: this client's index among the engine's clients.

    Raises:
        EngineStartupError: an engine failed to start or was not ready in time; the
            message names the engine and includes its exit code and last stderr lines.
        NotImplementedError: ``config.data_parallel_size > 1`` (data-parallel clients
            are not available yet).
    """
    config = config if config is not None else EngineConfig()
    if config.data_parallel_size != 1:
        raise NotImplementedError(
            "data-parallel clients (data_parallel_size > 1) are not available yet; "
            "use data_parallel_size=1"
        )
    return open_trio_mp_client(
        config,
        input_address=input_address,
        output_address=output_address,
        ready_timeout_s=ready_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
        max_pending_outputs=max_pending_outputs,
        client_index=client_index,
    )

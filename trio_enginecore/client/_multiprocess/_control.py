"""The engine group's control plane: its ZeroMQ context and what lives in it.

One context per group holds every socket engines connect to (the message pipe's, the
handshake's, the coordinator's), so that one CURVE handler admits or refuses them all.
:class:`ControlPlane` makes that context and the group's private directory, admits the
engines' CURVE keys (before any CURVE socket is bound: without a handler libzmq admits
anyone), makes the sockets engines connect to, runs the coordinator a client launches,
and stops the tasks that own sockets before the context is destroyed (closing a socket
under a waiting task breaks the wait).
"""

from __future__ import annotations

import logging
import secrets
import shutil
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, final

import attrs
import trio
import zmq

from ..._curve import CurveRefusal, CurveRefusals, local_engine_keys, run_zap_handler
from ..._ipc_dirs import private_ipc_dir
from ..._zmq import TrioSocket, make_socket
from ...coordinator import CoordinatorAddresses, serve_coordinator
from ._remote import RemoteEngines
from ._topology import Topology

__all__ = ["ControlPlane"]

logger = logging.getLogger("trio_enginecore.client")


@final
class ControlPlane:
    """An engine group's context, private directory, CURVE admission and socket tasks
    (see the module docstring).

    Args:
        topology: the group's plan (its CURVE settings, whether it needs a private
            directory).
        remote: engines that join over TCP (where a launched coordinator listens).
    """

    def __init__(self, topology: Topology, remote: RemoteEngines | None) -> None:
        self.topology = topology
        self.remote = remote
        self.refusals = CurveRefusals()
        """The connections refused for lack of an admitted CURVE key."""
        self.admitted: set[bytes] = set()
        """The engine keys CURVE admits (an engine restarted with a new key pair is
        admitted from then on)."""
        self.ipc_dir: str | None = None
        self.socket_tasks: list[tuple[trio.CancelScope, trio.Event]] = []
        self._ctx: zmq.Context[Any] | None = None

    def open(self) -> zmq.Context[Any]:
        """Make the context (and the private directory, if the plan has one)."""
        self._ctx = zmq.Context()
        if self.topology.private_dir:
            self.ipc_dir = private_ipc_dir()
        return self._ctx

    @property
    def context(self) -> zmq.Context[Any]:
        assert self._ctx is not None, "the transport was not started"
        return self._ctx

    async def admit_engines(self, nursery: trio.Nursery) -> list[str]:
        """With CURVE, start the handler admitting the engines' keys (in ``nursery``,
        until :meth:`stop_tasks`). The arguments of the engines launched here, which
        get a key pair of their own."""
        topology = self.topology
        curve = topology.curve
        if curve is None:
            return []
        self.admitted |= curve.allowed
        arguments: list[str] = []
        if topology.local_engine_keys:
            assert self.ipc_dir is not None
            public, arguments = local_engine_keys(self.ipc_dir, curve)
            self.admitted.add(public)
        await nursery.start(
            self.run_socket_task,
            partial(run_zap_handler, self.context, self.admitted, self._refused),
        )
        return arguments

    def _refused(self, refusal: CurveRefusal) -> None:
        logger.warning("refused a connection from %s", refusal)
        self.refusals.add(refusal)

    def server_socket(self, socket_type: int) -> TrioSocket:
        """A socket engines connect to: a CURVE server when remote engines use CURVE."""
        sock = make_socket(self.context, socket_type)
        if self.topology.curve is not None:
            self.topology.curve.apply(sock)
        return sock

    async def launch_coordinator(self, nursery: trio.Nursery, engines: int) -> CoordinatorAddresses:
        """Run a coordinator for ``engines`` engines in ``nursery`` (until
        :meth:`stop_tasks`); its addresses once it is bound."""
        if self.remote is not None:
            # Engines reach it over TCP; this client, in the same context, in-process.
            addresses = attrs.evolve(
                CoordinatorAddresses.on_host(self.remote.host),
                publish=f"inproc://coordinator-{secrets.token_hex(8)}",
            )
        else:
            assert self.ipc_dir is not None
            addresses = CoordinatorAddresses.in_directory(self.ipc_dir)
        serve = partial(
            serve_coordinator,
            self.context,
            engines=engines,
            addresses=addresses,
            curve=self.topology.curve,
        )
        bound: CoordinatorAddresses = await nursery.start(self.run_socket_task, serve)
        return bound

    async def run_socket_task(
        self,
        serve: Callable[..., Awaitable[None]],
        *,
        task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run ``serve(task_status=...)``, a task owning sockets, until
        :meth:`stop_tasks`."""
        done = trio.Event()
        with trio.CancelScope() as scope:
            self.socket_tasks.append((scope, done))
            try:
                await serve(task_status=task_status)
            finally:
                done.set()

    async def stop_tasks(self) -> None:
        """Cancel every socket task and wait until each has ended (and closed its
        sockets). Not a checkpoint if there is none."""
        for scope, _ in self.socket_tasks:
            scope.cancel()
        for _, done in self.socket_tasks:
            await done.wait()

    def close(self) -> None:
        """Destroy the context and remove the private directory. ``destroy()`` also
        closes any socket a failed startup left behind, with linger 0, so terminating
        the context cannot block."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

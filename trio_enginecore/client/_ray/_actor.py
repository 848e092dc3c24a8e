"""The Ray actor that runs one engine: a plain class, made a Ray actor by
:mod:`._ray` (``ray.remote(EngineActor)``), so that importing it needs no Ray.

It runs in a Ray worker process on the node its placement-group bundle was placed on,
and starts the reference engine there as its child process: ``trio-enginecore serve
--headless``, joining the client's handshake address over TCP exactly as an engine
started by hand does. The engine stops with the actor however the actor ends
(``--exit-with-parent``: a ``kill -9`` of the worker is an engine death within half a
second), and when the client leaves (``--rejoin-timeout-s 0``).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from ..._curve import load_public_key, write_key_pair

__all__ = ["EngineActor"]


class EngineActor:
    """One engine process on a Ray node (see the module docstring)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._key_dir: str | None = None

    def where(self) -> dict[str, Any]:
        """The actor's node (id and address), worker pid and actor id."""
        # Ray is untyped here (not installed where the package is type-checked).
        ray: Any = importlib.import_module("ray")
        context: Any = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "actor_id": context.get_actor_id(),
        }

    def generate_keys(self) -> tuple[str, bytes]:
        """A CURVE key pair made on this node: its secret stays here, in a new 0700
        directory (removed by :meth:`stop`); returns the secret file's path (for
        :meth:`start`) and the public key (for the client's allow-list)."""
        self._key_dir = tempfile.mkdtemp(prefix="tec-ray-keys-")
        public, secret = write_key_pair(self._key_dir, "engine")
        return str(secret), load_public_key(public)

    def start(self, arguments: list[str]) -> int:
        """Start ``trio-enginecore serve ARGUMENTS``; returns the engine's pid."""
        self._process = subprocess.Popen(
            [sys.executable, "-m", "trio_enginecore", "serve", *arguments],
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        return self._process.pid

    def stop(self, timeout_s: float) -> int | None:
        """Stop the engine (SIGTERM, then SIGKILL after ``timeout_s``) and remove the
        key directory; returns the engine's exit code (None: it never started)."""
        process = self._process
        try:
            if process is None:
                return None
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            return process.returncode
        finally:
            if self._key_dir is not None:
                shutil.rmtree(self._key_dir, ignore_errors=True)
                self._key_dir = None

"""The reference EngineCore: a scheduler, built-in models and the engine process.

``_core`` is the scheduler and the utilities (no I/O); ``_intake`` applies what
arrives to it; ``_links`` owns the sockets towards the clients and decides who is
connected; ``_proc`` runs it all as a process speaking vLLM's wire protocol, and
``_serve`` is that process's main.
"""

from __future__ import annotations

from ..protocol import identity_for_rank
from ._core import EngineCore, FatalEngineError, utility
from ._models import CounterModel, Model, NgramModel, SamplingState, Score, make_model
from ._proc import EngineCoreProc, addresses_for, engine_handshake

__all__ = [
    "CounterModel",
    "EngineCore",
    "EngineCoreProc",
    "FatalEngineError",
    "Model",
    "NgramModel",
    "SamplingState",
    "Score",
    "addresses_for",
    "engine_handshake",
    "identity_for_rank",
    "make_model",
    "utility",
]

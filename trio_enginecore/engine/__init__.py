"""The reference EngineCore: a scheduler, built-in models and the engine process."""

from __future__ import annotations

from ..protocol import identity_for_rank as identity_for_rank
from ._core import (
    EngineCore as EngineCore,
    FatalEngineError as FatalEngineError,
    utility as utility,
)
from ._models import (
    CounterModel as CounterModel,
    Model as Model,
    NgramModel as NgramModel,
    SamplingState as SamplingState,
    make_model as make_model,
)
from ._proc import (
    EngineCoreProc as EngineCoreProc,
    addresses_for as addresses_for,
    engine_handshake as engine_handshake,
)

"""The exception tree of trio-enginecore.

Every exception the library raises on purpose derives from :class:`EngineCoreError`,
so ``except trio_enginecore.errors.EngineCoreError`` catches all of them::

    EngineCoreError
    ├── ProtocolError          a frame or message that does not follow the wire protocol
    ├── EngineStartupError     an engine failed to start or never became ready
    ├── EngineDeadError        an engine died while the client was using it
    └── UtilityCallError       an engine-side utility method raised

``trio.Cancelled``, ``KeyboardInterrupt`` and the caller's own exceptions are never
wrapped in these.
"""

from __future__ import annotations

__all__ = [
    "EngineCoreError",
    "EngineDeadError",
    "EngineStartupError",
    "ProtocolError",
    "UtilityCallError",
]


class EngineCoreError(Exception):
    """Base class of every error raised by trio-enginecore."""


class ProtocolError(EngineCoreError):
    """A message could not be encoded or decoded according to the wire protocol.

    Raised by the decoders for truncated, oversized, wrongly typed or otherwise malformed
    frames, for unknown msgpack extension types (pickle is never accepted), and for
    unknown request-type bytes. The message says what was wrong and where.
    """


class EngineStartupError(EngineCoreError):
    """An engine process failed to start, exited early, or never sent its ready message."""


class EngineDeadError(EngineCoreError):
    """An engine died (or reported a fatal error) while requests were in flight.

    Every waiter on that engine (streams, utility calls, ``get_output``) receives this
    error; the client cannot be used with that engine afterwards.
    """


class UtilityCallError(EngineCoreError):
    """An engine-side utility method raised an exception.

    Attributes:
        method: the utility method that was called.
        engine_message: the engine's failure message, verbatim.
    """

    def __init__(self, method: str, engine_message: str) -> None:
        super().__init__(f"utility call {method!r} failed on the engine: {engine_message}")
        self.method = method
        self.engine_message = engine_message

"""The exception tree of trio-enginecore.

Every exception the library raises on purpose derives from :class:`EngineCoreError`,
so ``except trio_enginecore.errors.EngineCoreError`` catches all of them::

    EngineCoreError
    ├── ProtocolError          a frame or message that does not follow the wire protocol
    ├── EngineStartupError     an engine failed to start or never became ready
    │   └── AddressError       an address could not be bound or connected to
    ├── EngineDeadError        an engine died while the client was using it
    ├── RequestFailedError     the engine ended a streamed request with an error
    ├── UtilityCallError       an engine-side utility method raised
    ├── EngineConsensusError   engines that should agree gave different answers
    ├── InvalidInputError      a text request's field is wrong (also a ValueError and
    │                          a TypeError); names the field
    └── ModelDirectoryError    a model directory's file is missing or malformed
                               (also a ValueError); names the file

Mistakes in the arguments of a call (a request id that is not a ``str``, a request id
already in flight, ...) are the built-in ``TypeError`` and ``ValueError``, raised before
anything is sent.

``trio.Cancelled``, ``KeyboardInterrupt`` and the caller's own exceptions are never
wrapped in these.
"""

from __future__ import annotations

__all__ = [
    "AddressError",
    "EngineConsensusError",
    "EngineCoreError",
    "EngineDeadError",
    "EngineStartupError",
    "InvalidInputError",
    "ModelDirectoryError",
    "ProtocolError",
    "RequestFailedError",
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


class AddressError(EngineStartupError):
    """A ZeroMQ address could not be used: malformed, unknown transport, in use, or
    on an interface this host does not have.

    Attributes:
        address: the address as given.
        reason: what ZeroMQ (or the check before it) said, e.g. ``"Address already in use"``.
    """

    def __init__(self, address: str, reason: str, *, role: str = "") -> None:
        where = f" ({role})" if role else ""
        super().__init__(f"cannot use address {address!r}{where}: {reason}")
        self.address = address
        self.reason = reason
        self.role = role


class EngineDeadError(EngineCoreError):
    """An engine died (or reported a fatal error) while requests were in flight.

    Every waiter on that engine (streams, utility calls, ``get_output``) receives this
    error; the client cannot be used with that engine afterwards.

    Attributes:
        rank: the data-parallel rank of the engine that died, when one engine is to
            blame (None when the client failed as a whole for another reason, or was
            closed).
        pid: that engine's process id, when the client launched it (None otherwise).
        location: where that engine runs, when it was started elsewhere (its host, or
            its Ray actor and node), else None.
        retryable: whether sending the same request (or call) again on this client
            may succeed: True when another engine is in service or the dead one is
            being restarted (``on_engine_failure="route_around"`` or ``"restart"``),
            False when the client failed as a whole (open a new one).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        pid: int | None = None,
        location: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.pid = pid
        self.location = location
        self.retryable = retryable


class RequestFailedError(EngineCoreError):
    """The engine finished a streamed request with ``FinishReason.ERROR``.

    Raised by iterating a :class:`~trio_enginecore.RequestStream`, after every output
    that came before the error was delivered. The engine rejects a request this way
    when it cannot serve it (empty prompt, prompt too long, token id out of the
    vocabulary, ...) and keeps serving every other request. The batch API does not
    raise: its output carries ``finish_reason=ERROR`` and ``error``, as in vLLM.

    Attributes:
        request_id: the request's id.
        code: the engine's error code (``"invalid_request"``, ...), or ``"unknown"``
            when the engine sent none.
        engine_message: the engine's message, verbatim ("" when it sent none).
        retryable: whether the engine says the same request may succeed later.
    """

    def __init__(
        self, request_id: str, code: str, engine_message: str, *, retryable: bool = False
    ) -> None:
        detail = engine_message or "the engine gave no reason"
        super().__init__(f"request {request_id!r} failed on the engine ({code}): {detail}")
        self.request_id = request_id
        self.code = code
        self.engine_message = engine_message
        self.retryable = retryable


class UtilityCallError(EngineCoreError):
    """An engine-side utility method raised an exception.

    Attributes:
        method: the utility method that was called.
        engine_message: the engine's failure message, verbatim.
        rank: the data-parallel rank of the engine that failed, when the call went to
            several engines (None for a call to one).
    """

    def __init__(self, method: str, engine_message: str, *, rank: int | None = None) -> None:
        where = "the engine" if rank is None else f"engine {rank}"
        # vLLM's engines (and ours) say "Call to <method> method failed: <why>": the
        # message says that part once, its own way.
        reason = engine_message.removeprefix(f"Call to {method} method failed: ")
        super().__init__(f"utility call {method!r} failed on {where}: {reason}")
        self.method = method
        self.engine_message = engine_message
        self.rank = rank


class EngineConsensusError(EngineCoreError):
    """Engines that should agree (e.g. on ``is_sleeping``) gave different answers."""


class InvalidInputError(EngineCoreError, ValueError, TypeError):
    """A text request (a prompt or a sampling parameter) cannot be served as given.

    Raised by the text layer (:mod:`trio_enginecore.text`) before anything is sent: an
    empty prompt, a prompt longer than the engine's ``max_model_len``, a token id
    outside the vocabulary, a stop string that is not a string, ``n = 0``, ... Other
    requests are not affected. It is both a ``ValueError`` and a ``TypeError`` (wrong
    values and wrong types alike), so ``except ValueError`` catches it.

    Where vLLM's frontend refuses the same request with a sentence of its own (a token
    id outside the vocabulary in ``logit_bias``, say), the message is vLLM's: the
    sentence, then ``(parameter=..., value=...)``, as vLLM's ``VLLMValidationError``
    words it; otherwise ``"<param>: <reason>"``.

    Attributes:
        param: the field at fault, as an OpenAI-style server names it (``"prompt"``,
            ``"n"``, ``"stop"``, ``"min_tokens"``, ...).
        reason: what is wrong with it.
        value: the value refused, where the message is vLLM's (else ``None``).
    """

    def __init__(
        self, param: str, reason: str, *, value: object = None, vllm_wording: bool = False
    ) -> None:
        if vllm_wording:
            extras = f"parameter={param}" + ("" if value is None else f", value={value}")
            message = f"{reason} ({extras})"
        else:
            message = f"{param}: {reason}"
        super().__init__(message)
        self.param = param
        self.reason = reason
        self.value = value


class ModelDirectoryError(EngineCoreError, ValueError):
    """A file of a model directory is missing or cannot be used.

    Attributes:
        path: the file (or directory) at fault.
        reason: what is wrong with it.
    """

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

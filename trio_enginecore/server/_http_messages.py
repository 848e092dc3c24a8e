"""What the HTTP server and its handler exchange (pure): :class:`Request`,
:class:`Response`, :class:`Headers`, the server's :class:`HttpLimits` and
:class:`HttpServerStatistics`, and OpenAI-style error bodies.

Nothing here does I/O or needs Trio; :mod:`._http` runs the connections.
"""

from __future__ import annotations

import http
import json
from collections.abc import AsyncIterable, Iterator, Mapping, Sequence
from typing import Final, final
from urllib.parse import parse_qsl, unquote

import attrs

__all__ = [
    "KNOWN_METHODS",
    "Headers",
    "HttpLimits",
    "HttpServerStatistics",
    "Request",
    "Response",
    "error_response",
    "error_type",
]

KNOWN_METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
"""The methods handed to the handler; any other is answered 501 by the server (RFC 9110
15.6.2: a method the server does not recognise)."""

# OpenAI's client names its exceptions by status; vLLM's error bodies use the same names
# as their ``type``. Statuses not listed are named from their reason phrase.
_ERROR_TYPES: Final[dict[int, str]] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "ContentTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


@final
class Headers(Mapping[str, str]):
    """A request's header fields, looked up case-insensitively.

    ``headers["Content-Type"]`` is the first field of that name (``KeyError`` when
    there is none), :meth:`get_all` every one of them in order; iteration yields each
    name once, lower-cased. :attr:`raw` keeps the fields as received (names
    lower-cased by the parser).
    """

    __slots__ = ("_first", "raw")

    raw: tuple[tuple[bytes, bytes], ...]
    """The fields in order, as ``(lower-cased name, value)`` bytes."""

    def __init__(self, raw: Sequence[tuple[bytes, bytes]] = ()) -> None:
        self.raw = tuple((name.lower(), value) for name, value in raw)
        first: dict[str, str] = {}
        for name, value in self.raw:
            first.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        self._first = first

    def __getitem__(self, name: str) -> str:
        return self._first[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._first

    def __iter__(self) -> Iterator[str]:
        return iter(self._first)

    def __len__(self) -> int:
        return len(self._first)

    def get_all(self, name: str) -> list[str]:
        """Every value of the fields named ``name`` (any case), in order; ``[]`` if none."""
        key = name.lower().encode("latin-1")
        return [value.decode("latin-1") for field, value in self.raw if field == key]

    def __repr__(self) -> str:
        return f"Headers({list(self.raw)!r})"


@final
@attrs.frozen
class Request:
    """One HTTP request, its body already read (within :attr:`HttpLimits.max_body_bytes`)."""

    method: str
    """The method as sent (``"GET"``, ``"POST"``, ...): one of RFC 9110's methods
    (``KNOWN_METHODS``). Answer ``"HEAD"`` as ``"GET"``: the server sends the head alone."""
    target: str
    """The request target as sent: ``/v1/completions?x=1``."""
    headers: Headers
    """The header fields (case-insensitive)."""
    body: bytes = b""
    """The body, complete (de-chunked)."""
    peer: tuple[str, int] | None = None
    """The client's address and port, or None when the stream is not a TCP socket."""
    http_version: str = "1.1"
    """``"1.1"`` or ``"1.0"``."""

    @property
    def path(self) -> str:
        """The target's path, percent-decoded: ``/v1/completions``."""
        return unquote(self.target.partition("?")[0])

    @property
    def query(self) -> str:
        """The target's query string as sent (not decoded), ``""`` if none."""
        return self.target.partition("?")[2]

    def query_items(self) -> list[tuple[str, str]]:
        """The query string's ``name=value`` pairs, decoded, in order (blank values kept)."""
        return parse_qsl(self.query, keep_blank_values=True)


def _check_status(_instance: object, _attribute: object, status: int) -> None:
    if not 200 <= status <= 599:
        raise ValueError(f"Response.status must be a final status in 200..599, got {status}")


@final
@attrs.frozen
class Response:
    """What a handler returns: a complete response, or a streamed one.

    With ``body`` as bytes the server sends it with a ``Content-Length``. With
    ``body`` an async iterable of bytes (an async generator, a
    ``trio.MemoryReceiveChannel[bytes]``), the server sends each chunk as it comes,
    with chunked transfer encoding, and merges the chunks that are ready together into
    one write when the client (or the event loop) lags behind. A client that goes
    away cancels the iteration: the iterable sees ``trio.Cancelled`` at its next
    checkpoint, and is closed (``aclose()``) if it has that method.

    ``headers`` should not frame the body: ``Content-Length`` and
    ``Transfer-Encoding`` are dropped, the server writes its own.
    """

    status: int = attrs.field(default=200, validator=_check_status)
    """The status code, 200 to 599."""
    headers: Sequence[tuple[str, str]] = ()
    """The header fields, ``(name, value)``, in order."""
    body: bytes | AsyncIterable[bytes] = b""
    """The whole body, or its chunks as they come."""

    @property
    def streaming(self) -> bool:
        """Whether :attr:`body` is streamed (an async iterable)."""
        return not isinstance(self.body, bytes)


def error_type(status: int) -> str:
    """The OpenAI-style error ``type`` for ``status``: ``"BadRequestError"`` for 400,
    ``"InternalServerError"`` for 500, else the reason phrase's words joined, with
    ``Error``."""
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
    words = "".join(c if c.isalnum() else " " if c in " -" else "" for c in phrase).split()
    name = "".join(word[0].upper() + word[1:] for word in words)
    return name if name.endswith("Error") else name + "Error"


def error_response(
    status: int, message: str, *, headers: Sequence[tuple[str, str]] = ()
) -> Response:
    """A JSON error response in OpenAI's shape:
    ``{"error": {"message": ..., "type": ..., "param": null, "code": status}}``."""
    body = json.dumps(
        {"error": {"message": message, "type": error_type(status), "param": None, "code": status}}
    ).encode()
    return Response(status, [("content-type", "application/json"), *headers], body)


@final
@attrs.frozen
class HttpLimits:
    """The bounds the HTTP server holds every connection to. Defaults follow uvicorn's
    and h11's where they have one."""

    max_connections: int = attrs.field(default=1000, validator=attrs.validators.gt(0))
    """Connections open at once. At the cap the server stops accepting: new clients
    wait in the listen backlog until a connection closes."""
    max_header_bytes: int = attrs.field(default=16 * 1024, validator=attrs.validators.gt(0))
    """The request line and header fields together (h11's default); more is answered 431."""
    max_body_bytes: int = attrs.field(default=32 * 1024 * 1024, validator=attrs.validators.gt(0))
    """A request body; more is answered 413 (and the connection closed)."""
    header_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    """From a new connection, or from the first byte of a request on a reused one, to
    the end of its header fields. A connection that takes longer is closed."""
    body_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    """From the end of the header fields to the end of the body; past it, 408."""
    keep_alive_timeout_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    """How long an idle connection is kept between requests."""
    send_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    """How long one write may take: a client that reads nothing for longer is treated
    as gone (its request cancelled)."""
    write_buffer_bytes: int = attrs.field(default=64 * 1024, validator=attrs.validators.gt(0))
    """Chunks of a streamed response held while the client lags; at this much the
    server stops taking chunks from the response body until the client reads."""


@final
@attrs.frozen
class HttpServerStatistics:
    """A snapshot of an HTTP server, from ``HttpServer.statistics()``."""

    connections: int
    """Connections open."""
    requests_in_flight: int
    """Requests whose handler is running or whose response is being written."""
    requests_completed: int
    """Requests whose response was written in full (error responses included)."""
    requests_cancelled: int
    """Requests cancelled because their client went away (or at a shutdown's deadline)."""
    writes: int
    """Writes of response bytes to a connection (one ``send_all`` each)."""
    closing: bool
    """Whether a shutdown has begun (the server accepts no connection any more)."""

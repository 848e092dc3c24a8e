"""Per-request output streams: a feeding half and a reading half.

:func:`open_request_stream` returns both halves of one stream, as
:func:`trio.open_memory_channel` does: the client's receive side pushes outputs into the
:class:`StreamFeed`, the caller reads them from the :class:`RequestStream`. They share
one buffer, which never holds more than one (merged) output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, final

import msgspec
import trio

from ..errors import EngineCoreError, EngineDeadError, RequestFailedError
from ..protocol import EngineCoreOutput, FinishReason, RequestError
from ._collector import merge_outputs

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["RequestStream", "StreamFeed", "open_request_stream"]


def open_request_stream(
    request_id: str, *, on_close: Callable[[StreamFeed], None]
) -> tuple[StreamFeed, RequestStream]:
    """The two halves of a new stream of request ``request_id``.

    ``on_close(feed)`` is called once, when the reading half is closed.
    """
    feed = StreamFeed(request_id, on_close)
    return feed, RequestStream(feed)


@final
class StreamFeed:
    """The feeding half of a stream: what the client's receive side calls.

    Its methods never block and never checkpoint. The reading half,
    :class:`RequestStream`, reads the same fields.
    """

    __slots__ = (
        "closed",
        "event",
        "failure",
        "failure_type",
        "finished_delivered",
        "finished_received",
        "on_close",
        "pending",
        "receiving",
        "request_error",
        "request_id",
        "tokens_received",
        "wire_id",
    )

    def __init__(self, request_id: str, on_close: Callable[[StreamFeed], None]) -> None:
        self.request_id = request_id
        """The request's id, as the caller gave it."""
        self.wire_id = request_id
        """The id the request travels under: ``request_id``, or a fresh one when the
        caller reused the id of a request aborted moments before."""
        self.on_close = on_close
        self.pending: EngineCoreOutput | None = None
        self.finished_received = False
        self.finished_delivered = False
        self.failure: str | None = None
        self.failure_type: type[EngineCoreError] = EngineDeadError
        self.request_error: RequestError | None = None
        self.closed = False
        self.event: trio.Event | None = None
        self.receiving = False
        self.tokens_received = 0

    def push(self, output: EngineCoreOutput) -> None:
        """Hand over one output, merging it into any the reader has not taken yet.

        Raises:
            ProtocolError: the output cannot be merged with the pending one (the
                engine broke the protocol); nothing changed.
        """
        if self.finished_received or self.closed:
            return
        if self.pending is None:
            self.pending = output
        else:
            merge_outputs(self.pending, output)
        self.tokens_received += len(output.new_token_ids)
        if output.finish_reason is not None:
            self.finished_received = True
        self.wake()

    def fail(self, reason: str, error_type: type[EngineCoreError] = EngineDeadError) -> None:
        """The request cannot go on: its engine died (or sent what cannot be used).

        The outputs already pending are still delivered; then ``receive`` raises
        ``error_type(reason)``.
        """
        if self.failure is None and not self.finished_received:
            self.failure = reason
            self.failure_type = error_type
            self.wake()

    def abort_locally(self) -> None:
        """The request was aborted by the client: end the stream with an ABORT output."""
        if not self.finished_received and self.failure is None:
            self.push(EngineCoreOutput(self.request_id, [], finish_reason=FinishReason.ABORT))

    def close(self) -> None:
        """Close the stream (the reading half's ``aclose``): pending outputs are
        dropped, a waiting reader wakes up, ``on_close`` runs once."""
        if not self.closed:
            self.closed = True
            self.pending = None
            self.wake()
            self.on_close(self)

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()
            self.event = None


@final
class RequestStream(trio.abc.ReceiveChannel[EngineCoreOutput]):
    """The outputs of one request, in order, ending after the finished one.

    Obtained from ``async with client.stream(request) as stream:``. Iterate it with
    ``async for output in stream``; the loop ends after the output whose
    ``finish_reason`` is set. If the reader is slower than the engine, the outputs that
    arrived meanwhile are merged into one (token ids appended in order, the latest
    finish reason kept), so a slow reader never holds up other streams and every token
    is still delivered exactly once.

    If the engine finishes the request with ``FinishReason.ERROR`` (it rejected the
    request, or failed while serving it), the tokens that came before are delivered
    first (as an output with no finish reason), then :meth:`receive` raises
    :class:`~trio_enginecore.errors.RequestFailedError` carrying the engine's message,
    and keeps raising it.

    :meth:`receive` is atomic with respect to cancellation: it either returns an output
    or raises :class:`trio.Cancelled` leaving the stream unchanged.
    """

    __slots__ = ("_feed",)

    def __init__(self, feed: StreamFeed) -> None:
        self._feed = feed

    @property
    def request_id(self) -> str:
        """The request's id, as the caller gave it."""
        return self._feed.request_id

    @property
    def tokens_received(self) -> int:
        """New token ids received for the request so far (delivered or pending)."""
        return self._feed.tokens_received

    # ------------------------------------------------------------ reader side

    @property
    def finished(self) -> bool:
        """True once the engine reported the request finished (or it was aborted)."""
        return self._feed.finished_received

    async def receive(self) -> EngineCoreOutput:
        """The next output of the request (merged with any that queued up).

        Raises:
            trio.EndOfChannel: the finished output was already delivered. Not an error.
            RequestFailedError: the engine finished the request with an error.
            EngineDeadError: the engine died before the request finished.
            ProtocolError: the engine sent outputs for this request that cannot be
                used (the request was aborted); other requests are not affected.
            trio.ClosedResourceError: the stream was closed.
            trio.BusyResourceError: another task is already receiving on this stream.
        """
        # Every schedule point comes before the take, and nothing can intervene
        # between taking an output and returning it: a cancelled receive has taken
        # nothing. (Waiting is the schedule point when nothing is pending yet.)
        await trio.lowlevel.checkpoint_if_cancelled()
        feed = self._feed
        if feed.pending is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
        if feed.receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        feed.receiving = True
        try:
            while feed.pending is None:
                if feed.closed:
                    raise trio.ClosedResourceError("this stream was closed")
                if feed.request_error is not None:
                    raise self._request_failed()
                if feed.finished_delivered:
                    raise trio.EndOfChannel
                if feed.failure is not None:
                    raise feed.failure_type(feed.failure)
                event = feed.event = trio.Event()
                await event.wait()
        finally:
            feed.receiving = False
        output, feed.pending = feed.pending, None
        if output.finish_reason is not None:
            feed.finished_delivered = True
            if output.finish_reason is FinishReason.ERROR:
                feed.request_error = output.error or RequestError("unknown", "")
                if not output.new_token_ids:
                    raise self._request_failed()
                # Tokens merged into the failed output came before the failure: they
                # are delivered first, the error on the next receive.
                output = msgspec.structs.replace(
                    output, finish_reason=None, stop_reason=None, error=None
                )
        return output

    def _request_failed(self) -> RequestFailedError:
        error = self._feed.request_error
        assert error is not None
        return RequestFailedError(
            self.request_id, error.code, error.message, retryable=error.retryable
        )

    async def aclose(self) -> None:
        """Close the stream; pending outputs are dropped.

        Closing does not abort the request by itself: leaving the ``client.stream``
        block does that.
        """
        self._feed.close()
        await trio.lowlevel.checkpoint()

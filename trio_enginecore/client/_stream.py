"""Per-request output streams."""

from __future__ import annotations

from typing import TYPE_CHECKING, final

import msgspec
import trio

from ..errors import EngineCoreError, EngineDeadError, RequestFailedError
from ..protocol import EngineCoreOutput, FinishReason, RequestError
from ._collector import merge_outputs

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["RequestStream"]


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

    def __init__(self, request_id: str, *, on_close: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        """The request's id, as the caller gave it."""
        self.wire_id = request_id
        """The id the request travels under: ``request_id``, or a fresh one when the
        caller reused the id of a request aborted moments before."""
        self._on_close = on_close
        self._pending: EngineCoreOutput | None = None
        self._finished_received = False
        self._finished_delivered = False
        self._failure: str | None = None
        self._failure_type: type[EngineCoreError] = EngineDeadError
        self._request_error: RequestError | None = None
        self._closed = False
        self._event: trio.Event | None = None
        self._receiving = False
        self.tokens_received = 0

    # ------------------------------------------------------- receive-task side

    def _push(self, output: EngineCoreOutput) -> None:
        """Hand over one output (called by the receive task; never blocks)."""
        if self._finished_received or self._closed:
            return
        if self._pending is None:
            self._pending = output
        else:
            merge_outputs(self._pending, output)
        self.tokens_received += len(output.new_token_ids)
        if output.finish_reason is not None:
            self._finished_received = True
        self._wake()

    def _fail(self, reason: str, error_type: type[EngineCoreError] = EngineDeadError) -> None:
        """The request cannot go on: its engine died (or sent what cannot be used).

        The outputs already pending are still delivered; then ``receive`` raises
        ``error_type(reason)``.
        """
        if self._failure is None and not self._finished_received:
            self._failure = reason
            self._failure_type = error_type
            self._wake()

    def _abort_locally(self) -> None:
        """The request was aborted by the client: end the stream with an ABORT output."""
        if not self._finished_received and self._failure is None:
            self._push(EngineCoreOutput(self.request_id, [], finish_reason=FinishReason.ABORT))

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    # ------------------------------------------------------------ reader side

    @property
    def finished(self) -> bool:
        """True once the engine reported the request finished (or it was aborted)."""
        return self._finished_received

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
        if self._pending is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        self._receiving = True
        try:
            while self._pending is None:
                if self._closed:
                    raise trio.ClosedResourceError("this stream was closed")
                if self._request_error is not None:
                    raise self._request_failed()
                if self._finished_delivered:
                    raise trio.EndOfChannel
                if self._failure is not None:
                    raise self._failure_type(self._failure)
                event = self._event = trio.Event()
                await event.wait()
        finally:
            self._receiving = False
        output, self._pending = self._pending, None
        if output.finish_reason is not None:
            self._finished_delivered = True
            if output.finish_reason is FinishReason.ERROR:
                self._request_error = output.error or RequestError("unknown", "")
                if not output.new_token_ids:
                    raise self._request_failed()
                # Tokens merged into the failed output came before the failure: they
                # are delivered first, the error on the next receive.
                output = msgspec.structs.replace(
                    output, finish_reason=None, stop_reason=None, error=None
                )
        return output

    def _request_failed(self) -> RequestFailedError:
        error = self._request_error
        assert error is not None
        return RequestFailedError(
            self.request_id, error.code, error.message, retryable=error.retryable
        )

    async def aclose(self) -> None:
        """Close the stream; pending outputs are dropped.

        Closing does not abort the request by itself: leaving the ``client.stream``
        block does that.
        """
        self._close()
        await trio.lowlevel.checkpoint()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pending = None
            self._wake()
            self._on_close(self)

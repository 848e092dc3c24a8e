"""The text layer's Trio face: :class:`AsyncLLM` and :func:`open_llm`.

A thin shell over the pure parts: :func:`~._inputs.prepare_request` before anything is
sent, a client stream per engine request, and :class:`~._processor.TextRequestState`
turning what arrives into :class:`RequestOutput` s. The text is made on the reader's
task as it reads: a reader that falls behind finds its engine outputs merged by the
client (token ids appended, never queued without bound) and turns them into text in
one go, which gives the same text as reading every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Unpack, final

import trio

from ..client import AsyncEngineCoreClient, RequestStream, open_engine_client
from ..client._options import check_option_keywords
from ..config import EngineConfig
from ..errors import EngineCoreError, InvalidInputError
from ..protocol import LoRARequest, RequestOutputKind, SamplingKeywords, SamplingParams
from ._inputs import PromptInput, final_only, prepare_request, sampling_params_from
from ._model_dir import builtin_tokenizer, load_tokenizer
from ._outputs import RequestOutput
from ._tokenizer import Tokenizer

if TYPE_CHECKING:
    from ..client._options import ClientOptionKeywords, ClientOptions
    from ._processor import TextRequestState

__all__ = ["AsyncLLM", "GenerationStream", "open_llm"]


@final
class AsyncLLM:
    """Text in, text out, over any Trio engine client.

    ::

        async with trio_enginecore.text.open_llm() as llm:
            async with llm.generate("The river", max_tokens=40, stop=["."]) as outputs:
                async for output in outputs:
                    print(output.outputs[0].text)

    Wraps a client the caller opened (launched reference engines, attached or remote
    vLLM engine cores, a data-parallel group, Ray): ``AsyncLLM(client, tokenizer)``.
    It owns nothing: closing the client is the caller's business (:func:`open_llm`
    opens both). Any number of tasks may generate at once.

    Args:
        client: an open Trio engine client.
        tokenizer: the model's tokenizer (:func:`~trio_enginecore.text.load_tokenizer`),
            or the path of a model directory.
        max_model_len: the longest prompt plus output the engine serves; by default
            what the client's first engine announced in its ready message.
    """

    def __init__(
        self,
        client: AsyncEngineCoreClient,
        tokenizer: Tokenizer | str | Path,
        *,
        max_model_len: int | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = (
            tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        )
        if max_model_len is None:
            engines: tuple[Any, ...] = getattr(client, "engines", ())
            lengths = [e.max_model_len for e in engines if e is not None]
            max_model_len = min(lengths) if lengths else None
        self.max_model_len = max_model_len

    def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        **sampling: Unpack[SamplingKeywords],
    ) -> AbstractAsyncContextManager[GenerationStream]:
        """Send a request and stream its outputs::

            async with llm.generate("Once upon", max_tokens=32) as outputs:
                async for output in outputs:      # RequestOutput, as vLLM's
                    ...

        ``prompt`` is text, or token ids (a list of ints, or vLLM's
        ``{"prompt_token_ids": [...]}``). Give the sampling parameters as a
        :class:`~trio_enginecore.protocol.SamplingParams` or as keywords. What each output holds
        follows ``output_kind`` as in vLLM: ``CUMULATIVE`` (the default) everything so
        far, ``DELTA`` what is new, ``FINAL_ONLY`` one output at the end. With
        ``n > 1`` there is one engine request per sequence; outputs name the sequence
        in ``CompletionOutput.index``.

        Everything is checked before anything is sent: a wrong prompt or parameter
        raises :class:`~trio_enginecore.errors.InvalidInputError` naming the field,
        here (not on entry), and no other request is affected. A text prompt is
        encoded here, in the caller's task, holding the event loop meanwhile (about
        0.7 s per MB of text with the built-in tokenizer): encode a long one in a worker
        thread with :meth:`Tokenizer.encode_without_gil
        <trio_enginecore.text.Tokenizer.encode_without_gil>` and give its ids with the
        text (``{"prompt_token_ids": ids, "prompt": text}``), as the OpenAI server does.

        Leaving the block before the request finished (``break``, an exception,
        cancellation) aborts every engine request it still has, exactly once, before
        the block exits. A stop string found in the text aborts its engine request at
        once (the engine cannot see text). Entering is a checkpoint; if it is
        cancelled, what it had sent is aborted.

        Raises:
            InvalidInputError: at the call, as said.
            EngineDeadError: on entry or while iterating, the engine died.
            RequestFailedError: while iterating, the engine failed the request.
        """
        params = sampling_params_from(sampling_params, sampling)
        state, requests = prepare_request(
            prompt,
            params,
            tokenizer=self.tokenizer,
            max_model_len=self.max_model_len,
            request_id=request_id,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
            cache_salt=cache_salt,
        )
        return _GenerationBlock(self.client, state, requests)

    async def complete(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        **sampling: Unpack[SamplingKeywords],
    ) -> RequestOutput:
        """Generate and return the final output (every sequence, whole).

        The output kind is ``FINAL_ONLY`` whatever the parameters say. Cancellation
        aborts the request on the engine.

        Raises:
            InvalidInputError, EngineDeadError, RequestFailedError: as :meth:`generate`.
        """
        params = sampling_params_from(sampling_params, sampling)
        params = final_only(params)
        last: RequestOutput | None = None
        async with self.generate(
            prompt,
            params,
            request_id=request_id,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
            cache_salt=cache_salt,
        ) as outputs:
            async for output in outputs:
                last = output
        assert last is not None, "a finished request always has a final output"
        return last


@final
class GenerationStream:
    """The outputs of one text request, in order; the loop ends after the last.

    Obtained from ``async with llm.generate(...) as outputs:``. Each item is a
    :class:`RequestOutput`. A reader slower than the engine gets fewer, bigger outputs
    (what arrived meanwhile, merged), never a queue that grows: the client keeps each
    engine request's undelivered token ids, and nothing else.

    Reading is atomic with respect to cancellation: an output is either returned, or
    ``trio.Cancelled`` is raised and the stream is unchanged.
    """

    __slots__ = ("_block",)

    def __init__(self, block: _GenerationBlock) -> None:
        self._block = block

    @property
    def request_id(self) -> str:
        """The request's id (the caller's, or the one made for it)."""
        return self._block.state.request_id

    @property
    def engine_request_ids(self) -> list[str]:
        """The engine requests serving it (``n`` of them with ``n > 1``)."""
        return self._block.state.engine_request_ids

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._block.next_output()


@final
class _GenerationBlock(AbstractAsyncContextManager[GenerationStream]):
    """``async with llm.generate(...)``: one stream per engine request; with ``n > 1``
    a task per stream feeding one merging slot."""

    def __init__(
        self,
        client: AsyncEngineCoreClient,
        state: TextRequestState,
        requests: list[Any],
    ) -> None:
        self.client = client
        self.state = state
        self._requests = requests
        self._blocks: dict[str, AbstractAsyncContextManager[RequestStream]] = {}
        self._streams: dict[str, RequestStream] = {}
        self._single: tuple[str, RequestStream] | None = None
        self._entered = False
        self._done = False
        # n > 1: the tasks' nursery and the slot they merge outputs into.
        self._exits: tuple[Any, trio.Nursery] | None = None
        self._slot: RequestOutput | None = None
        self._failure: BaseException | None = None
        self._waiter: trio.lowlevel.Task | None = None
        self._pending_tasks = 0

    async def __aenter__(self) -> GenerationStream:
        if self._entered:
            raise RuntimeError("an llm.generate(...) block can be entered only once")
        self._entered = True
        requests, self._requests = self._requests, []
        try:
            for request in requests:
                block = self.client.stream(request)
                self._streams[request.request_id] = await block.__aenter__()
                self._blocks[request.request_id] = block
        except BaseException:
            await self._leave_all()
            raise
        if len(requests) == 1:
            ((engine_id, stream),) = self._streams.items()
            self._single = (engine_id, stream)
        else:
            manager = trio.open_nursery()
            nursery = await manager.__aenter__()
            self._exits = (manager, nursery)
            self._pending_tasks = len(requests)
            for engine_id in self._streams:
                nursery.start_soon(self._pump, engine_id)
        return GenerationStream(self)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        self._done = True
        # Abort first (no checkpoint: cancellation cannot skip it), then stop the tasks.
        await self._leave_all()
        exits, self._exits = self._exits, None
        if exits is not None:
            # The tasks are stopped, and the nursery left as if its body had ended:
            # the block's own exception (or Cancelled) goes on as itself, never wrapped
            # in an exception group.
            manager, nursery = exits
            nursery.cancel_scope.cancel()
            await manager.__aexit__(None, None, None)
        return None

    async def _leave(self, engine_id: str) -> None:
        # Leaving a client stream block aborts its request if the engine did not finish
        # it: one non-blocking send, with no checkpoint (the interface's promise), once
        # (the block forgets its request on exit).
        block = self._blocks.pop(engine_id, None)
        if block is not None:
            await block.__aexit__(None, None, None)

    async def _leave_all(self) -> None:
        for engine_id in list(self._blocks):
            await self._leave(engine_id)

    # ------------------------------------------------------------------ n == 1

    async def next_output(self) -> RequestOutput:
        if self._exits is not None:
            return await self._next_merged()
        state = self.state
        while True:
            if self._done or state.finished:
                await trio.lowlevel.checkpoint()
                raise StopAsyncIteration
            assert self._single is not None
            engine_id, stream = self._single
            # The stream's receive is the one checkpoint, and is atomic; nothing after
            # it can be interrupted.
            try:
                output = await stream.__anext__()
            except StopAsyncIteration:
                self._done = True
                raise
            result, abort = state.process(output)
            if abort or state.finished:
                await self._leave(engine_id)
            if result is not None:
                return result

    # ------------------------------------------------------------------ n > 1

    async def _pump(self, engine_id: str) -> None:
        stream = self._streams[engine_id]
        state = self.state
        try:
            async for output in stream:
                result, abort = state.process(output)
                if abort or state.sequence(engine_id).finished:
                    await self._leave(engine_id)
                if result is not None:
                    self._put(result)
                if state.sequence(engine_id).finished:
                    break
        except (EngineCoreError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if self._failure is None:
                self._failure = exc
        finally:
            self._pending_tasks -= 1
            self._wake()

    def _put(self, output: RequestOutput) -> None:
        if self._slot is None:
            self._slot = output
        else:
            self._slot.add(output, aggregate=self.state.output_kind is RequestOutputKind.DELTA)
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            trio.lowlevel.reschedule(waiter)

    def _abort_wait(self, _: object) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _next_merged(self) -> RequestOutput:
        # As RequestStream: every schedule point comes before the take.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._slot is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
        while self._slot is None:
            if self._failure is not None:
                raise self._failure
            if self._done or self.state.finished or self._pending_tasks == 0:
                raise StopAsyncIteration
            if self._waiter is not None:
                raise trio.BusyResourceError("another task is already reading this stream")
            self._waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
        output, self._slot = self._slot, None
        if output.finished:
            self._done = True
        return output


@contextlib.asynccontextmanager
async def open_llm(
    config: EngineConfig | None = None,
    options: ClientOptions | None = None,
    *,
    tokenizer: Tokenizer | str | Path | None = None,
    **keywords: Unpack[ClientOptionKeywords],
) -> AsyncGenerator[AsyncLLM]:
    """Open an engine client and its text layer: ``async with open_llm() as llm:``.

    With no arguments it launches the built-in reference engine's ``ngram`` model and
    uses the tokenizer shipped for it, so it writes English text on a laptop. Otherwise
    ``config``, ``options`` and the keywords are those of
    :func:`~trio_enginecore.open_engine_client` (launch reference engines, or launch
    vLLM's engine cores with ``vllm=``, or attach to vLLM engine cores with
    ``input_address``/``output_address``, or have engines on other hosts join with
    ``remote=``), and ``tokenizer`` is the model's tokenizer or the path of its model
    directory (read before anything is launched; with ``vllm=``, by default, the
    directory vLLM serves).

    Leaving the block closes the client as :func:`~trio_enginecore.open_engine_client`
    does: in-flight requests aborted, launched engines stopped.

    Raises:
        ModelDirectoryError: the tokenizer's directory cannot be used (nothing started).
        InvalidInputError: a built-in model other than ``ngram`` without a tokenizer.
        EngineStartupError: as :func:`~trio_enginecore.open_engine_client`.
        TypeError: a keyword that is not an option (nothing started).
    """
    check_option_keywords(keywords, open_llm)
    vllm = options.vllm if options is not None else keywords.get("vllm")
    if config is None and vllm is None:
        config = EngineConfig(model="ngram")
    if tokenizer is None and vllm is not None:
        tokenizer = vllm.model  # the model directory vLLM serves holds its tokenizer
    if tokenizer is None:
        assert config is not None
        if config.model != "ngram":
            raise InvalidInputError(
                "tokenizer",
                f"give the tokenizer (or model directory) of model {config.model!r}; "
                "only the built-in 'ngram' model has one built in",
            )
        tokenizer = builtin_tokenizer()
    elif not isinstance(tokenizer, Tokenizer):
        tokenizer = await trio.to_thread.run_sync(load_tokenizer, tokenizer)
    async with open_engine_client(config, options, **keywords) as client:
        yield AsyncLLM(client, tokenizer)

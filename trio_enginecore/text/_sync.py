"""The text layer's blocking face: :class:`SyncLLM`, for code that does not run
under Trio. The text is made in the calling thread; the engine client's sockets stay
in the blocking client's Trio thread (:class:`~trio_enginecore.SyncMPClient`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, Unpack, final

from ..client import SyncMPClient, SyncRequestStream
from ..client._options import check_option_keywords
from ..config import EngineConfig
from ..errors import InvalidInputError
from ..protocol import LoRARequest, SamplingKeywords, SamplingParams
from ._inputs import PromptInput, final_only, prepare_request, sampling_params_from
from ._model_dir import builtin_tokenizer, load_tokenizer
from ._outputs import RequestOutput
from ._tokenizer import Tokenizer

if TYPE_CHECKING:
    from ..client._options import ClientOptionKeywords, ClientOptions
    from ._processor import TextRequestState

__all__ = ["SyncGeneration", "SyncLLM"]


@final
class SyncLLM:
    """Text in, text out, blocking; safe to use from many threads at once.

    ::

        with trio_enginecore.text.SyncLLM() as llm:          # the built-in ngram model
            print(llm.complete("The river", max_tokens=40).outputs[0].text)
            with llm.generate("Tea is", max_tokens=40) as outputs:
                for output in outputs:
                    ...

    The constructor launches (or attaches to) engines as
    :class:`~trio_enginecore.SyncMPClient` does, with the same arguments, or wraps
    ``client``, a blocking client the caller opened (and closes). ``tokenizer`` as for
    :func:`~trio_enginecore.text.open_llm`.

    Raises:
        ModelDirectoryError, InvalidInputError: the tokenizer cannot be used (nothing
            started).
        EngineStartupError: as :class:`~trio_enginecore.SyncMPClient`.
        TypeError: a keyword that is not an option (nothing started).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        options: ClientOptions | None = None,
        *,
        tokenizer: Tokenizer | str | Path | None = None,
        client: SyncMPClient | None = None,
        max_model_len: int | None = None,
        **keywords: Unpack[ClientOptionKeywords],
    ) -> None:
        check_option_keywords(keywords, SyncLLM)
        if client is None and config is None:
            config = EngineConfig(model="ngram")
        if tokenizer is None:
            if client is not None or config is None or config.model != "ngram":
                raise InvalidInputError(
                    "tokenizer", "give the model's tokenizer (only 'ngram' has one built in)"
                )
            tokenizer = builtin_tokenizer()
        self.tokenizer = (
            tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        )
        self._owned = client is None
        self.client = client if client is not None else SyncMPClient(config, options, **keywords)
        if max_model_len is None:
            lengths = [e.max_model_len for e in self.client.engines if e is not None]
            max_model_len = min(lengths) if lengths else None
        self.max_model_len = max_model_len

    def close(self) -> None:
        """Close the client, if this object opened it. Idempotent."""
        if self._owned:
            self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

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
    ) -> SyncGeneration:
        """Send a request and stream its outputs, blocking: as
        :meth:`AsyncLLM.generate <trio_enginecore.text.AsyncLLM.generate>`, with
        ``with`` and ``for``. With ``n > 1`` the sequences are read one after the other
        (each whole before the next), in ``index`` order.

        Raises:
            InvalidInputError: at the call; nothing was sent.
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
        return SyncGeneration(self.client, state, requests)

    def complete(
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
        """Generate and return the final output (every sequence, whole)."""
        params = final_only(sampling_params_from(sampling_params, sampling))
        last: RequestOutput | None = None
        with self.generate(
            prompt,
            params,
            request_id=request_id,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
            cache_salt=cache_salt,
        ) as outputs:
            for output in outputs:
                last = output
        assert last is not None, "a finished request always has a final output"
        return last


@final
class SyncGeneration:
    """``with llm.generate(...) as outputs: for output in outputs:`` (blocking)."""

    def __init__(self, client: SyncMPClient, state: TextRequestState, requests: list[Any]) -> None:
        self._client = client
        self.state = state
        self._requests = requests
        self._exits = ExitStack()
        self._streams: dict[str, SyncRequestStream] = {}

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.state.request_id

    def __enter__(self) -> Self:
        requests, self._requests = self._requests, []
        with ExitStack() as entering:
            for request in requests:
                stream = self._client.stream(request)
                self._streams[request.request_id] = entering.enter_context(stream)
            self._exits = entering.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._exits.close()

    def __iter__(self) -> Iterator[RequestOutput]:
        state = self.state
        for engine_id, stream in self._streams.items():
            for output in stream:
                result, abort = state.process(output)
                if abort:
                    # Leaving the stream's block aborts it on the engine (once).
                    stream.__exit__(None, None, None)
                if result is not None:
                    yield result
                if state.sequence(engine_id).finished:
                    break

"""Text in, text out: tokenizers, incremental detokenization, stop strings, parallel
sampling and logprobs as text, over any engine client (vLLM's ``AsyncLLM`` and
``OutputProcessor``, for Trio).

::

    async with trio_enginecore.text.open_llm() as llm:      # the built-in ngram model
        output = await llm.complete("The river", max_tokens=40, stop=["."])
        print(output.outputs[0].text)

Needs the ``text`` extra (``pip install "/path/to/trio-enginecore[text]"``: the ``tokenizers``
package). The pure parts (:class:`IncrementalDetokenizer`, :class:`TextRequestState`)
do no I/O and can be driven by hand, as the tests do.
"""

from __future__ import annotations

from ..errors import (
    InvalidInputError as InvalidInputError,
    ModelDirectoryError as ModelDirectoryError,
)
from ._detokenizer import IncrementalDetokenizer as IncrementalDetokenizer
from ._inputs import (
    PromptInput as PromptInput,
    TextPrompt as TextPrompt,
    TokensPrompt as TokensPrompt,
)
from ._llm import AsyncLLM as AsyncLLM, GenerationStream as GenerationStream, open_llm as open_llm
from ._logprobs import Logprob as Logprob
from ._model_dir import (
    BUILTIN_TOKENIZER_DIR as BUILTIN_TOKENIZER_DIR,
    builtin_tokenizer as builtin_tokenizer,
    load_tokenizer as load_tokenizer,
)
from ._outputs import CompletionOutput as CompletionOutput, RequestOutput as RequestOutput
from ._processor import TextRequestState as TextRequestState
from ._sync import SyncLLM as SyncLLM
from ._tokenizer import Tokenizer as Tokenizer

__all__ = [
    "BUILTIN_TOKENIZER_DIR",
    "AsyncLLM",
    "CompletionOutput",
    "GenerationStream",
    "IncrementalDetokenizer",
    "InvalidInputError",
    "Logprob",
    "ModelDirectoryError",
    "PromptInput",
    "RequestOutput",
    "SyncLLM",
    "TextPrompt",
    "TextRequestState",
    "Tokenizer",
    "TokensPrompt",
    "builtin_tokenizer",
    "load_tokenizer",
    "open_llm",
]

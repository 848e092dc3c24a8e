"""An OpenAI-compatible HTTP server on Trio, over the text layer, with vLLM's metrics.

Run it as a program, ``trio-enginecore api-server`` (see ``--help``), or serve an
:class:`~trio_enginecore.text.AsyncLLM` you opened yourself::

    async with open_llm() as llm:
        app = OpenAIApp(llm, ServerSettings(served_model_names=["ngram"]))
        listeners = await trio.open_tcp_listeners(8000, host="127.0.0.1")
        await serve_http(app, listeners)

Needs the ``server`` extra (h11, jinja2, prometheus-client, tokenizers).
"""

from __future__ import annotations

from ._chat_template import (
    ChatTemplate as ChatTemplate,
    ChatTemplateError as ChatTemplateError,
    ChatTemplateRejectedError as ChatTemplateRejectedError,
    ChatTemplates as ChatTemplates,
    ChatTemplateSecurityError as ChatTemplateSecurityError,
    ChatTemplateSyntaxError as ChatTemplateSyntaxError,
)
from ._http import HttpServer as HttpServer, serve_http as serve_http
from ._http_messages import (
    Headers as Headers,
    HttpLimits as HttpLimits,
    HttpServerStatistics as HttpServerStatistics,
    Request as Request,
    Response as Response,
)
from ._metrics import VllmMetrics as VllmMetrics
from ._openai_app import OpenAIApp as OpenAIApp, ServerSettings as ServerSettings
from ._openai_requests import ApiError as ApiError, RequestLimits as RequestLimits

__all__ = [
    "ApiError",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTemplateRejectedError",
    "ChatTemplateSecurityError",
    "ChatTemplateSyntaxError",
    "ChatTemplates",
    "Headers",
    "HttpLimits",
    "HttpServer",
    "HttpServerStatistics",
    "OpenAIApp",
    "Request",
    "RequestLimits",
    "Response",
    "ServerSettings",
    "VllmMetrics",
    "serve_http",
]

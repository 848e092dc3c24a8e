"""How a client talks to its engines, in one frozen object.

:class:`~trio_enginecore.EngineConfig` describes the reference engine a client
launches; :class:`ClientOptions` describes the client's side: where to bind, how long
to wait, how deaths are noticed. Attaching to engines started elsewhere (vLLM's among
them) needs only the options.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, TypedDict, final

import attrs

from .._keywords import check_keywords, known_keywords, suggest_keywords
from .._listeners import ListenerFd
from ..coordinator import CoordinatorAddresses
from ._core._lb import LoadBalancer
from ._core._liveness_rules import DEFAULT_LIVENESS, Liveness
from ._core._policy import FailurePolicy, resolve_policy
from ._core._settings_checks import positive_number
from ._multiprocess._remote import RemoteEngines
from ._multiprocess._vllm import VllmEngines

__all__ = [
    "ClientOptionKeywords",
    "ClientOptions",
    "FailurePolicy",
    "InprocOptionKeywords",
    "check_option_keywords",
    "options_from",
]


def _failure_policy(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    # The policy module's own judgement, so that the options and the client cannot
    # disagree on what a policy is; the options keep the value as given.
    resolve_policy(value)


_positive: Final = positive_number(None)


@final
@suggest_keywords
@attrs.frozen(kw_only=True)
class ClientOptions:
    """The options of a multiprocess client (see
    :func:`~trio_enginecore.open_engine_client` for each one's meaning).

    Raises:
        ValueError: a timeout that is not a positive number.
    """

    input_address: str | ListenerFd | None = None
    output_address: str | ListenerFd | None = None
    remote: RemoteEngines | None = None
    vllm: VllmEngines | None = None
    liveness: Liveness | None = DEFAULT_LIVENESS
    coordinator: CoordinatorAddresses | None = None
    load_balancer: LoadBalancer | None = None
    ready_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    shutdown_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    max_pending_outputs: int = 64
    client_index: int = 0
    on_engine_failure: FailurePolicy = attrs.field(default="fail", validator=_failure_policy)


class ClientOptionKeywords(TypedDict, total=False):
    """:class:`ClientOptions`' fields as keywords, for the openers' ``**options``
    (the type checker then knows every name and type; a test keeps both in step)."""

    input_address: str | ListenerFd | None
    output_address: str | ListenerFd | None
    remote: RemoteEngines | None
    vllm: VllmEngines | None
    liveness: Liveness | None
    coordinator: CoordinatorAddresses | None
    load_balancer: LoadBalancer | None
    ready_timeout_s: float
    shutdown_timeout_s: float
    max_pending_outputs: int
    client_index: int
    on_engine_failure: FailurePolicy


class InprocOptionKeywords(TypedDict, total=False):
    """The options an in-process client has (the others are about processes and
    sockets)."""

    max_pending_outputs: int
    client_index: int


_OPTION_NAMES: Final = frozenset(field.name for field in attrs.fields(ClientOptions))


def options_from(
    options: ClientOptions | None,
    keywords: ClientOptionKeywords,
    *,
    opener: Callable[..., object] | None = None,
) -> ClientOptions:
    """``options``, or the :class:`ClientOptions` the keywords make (never both).

    ``opener`` is the function (or class) the keywords were given to: an unknown one
    is reported as its own, with the nearest of its keywords and the options.

    Raises:
        TypeError: both were given, or a keyword is not an option (the message names
            the nearest one).
        ValueError: an option's value is out of range.
    """
    if options is None:
        if opener is not None:
            check_option_keywords(keywords, opener)
        return ClientOptions(**keywords)
    if keywords:
        raise TypeError(f"give options or keywords, not both (got {sorted(keywords)})")
    return options


def check_option_keywords(keywords: Mapping[str, object], opener: Callable[..., object]) -> None:
    """Refuse a keyword given to ``opener`` that is neither an option nor one of its own
    parameters, naming the nearest of those (``did you mean 'on_engine_failure'?``).

    Raises:
        TypeError: an unknown keyword.
    """
    if not keywords.keys() <= _OPTION_NAMES:
        check_keywords(opener.__name__, keywords, _OPTION_NAMES | known_keywords(opener))

"""The protocols a gateway serves: tracerl's own (a built-in plugin) and every plugin's
``tracerl_protocols``, each checked before any is served."""

from __future__ import annotations

from ...core.errors import PluginError
from ...events.hookspecs import hookimpl
from ...events.plugins import collect_classes
from .anthropic_messages import AnthropicMessages
from .base import Protocol
from .openai import ChatCompletions, Completions
from .responses import Responses


@hookimpl
def tracerl_protocols() -> list[type[Protocol]]:
    return [ChatCompletions, Completions, Responses, AnthropicMessages]


def check_protocol(name: str, cls: object, owner: dict[str, str]) -> type[Protocol]:
    """``cls`` as a protocol the gateway can serve, its routes added to ``owner`` (route ->
    protocol name); a :class:`~tracerl.core.errors.PluginError` naming what is wrong: not a
    :class:`Protocol`, a route another protocol serves or without its leading '/', or streams
    on an engine call that has none (only chat completions stream)."""
    if not (isinstance(cls, type) and issubclass(cls, Protocol)):
        raise PluginError(f"protocol {name!r} ({cls!r}) is not a "
                          "tracerl.backend.protocols.base.Protocol subclass")
    if cls.streams and cls.endpoint != "chat.completions":
        raise PluginError(f"protocol {name!r} is rendered on {cls.endpoint!r}, which does not "
                          "stream: set streams = False")
    for route in cls.routes:
        if not route.startswith("/") or route in owner:
            why = f"is also served by {owner[route]!r}" if route in owner else \
                "must start with '/'"
            raise PluginError(f"protocol {name!r} route {route!r} {why}")
        owner[route] = name
    return cls


def load_protocols() -> list[Protocol]:
    """One instance of every registered protocol, each checked (:func:`check_protocol`)."""
    owner: dict[str, str] = {}
    return [check_protocol(name, cls, owner)()
            for name, cls in collect_classes("tracerl_protocols").items()]

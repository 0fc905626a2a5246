"""The protocols a gateway serves: tracerl's own (a built-in plugin) and every plugin's
``tracerl_protocols``, checked for clashing names and routes."""

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


def load_protocols() -> list[Protocol]:
    """One instance of every registered protocol; a route served twice is a
    :class:`~tracerl.core.errors.PluginError` naming both protocols."""
    protocols: list[Protocol] = []
    owner: dict[str, str] = {}
    for name, cls in collect_classes("tracerl_protocols").items():
        if not (isinstance(cls, type) and issubclass(cls, Protocol)):
            raise PluginError(f"protocol {name!r} ({cls!r}) is not a "
                              "tracerl.backend.protocols.base.Protocol subclass")
        for route in cls.routes:
            if not route.startswith("/") or route in owner:
                why = f"is also served by {owner[route]!r}" if route in owner else \
                    "must start with '/'"
                raise PluginError(f"protocol {name!r} route {route!r} {why}")
            owner[route] = name
        protocols.append(cls())
    return protocols

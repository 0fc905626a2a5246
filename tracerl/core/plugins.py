"""Moved to :mod:`tracerl.events.plugins`; this import path stays for code written before."""

from ..events.plugins import (
    BUILTIN_PLUGINS,
    ENTRY_POINT_GROUP,
    LOGGERS,
    HookDoc,
    PluginInfo,
    collect_classes,
    enabled_loggers,
    get_plugin_manager,
    hook_reference,
    list_plugins,
    register,
    reset_plugin_manager,
)

__all__ = ["BUILTIN_PLUGINS", "ENTRY_POINT_GROUP", "LOGGERS", "HookDoc", "PluginInfo",
           "collect_classes", "enabled_loggers", "get_plugin_manager", "hook_reference",
           "list_plugins", "register", "reset_plugin_manager"]

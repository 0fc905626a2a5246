"""The plugin manager: tracerl's built-in plugins, then the ``tracerl`` entry-point group.

Built-in plugins are listed here by name and module (:data:`BUILTIN_PLUGINS`), the way pytest
lists its default plugins; third-party plugins come from entry points. Loggers are registered
only when enabled (:data:`LOGGERS`, turned on by ``TRACERL_LOGGERS``), like pytest's junitxml:
a logger that is off is not loaded at all.

The variables that choose loggers, block plugins and trace hook calls are declared in
:mod:`tracerl.core.settings` (group "Plugins and loggers"), with their types and defaults.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

import pluggy

from ..core import settings
from ..core.errors import PluginError
from . import hookspecs

if TYPE_CHECKING:
    from ..core.backend import Backend
    from ..core.engine import Engine
    from ..core.launcher import Launcher

ENTRY_POINT_GROUP = "tracerl"
log = logging.getLogger(__name__)

# name -> module; each module holds @hookimpl functions
BUILTIN_PLUGINS = {
    "transformers_engine": "tracerl.backend.engines.transformers_engine",
    "vllm_engine": "tracerl.backend.engines.vllm_engine",
    "protocols": "tracerl.backend.protocols.registry",
    "local_backend": "tracerl.backend.local",
    "remote_backend": "tracerl.remote.client",
    "local_launcher": "tracerl.backend.launchers.local",
    "ray_launcher": "tracerl.backend.launchers.ray",
    "ruler": "tracerl.ruler.plugin",
    "tasks": "tracerl.tasks.catalog",
}
# logger name (as in TRACERL_LOGGERS) -> "module:factory"; the factory makes the plugin object
LOGGERS = {
    "console": "tracerl.integrations.console_logger:ConsoleLogger",
    "wandb": "tracerl.integrations.wandb_logger:WandbLogger",
    "langfuse": "tracerl.integrations.langfuse_logger:LangfuseLogger",
    "weave": "tracerl.integrations.weave_logger:WeaveLogger",
}

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
_dist_info: dict[str, tuple[str | None, str | None]] = {}


@dataclass(frozen=True)
class PluginInfo:
    name: str
    module: str
    distribution: str | None
    version: str | None
    hooks: list[str]


def _check_api(name: str, plugin: object) -> None:
    wanted = getattr(plugin, "TRACERL_PLUGIN_API", hookspecs.HOOKSPEC_VERSION)
    if not isinstance(wanted, int) or wanted > hookspecs.HOOKSPEC_VERSION:
        raise PluginError(
            f"plugin {name!r} needs tracerl plugin API {wanted!r}, but this tracerl provides "
            f"{hookspecs.HOOKSPEC_VERSION}; upgrade tracerl or pin an older plugin"
        )


def _blocked() -> set[str]:
    return set(settings.TRACERL_BLOCK_PLUGINS.get())


def enabled_loggers() -> list[str]:
    """The loggers ``TRACERL_LOGGERS`` turns on, plus the console one unless TRACERL_QUIET=1."""
    names = settings.TRACERL_LOGGERS.get()
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise PluginError(f"TRACERL_LOGGERS names unknown loggers {unknown}; "
                          f"known: {sorted(LOGGERS)}")
    console = [] if settings.TRACERL_QUIET.get() else ["console"]
    return [*console, *dict.fromkeys(n for n in names if n != "console")]


def _load_builtins(pm: pluggy.PluginManager, blocked: set[str]) -> None:
    for name, module in BUILTIN_PLUGINS.items():
        if name not in blocked:
            pm.register(importlib.import_module(module), name=name)
            _dist_info[name] = ("tracerl", _version())
    for name in enabled_loggers():
        if name in blocked:
            continue
        module, _, factory = LOGGERS[name].partition(":")
        pm.register(getattr(importlib.import_module(module), factory)(), name=f"{name}_logger")
        _dist_info[f"{name}_logger"] = ("tracerl", _version())


def _version() -> str | None:
    try:
        return importlib.metadata.version("tracerl")
    except importlib.metadata.PackageNotFoundError:
        return None


def _load_entry_points(pm: pluggy.PluginManager, blocked: set[str]) -> None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in blocked or pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as e:
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {e}") from e
        _check_api(ep.name, plugin)
        pm.register(plugin, name=ep.name)
        dist = ep.dist
        _dist_info[ep.name] = (dist.name if dist else None, dist.version if dist else None)


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked = _blocked()
    _load_builtins(pm, blocked)
    _load_entry_points(pm, blocked)
    for name in blocked:
        pm.set_blocked(name)
    pm.check_pending()
    if settings.TRACERL_TRACE_PLUGINS.get():
        pm.trace.root.setwriter(lambda s: log.debug("%s", s.rstrip()))
        pm.enable_tracing()
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created (and entry points loaded) on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = _new_manager()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the manager so the next use reloads entry points (tests, plugin development)."""
    global _manager
    with _lock:
        _manager = None


def register(plugin: object, name: str | None = None) -> str:
    """Register a plugin object or module at run time (for code that is not packaged)."""
    pm = get_plugin_manager()
    _check_api(name or repr(plugin), plugin)
    result = pm.register(plugin, name=name)
    if result is None:
        raise PluginError(f"plugin {name or plugin!r} is blocked or already registered")
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        pm.unregister(name=result)
        raise PluginError(f"plugin {result!r} implements a hook that does not exist: {e}") from e
    return result


def list_plugins() -> list[PluginInfo]:
    pm = get_plugin_manager()
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        dist, version = _dist_info.get(name, (None, None))
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        module = plugin.__name__ if inspect.ismodule(plugin) else type(plugin).__module__
        out.append(PluginInfo(
            name=name, module=module,
            distribution=dist, version=version,
            hooks=hooks,
        ))
    return sorted(out, key=lambda p: p.name)


@dataclass(frozen=True)
class HookDoc:
    """One hook of the plugin API, as a plugin author needs it."""

    name: str
    signature: str
    doc: str
    first_result: bool
    implemented_by: list[str]


def _signature(name: str, fn: Callable[..., object]) -> str:
    """``name(arg: Type, ...) -> Type`` from the (postponed, so textual) annotations."""
    sig = inspect.signature(fn)
    params = ", ".join(
        p.name if p.annotation is inspect.Parameter.empty else f"{p.name}: {p.annotation}"
        for p in sig.parameters.values()
    )
    return f"{name}({params}) -> {sig.return_annotation}"


def hook_reference() -> list[HookDoc]:
    """Every hook in :mod:`tracerl.events.hookspecs`, in source order, with the plugins that
    implement it now."""
    pm = get_plugin_manager()
    out = []
    for name, fn in vars(hookspecs).items():
        spec = getattr(fn, f"{hookspecs.PROJECT}_spec", None)
        if spec is None:
            continue
        callers = pm.hook.__dict__.get(name)
        implementers = sorted({pm.get_name(impl.plugin) or "?" for impl in callers.get_hookimpls()}
                              if callers is not None else set())
        out.append(HookDoc(name=name, signature=_signature(name, fn),
                           doc=inspect.cleandoc(fn.__doc__ or ""),
                           first_result=bool(spec.get("firstresult")), implemented_by=implementers))
    return out


@overload
def collect_classes(hook_name: Literal["tracerl_engines"]) -> dict[str, type[Engine]]: ...
@overload
def collect_classes(hook_name: Literal["tracerl_backends"]) -> dict[str, type[Backend]]: ...
@overload
def collect_classes(hook_name: Literal["tracerl_launchers"]) -> dict[str, type[Launcher]]: ...
@overload
def collect_classes(hook_name: str) -> dict[str, type]: ...
def collect_classes(hook_name: str) -> dict[str, type]:
    """Gather the classes returned by a list-returning hook (engines, backends), keyed by name."""
    pm = get_plugin_manager()
    found: dict[str, type] = {}
    for result in getattr(pm.hook, hook_name)():
        for cls in result or []:
            name = getattr(cls, "name", None)
            if not name:
                raise PluginError(f"{hook_name} returned {cls!r} without a 'name'")
            if name in found and found[name] is not cls:
                raise PluginError(f"two plugins provide {hook_name[8:-1]} {name!r}: "
                                  f"{found[name].__module__} and {cls.__module__}")
            found[name] = cls
    return found


def _results_by_plugin(hook_name: str) -> list[tuple[str, object]]:
    """(plugin name, result) of each implementation of an argument-less hook, in the order
    pluggy calls them, so that a clash can name the plugins."""
    caller = getattr(get_plugin_manager().hook, hook_name)
    return [(impl.plugin_name, impl.function()) for impl in reversed(caller.get_hookimpls())
            if not (impl.wrapper or impl.hookwrapper)]


def collect_tasks() -> dict[str, str]:
    """The task catalog (``tracerl_tasks``): task name -> ``module:attribute`` of its Task. A
    name two plugins give (for two different tasks) is a PluginError naming both."""
    found: dict[str, tuple[str, str]] = {}  # name -> (plugin, reference)
    for plugin, result in _results_by_plugin("tracerl_tasks"):
        if result is None:
            continue
        if not isinstance(result, Mapping):
            raise PluginError(f"plugin {plugin!r}: tracerl_tasks returned {result!r}, not a "
                              "dict of task name -> 'module:attribute'")
        for name, reference in result.items():
            if not (isinstance(name, str) and name and isinstance(reference, str)
                    and reference):
                raise PluginError(f"plugin {plugin!r}: tracerl_tasks maps {name!r} to "
                                  f"{reference!r}, not a task name to 'module:attribute'")
            if name in found and found[name][1] != reference:
                other, where = found[name]
                raise PluginError(f"two plugins give task {name!r}: {other!r} ({where}) and "
                                  f"{plugin!r} ({reference})")
            found[name] = (plugin, reference)
    return {name: reference for name, (_, reference) in found.items()}

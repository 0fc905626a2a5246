"""The package layout: one package per stage, contracts at the bottom, nothing imports upward.

The import graph is read from the source with ``ast`` (every import statement, including those
inside functions and ``TYPE_CHECKING`` blocks), so a lazy import cannot hide a dependency.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tracerl"

# stage -> the stages it may import (besides itself); modules directly in tracerl/ sit on top
ALLOWED = {
    "core": set(),
    "events": {"core"},
    "rollout": {"core", "events"},
    "backend": {"core", "events"},
    "remote": {"core", "events", "backend"},
    "integrations": {"core", "events", "rollout"},
    "ruler": {"core", "events", "rollout"},
}
# old import paths kept for users (module -> the one module it re-exports): exempt from the
# stage rule, and checked to hold nothing but that re-export
COMPAT_ALIASES = {
    "tracerl.core.hookspecs": "tracerl.events.hookspecs",
    "tracerl.core.plugins": "tracerl.events.plugins",
    "tracerl.core.lifecycle": "tracerl.events.lifecycle",
    "tracerl.backend.release": "tracerl.backend.online.release",
    "tracerl.backend.release_gates": "tracerl.backend.online.gates",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _nodes(tree: ast.AST, runtime_only: bool) -> list[ast.AST]:
    """Every node, leaving out ``if TYPE_CHECKING:`` blocks when ``runtime_only``."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if runtime_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def imported_modules(name: str, path: Path, known: set[str], runtime_only: bool = False
                     ) -> set[str]:
    """The tracerl modules ``name`` imports (a name imported from a package counts as its
    submodule when one exists); ``runtime_only`` leaves out imports for type checkers."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text()), runtime_only):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "tracerl"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "tracerl":
                target = node.module
            else:
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known
            found |= subs or {target}
    return {m for m in found if m in known} - {name}


def graph(runtime_only: bool = False) -> dict[str, set[str]]:
    mods = modules()
    return {name: imported_modules(name, path, set(mods), runtime_only)
            for name, path in mods.items()}


# packages at the top (ART's import paths; the task catalog, whose tasks use the public API as
# users' code does: ``import tracerl as art``), like the modules directly in tracerl/
TOP_PACKAGES = {"utils", "local", "tasks", "trajectories", "mcp"}


def stage(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in TOP_PACKAGES:
        return None
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else None


def test_no_stage_imports_upward() -> None:
    wrong = []
    for module, targets in graph().items():
        own = stage(module)
        if own is None or module in COMPAT_ALIASES:
            continue  # the top: CLI, demo, report, public API, ART import paths
        for target in targets:
            other = stage(target)
            if other != own and (other is None or other not in ALLOWED[own]):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``edges`` closes, as the modules along it."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    return cycles


# backend's rooms -> the rooms each may import (besides itself). A module directly in backend/
# is a shared leaf when listed here, else part of the facade on top (``local.py`` and the
# modules it is made of); compat aliases are exempt.
BACKEND_LEAVES = {"chat_template", "weights", "publishing", "object_sync", "rollout_log",
                  "heap"}
BACKEND_ALLOWED = {
    "leaf": set(),
    "protocols": {"leaf"},
    "engines": {"leaf"},
    "training": {"leaf"},
    "launchers": {"leaf", "training"},
    "gateway": {"leaf", "protocols", "engines"},
    "online": {"leaf", "gateway", "training"},
    "facade": {"leaf", "protocols", "engines", "training", "launchers", "gateway", "online"},
}


def backend_room(module: str) -> str | None:
    """The room of a ``tracerl.backend`` module (None: not in backend, or the package itself)."""
    parts = module.split(".")
    if parts[:2] != ["tracerl", "backend"] or len(parts) < 3:
        return None
    if len(parts) > 3 or parts[2] in BACKEND_ALLOWED:
        return parts[2] if parts[2] in BACKEND_ALLOWED else None
    return "leaf" if parts[2] in BACKEND_LEAVES else "facade"


def backend_graph() -> dict[str, set[str]]:
    """backend's modules and the backend modules each imports, ``TYPE_CHECKING`` and
    function-level imports included (compat aliases left out)."""
    return {m: {t for t in ts if backend_room(t) and t not in COMPAT_ALIASES}
            for m, ts in graph().items() if backend_room(m) and m not in COMPAT_ALIASES}


def test_every_backend_package_is_a_room() -> None:
    packages = {m.split(".")[2] for m in modules()
                if m.startswith("tracerl.backend.") and m.count(".") >= 3}
    assert packages <= set(BACKEND_ALLOWED)


def test_no_backend_room_imports_a_room_above_it() -> None:
    """Even an import for type checkers or inside a function: the rooms read bottom up."""
    wrong = [f"{m} -> {t}" for m, ts in backend_graph().items() for t in ts
             if backend_room(t) != backend_room(m)
             and backend_room(t) not in BACKEND_ALLOWED[backend_room(m) or ""]]
    assert wrong == []


def test_backend_has_no_cycle_even_through_type_checking_or_lazy_imports() -> None:
    assert find_cycles(backend_graph()) == []


def test_import_graph_has_no_cycle() -> None:
    """At run time (imports for type checkers only may point back: they never execute)."""
    assert find_cycles(graph(runtime_only=True)) == []


def test_core_has_no_cycle_even_through_type_checking_imports() -> None:
    """Core's modules form no circle at all, not even one closed by a ``TYPE_CHECKING`` import
    (a cycle in meaning: the data model would depend on what depends on it)."""
    edges = {m: {t for t in ts if stage(t) == "core"}
             for m, ts in graph().items() if stage(m) == "core" and m not in COMPAT_ALIASES}
    assert find_cycles(edges) == []


@pytest.mark.parametrize("alias", sorted(COMPAT_ALIASES))
def test_a_compat_alias_only_re_exports_its_module(alias: str) -> None:
    path = modules()[alias]
    body = [n for n in ast.parse(path.read_text()).body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    imports = [n for n in body if isinstance(n, ast.ImportFrom)]
    others = [n for n in body if not isinstance(n, ast.ImportFrom)
              and not (isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__")]
    assert others == [] and len(imports) == 1
    assert imported_modules(alias, path, set(modules())) == {COMPAT_ALIASES[alias]}


def test_the_graph_reader_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The checks above are only as good as the reader: it must see a function-level import."""
    known = {"tracerl.core.a", "tracerl.core.b", "tracerl.rollout.c"}
    source = tmp_path / "a.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom . import b\n\n"
                      "if TYPE_CHECKING:\n    from .d import D\n\n"
                      "def f():\n    from ..rollout.c import x\n")
    known.add("tracerl.core.d")
    assert imported_modules("tracerl.core.a", source, known) == {
        "tracerl.core.b", "tracerl.core.d", "tracerl.rollout.c"}
    assert imported_modules("tracerl.core.a", source, known, runtime_only=True) == {
        "tracerl.core.b", "tracerl.rollout.c"}


CLIENT_SIDE = {
    "package": "import tracerl",
    "remote-client": "import tracerl.remote.client",
    "model-handle": "import tracerl.rollout.model",
    # the plugin manager loads every built-in plugin, the backends' modules included
    "plugin-manager": "from tracerl.events.plugins import get_plugin_manager; get_plugin_manager()",
}


@pytest.mark.parametrize("statement", CLIENT_SIDE.values(), ids=list(CLIENT_SIDE))
def test_client_side_code_loads_no_backend_dependency(statement: str) -> None:
    """A rollout machine or a remote client needs neither torch nor a web framework."""
    code = (f"import sys\n{statement}\n"
            "heavy = sorted({'torch', 'fastapi', 'transformers', 'uvicorn'} & set(sys.modules))\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_package_names_its_stage_and_files_in_flow_order() -> None:
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        files = sorted(p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py")
        missing = [f for f in files if f"{f}.py" not in doc]
        assert doc and missing == [], f"{init}: docstring lacks {missing}"


def test_hooks_are_fired_from_lifecycle_only() -> None:
    """One place fires hooks (``events/lifecycle.py``); plugins.py only looks classes up."""
    firing = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                    if ".hook.tracerl_" in p.read_text())
    assert firing == ["events/lifecycle.py"]


# every public name users imported before the layout by stage (tracerl 0.1.0's __all__, the
# ART import paths and the documented modules): each still imports from where it was
PUBLIC_NAMES = {
    "tracerl": "HOOKSPEC_VERSION AuthenticationError BackendUnavailableError CompletionRecord "
               "ConfigError ContextThreadPoolExecutor EngineConfig EngineError History "
               "InvalidTrajectoryError LLMCall LocalBackend LoraConfig Model ModelConfig "
               "NotRegisteredError PluginError RemoteBackend RolloutException RolloutTimeoutError "
               "Span TooManyExceptionsError TracerlError TrainConfig TrainableModel TrainingError "
               "Trajectory TrajectoryGroup call_tags current_rollout dev gather_trajectories "
               "gather_trajectory_groups hookimpl rollout_headers rollout_scope utils",
    "tracerl.local": "LocalBackend",
    "tracerl.utils": "DatasetBatch iterate_dataset limit_concurrency",
    "tracerl.dev": "EngineArgs InitArgs InternalModelConfig LoRAConfig TrainConfig",
    "tracerl.rewards": "DEFAULT_RUBRIC TrajectoryScore ruler ruler_score_group",
    "tracerl.langgraph": "init_chat_model wrap_rollout",
    "tracerl.ruler": "DEFAULT_RUBRIC Ruler RulerError TrajectoryScore parse_judgement parse_scores "
                     "ruler ruler_score_group trajectory_id",
    "tracerl.integrations.langchain": "TracerlCallbackHandler graph_rollout init_chat_model "
                                      "wrap_rollout",
    "tracerl.integrations.openai_agents": "TracerlModelProvider TracerlTracingProcessor "
                                          "install_tracing",
    "tracerl.integrations.litellm": "TracerlLiteLLMLogger completion_kwargs",
    "tracerl.integrations.litellm_proxy": "LiteLLMProxy",
    "tracerl.core.hookspecs": "HOOKSPEC_VERSION hookimpl hookspec",
    "tracerl.core.plugins": "get_plugin_manager hook_reference list_plugins register",
    "tracerl.core.lifecycle": "llm_call_recorded rollout_started score_group step_logged "
                              "train_event trajectory_finished",
    # the backend's documented modules, from before its rooms (docs/online.md)
    "tracerl.backend.online": "OnlineLoop",
    "tracerl.backend.release": "ReleaseControl",
    "tracerl.backend.release_gates": "Gates",
    "tracerl.backend.local": "LocalBackend",
}


@pytest.fixture(scope="module")
def missing_public_names() -> dict[str, list[str]]:
    """Imported in a fresh interpreter, so nothing the tests loaded before can help."""
    code = ("import importlib, json, sys\n"
            f"names = {PUBLIC_NAMES!r}\n"
            "out = {}\n"
            "for module, wanted in names.items():\n"
            "    m = importlib.import_module(module)\n"
            "    out[module] = [n for n in wanted.split() if not hasattr(m, n)]\n"
            "print(json.dumps(out))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("module", sorted(PUBLIC_NAMES))
def test_public_names_still_import_from_where_users_import_them(
        module: str, missing_public_names: dict[str, list[str]]) -> None:
    assert missing_public_names[module] == []


def test_python_m_tracerl_is_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "tracerl", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "serve" in out.stdout and "demo" in out.stdout


def test_no_function_is_over_80_lines() -> None:
    """A function that long has grown several jobs: split it (a table, a router, helpers)."""
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 80:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []


def test_local_backend_stays_a_facade() -> None:
    """``LocalBackend`` forwards to the rooms below it (registration, steps, policies); the
    work itself lives there."""
    assert len((PACKAGE / "backend" / "local.py").read_text().splitlines()) <= 350

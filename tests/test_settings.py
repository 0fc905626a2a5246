"""Settings checked like hooks (datasette's ``test_settings_are_documented`` is the model).

Fails when a module of ``tracerl/`` reads the environment anywhere but ``core/settings.py``, when a
variable, a config field or a CLI flag has no doc, and when ``docs/configuration.md`` is not what
its generator writes. The environment reads are found with ``ast`` (every form: ``os.environ[...]``,
``.get``, ``os.getenv``, ``in os.environ``, ``environ`` imported from ``os`` or bound to a name),
and the scanner is itself tested on a sample.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from tracerl import config_reference
from tracerl.backend.gateway import http_limits
from tracerl.core import config, settings, watchdog
from tracerl.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tracerl"
SETTINGS_FILE = PACKAGE / "core" / "settings.py"

# methods of os.environ that read it (setdefault, update and copy are writes or whole copies)
READ_METHODS = {"get", "pop", "items", "keys", "values", "__getitem__", "__contains__"}
# TRACERL_ names in the source that are not environment variables
NOT_VARIABLES = {"TRACERL_PLUGIN_API"}  # a plugin module's attribute (events/hookspecs.py)


def environment_reads(source: str) -> list[tuple[int, str]]:
    """(line, code) of every read of the environment in ``source``."""
    tree = ast.parse(source)
    os_names: set[str] = set()        # names bound to the os module
    environ_names: set[str] = set()   # names bound to os.environ
    getenv_names: set[str] = set()    # names bound to os.getenv

    def is_environ(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in environ_names
        return (isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")
                and isinstance(node.value, ast.Name) and node.value.id in os_names)

    nodes = list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            environ_names |= {a.asname or a.name for a in node.names
                              if a.name in ("environ", "environb")}
            getenv_names |= {a.asname or a.name for a in node.names
                             if a.name in ("getenv", "getenvb")}
    for node in nodes:  # a name bound to os.environ reads it too
        if isinstance(node, ast.Assign) and is_environ(node.value):
            environ_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    found = []
    for node in nodes:
        if isinstance(node, ast.Call):
            func = node.func
            read = (isinstance(func, ast.Name) and func.id in getenv_names) or (
                isinstance(func, ast.Attribute) and (
                    (func.attr in ("getenv", "getenvb") and isinstance(func.value, ast.Name)
                     and func.value.id in os_names)
                    or (func.attr in READ_METHODS and is_environ(func.value))))
        elif isinstance(node, ast.Subscript):
            read = isinstance(node.ctx, ast.Load) and is_environ(node.value)
        elif isinstance(node, ast.Compare):
            read = any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) and any(
                is_environ(c) for c in node.comparators)
        else:
            continue
        if read:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


READS = '''\
import os
import os as system
from os import environ, getenv
from os import environ as env_alias

a = os.environ["A"]
b = os.environ.get("B")
c = os.getenv("C", "c")
d = environ.get("D")
e = getenv("E")
f = "F" in os.environ
g = system.environ.get("G")
h = env_alias["H"]
bound = os.environ
i = bound.get("I")
j = os.environ.pop("J", None)

def later():
    import os as late
    return late.environ["K"]
'''

NOT_READS = '''\
import os
child = {**os.environ, "X": "1"}
copied = dict(os.environ)
os.environ["Y"] = "1"
os.environ.setdefault("Z", "1")
os.environ.update({"W": "1"})
del os.environ["V"]
config = {"a": 1}
config.get("a"), config["a"], "a" in config
'''


def test_the_scanner_finds_every_form_of_read() -> None:
    lines = [n for n, _ in environment_reads(READS)]
    assert lines == [6, 7, 8, 9, 10, 11, 12, 13, 15, 16, 20]


def test_the_scanner_leaves_copies_and_writes_alone() -> None:
    assert environment_reads(NOT_READS) == []


def sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_reads_the_environment_but_settings() -> None:
    reads = [f"{path}:{line}: {code}" for path, source in sources().items()
             if Path(ROOT / path) != SETTINGS_FILE
             for line, code in environment_reads(source)]
    assert reads == [], ("declare the variable in tracerl/core/settings.py and read it with its "
                         "accessor: " + "; ".join(reads))


def test_every_tracerl_variable_the_package_names_is_declared() -> None:
    """A variable only written (for a child) or only named in a message is declared too."""
    named = {m for source in sources().values()
             for m in re.findall(r"\bTRACERL_[A-Z0-9_]*[A-Z0-9]\b", source)}
    assert sorted(named - NOT_VARIABLES - set(settings.SETTINGS)) == []


def test_every_watchdog_kind_watched_has_its_variable() -> None:
    kinds = {m for source in sources().values()
             for m in re.findall(r"\bwatch\(\s*\"(\w+)\"", source)}
    assert kinds and sorted(kinds - set(settings.WATCHDOG_THRESHOLDS)) == []


@pytest.mark.parametrize("name", sorted(settings.SETTINGS))
def test_every_variable_is_declared_with_type_default_and_one_line_of_doc(name: str) -> None:
    setting = settings.SETTINGS[name]
    assert setting.name == name and setting.kind and setting.group
    assert len(setting.doc) >= 20 and "\n" not in setting.doc, f"{name} needs one line of doc"


def test_a_variable_is_read_when_asked_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACERL_HEAD_TIMEOUT_S", raising=False)
    assert http_limits.head_timeout_s() == 10.0
    monkeypatch.setenv("TRACERL_HEAD_TIMEOUT_S", "2.5")
    assert http_limits.head_timeout_s() == 2.5
    monkeypatch.setenv("TRACERL_HEAD_TIMEOUT_S", "")
    assert http_limits.head_timeout_s() == 10.0  # empty is unset, for a number
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert settings.CUDA_VISIBLE_DEVICES.get() == ""  # but a value, for a string


@pytest.mark.parametrize("name, value", [
    ("TRACERL_HEAD_TIMEOUT_S", "ten"), ("TRACERL_GC_FREEZE", "yes"), ("LOCAL_RANK", "first"),
    ("TRACERL_RANK_DEVICE", "tpu"), ("TRACERL_WATCHDOG_SWAP_S", "soon")])
def test_a_bad_value_is_a_config_error_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        settings.SETTINGS[name].get()


def test_each_watchdog_kind_reads_its_own_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for kind, setting in settings.WATCHDOG_THRESHOLDS.items():
        monkeypatch.setenv(setting.name, "0.5")
        assert watchdog.threshold(kind) == 0.5
        monkeypatch.delenv(setting.name)
        assert watchdog.threshold(kind) == watchdog.THRESHOLDS[kind]
    monkeypatch.setenv("TRACERL_WATCHDOG_SWAP_S", "x")
    with pytest.raises(ConfigError, match="TRACERL_WATCHDOG_SWAP_S"):
        watchdog.threshold("swap")


def test_a_required_variable_that_is_unset_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACERL_COORDINATOR", raising=False)
    with pytest.raises(ConfigError, match="TRACERL_COORDINATOR is not set"):
        settings.TRACERL_COORDINATOR.require()


# --- config models and CLI flags -------------------------------------------------------------

def test_every_config_model_of_core_config_is_in_the_reference() -> None:
    models = {obj for obj in vars(config).values() if isinstance(obj, type)
              and issubclass(obj, BaseModel) and obj.__module__ == config.__name__
              and not obj.__name__.startswith("_")}
    assert models
    assert sorted(m.__name__ for m in models - set(config_reference.CONFIG_MODELS)) == []


@pytest.mark.parametrize("field", [f"{m.__name__}.{name}" for m in config_reference.CONFIG_MODELS
                                   for name in m.model_fields])
def test_every_config_field_has_a_description(field: str) -> None:
    model_name, name = field.split(".")
    (model,) = [m for m in config_reference.CONFIG_MODELS if m.__name__ == model_name]
    description = model.model_fields[name].description or ""
    assert len(description) >= 20, f"{field} needs Field(description=...): what, when to change"


CLI_ARGUMENTS = {f"{command} {'/'.join(action.option_strings) or action.dest}": action
                 for command, _, action in config_reference.cli_arguments()}


@pytest.mark.parametrize("argument", sorted(CLI_ARGUMENTS))
def test_every_cli_argument_has_help(argument: str) -> None:
    assert CLI_ARGUMENTS[argument].help, f"tracerl {argument} needs help=..."


def test_every_cli_command_has_help() -> None:
    commands = list(config_reference._subcommands(config_reference.build_parser()))
    assert commands and [name for name, text, _ in commands if not text] == []


# --- the reference page ----------------------------------------------------------------------

def test_the_configuration_page_is_what_its_generator_writes() -> None:
    page = ROOT / config_reference.PAGE
    committed = page.read_text() if page.exists() else ""
    assert committed == config_reference.render(), (
        f"{config_reference.PAGE} is stale: run `{config_reference.COMMAND}`")


def test_the_generator_starts_nothing_and_loads_no_backend() -> None:
    code = ("import sys, tracerl.config_reference as r\nr.main()\n"
            "heavy = sorted({'torch', 'fastapi', 'transformers', 'uvicorn', 'vllm'} "
            "& set(sys.modules))\nprint('HEAVY', ','.join(heavy), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == config_reference.render()
    assert out.stderr.strip().splitlines()[-1] == "HEAVY"

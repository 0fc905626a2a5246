"""The plugin reference is complete (datasette's test_docs): every hook documents each of its
arguments, when and on which thread it is called, and an example that parses; the README names
every hook; the error tree drawn in ``errors.py`` is the tree the classes form."""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest

from tracerl.core import errors
from tracerl.events import hookspecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [name for name, fn in vars(hookspecs).items() if hasattr(fn, "tracerl_spec")]


def test_there_are_hooks_to_check() -> None:
    assert len(HOOKS) >= 10


@pytest.mark.parametrize("name", HOOKS)
def test_every_argument_of_every_hook_is_documented(name: str) -> None:
    fn = getattr(hookspecs, name)
    doc = inspect.getdoc(fn) or ""
    params = list(inspect.signature(fn).parameters)
    undocumented = [p for p in params
                    if not re.search(rf"^\s+{p} \(.+\): \S", doc, flags=re.MULTILINE)]
    assert undocumented == []
    if not params:
        assert "Arguments: none." in doc


@pytest.mark.parametrize("name", HOOKS)
def test_every_hook_says_when_and_where_it_runs_and_shows_an_example(name: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert re.search(r"^Called: \S", doc, flags=re.MULTILINE)
    example = doc.split("Example::", 1)[1] if "Example::" in doc else ""
    tree = ast.parse(textwrap.dedent(example))
    defined = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert defined == [name]


@pytest.mark.parametrize("name", HOOKS)
def test_the_readme_names_every_hook(name: str) -> None:
    readme = (ROOT / "README.md").read_text()
    assert name in readme


def test_the_error_tree_in_the_docstring_is_the_class_tree() -> None:
    drawn = {}
    for line in (errors.__doc__ or "").splitlines():
        match = re.match(r"^\s+([│├└─ ]*)(\w+Error)\b", line)
        if match:
            drawn[match.group(2)] = len(match.group(1))
    classes = {c.__name__: c for c in errors.error_classes().values()}
    classes |= {"EngineRequestError": errors.EngineRequestError, "RemoteError": errors.RemoteError}
    assert set(drawn) == set(classes)
    for name, cls in classes.items():
        parent = next(b for b in cls.__mro__[1:] if issubclass(b, errors.TracerlError)
                      or b is Exception)
        if parent is not Exception:
            assert drawn[parent.__name__] < drawn[name], name


def test_every_code_and_status_in_the_tree_is_the_class_attribute() -> None:
    for line in (errors.__doc__ or "").splitlines():
        match = re.match(r"^\s+[│├└─ ]*(\w+Error)\b.*?\s(\w+)\s+(\d{3})$", line)
        if match:
            cls = getattr(errors, match.group(1))
            assert (cls.code, cls.status) == (match.group(2), int(match.group(3))), line


def test_the_certified_harnesses_matrix_is_generated_from_the_last_results() -> None:
    from tests.conformance_matrix import README, RESULTS, render

    assert README.read_text() == render(README.read_text(), json.loads(RESULTS.read_text()))

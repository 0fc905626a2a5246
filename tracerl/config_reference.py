"""The configuration reference page, generated from the code that it describes.

``python -m tracerl.config_reference > docs/configuration.md`` writes every environment variable
(:mod:`tracerl.core.settings`), every field of the config models (:data:`CONFIG_MODELS`) and
every flag of every ``tracerl`` sub-command (the CLI's argparse parser), each with its type,
default and doc. ``tests/test_settings.py`` fails when the committed page differs from this
output, and when a variable, field or flag has no doc. It only reads: nothing is started.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .cli import build_parser
from .core import settings
from .core.config import (
    DistributedTrainerConfig,
    DynamicSampling,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    OnlineConfig,
    TrainConfig,
    TrainSFTConfig,
)
from .core.model_spec import ModelSpec

COMMAND = "python -m tracerl.config_reference > docs/configuration.md"
PAGE = Path("docs") / "configuration.md"

# the models a user fills in, in the order a reader meets them
CONFIG_MODELS: tuple[type[BaseModel], ...] = (
    TrainConfig, TrainSFTConfig, DynamicSampling, ModelConfig, LoraConfig, EngineConfig,
    DistributedTrainerConfig, ModelSpec, OnlineConfig)

_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "<="))


def _code(value: str) -> str:
    return f"`{value}`"


def _paragraph(doc: str | None) -> str:
    """A docstring as one paragraph per blank-line-separated block."""
    blocks = (doc or "").strip().split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in b.splitlines()) for b in blocks)


# --- environment variables -------------------------------------------------------------------

def _setting_default(setting: settings.Setting[Any]) -> str:
    value = setting.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return _code("1" if value else "0")
    if isinstance(value, tuple):
        return "empty" if not value else _code(",".join(value))
    if isinstance(value, float):
        return _code(f"{value:g}")
    return _code(str(value))


def environment_section() -> list[str]:
    out = ["## Environment variables", "",
           "Declared in `tracerl/core/settings.py`, the only module that reads them, when they "
           "are used (never at import). A value that is not of its type raises `ConfigError` "
           "naming the variable. An empty value counts as unset, except for strings; flags take "
           "`1` or `0`; lists are comma-separated."]
    groups: dict[str, list[settings.Setting[Any]]] = {}
    for setting in settings.SETTINGS.values():
        groups.setdefault(setting.group, []).append(setting)
    for group, members in groups.items():
        out += ["", f"### {group}", ""]
        out += [f"- **`{s.name}`** ({s.kind}, default {_setting_default(s)}): {s.doc}"
                for s in members]
    return out


# --- config models ---------------------------------------------------------------------------

def _annotation(model: type[BaseModel], name: str) -> str:
    """The field's type as written in the source (the modules use postponed annotations)."""
    for cls in model.__mro__:
        written = getattr(cls, "__annotations__", {}).get(name)
        if written is not None:
            return written if isinstance(written, str) else getattr(written, "__name__",
                                                                     str(written))
    return "Any"


def _field_default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return f"`{type(value).__name__}()`"
    return _code(repr(value))


def _field_notes(name: str, field: FieldInfo) -> list[str]:
    notes = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                notes.append(f"{sign} {getattr(meta, attr)}")
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        others = [a for a in alias.choices if isinstance(a, str) and a != name]
        notes += [f"also accepted as `{a}`" for a in others]
    return notes


def model_fields(model: type[BaseModel]) -> Iterator[tuple[str, FieldInfo]]:
    yield from model.model_fields.items()


def models_section() -> list[str]:
    out = ["## Config models", "",
           "Passed in code: `TrainConfig` to `model.train(...)`, `ModelConfig` (with `LoraConfig` "
           "and `EngineConfig`) to `TrainableModel(config=...)`, `DistributedTrainerConfig` to "
           "`LocalBackend(trainer=...)`. Unknown fields are refused."]
    for model in CONFIG_MODELS:
        out += ["", f"### `{model.__name__}`", "", _paragraph(model.__doc__), ""]
        for name, field in model_fields(model):
            facts = [_code(_annotation(model, name)), f"default {_field_default(field)}",
                     *_field_notes(name, field)]
            out.append(f"- **`{name}`** ({', '.join(facts)}): {field.description or ''}")
    return out


# --- the command line ------------------------------------------------------------------------

def _subcommands(parser: argparse.ArgumentParser
                 ) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each sub-command, in the order ``tracerl --help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def cli_arguments() -> Iterator[tuple[str, str | None, argparse.Action]]:
    """(sub-command, argument group title, argument) for every argument of every sub-command,
    ``--help`` left out."""
    for name, _, sub in _subcommands(build_parser()):
        for group in sub._action_groups:
            for action in group._group_actions:
                if not isinstance(action, argparse._HelpAction):
                    yield name, group.title, action


def _usage(action: argparse.Action) -> str:
    if not action.option_strings:
        name = str(action.metavar or action.dest)
        return f"[{name}]" if action.nargs == "?" else name
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    if action.choices is not None:
        return f"{flags} {{{','.join(map(str, action.choices))}}}"
    return f"{flags} {action.metavar or action.dest.upper()}"


def _argument_notes(action: argparse.Action) -> list[str]:
    notes = []
    if action.required:
        notes.append("required")
    if isinstance(action, argparse._AppendAction):
        notes.append("repeatable")
    default = action.default
    if action.nargs != 0 and default not in (None, [], argparse.SUPPRESS):
        notes.append(f"default `{default}`")
    return notes


def cli_section() -> list[str]:
    out = ["## Command line", "", "Every sub-command of `tracerl` (also `python -m tracerl`); "
           "`tracerl COMMAND --help` prints the same."]
    arguments = list(cli_arguments())
    for name, help_text, _ in _subcommands(build_parser()):
        out += ["", f"### `tracerl {name}`", "", help_text[:1].upper() + help_text[1:] + "."]
        if any(command == name for command, _, _ in arguments):
            out.append("")
        shown_group = None
        for command, group, action in arguments:
            if command != name:
                continue
            if group not in ("positional arguments", "options") and group != shown_group:
                out.append(f"- *{group}*:")
                shown_group = group
            indent = "  " if shown_group is not None else ""
            notes = _argument_notes(action)
            facts = f" ({', '.join(notes)})" if notes else ""
            out.append(f"{indent}- **`{_usage(action)}`**{facts}: {action.help or ''}")
    return out


def render() -> str:
    """The whole page."""
    lines = ["# Configuration reference", "",
             f"Generated from the code by `{COMMAND}`: do not edit by hand "
             "(`tests/test_settings.py` fails when this page and the code disagree).", "",
             "- [Environment variables](#environment-variables)",
             "- [Config models](#config-models)",
             "- [Command line](#command-line)", "",
             *environment_section(), "", *models_section(), "", *cli_section()]
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""BENCHMARKS.md's current numbers: one row per measure, each with its device, date and command.

A measure is a row's ``measure`` cell together with its device class, the first word of its
``device`` cell (``GPU``, then the card; or ``CPU``): two rows with one key are two "current"
numbers of one thing, and a reader cannot tell which is today's. The key is those two cells
exactly, so the test is exact: a new measurement of a measure copies the old row's ``measure``
cell and replaces the row (the old row moves to benchmarks/HISTORY.md). A ``(same command)``
row is of the run of the nearest row above that names its command: same date, same device.
Each checker is also run on a bad table, so that it is seen to fail."""

from __future__ import annotations

import datetime as dt
import re
from typing import NamedTuple

import pytest

from tests.test_docs import BENCHMARKS, current_numbers

COLUMNS = ["measure", "ratio/value", "peer", "device", "date", "command"]
DEVICE = re.compile(r"^(?P<kind>CPU|GPU)(?: (?P<card>\S.*))?$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
SAME_COMMAND = "(same command"
# the code state is no part of a measure: it belongs in the value or peer cell
CODE_STATE = re.compile(r"\d{4}-\d{2}-\d{2}|\bsession \d+|\bcommit\b", flags=re.IGNORECASE)


class Row(NamedTuple):
    measure: str
    value: str
    peer: str
    device: str
    date: str
    command: str


def cells(line: str) -> list[str]:
    """A table line's cells, stripped."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(table: str) -> list[Row]:
    """The rows under the table's header; a header or row of other columns raises ValueError."""
    lines = table.splitlines()
    if cells(lines[0]) != COLUMNS:
        raise ValueError(f"the columns are {cells(lines[0])}, not {COLUMNS}")
    rows = []
    for line in lines[2:]:
        row = cells(line)
        if len(row) != len(COLUMNS):
            raise ValueError(f"{len(row)} cells, not {len(COLUMNS)}: {line}")
        rows.append(Row(*row))
    return rows


def device_class(device: str) -> str | None:
    """``GPU`` or ``CPU`` for a well-formed device cell (a GPU names its card), else None."""
    match = DEVICE.match(device)
    if not match or (match["kind"] == "GPU" and not match["card"]):
        return None
    return match["kind"]


def is_date(text: str) -> bool:
    """Whether ``text`` is a real day written YYYY-MM-DD."""
    try:
        return bool(DATE.match(text)) and bool(dt.date.fromisoformat(text))
    except ValueError:
        return False


def duplicate_measures(rows: list[Row]) -> list[str]:
    """Every measure (``measure`` cell, device class) that has more than one row."""
    seen: dict[tuple[str, str | None], int] = {}
    for row in rows:
        key = (row.measure, device_class(row.device))
        seen[key] = seen.get(key, 0) + 1
    return [f"{measure} [{kind}]" for (measure, kind), n in seen.items() if n > 1]


def row_problems(rows: list[Row]) -> list[str]:
    """What each row lacks: a measure free of code state, a value, a device, a real date, and a
    command (in backticks, a link, or the same run's ``(same command)``)."""
    problems, run = [], None
    for row in rows:
        name = row.measure or "(no measure)"
        if not row.measure or CODE_STATE.search(row.measure):
            problems.append(f"{name}: the measure cell is empty or names a code state")
        if not row.value:
            problems.append(f"{name}: no value")
        if device_class(row.device) is None:
            problems.append(f"{name}: device {row.device!r} is not 'CPU' or 'GPU <card>'")
        if not is_date(row.date):
            problems.append(f"{name}: date {row.date!r} is not YYYY-MM-DD")
        if row.command.startswith(SAME_COMMAND):
            if run is None or (run.date, run.device) != (row.date, row.device):
                problems.append(f"{name}: '(same command)' but the row above with a command is "
                                "of another run (date or device)")
        elif "`" in row.command or "](" in row.command:
            run = row
        else:
            problems.append(f"{name}: no command (in backticks, a link or '(same command)')")
    return problems


def stray_table_lines(text: str) -> list[str]:
    """The ``|`` lines of the current-numbers section that are not in its one table (a row
    written after the prose below the table is no row of it)."""
    section = text.split("\n## Current numbers\n", 1)[1].split("\n## ", 1)[0].splitlines()
    end = next((i for i, line in enumerate(section) if line.startswith("|")), len(section))
    while end < len(section) and section[end].startswith("|"):
        end += 1
    return [line for line in section[end:] if line.startswith("|")]


def test_the_current_numbers_have_one_row_per_measure() -> None:
    rows = parse(current_numbers(BENCHMARKS.read_text()))
    assert len(rows) >= 10
    assert duplicate_measures(rows) == []


def test_every_current_row_has_a_device_a_date_and_a_command() -> None:
    assert row_problems(parse(current_numbers(BENCHMARKS.read_text()))) == []


def test_the_current_numbers_are_one_table() -> None:
    assert stray_table_lines(BENCHMARKS.read_text()) == []


def test_the_checkers_fail_on_a_bad_table() -> None:
    head = "| measure | ratio/value | peer | device | date | command |\n|---|---|---|---|---|---|\n"
    bad = parse(head +
                "| tok/s, c64 | 0.92 | vLLM | GPU H200 | 2026-12-04 | `run c64` |\n"
                "| tok/s, c64 | 0.91 | vLLM | GPU H100 | 2026-12-05 | `run c64` |\n"
                "| tok/s, c64 | 1.01 | vLLM | CPU | 2026-12-02 | `cpu run` |\n"
                "| tok/s, c256 | 0.90 | vLLM | CPU | 2026-12-03 | (same command) |\n"
                "| tok/s after commit abc1234, c8 | 0.90 | vLLM | H200 | 2026-13-01 |  |\n"
                "| latency, c1 |  | direct | GPU | 12/05 | see the section |\n"
                "| memory | 1 GiB | - | CPU | 2026-12-05 | [method](HISTORY.md#memory) |\n")
    assert duplicate_measures(bad) == ["tok/s, c64 [GPU]"]
    assert row_problems(bad) == [
        "tok/s, c256: '(same command)' but the row above with a command is of another run "
        "(date or device)",
        "tok/s after commit abc1234, c8: the measure cell is empty or names a code state",
        "tok/s after commit abc1234, c8: device 'H200' is not 'CPU' or 'GPU <card>'",
        "tok/s after commit abc1234, c8: date '2026-13-01' is not YYYY-MM-DD",
        "tok/s after commit abc1234, c8: no command (in backticks, a link or '(same command)')",
        "latency, c1: no value",
        "latency, c1: device 'GPU' is not 'CPU' or 'GPU <card>'",
        "latency, c1: date '12/05' is not YYYY-MM-DD",
        "latency, c1: no command (in backticks, a link or '(same command)')"]
    with pytest.raises(ValueError, match="2 cells, not 6"):
        parse(head + "| one | two |\n")
    row_a, row_b = ("| a | 1 | p | CPU | 2026-12-05 | `x` |",
                    "| b | 2 | p | CPU | 2026-12-05 | `y` |")
    text = f"# Page\n## Current numbers\n\n{head}{row_a}\n\nNot yet.\n{row_b}\n\n## Next\n| c |\n"
    assert stray_table_lines(text) == [row_b]

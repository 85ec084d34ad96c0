"""The layering rules of docs/design.md ("Layout: where a change goes") hold for the code: every import of one
terapipe_cli package by another is one the rule table allows, or one of the named exceptions, of the kind it names.

The rules are read from design.md itself, so the document and the check cannot drift apart. Imports are found with
`ast`, not by importing anything: the check needs neither torch nor the optional packages, and it sees every import —
at module level, inside functions (a lazy import is still a dependency: it runs when the function does) and under
``if TYPE_CHECKING:`` (a type-only import is what a reader follows, and one edit turns it into a real one)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from conftest import ROOT

DESIGN = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "src" / "terapipe_cli"
ROOT_NAME = "terapipe_cli"  # the root package's own __init__.py: `__version__`, `load_exported`
LAYER_HEADER = "| layer | package | may import |"
EXCEPTION_HEADER = "| from | to | how | why |"
KINDS = {"at import", "in a function", "type-only"}
NAME = re.compile(r"`([\w.]+)`")


@dataclass(frozen=True)
class Rules:
    layer: dict[str, int]  # package -> its layer; 0 is the foundation
    row: dict[str, int]  # package -> its row in the table, top first
    allowed: dict[str, frozenset[str]]  # package -> the packages its row names (the foundation added above layer 0)
    exceptions: dict[tuple[str, str], str]  # (from, to) -> how it imports: "in a function" or "type-only"


@dataclass(frozen=True)
class Import:
    where: str  # "plan/search.py:12"
    source: str  # the importing package
    target: str  # the imported package
    kind: str  # "at import", "in a function" or "type-only"


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of the Markdown table that starts with ``header`` (its separator row left out)."""
    lines = text.splitlines()
    start = next((n for n, line in enumerate(lines) if line.strip() == header), None)
    assert start is not None, f"design.md has no table headed {header!r}"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def parse_rules(text: str) -> Rules:
    """The layer table and the exception table of design.md. The foundation is layer 0: a package above it may
    import every foundation module; a foundation module only what its row names. Every name a row may import must
    sit in a lower layer (or, in the foundation, in an earlier row), so the table cannot describe a cycle."""
    layer: dict[str, int] = {}
    row: dict[str, int] = {}
    named: dict[str, set[str]] = {}
    for n, (level, packages, may) in enumerate(_table(text, LAYER_HEADER)):
        number = 0 if level == "foundation" else int(level)
        targets = set(NAME.findall(may))
        for package in NAME.findall(packages):
            assert package not in layer, f"design.md's layer table names {package!r} twice"
            layer[package], row[package], named[package] = number, n, targets
    foundation = {p for p, n in layer.items() if n == 0}
    for package, targets in named.items():
        for target in targets:
            assert target in layer, f"the layer table lets {package!r} import {target!r}, which it does not list"
            earlier = layer[target] == layer[package] == 0 and row[target] < row[package]
            lower = layer[target] < layer[package] or earlier
            assert lower, f"the layer table lets {package!r} import {target!r}, which is not below it"
    allowed = {p: frozenset(t | (foundation if layer[p] > 0 else set())) for p, t in named.items()}
    exceptions = {}
    for source, target, how, _why in _table(text, EXCEPTION_HEADER):
        (source,), (target,) = NAME.findall(source), NAME.findall(target)
        assert how in KINDS - {"at import"}, f"the exception {source} -> {target} says {how!r}"
        exceptions[(source, target)] = how
    return Rules(layer, row, allowed, exceptions)


def package_of(relative: str) -> str:
    """The package a file belongs to: its first folder, or the module's name for a top-level module."""
    parts = Path(relative).with_suffix("").parts
    if len(parts) > 1:
        return parts[0]
    return ROOT_NAME if parts[0] == "__init__" else parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(relative: str, source: str, packages: set[str]) -> list[Import]:
    """Every import of another terapipe_cli package in one file (``relative`` to src/terapipe_cli), with its kind.
    ``from terapipe_cli import x`` imports package x when x is one, else the root package (``__version__``)."""
    here = package_of(relative)
    module = [ROOT_NAME, *Path(relative).with_suffix("").parts]
    found: list[Import] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if node.level:  # relative: from the file's own package upwards
            base = module[: len(module) - node.level]  # plan/search.py and plan/__init__.py alike: plan for "."
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        if name == ROOT_NAME:
            return [f"{ROOT_NAME}.{a.name}" for a in node.names]
        return [name]

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in targets(child):
                    parts = name.split(".")
                    if parts[0] != ROOT_NAME:
                        continue
                    target = parts[1] if len(parts) > 1 and parts[1] in packages else ROOT_NAME
                    if target != here:
                        found.append(Import(f"{relative}:{child.lineno}", here, target, kind))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    visit(ast.Module(body=[statement], type_ignores=[]), "type-only")
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]), kind)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "type-only" if kind == "type-only" else "in a function")
            else:
                visit(child, kind)

    for tree in _parsed(source, relative):
        visit(tree, "at import")
    return found


# A line that may import a terapipe_cli package: absolute or relative. Docstrings are skipped by `_parsed`.
CANDIDATE = re.compile(r"^[ \t]*(?:from[ \t]+(?:terapipe_cli\b|\.)|import[ \t]+terapipe_cli\b)")
TRIPLE_QUOTED = re.compile(r"(\"\"\"|\'\'\').*?\1", re.S)


def _parsed(source: str, relative: str) -> list[ast.Module]:
    """The syntax trees of the top-level statements that may hold an import of terapipe_cli (a whole function, a
    whole ``if TYPE_CHECKING:`` block), line numbers as in the file. Parsing only those keeps the scan well under a
    second (the whole tree of src/ takes seconds to parse); a top-level statement is a line that starts at column 0
    outside a triple-quoted string, with its decorators. Where a piece does not parse, the whole file is parsed."""
    lines = source.splitlines(keepends=True)
    inside = set()  # lines that continue a triple-quoted string
    for m in TRIPLE_QUOTED.finditer(source):
        first, last = source.count("\n", 0, m.start()), source.count("\n", 0, m.end())
        inside.update(range(first + 1, last + 1))
    starts = [n for n, line in enumerate(lines) if n not in inside and line[:1] not in " \t\r\n#)]}"]
    starts = [n for k, n in enumerate(starts) if k == 0 or not lines[starts[k - 1]].startswith("@")]
    trees = []
    for begin, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        if not any(n not in inside and CANDIDATE.match(lines[n]) for n in range(begin, end)):
            continue
        try:
            tree = ast.parse("".join(lines[begin:end]), filename=relative)
        except SyntaxError:
            return [ast.parse(source, filename=relative)]
        trees.append(ast.increment_lineno(tree, begin))
    return trees


def violations(rules: Rules, found: list[Import]) -> list[str]:
    """One line per import the rules do not allow: a package or an arrow the table lacks, or a named exception
    imported otherwise than as it says (a type-only exception imported at run time, a lazy one at import)."""
    bad = []
    for imp in found:
        if imp.source not in rules.allowed:
            bad.append(f"{imp.where}: package {imp.source!r} has no row in the layer table")
        elif imp.target in rules.allowed[imp.source]:
            continue
        elif (imp.source, imp.target) in rules.exceptions:
            how = rules.exceptions[(imp.source, imp.target)]
            allowed = {"type-only"} if how == "type-only" else {"type-only", "in a function"}
            if imp.kind not in allowed:
                bad.append(f"{imp.where}: {imp.source} -> {imp.target} {imp.kind}, an exception only {how}")
        else:
            bad.append(f"{imp.where}: {imp.source} -> {imp.target} ({imp.kind}) is not allowed by the layer table")
    return bad


def actual_packages() -> set[str]:
    """The packages (folders with an __init__.py) and top-level modules of src/terapipe_cli, and the root itself."""
    names = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    names |= {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    return names | {ROOT_NAME}


@cache
def _code() -> tuple[Import, ...]:
    packages = actual_packages()
    return tuple(
        imp
        for path in sorted(PACKAGE.rglob("*.py"))
        for imp in imports(path.relative_to(PACKAGE).as_posix(), path.read_text(), packages)
    )


@cache
def _rules() -> Rules:
    return parse_rules(DESIGN.read_text())


def test_every_import_is_allowed():
    bad = violations(_rules(), list(_code()))
    assert not bad, "imports the layering rules of docs/design.md do not allow:\n" + "\n".join(bad)


def test_the_rules_name_every_package_and_only_those():
    named, actual = set(_rules().layer), actual_packages()
    assert not named - actual, f"design.md's layer table names packages that do not exist: {sorted(named - actual)}"
    assert not actual - named, f"packages without a row in design.md's layer table: {sorted(actual - named)}"
    for source, target in _rules().exceptions:
        assert {source, target} <= actual, f"the exception {source} -> {target} names a package that does not exist"


def test_every_exception_is_still_needed():
    """An exception the code no longer uses is removed from the table, so the list stays the true one."""
    used = {(imp.source, imp.target) for imp in _code()}
    for source, target in _rules().exceptions:
        assert (source, target) in used, f"the exception {source} -> {target} is no longer used: remove it"
        assert target not in _rules().allowed[source], f"{source} -> {target} is both allowed and an exception"


RULES = """
| layer | package | may import |
|---|---|---|
| foundation | `errors` | — |
| foundation | `files` | `errors` |
| 1 | `config` | — |
| 2 | `plan` | `config` |
| 3 | `engine` | `plan` |

| from | to | how | why |
|---|---|---|---|
| `config` | `engine` | type-only | for the test |
"""

FAKE = {
    "plan/search.py": "import numpy\nfrom terapipe_cli.engine import stage\nfrom terapipe_cli.files import x\n",
    "config/run.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from terapipe_cli.engine.model import GPT\n"
        "def f():\n    import terapipe_cli.engine.data\n"
    ),
    "engine/stage.py": "from . import model\nfrom ..plan import schedule\nfrom terapipe_cli import errors\n",
    "plan/doc.py": '"""A docstring that shows:\nfrom terapipe_cli.engine import stage\n"""\n',
}


def test_the_checker_reports_what_the_rules_forbid():
    """The negative control: on a small made-up tree the checker names each forbidden import by file and line —
    an upward import, a type-only exception imported at run time — and passes the allowed ones (relative imports
    resolved, the foundation open to all, the type-only import under TYPE_CHECKING, an import in a docstring)."""
    rules = parse_rules(RULES)
    packages = {"errors", "files", "config", "plan", "engine", ROOT_NAME}
    found = [imp for path, text in FAKE.items() for imp in imports(path, text, packages)]
    assert violations(rules, found) == [
        "plan/search.py:2: plan -> engine (at import) is not allowed by the layer table",
        "config/run.py:5: config -> engine in a function, an exception only type-only",
    ]


def test_the_rule_parser_refuses_a_cycle_and_an_unknown_name():
    upward = RULES.replace("| 2 | `plan` | `config` |", "| 2 | `plan` | `engine` |")
    unknown = RULES.replace("| 2 | `plan` | `config` |", "| 2 | `plan` | `nowhere` |")
    for text, says in ((upward, "not below it"), (unknown, "does not list")):
        try:
            parse_rules(text)
        except AssertionError as e:
            assert says in str(e)
        else:
            raise AssertionError(f"parse_rules accepted {says!r}")

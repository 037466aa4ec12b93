"""docs/reliability.md stays true: every promise names at least one test, and every test it names exists."""

from __future__ import annotations

import ast
import re

from scripts import module_tree
from scripts.stack import ROOT

RELIABILITY = ROOT / "docs" / "reliability.md"


def promised_rows() -> list[str]:
    text = RELIABILITY.read_text()
    section = text.split("## Promised", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| promise")]


def named_tests() -> dict[str, set[str]]:
    """Every tests/**/test_*.py by its file name and its path under tests/, with its test functions."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names = {n.name for n in ast.parse(path.read_text()).body
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
        for key in (path.name, str(path.relative_to(ROOT)), str(path.relative_to(ROOT / "tests"))):
            found.setdefault(key, set()).update(names)
    return found


def test_every_promise_names_a_test_and_every_named_test_exists() -> None:
    rows = promised_rows()
    assert len(rows) > 20, "the Promised table was not found"
    functions = named_tests()
    for row in rows:
        promise, proof = row.split(" | ")[0].lstrip("| "), row.split(" | ")[-1]
        files = re.findall(r"`((?:tests/)?[\w/]*test_\w+\.py)(?:::(test_\w+))?`", proof)
        bare = re.findall(r"(?<![\w:])`(test_\w+)`", proof)  # functions listed after "file.py:"
        assert files, f"{promise!r} names no test file: {proof}"
        for file, function in files:
            assert file in functions, f"{promise!r} names {file}, which does not exist"
            if function:
                assert function in functions[file], f"{promise!r} names {file}::{function}, which does not exist"
        everything = set().union(*(functions[f] for f, _ in files))
        for function in bare:
            assert function in everything, f"{promise!r} names {function}, not in {sorted({f for f, _ in files})}"


def test_the_module_tree_in_architecture_md_is_current() -> None:
    """docs/architecture.md's module tree is what scripts/module_tree.py makes of the modules' first docstring
    lines today: a module added, moved or described anew without `make docs` fails here."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert module_tree.written(doc) == module_tree.tree(), "the module tree is stale: run `make docs`"


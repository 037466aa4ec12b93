"""The tree's promises, checked: layers import only downward, the API process and the client never load
TensorFlow, and every module is small and says its one concern in its first line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.stack import ROOT

MODULES = sorted(p for top in ("app", "worker", "mpjobs") for p in (ROOT / top).rglob("*.py"))
MAX_LINES = 310
"""About 300 lines: a module longer than this does more than one thing."""
ALLOWED = {
    "app.core": {"app.core"},
    "app.store": {"app.core", "app.store"},
    "app.api": {"app.core", "app.store", "app.api"},
    "mpjobs.cli": {"app.core", "mpjobs.cli", "mpjobs"},
    "app.main": {"app.core", "app.store", "app.api"},
    "worker": {"app.core", "app.store", "worker"},
    "mpjobs": {"app.core", "mpjobs"},
}
"""What each layer may import from the project: the shared core below everything, the store above it,
the API and the CLI beside each other, the worker never the API; the Python client (`mpjobs`) on the core
alone, and the CLI on the client."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module not in ("app", "app.api", "app.store", "app.core") else [
                f"{node.module}.{a.name}" for a in node.names]
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name.split(".")[0] in ("app", "worker", "mpjobs")}


def layer(name: str) -> str:
    return next(prefix for prefix in sorted(ALLOWED, key=len, reverse=True)
                if name == prefix or name.startswith(prefix + "."))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_imports_only_from_the_layers_below_it(path: Path) -> None:
    name = module_name(path)
    if name in ("app",):
        return
    allowed = ALLOWED[layer(name)]
    wrong = sorted(i for i in project_imports(path) if not any(i == a or i.startswith(a + ".") for a in allowed))
    assert not wrong, f"{name} ({layer(name)}) imports {wrong}; it may import from {sorted(allowed)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_is_small_and_opens_with_its_concern(path: Path) -> None:
    text = path.read_text()
    docstring = ast.get_docstring(ast.parse(text))
    assert docstring, f"{path.relative_to(ROOT)} has no module docstring"
    assert text.startswith('"""') and len(docstring.splitlines()[0]) <= 116
    assert len(text.splitlines()) <= MAX_LINES, f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines"


def test_the_api_process_loads_no_tensorflow_keras_or_worker_module() -> None:
    check = ("import sys, app.main, mpjobs.cli; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'keras', 'jax', 'worker'}))")
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

"""The tree's promises, checked: layers import only downward, only the store spells Redis keys, the API process and
the client never load TensorFlow, and every module is small and says its one concern in its first line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.stack import ROOT

MODULES = sorted(p for top in ("app", "worker", "mpjobs") for p in (ROOT / top).rglob("*.py"))
MAX_LINES = 310
"""About 300 lines: a module longer than this does more than one thing (a sign to look, never a reason to cut)."""
ALLOWED = {
    "mpjobs.contract": {"mpjobs.contract"},
    "mpjobs.cli": {"mpjobs.cli", "mpjobs.contract", "mpjobs"},
    "mpjobs": {"mpjobs"},
    "app.core": {"app.core", "mpjobs.contract"},
    "app.store": {"app.core", "app.store", "mpjobs.contract"},
    "app.api": {"app.core", "app.store", "app.api", "mpjobs.contract"},
    "app.main": {"app.core", "app.store", "app.api", "mpjobs.contract"},
    "worker": {"app.core", "app.store", "worker", "mpjobs.contract"},
}
"""What each layer may import from the project. The wire contract (`mpjobs.contract`) lies below everything; the
client (`mpjobs`) is built on it alone and never imports the API, the store or the worker; the command
(`mpjobs.cli`) only on the client's public face (`from mpjobs import ...`) and the contract; the server's core
above the contract, the store above the core, the API above the store; the worker never the API."""
KEYS = "app.store.keys"
"""Where every Redis key is spelled: only the store may import it."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def project_imports(path: Path) -> set[str]:
    """Every project module `path` imports: `from a.b import c` counts as a.b.c when c is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                         for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name.split(".")[0] in ("app", "worker", "mpjobs")}


def layer(name: str) -> str:
    return next(prefix for prefix in sorted(ALLOWED, key=len, reverse=True)
                if name == prefix or name.startswith(prefix + "."))


def allowed(importer: str, imported: str) -> bool:
    if layer(importer) == "mpjobs.cli" and imported.startswith("mpjobs.") and layer(imported) == "mpjobs":
        return False  # the command uses the client's public face only: `from mpjobs import Client`
    return any(imported == a or imported.startswith(a + ".") for a in ALLOWED[layer(importer)])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_imports_only_from_the_layers_below_it(path: Path) -> None:
    name = module_name(path)
    if name in ("app",):
        return
    wrong = sorted(i for i in project_imports(path) if not allowed(name, i))
    assert not wrong, f"{name} ({layer(name)}) imports {wrong}; it may import from {sorted(ALLOWED[layer(name)])}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_store_spells_redis_keys(path: Path) -> None:
    name = module_name(path)
    if name.startswith("app.store"):
        return
    assert KEYS not in project_imports(path), f"{name} imports {KEYS}: read and write through the store's classes"


def test_the_layer_rules_catch_what_they_forbid() -> None:
    """The rules themselves, on imports they must refuse: a check that could never fail would prove nothing."""
    assert not allowed("mpjobs._client", "app.store.jobs")
    assert not allowed("mpjobs.contract.spec", "mpjobs._client")
    assert not allowed("mpjobs.cli.commands", "mpjobs._stream")
    assert allowed("mpjobs.cli.commands", "mpjobs")
    assert not allowed("worker.engine.training", "app.api.services")
    assert not allowed("app.store.jobs", "app.api.deps")
    assert allowed("app.api.sse", "app.store.streams")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_is_small_and_opens_with_its_concern(path: Path) -> None:
    text = path.read_text()
    docstring = ast.get_docstring(ast.parse(text))
    assert docstring, f"{path.relative_to(ROOT)} has no module docstring"
    assert text.startswith('"""') and len(docstring.splitlines()[0]) <= 116
    assert len(text.splitlines()) <= MAX_LINES, f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines"


@pytest.mark.processes
def test_the_api_process_loads_no_tensorflow_keras_or_worker_module() -> None:
    check = ("import sys, app.main, mpjobs.cli; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'keras', 'jax', 'worker'}))")
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.processes
def test_the_client_and_its_command_load_nothing_of_the_server() -> None:
    check = ("import sys, mpjobs, mpjobs.cli; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'app', 'worker', 'fastapi', 'rq', 'redis', "
             "'pyarrow', 'tensorflow', 'keras', 'uvicorn', 'pydantic_settings'}))")
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

"""The client installs alone: `pip install .` into a fresh virtualenv gives `mpjobs` and its command, and nothing
of the server (FastAPI, RQ, Redis, pyarrow, TensorFlow), nor an `app` or `worker` package."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.stack import ROOT

SERVER_DISTRIBUTIONS = {"fastapi", "starlette", "uvicorn", "rq", "redis", "hiredis", "pyarrow", "tensorflow",
                        "tensorflow-cpu", "keras", "tensorboard", "pydantic-settings", "prometheus-client", "numpy"}
"""What the API and the worker need and the client must not pull in."""
SERVER_MODULES = {"app", "worker", "fastapi", "starlette", "uvicorn", "rq", "redis", "pyarrow", "tensorflow", "keras",
                  "pydantic_settings", "numpy"}


def run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the base install from a copy of what the distribution is built from, so that
    nothing else in the checkout can leak into it."""
    home = tmp_path_factory.mktemp("client-install")
    source = home / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "mpjobs", source / "mpjobs", ignore=shutil.ignore_patterns("__pycache__"))
    venv = home / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=home)
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", source, cwd=home)
    return venv


def test_the_base_install_is_the_client_and_nothing_of_the_server(client_venv: Path) -> None:
    listed = run(client_venv / "bin" / "python", "-m", "pip", "list", "--format=json", cwd=client_venv)
    installed = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
    assert {"mpjobs", "httpx", "pydantic"} <= installed
    assert not installed & SERVER_DISTRIBUTIONS, f"the client pulled in {sorted(installed & SERVER_DISTRIBUTIONS)}"


def test_the_client_imports_and_loads_nothing_of_the_server(client_venv: Path) -> None:
    check = ("import sys\n"
             "from mpjobs import Client, Job, Comparison\n"
             "import mpjobs.cli, mpjobs.contract.spec\n"
             "print(Client.__module__)\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(SERVER_MODULES)!r})))\n")
    out = run(client_venv / "bin" / "python", "-c", check, cwd=client_venv)
    assert out.stdout.split() == ["mpjobs._client", "[]"]


def test_no_app_or_worker_package_is_installed(client_venv: Path) -> None:
    """A user's own `app` or `worker` never meets ours: neither is importable from the virtualenv."""
    check = "import importlib.util as u; print(u.find_spec('app'), u.find_spec('worker'))"
    out = run(client_venv / "bin" / "python", "-c", check, cwd=client_venv)
    assert out.stdout.split() == ["None", "None"]


def test_the_command_runs(client_venv: Path) -> None:
    out = run(client_venv / "bin" / "mpjobs", "--help", cwd=client_venv)
    assert out.stdout.startswith("usage: mpjobs")
    for command in ("submit", "compare", "metrics", "layers"):
        assert command in out.stdout

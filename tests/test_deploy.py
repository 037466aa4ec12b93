"""Docker has no engine here, so the deploy files are checked by parsing them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts.stack import ROOT


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_redis_keeps_every_job() -> None:
    redis = compose()["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    assert "--maxmemory ${REDIS_MAXMEMORY:-2gb}" in command, "a bounded Redis: the API refuses new jobs near it"
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_api_waits_for_healthy_redis() -> None:
    api = compose()["services"]["api"]
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    assert api["build"]["target"] == "api"
    assert api["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert api["environment"]["API_KEYS"].startswith("${API_KEYS:?"), "a published API must require keys"


def test_gpu_worker_takes_every_gpu_is_restarted_and_shares_artifacts() -> None:
    services = compose()["services"]
    worker = services["worker"]
    (devices,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices["driver"] == "nvidia" and "gpu" in devices["capabilities"]
    assert devices["count"] == "all", "one worker, a job slot per GPU: replicas would all get the same GPU"
    assert worker["restart"] == "unless-stopped"
    assert worker["environment"]["WORKER_GPUS"] == "${WORKER_GPUS:-all}"
    shared = {v.split(":")[0] for v in worker["volumes"]} & {v.split(":")[0] for v in services["api"]["volumes"]}
    assert "artifacts" in shared
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"


def test_cpu_worker_is_an_optional_profile() -> None:
    cpu = compose()["services"]["cpu-worker"]
    assert cpu["profiles"] == ["cpu"]
    assert cpu["build"]["args"]["EXTRAS"] == "worker"
    assert cpu["restart"] == "unless-stopped" and cpu["environment"]["HOST_GPUS"] == "none"


def test_no_advice_to_scale_the_gpu_worker_is_left() -> None:
    """`--scale worker=N` gives every replica the same GPU (docker/compose#11863): the docs say
    how to use part of a host instead."""
    for path in ("docker-compose.yml", "README.md", "docs/architecture.md", "docs/reliability.md"):
        text = (ROOT / path).read_text()
        assert not re.search(r"--scale\b|\bscale worker", text), f"{path} still advises scaling the worker"
    readme = (ROOT / "README.md").read_text()
    assert "WORKER_GPUS=0,1" in readme and "device_ids" in readme


def test_dockerfile_api_image_has_no_tensorflow() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, flags=re.M | re.S))
    assert set(stages) == {"base", "api", "worker", "tensorboard"}
    assert 'pip install ".[api]"' in stages["api"], "the API image: the client package with the API's extra alone"
    assert 'pip install ".[${EXTRAS}]"' in stages["worker"] and "ARG EXTRAS=worker-gpu" in stages["worker"]
    assert "ENV PYTHONPATH=/srv" in stages["base"], "app/ and worker/ run from the image's checkout, not site-packages"


def test_tensorboard_is_an_optional_loopback_profile_over_the_artifacts() -> None:
    board = compose()["services"]["tensorboard"]
    assert board["profiles"] == ["tensorboard"] and board["build"]["target"] == "tensorboard"
    assert board["volumes"] == ["artifacts:/data/artifacts:ro"]
    assert board["ports"] == ["127.0.0.1:6006:6006"], "it shows every tenant's runs: loopback only"
    dockerfile = (ROOT / "Dockerfile").read_text()
    pinned = re.search(r'"(tensorboard==[\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned and f"pip install --no-cache-dir {pinned.group(1)}" in dockerfile
    assert '"--logdir", "/data/artifacts"' in dockerfile


def test_env_example_lists_every_setting() -> None:
    from app.core.config import Settings

    listed = {line.split("=")[0] for line in (ROOT / ".env.example").read_text().splitlines()
              if line and not line.startswith("#")}
    run_stack = {"PORT", "HOST", "REDIS_PORT"}  # read by scripts/run-stack.sh only
    assert listed == {name.upper() for name in Settings.model_fields} | run_stack
    script = (ROOT / "scripts/run-stack.sh").read_text()
    assert all(f"${{{name}:-" in script for name in run_stack)


@pytest.mark.processes
def test_the_wheel_is_the_client_alone_and_builds_quietly(tmp_path: Path) -> None:
    """`pip install .` installs `mpjobs` (the client, its command and the wire contract) and nothing else: no
    `app`, `worker`, `tests`, `bench` or `scripts` package lands in a user's site-packages, and setuptools
    prints no "Package would be ignored"."""
    import subprocess
    import sys
    import zipfile

    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert "would be ignored" not in built.stdout + built.stderr
    [wheel] = tmp_path.glob("mpjobs-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"mpjobs"}, f"the wheel installs {sorted(tops)}"
    wanted = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mpjobs").rglob("*.py")}
    assert wanted <= names, f"missing from the wheel: {sorted(wanted - names)}"

"""`make run`'s script starts Redis, the API and a worker, prints the curl, and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.service.conftest import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]


def test_run_stack_starts_everything_and_prints_the_curl(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(PORT=str(port), PY=str(ROOT / ".venv/bin/python"), TF_CPP_MIN_LOG_LEVEL="2")
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        process = subprocess.Popen([str(ROOT / "scripts/run-stack.sh")], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: "curl -N" in log.read_text(), 120, "the ready message")
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz").json()
        assert ready["status"] == "ok" and ready["workers"]["cpu"] == 1
        text = log.read_text()
        assert "local redis-server at redis://127.0.0.1:" in text
        assert "-d @examples/mlp_mixed_float16.json" in text
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
    time.sleep(0.5)
    try:
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        raise AssertionError("the API still answers after the stack was stopped")
    except httpx.ConnectError:
        pass

"""A worker started before Redis waits for it, saying so, then takes jobs; Redis stopped under the idle worker, it waits
again and takes the next job once Redis is back. It never exits on its own; SIGTERM ends its wait."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from scripts.stack import RedisServer, Stack, wait_until

SPEC = {"model": {"name": "mlp"}, "training": {"steps": 5}, "dataset": {"samples": 64}}
WAITING = "waiting for redis at"


def said(stack: Stack, worker: subprocess.Popen[bytes], words: str, times: int = 1) -> bool:
    """Whether the worker's log holds `words` `times` times; raises once the worker has exited."""
    assert worker.poll() is None, f"the worker exited with code {worker.returncode}"
    return log_of(stack, worker).count(words) >= times


def log_of(stack: Stack, worker: subprocess.Popen[bytes]) -> str:
    return (stack.logs / f"worker{stack.workers.index(worker)}.log").read_text(errors="replace")


def run_one(stack: Stack, client: httpx.Client) -> None:
    job_id = client.post("/jobs", json=SPEC).json()["id"]
    done = stack.wait_for_state(client, job_id, {"succeeded", "failed", "canceled"})
    assert done["state"] == "succeeded", done["error"]


@pytest.mark.slow
def test_a_worker_started_before_redis_waits_for_it_and_again_after_a_drop(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")  # not started yet
    stack = Stack(server, tmp_path / "stack")
    try:
        worker, stopped = stack.start_worker(registered=False), stack.start_worker(registered=False)
        wait_until(lambda: said(stack, worker, f"{WAITING} {server.url}"), 120, "the worker to wait for redis")
        wait_until(lambda: said(stack, stopped, WAITING), 120, "the other worker to wait for redis")
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(30) == 0 and "stopped while waiting for redis" in log_of(stack, stopped)
        server.start()
        stack.wait_registered(worker)
        stack.start_api()
        with stack.client() as client:
            run_one(stack, client)
            server.stop()  # under the idle worker, blocked in its dequeue
            wait_until(lambda: said(stack, worker, WAITING, times=2), 60, "the worker to wait for redis again")
            server.start()
            run_one(stack, client)
        assert worker.poll() is None
    finally:
        stack.stop()
        server.stop()

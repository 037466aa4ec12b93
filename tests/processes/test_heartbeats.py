"""RQ heartbeats during a long job (docs/reliability.md): TrainingWorker, a SimpleWorker, runs RQ's
`maintain_heartbeats` on a thread of its own, so RQ never takes a long job's worker, or the job, for dead."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from rq import Worker
from rq.registry import StartedJobRegistry

from scripts.stack import private_stack, wait_until

HEARTBEAT_INTERVAL_S = 0.5
LONG_JOB = {"model": {"name": "mlp"}, "precision_policy": "float32", "dataset": {"samples": 64},
            "training": {"steps": 100_000}}
"""A tiny model with more steps than any machine trains while this test looks: it is canceled at the end."""


def advances(read: Callable[[], Any], count: int) -> Callable[[], bool]:
    """A check for wait_until: true once `read()` has taken `count` new values, each above the last."""
    seen = [read()]

    def check() -> bool:
        value = read()
        assert value is not None
        if value != seen[-1]:
            assert value > seen[-1], f"went back from {seen[-1]} to {value}"
            seen.append(value)
        return len(seen) > count

    return check


def test_long_job_keeps_the_worker_s_heartbeat_and_its_started_registry_entry_alive(tmp_path: Path) -> None:
    with private_stack(tmp_path, HEARTBEAT_INTERVAL_S=str(HEARTBEAT_INTERVAL_S)) as stack, stack.client() as client:
        raw, text = redis.Redis.from_url(stack.redis.url), stack.redis.client()  # RQ wants bytes replies
        response = client.post("/jobs", json=LONG_JOB)
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        try:
            # Past step 1, the job is inside perform_job: RQ's own per-job heartbeat (at its start) is behind us.
            job = wait_until(lambda: (j := client.get(f"/jobs/{job_id}").json())["progress"]["step"] >= 1 and j,
                             120, "the job to run", interval=0.1)
            assert job["state"] == "running"
            worker_key = f"{Worker.redis_worker_namespace_prefix}{job['worker']['host']}.{job['worker']['pid']}"
            registry = StartedJobRegistry(job["queue"], connection=raw)

            def last_heartbeat() -> datetime | None:
                worker = Worker.find_by_key(worker_key, connection=raw)
                return None if worker is None else worker.last_heartbeat

            def registry_expiry() -> float | None:
                """The score of the job's `{job id}:{execution id}` entry: when RQ's cleanup will call the
                job abandoned (whole seconds; maintain_heartbeats sets it to now + its TTL)."""
                entries = [(key, score) for key, score in text.zrange(registry.key, 0, -1, withscores=True)
                           if key.startswith(f"{job_id}:")]
                assert len(entries) <= 1, entries
                return float(entries[0][1]) if entries else None

            wait_until(advances(last_heartbeat, 2), 60, "two advances of the worker's last_heartbeat")
            wait_until(advances(registry_expiry, 2), 60, "two advances of the job's StartedJobRegistry expiry")
            assert client.get(f"/jobs/{job_id}").json()["state"] == "running"  # all of it while the job ran
        finally:
            client.delete(f"/jobs/{job_id}")
        assert stack.wait_for_state(client, job_id, {"canceled", "failed", "succeeded"}, timeout=60)["state"] \
            == "canceled"

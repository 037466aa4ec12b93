"""A cancel of a running job whose worker died ends it at once, not after the lease and the reaper's
requeue; a worker that was only frozen finds its job canceled when it wakes and writes no end of its own.
Own Redis, API and two workers, with a lease long enough that the reaper cannot be what ends the job."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from rq.job import Job as RQJob
from rq.job import JobStatus

from app.store import JobStore
from app.store.keys import RUNNING, lease_key
from scripts.stack import Stack, freeze_mid_run, private_stack, wait_until

LEASE_S, REAP_INTERVAL_S = 10.0, 1.0
"""A killed worker's lease lives on for LEASE_S * 5/6 at least (it was renewed every LEASE_S / 6), so
the old path, lease expiry then requeue then the next attempt seeing the cancel, takes over 8 s."""
CANCEL_BOUND_S = 5.0
"""The promise: a DELETE of a running job whose worker is dead reads `canceled` within 5 s."""
ENDLESS = {"model": {"name": "mlp"}, "precision_policy": "float32", "training": {"steps": 10_000_000},
           "dataset": {"samples": 512}}


@pytest.fixture(scope="module")
def dead_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with private_stack(tmp_path_factory.mktemp("dead-cancel"), workers=2, LEASE_S=str(LEASE_S),
                       REAP_INTERVAL_S=str(REAP_INTERVAL_S)) as stack:
        yield stack


def live_workers(stack: Stack) -> list[subprocess.Popen[bytes]]:
    return [w for w in stack.workers if w.poll() is None]


def canceled_within_bound(stack: Stack, client: httpx.Client, job_id: str) -> dict[str, Any]:
    """DELETE the job; it must read `canceled` within CANCEL_BOUND_S of the DELETE."""
    asked = time.monotonic()
    assert client.delete(f"/jobs/{job_id}").status_code == 202
    job = stack.wait_for_state(client, job_id, {"canceled", "failed", "succeeded"}, timeout=60)
    took = time.monotonic() - asked
    assert job["state"] == "canceled", job
    assert took <= CANCEL_BOUND_S, f"canceled {took:.1f} s after the DELETE"
    assert job["error"]["reason"] == "canceled" and "presumed dead" in job["error"]["message"], job["error"]
    assert [t["state"] for t in job["transitions"]] == ["queued", "running", "canceled"]
    assert job["attempt"] == 1
    return job


def test_cancel_of_a_job_whose_worker_was_sigkilled_ends_it_within_five_seconds(dead_stack: Stack) -> None:
    while len(live_workers(dead_stack)) < 2:  # one to kill; one whose reaper keeps looking
        dead_stack.start_worker()
    r, raw = dead_stack.redis.client(), redis.Redis.from_url(dead_stack.redis.url)
    with dead_stack.client() as client:
        job_id = client.post("/jobs", json=ENDLESS).json()["id"]
        wait_until(lambda: client.get(f"/jobs/{job_id}").json()["progress"]["step"] >= 1, 120, "a first step")
        pid = client.get(f"/jobs/{job_id}").json()["worker"]["pid"]
        os.killpg(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        next(w for w in dead_stack.workers if w.pid == pid).wait(10)
        canceled = canceled_within_bound(dead_stack, client, job_id)
        assert not r.exists(lease_key(job_id)) and not r.sismember(RUNNING, job_id)
        # The dead attempt's lease would have run out by now, and the live worker's reaper looked twice since.
        while time.monotonic() < killed_at + LEASE_S + 2 * REAP_INTERVAL_S:
            assert client.get(f"/jobs/{job_id}").json()["transitions"] == canceled["transitions"]
            time.sleep(REAP_INTERVAL_S / 4)
        assert JobStore(r).leases.reap(job_id, max_attempts=3) == "alive"  # a reaper's own check refuses it too
        assert client.get(f"/jobs/{job_id}").json() == canceled
        assert not RQJob.exists(f"{job_id}-a2", connection=raw), "a retry was enqueued"
        assert len(live_workers(dead_stack)) == 1


def test_a_frozen_worker_presumed_dead_finds_its_job_canceled_when_it_wakes(dead_stack: Stack) -> None:
    raw = redis.Redis.from_url(dead_stack.redis.url)
    with dead_stack.client() as client:
        job_id, pid, _ = freeze_mid_run(dead_stack, client, {**ENDLESS, "training": {"steps": 2000}}, past_step=3)
        try:
            canceled = canceled_within_bound(dead_stack, client, job_id)
        finally:
            os.killpg(pid, signal.SIGCONT)
        # Awake, it sees the cancel, stops, and its own end is refused: the job is as the API left it.
        wait_until(lambda: RQJob.fetch(job_id, connection=raw).get_status() == JobStatus.FINISHED, 60,
                   "the woken attempt to end")
        after = client.get(f"/jobs/{job_id}").json()
        assert {k: after[k] for k in ("state", "transitions", "error", "finished_at", "attempt")} == \
            {k: canceled[k] for k in ("state", "transitions", "error", "finished_at", "attempt")}
        assert not raw.exists(lease_key(job_id))
        # ...and it is free for the next job.
        next_id = client.post("/jobs", json={**ENDLESS, "training": {"steps": 3}}).json()["id"]
        assert dead_stack.wait_for_state(client, next_id, {"succeeded", "failed"}, timeout=120)["state"] == \
            "succeeded"

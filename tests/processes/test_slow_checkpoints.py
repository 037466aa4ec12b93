"""Issue 31, item 8: a job of 2-second steps whose worker is SIGKILLed every 10 s still finishes, because it
checkpoints every CHECKPOINT_INTERVAL_S seconds as well as every `checkpoint_every` steps."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from app.store import JobStore
from scripts.stack import private_stack, wait_until

SLOW = "tests.processes.slow_steps"
KILL_EVERY_S = 10.0
SPEC = {"model": {"name": "mlp", "input_dim": 16, "hidden_units": 16}, "speed_check": [],
        "training": {"steps": 16, "checkpoint_every": 50}, "dataset": {"samples": 256}}
"""16 steps of 2 s: 32 s of training, four attempts' worth at least (at most five steps in each 10 s, its model
built in that time too); a step checkpoint never comes."""


@pytest.mark.slow
def test_a_job_of_2_second_steps_killed_every_10_s_still_finishes(tmp_path_factory: pytest.TempPathFactory) -> None:
    # MAX_ATTEMPTS as by default (3): only attempts lost without progress count. 4 s: two checkpoints per attempt.
    with private_stack(tmp_path_factory.mktemp("slow"), workers=0, LEASE_S="3", REAP_INTERVAL_S="1",
                       CHECKPOINT_INTERVAL_S="4") as stack:
        client, store = stack.client(), JobStore(stack.redis.client())
        stack.start_worker(SLOW, SLOW_STEP_S="2")
        job_id = client.post("/jobs", json=SPEC).json()["id"]
        kills, killed = 0, set()
        while (job := store.jobs.get(job_id)) is not None and not job.state.terminal:
            if job.state.value != "running" or job.worker is None or job.attempt in killed:  # not yet requeued
                time.sleep(0.1)
                continue
            pid, attempt, killed_at = job.worker.pid, job.attempt, time.monotonic() + KILL_EVERY_S
            stack.start_worker(SLOW, registered=False, SLOW_STEP_S="2")  # warm by the kill, to take the next attempt

            def attempt_over(attempt: int = attempt) -> bool:
                now = store.jobs.get(job_id)
                return now is None or now.state.terminal or now.attempt != attempt

            # Each attempt runs KILL_EVERY_S from the moment it started (its worker warm), then its worker dies.
            wait_until(lambda killed_at=killed_at: attempt_over() or time.monotonic() >= killed_at,
                       KILL_EVERY_S + 60, "the attempt's 10 s")
            if attempt_over():
                continue
            os.killpg(pid, signal.SIGKILL)
            stack.workers = [w for w in stack.workers if w.pid != pid]
            kills += 1
            killed.add(attempt)
            assert kills <= 8, "no progress: every attempt starts over"
        assert job is not None
        assert job.state.value == "succeeded", job.error
        assert kills >= 3, "too few attempts lost to show that progress resets the MAX_ATTEMPTS=3 count"
        events = client.get(f"/jobs/{job_id}").json()["transitions"]
        resumed = [int(m.group(1)) for e in events if (m := re.search(r"resuming from step (\d+)", e["message"]))]
        assert resumed == sorted(resumed) and resumed[0] > 0, resumed  # each attempt from further on
        page = client.get(f"/jobs/{job_id}/metrics", params={"limit": 100}).json()
        assert [p["step"] for p in page["points"]] == list(range(1, 17)) and page["missing_steps"] == []

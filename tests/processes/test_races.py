"""Cancels raced against a worker's start and finish, many times over: whichever lands first, each
job's state only moves forward (queued -> running -> an end, or queued -> canceled), once, and
Redis and RQ agree with its record at the end. Own Redis, API and one worker."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
import redis
from rq import Queue
from rq.job import Job as RQJob
from rq.job import JobStatus
from rq.registry import StartedJobRegistry

from app.store.keys import RUNNING, index_key, job_key, lease_key
from app.store.queue import QUEUES
from mpjobs.contract.jobs import JobState
from scripts.stack import Stack, private_stack, wait_until

QUEUED, RUNNING_, SUCCEEDED, CANCELED = "queued", "running", "succeeded", "canceled"
FORWARD = ([QUEUED, CANCELED], [QUEUED, RUNNING_, CANCELED], [QUEUED, RUNNING_, SUCCEEDED])
"""Every history a job here may have: one move to an end, never out of it."""
START_RACES = 16
"""Cancels aimed at the moment the worker takes a job."""


@pytest.fixture(scope="module")
def race_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with private_stack(tmp_path_factory.mktemp("races")) as stack:
        yield stack


class Race:
    def __init__(self, stack: Stack, client: httpx.Client) -> None:
        self.stack, self.client = stack, client
        self.raw = redis.Redis.from_url(stack.redis.url)
        self.jobs: list[str] = []

    def submit(self, steps: int) -> str:
        spec = {"model": {"name": "mlp"}, "precision_policy": "float32", "training": {"steps": steps},
                "dataset": {"samples": 64}}
        response = self.client.post("/jobs", json=spec)
        assert response.status_code == 201, response.text
        self.jobs.append(response.json()["id"])
        return self.jobs[-1]

    def cancel(self, job_id: str) -> None:
        response = self.client.delete(f"/jobs/{job_id}")
        # 409: the race was won by the job's end, which the cancel found already written.
        assert response.status_code == 202 or (response.status_code == 409 and response.json()["state"] in {
            "succeeded", "canceled", "failed"}), response.text

    def get(self, job_id: str) -> dict[str, Any]:
        return dict(self.client.get(f"/jobs/{job_id}").json())

    def taken(self, job_id: str) -> bool:
        """The worker has dequeued the job's RQ job (RQ's `started`, set before our task runs)."""
        return RQJob(job_id, connection=self.raw).get_status() is not JobStatus.QUEUED

    def settle(self, job_id: str) -> dict[str, Any]:
        """The job has ended, and so has any task the worker ran for it: the worker is free."""
        def settled() -> dict[str, Any] | None:
            job = self.get(job_id)
            task = RQJob(job_id, connection=self.raw).get_status()
            waiting = any(job_id in Queue(name, connection=self.raw).get_job_ids() for name in QUEUES)
            ended = job["state"] in (SUCCEEDED, CANCELED, "failed")
            return job if ended and task is not JobStatus.STARTED and not waiting else None

        return wait_until(settled, 60, f"job {job_id} to end")  # type: ignore[no-any-return]


def history(job: dict[str, Any]) -> list[str]:
    return [t["state"] for t in job["transitions"]]


def test_cancels_racing_start_and_finish_leave_every_job_consistent(race_stack: Stack) -> None:
    with race_stack.client() as client:
        race = Race(race_stack, client)

        # After the end: nothing changes.
        done = race.submit(3)
        race.settle(done)
        race.cancel(done)

        # While queued, behind a running job; then that one, mid-run.
        blocker = race.submit(10_000_000)
        wait_until(lambda: race.get(blocker)["progress"]["step"] >= 1, 60, "the blocker to run")
        behind = race.submit(3)
        race.cancel(behind)
        race.cancel(blocker)
        race.settle(blocker)
        race.settle(behind)

        # At the finish: once the last step is reported, against the worker's last transition.
        for _ in range(3):
            job_id = race.submit(20)
            wait_until(lambda job_id=job_id: race.get(job_id)["progress"]["step"] >= 20, 60, "the last step")
            race.cancel(job_id)
            race.settle(job_id)

        # At the start: a delay after the worker took the job, bisected towards the delay at which a
        # cancel stops finding it queued (the worker's move to `running`), then scattered around it.
        rng = random.Random(14)
        found_queued, found_running = 0.0, 0.05
        for i in range(START_RACES):
            if i == 0:
                delay = 0.0
            elif found_running - found_queued > 0.001:
                delay = (found_queued + found_running) / 2
            else:
                delay = max(0.0, rng.uniform(found_queued - 0.003, found_running + 0.003))
            job_id = race.submit(50)
            wait_until(lambda job_id=job_id: race.taken(job_id), 60, "the worker to take the job", interval=0.0005)
            time.sleep(delay)
            race.cancel(job_id)
            if RUNNING_ in history(race.settle(job_id)):
                found_running = min(found_running, delay)
            else:
                found_queued = max(found_queued, delay)
                found_running = max(found_running, 2 * delay)

        assert_consistent(race)


def assert_consistent(race: Race) -> None:
    r = race.stack.redis.client()
    histories = []
    for job_id in race.jobs:
        job = race.get(job_id)
        states = history(job)
        histories.append(states)
        assert states in FORWARD, f"job {job_id}: {states}"
        assert job["state"] == states[-1], f"job {job_id} is {job['state']} after {states}"
        stamps = [datetime.fromisoformat(t["at"].replace("Z", "+00:00")) for t in job["transitions"]]
        assert stamps == sorted(stamps), f"job {job_id}: {job['transitions']}"
        ran = RUNNING_ in states
        assert job["attempt"] == int(ran) and (job["started_at"] is not None) == ran, job
        assert job["finished_at"] is not None
        if job["state"] == CANCELED:
            assert job["error"]["reason"] == "canceled", job["error"]
        else:
            assert job["summary"]["steps_done"] == job["spec"]["training"]["steps"]
        assert not r.sismember(RUNNING, job_id), f"job {job_id} ({states}) is still in the running set"
        assert not r.exists(lease_key(job_id)), f"job {job_id} ({states}) still holds a lease"
        tenant = r.hget(job_key(job_id), "tenant")
        indexed = [s.value for s in JobState if r.zscore(index_key(tenant, s), job_id) is not None]
        assert indexed == [job["state"]], f"job {job_id} ({states}) is indexed under {indexed}"
    for name in QUEUES:
        assert Queue(name, connection=race.raw).get_job_ids() == [], f"RQ queue {name!r} is not empty"
        assert StartedJobRegistry(name, connection=race.raw).get_job_ids() == [], f"RQ still runs on {name!r}"
    # Each way a cancel can land was taken at least once.
    assert {tuple(h) for h in histories} == {tuple(h) for h in FORWARD}, histories

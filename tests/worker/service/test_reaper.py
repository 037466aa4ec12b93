"""The reaper (worker/service/reaper.py) against a real redis-server: a dead job is requeued once, or failed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Queue

from app.core import clock
from app.core.config import Settings
from app.store import JobStore
from app.store.queue import enqueue, queue_for
from mpjobs.contract.jobs import JobState
from mpjobs.contract.spec import JobSpec
from scripts.stack import RedisServer
from worker.service import reaper as reaper_module
from worker.service.reaper import Reaper

SPEC = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": 10}})


@pytest.fixture
def settings(server: RedisServer, tmp_path: Path) -> Iterator[Settings]:
    server.client().flushall()
    yield Settings(redis_url=server.url, artifacts_dir=tmp_path, max_attempts=3)


@pytest.fixture
def store(server: RedisServer) -> JobStore:
    return JobStore(server.client())


def running_job(store: JobStore, server: RedisServer, attempt: int = 1, lease: bool = False) -> str:
    """A job queued through RQ and moved to `running` by attempt `attempt`, its lease alive or expired."""
    rq_redis = Redis.from_url(server.url)
    job_id, _ = store.jobs.create(SPEC, "t", queue_for(SPEC), lambda i, pipe: enqueue(rq_redis, SPEC, i, pipe),
                             rq_redis.pipeline(transaction=True))
    Queue(queue_for(SPEC), connection=rq_redis).empty()  # the attempt took it off the queue
    if lease:
        store.leases.renew_lease(job_id, "worker-1", 60)
    moved, _ = store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], f"attempt {attempt}",
                                started_at=clock.iso(), attempt=attempt)
    assert moved
    return job_id


def rq_ids(server: RedisServer) -> list[str]:
    return Queue(queue_for(SPEC), connection=Redis.from_url(server.url)).get_job_ids()


def test_a_job_whose_lease_expired_is_requeued_as_its_next_attempt(
        settings: Settings, store: JobStore, server: RedisServer) -> None:
    job_id = running_job(store, server)
    requeued = Reaper(settings, Redis.from_url(server.url)).reap_once()
    assert requeued == [job_id]
    job = store.jobs.get(job_id)
    assert job is not None and job.state is JobState.QUEUED
    assert job.transitions[-1].message == "worker lost during attempt 1; requeued to resume from its checkpoint"
    assert rq_ids(server) == [f"{job_id}-a2"] and store.jobs.rq_job_id(job_id) == f"{job_id}-a2"
    assert job_id not in store.leases.running_ids()


def test_a_job_with_a_live_lease_is_left_alone(settings: Settings, store: JobStore, server: RedisServer) -> None:
    job_id = running_job(store, server, lease=True)
    assert Reaper(settings, Redis.from_url(server.url)).reap_once() == []
    job = store.jobs.get(job_id)
    assert job is not None and job.state is JobState.RUNNING and rq_ids(server) == []


def test_the_last_attempt_lost_fails_the_job_with_worker_lost(
        settings: Settings, store: JobStore, server: RedisServer) -> None:
    job_id = running_job(store, server, attempt=settings.max_attempts)
    assert Reaper(settings, Redis.from_url(server.url)).reap_once() == []
    job = store.jobs.get(job_id)
    assert job is not None and job.state is JobState.FAILED and job.error is not None
    assert job.error.reason == "worker_lost" and "on 3 attempts in a row" in job.error.message
    assert rq_ids(server) == []


def test_only_attempts_lost_in_a_row_without_progress_count_against_the_limit(
        settings: Settings, store: JobStore, server: RedisServer) -> None:
    """Each attempt resumes past the one before (the worker resets `stalled`): five lost attempts, still queued.
    Then three in a row from the same checkpoint: failed, on the third."""
    job_id = running_job(store, server)
    reaper = Reaper(settings, Redis.from_url(server.url))
    for attempt in range(2, 7):
        assert reaper.reap_once() == [job_id]
        store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], f"attempt {attempt}", attempt=attempt,
                              resumed_from=attempt * 10, stalled=0)
    for attempt in range(7, 9):
        assert reaper.reap_once() == [job_id]
        store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], f"attempt {attempt}", attempt=attempt,
                              resumed_from=60)
    assert reaper.reap_once() == []
    job = store.jobs.get(job_id)
    assert job is not None and job.state is JobState.FAILED and job.error is not None
    assert "on 3 attempts in a row" in job.error.message and job.attempt == 8


def test_two_reapers_requeue_a_job_once(settings: Settings, store: JobStore, server: RedisServer) -> None:
    job_id = running_job(store, server)
    first, second = (Reaper(settings, Redis.from_url(server.url)) for _ in range(2))
    assert second.reap_once() == [job_id] and first.reap_once() == []
    assert rq_ids(server) == [f"{job_id}-a2"]


def test_an_enqueue_that_fails_after_the_move_is_retried_on_the_next_pass(
        settings: Settings, store: JobStore, server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = running_job(store, server)
    calls: list[str] = []

    def redis_down_once(*args: Any, **kwargs: Any) -> None:
        calls.append(args[2])
        if len(calls) == 1:
            raise ConnectionError("Redis went away mid-requeue")
        enqueue(*args, **kwargs)

    monkeypatch.setattr(reaper_module, "enqueue", redis_down_once)
    reaper = Reaper(settings, Redis.from_url(server.url))
    assert reaper.reap_once() == []  # moved to queued, but not on RQ's queue yet
    job = store.jobs.get(job_id)
    assert job is not None and job.state is JobState.QUEUED and rq_ids(server) == []
    assert reaper.reap_once() == [job_id]
    assert calls == [job_id, job_id] and rq_ids(server) == [f"{job_id}-a2"]
    again = store.jobs.get(job_id)
    assert again is not None and sum("worker lost" in t.message for t in again.transitions) == 1


def test_a_job_queued_under_the_tasks_former_import_path_still_finds_it() -> None:
    """RQ resolves a job's function from the import path stored with it: the path before worker/service/ must
    still name the same task, so jobs queued before an upgrade run after it."""
    from rq.utils import import_attribute

    from app.store.queue import TASK
    from worker.service.tasks import run_training

    assert TASK == "worker.service.tasks.run_training"
    assert import_attribute("worker.tasks.run_training") is run_training
    assert import_attribute(TASK) is run_training

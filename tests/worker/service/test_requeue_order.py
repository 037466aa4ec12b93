"""Queue order after a requeue, against a real redis-server: a dead job's next attempt goes to the front of its queue,
a new job to the back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
from worker.service.reaper import Reaper

SPEC = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": 10}})


@pytest.fixture
def rq_redis(server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(server.url)
    client.flushall()
    yield client
    client.close()


def queued(store: JobStore, rq_redis: Redis) -> str:
    """A job as the API queues it."""
    job_id, _ = store.jobs.create(SPEC, "t", queue_for(SPEC), lambda i, pipe: enqueue(rq_redis, SPEC, i, pipe),
                                  rq_redis.pipeline(transaction=True))
    return job_id


def test_a_requeued_attempt_goes_first_and_a_new_job_last(server: RedisServer, rq_redis: Redis,
                                                          tmp_path: Path) -> None:
    store = JobStore(server.client())
    queue = Queue(queue_for(SPEC), connection=rq_redis)
    lost = queued(store, rq_redis)
    assert queue.pop_job_id() == lost  # a worker took it
    moved, _ = store.jobs.transition(lost, JobState.RUNNING, [JobState.QUEUED], "attempt 1", started_at=clock.iso(),
                                     attempt=1)  # and died: no lease
    assert moved
    waiting = [queued(store, rq_redis) for _ in range(3)]

    assert Reaper(Settings(redis_url=server.url, artifacts_dir=tmp_path), rq_redis).reap_once() == [lost]
    later = queued(store, rq_redis)
    assert queue.job_ids == [f"{lost}-a2", *waiting, later]

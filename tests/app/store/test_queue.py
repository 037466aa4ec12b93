"""The RQ job behind a training job: its queue, its task and its timeout, read back from a real Redis.

docs/reliability.md: no default limit, RQ's `job_timeout` is -1 unless `training.max_seconds` is set,
then `max_seconds + 60`, so the engine's own `timeout` failure (with its checkpoint) comes first.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Queue
from rq.job import Job

from app.store.queue import devices_of, enqueue, listening_queues
from mpjobs.contract.spec import JobSpec
from scripts.stack import RedisServer

GRACE_S = 60
RQ_DEFAULT_TIMEOUT_S = 180
"""What RQ gives a job enqueued without a timeout: never what a job of ours may get by default."""


@pytest.fixture(scope="module")
def rq_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    """A connection to a fresh redis-server, as the API's RQ connection is: bytes, not decoded."""
    server = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    server.start()
    client = Redis.from_url(server.url)
    yield client
    client.close()
    server.stop()


def enqueued(rq_redis: Redis, spec: dict[str, Any], job_id: str, rq_job_id: str | None = None) -> Job:
    """Enqueue through app.store.queue as the API does (in a MULTI/EXEC), then fetch the RQ job back."""
    pipe = rq_redis.pipeline(transaction=True)
    with pipe:
        enqueue(rq_redis, JobSpec.model_validate(spec), job_id, pipe, rq_job_id=rq_job_id)
        pipe.execute()
    return Job.fetch(rq_job_id or job_id, connection=rq_redis)


@pytest.mark.parametrize(("max_seconds", "timeout"), [
    (1, 1 + GRACE_S),
    (3600, 3600 + GRACE_S),
    (30 * 24 * 3600, 30 * 24 * 3600 + GRACE_S),  # the largest max_seconds a spec accepts
])
def test_a_job_with_max_seconds_gets_that_plus_a_minute(rq_redis: Redis, max_seconds: int, timeout: int) -> None:
    job_id = f"limited-{max_seconds}"
    job = enqueued(rq_redis, {"model": {"name": "mlp"}, "training": {"max_seconds": max_seconds}}, job_id)
    assert job.timeout == timeout
    assert job.func_name == "worker.service.tasks.run_training" and job.args == (job_id,)
    assert job.origin == "any" and job_id in Queue("any", connection=rq_redis).job_ids


def test_a_job_without_max_seconds_has_no_timeout(rq_redis: Redis) -> None:
    job = enqueued(rq_redis, {"model": {"name": "mlp"}, "device": "cpu"}, "unlimited")
    assert job.timeout == -1, f"no limit, never RQ's default of {RQ_DEFAULT_TIMEOUT_S} s"
    assert job.origin == "cpu" and "unlimited" in Queue("cpu", connection=rq_redis).job_ids


def test_a_retry_keeps_the_timeout_under_its_own_rq_job_id(rq_redis: Redis) -> None:
    spec = {"model": {"name": "mlp"}, "training": {"max_seconds": 90}}
    retry = enqueued(rq_redis, spec, "retried", rq_job_id="retried-attempt-2")
    assert retry.id == "retried-attempt-2" and retry.args == ("retried",)
    assert retry.timeout == 90 + GRACE_S


def test_a_job_on_two_devices_waits_on_a_queue_only_two_device_workers_take(rq_redis: Redis) -> None:
    job = enqueued(rq_redis, {"model": {"name": "mlp"}, "device": "gpu", "training": {"devices": 2}}, "pair")
    assert job.origin == "gpu-x2" and "pair" in Queue("gpu-x2", connection=rq_redis).job_ids
    assert devices_of("gpu-x2") == 2 and devices_of("gpu") == 1 and devices_of("any-x16") == 16
    # A worker with N devices serves every job of up to N, the widest first; one device, as before.
    assert listening_queues("gpu") == ["gpu", "any"]
    assert listening_queues("gpu", 2) == ["gpu-x2", "any-x2", "gpu", "any"]
    assert "gpu-x2" not in listening_queues("gpu", 1) and "cpu-x2" not in listening_queues("gpu", 4)
    assert listening_queues("cpu", 3)[:2] == ["cpu-x3", "any-x3"]

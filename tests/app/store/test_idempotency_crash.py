"""An Idempotency-Key write killed right after its EXEC, against a real redis-server: the retry with that key returns
the one job (or comparison) the EXEC made, and no second one is made."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis import Redis
from redis.client import Pipeline
from rq import Queue

from app.api import services
from app.store import JobStore
from mpjobs.contract.spec import ComparisonSpec, JobSpec
from scripts.stack import RedisServer

TENANT, KEY = "tenant-a", "retry-me"
JOB = {"model": {"name": "mlp"}, "training": {"steps": 5}}


class Killed(Exception):
    """The API process dying right after Redis ran its EXEC: nothing it would have written next is written."""


def killed_after_exec(server: RedisServer) -> Redis:
    """RQ's connection, as the API's, whose transactions Redis runs whole, after which the request dies."""

    class KilledAfterExec(Pipeline):
        def execute(self, raise_on_error: bool = True) -> list[Any]:
            super().execute(raise_on_error)
            raise Killed

    class Killing(Redis):
        def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
            return KilledAfterExec(self.connection_pool, self.response_callbacks, transaction, shard_hint)

    return Killing.from_url(server.url)


@pytest.fixture
def store(server: RedisServer) -> Iterator[JobStore]:
    client = server.client()
    client.flushdb()
    yield JobStore(client)
    client.close()


def submit_job(store: JobStore, rq: Redis) -> tuple[str, bool]:
    job, created = services.submit(store, rq, JobSpec.model_validate(JOB), TENANT, KEY)
    return job.id, created


def submit_comparison(store: JobStore, rq: Redis) -> tuple[str, bool]:
    report, created = services.submit_comparison(store, rq, ComparisonSpec.model_validate({"spec": JOB}), TENANT, KEY)
    return report.id, created


def made(store: JobStore, what: str) -> list[str]:
    """The ids of every job, or every comparison, the tenant has."""
    if what == "job":
        return [job.id for job in store.jobs.list(TENANT, None, 100, None)[0]]
    return [comparison.id for comparison in store.comparisons.list_comparisons(TENANT, 100, None)[0]]


@pytest.mark.parametrize(("submit", "what"), [(submit_job, "job"), (submit_comparison, "comparison")],
                         ids=["job", "comparison"])
def test_a_write_killed_right_after_its_exec_is_returned_once_to_the_retry_with_its_key(
        server: RedisServer, store: JobStore, submit: Callable[[JobStore, Redis], tuple[str, bool]],
        what: str) -> None:
    killing = killed_after_exec(server)
    try:
        with pytest.raises(Killed):
            submit(store, killing)
    finally:
        killing.close()
    first = made(store, what)
    assert len(first) == 1, "the EXEC ran: it wrote the record"

    rq = Redis.from_url(server.url)
    try:
        made_id, created = submit(store, rq)
        queued = Queue("cpu", connection=rq).job_ids + Queue("any", connection=rq).job_ids
    finally:
        rq.close()
    assert (made_id, created) == (first[0], False), "the key was written in the EXEC that wrote the record"
    assert made(store, what) == first
    assert len(queued) == len(store.jobs.list(TENANT, None, 100, None)[0]), "one RQ job per job: none queued twice"

"""`GET /jobs/{id}` on the async client (app/api/job_views.py) against a real redis-server: at every point of a
job's life its JSON is what the sync path builds and FastAPI's response model dumps, never a stale copy."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio
from pydantic import TypeAdapter

from app.api import services
from app.api.job_views import JobViews
from app.core.errors import JobNotFound
from app.store import JobStore
from mpjobs.contract.jobs import JobRecord, JobState
from mpjobs.contract.records import Summary
from scripts.stack import RedisServer
from tests.app.store.history import SPEC, records
from worker.telemetry.redis_reporter import RedisReporter

RESPONSE = TypeAdapter(JobRecord)


def test_the_async_view_is_the_sync_job_at_every_change(server: RedisServer) -> None:
    server.client().flushall()
    store = JobStore(server.client())
    workers = services.LiveWorkers(redis.Redis.from_url(server.url))

    async def scenario() -> None:
        aredis = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
        views = JobViews(aredis, store, workers)
        job_id, _ = store.jobs.create(SPEC, "t", "cpu", lambda _id, _pipe: None, store.redis.pipeline(transaction=True))

        async def same() -> bytes:
            body = await views.json(job_id, "t")
            job = store.jobs.get(job_id, "t")
            assert job is not None
            if job.state is JobState.QUEUED and not workers.count(job.queue):
                job = job.model_copy(update={"waiting_reason": services.waiting_reason(job.queue)})
            assert body == RESPONSE.dump_json(job)
            return body

        queued = await same()
        assert b'"waiting_reason":"No live worker listens on queue' in queued, "no worker runs in this test"
        assert await views.json(job_id, "t") is queued, "unchanged: the kept JSON"
        store.leases.renew_lease(job_id, "tests", 60)
        store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "attempt 1", attempt=1)
        running = await same()
        assert b'"state":"running"' in running and b'"waiting_reason":null' in running
        reporter = RedisReporter(store, job_id)
        for first in (1, 4):
            reporter.steps(records(6)[first - 1:first + 2])
            assert f'"progress":{{"step":{first + 2},'.encode() in await same()
        store.jobs.set_fields(job_id, phase="saving the model")
        assert b'"phase":"saving the model"' in await same()
        summary = Summary(steps_done=6, final_loss=0.5, skipped_steps=0, loss_scale_min=1.0, loss_scale_max=2.0,
                          loss_scale_final=2.0, peak_zero_grad_fraction=0.1, mean_examples_per_sec=1.0)
        store.jobs.transition(job_id, JobState.SUCCEEDED, [JobState.RUNNING], "done", summary=summary.model_dump_json())
        ended = await same()
        assert b'"state":"succeeded"' in ended and b'"steps_done":6' in ended
        for tenant, missing in (("other", job_id), ("t", "nope")):
            with pytest.raises(JobNotFound):
                await views.json(missing, tenant)
        await aredis.aclose()

    asyncio.run(scenario())

"""`missing_steps` names every step a job trained that Redis does not hold: gaps inside a page and,
once the job has ended, the steps after the last one stored."""

from __future__ import annotations

import asyncio

import redis.asyncio

from app.api.page_reads import PageReads
from app.store import JobStore
from app.store.pages import RawPage
from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import StepRecord, Summary
from mpjobs.contract.spec import JobSpec

TENANT = "t"


def metrics(store: JobStore, job_id: str, tenant: str, after: int, limit: int) -> RawPage:
    """A page as the API's route reads it (app/api/page_reads.py), on a client of its own."""
    async def read() -> RawPage:
        url = store.redis.connection_pool.connection_kwargs
        async with redis.asyncio.Redis(host=url["host"], port=url["port"]) as aredis:
            return await PageReads(aredis, store).page(job_id, tenant, after, limit)
    return asyncio.run(read())


def record(step: int) -> StepRecord:
    return StepRecord(step=step, loss=1.0, loss_scale=1.0, grad_norm=1.0, grads_finite=True, skipped=False,
                      zero_grad_fraction=0.0, learning_rate=1e-3, examples_per_sec=1.0, step_time_ms=1.0,
                      time=float(step))


def job_with_steps(store: JobStore, stored: list[int]) -> str:
    spec = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": 10}})
    job_id, _ = store.jobs.create(spec, TENANT, "cpu", lambda job_id, pipe: None,
                                  store.redis.pipeline(transaction=True))
    store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "running")
    store.streams.append_steps(job_id, [record(s) for s in stored], [])
    return job_id


def finish(store: JobStore, job_id: str, steps_done: int) -> None:
    summary = Summary(steps_done=steps_done, final_loss=1.0, skipped_steps=0, loss_scale_min=1.0, loss_scale_max=1.0,
                      loss_scale_final=1.0, peak_zero_grad_fraction=0.0, mean_examples_per_sec=1.0, diagnoses=[])
    store.jobs.transition(job_id, JobState.SUCCEEDED, [JobState.RUNNING], "finished",
                     summary=summary.model_dump_json())


def test_an_ended_job_reports_the_steps_lost_after_its_last_stored_one(store: JobStore) -> None:
    job_id = job_with_steps(store, [1, 2, 3, 5, 6])
    running = metrics(store, job_id, TENANT, after=0, limit=1000)
    assert running.missing_steps == [(4, 4)], "a running job's newest steps may simply not be written yet"
    finish(store, job_id, steps_done=10)
    page = metrics(store, job_id, TENANT, after=0, limit=1000)
    assert page.steps == [1, 2, 3, 5, 6]
    assert page.missing_steps == [(4, 4), (7, 10)]
    assert metrics(store, job_id, TENANT, after=6, limit=1000).missing_steps == [(7, 10)]


def test_only_the_last_page_carries_the_tail(store: JobStore) -> None:
    job_id = job_with_steps(store, [1, 2, 3, 4])
    finish(store, job_id, steps_done=6)
    first = metrics(store, job_id, TENANT, after=0, limit=2)
    assert first.next_after == 2 and first.missing_steps == []
    last = metrics(store, job_id, TENANT, after=2, limit=2)
    assert last.next_after is None and last.missing_steps == [(5, 6)]


def test_a_job_with_every_step_stored_reports_none_missing(store: JobStore) -> None:
    job_id = job_with_steps(store, [1, 2, 3])
    finish(store, job_id, steps_done=3)
    assert metrics(store, job_id, TENANT, after=0, limit=1000).missing_steps == []

"""Evaluations in the store: each step's once, rewound with the steps, read back in pages, purged with the job."""

from __future__ import annotations

import pytest

from app.api import services
from app.core.errors import JobNotFound
from app.store import JobStore
from app.store.keys import evaluations_key, job_keys
from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import EvalRecord
from tests.app.store.test_missing_steps import TENANT, job_with_steps, record


def evaluation(step: int, loss: float | None = 0.5) -> EvalRecord:
    return EvalRecord(step=step, loss=loss, metrics={"accuracy": 0.75, "auc": None}, examples=30, seconds=0.01,
                      time=1_700_000_000.0 + step)


def test_evaluations_are_read_back_in_step_order_page_by_page(store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    store.evaluations.append(job_id, [evaluation(3), evaluation(6)])
    store.evaluations.append(job_id, [evaluation(7, loss=None)])
    first = services.evaluations(store, job_id, TENANT, after=0, limit=2)
    assert first.evaluations == [evaluation(3), evaluation(6)] and first.next_after == 6
    rest = services.evaluations(store, job_id, TENANT, after=6, limit=2)
    assert rest.evaluations == [evaluation(7, loss=None)] and rest.next_after is None
    assert services.evaluations(store, job_id, TENANT, after=7, limit=2).evaluations == []
    with pytest.raises(JobNotFound):
        services.evaluations(store, job_id, "another-tenant", after=0, limit=2)


def test_a_resent_evaluation_is_stored_once(store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    store.evaluations.append(job_id, [evaluation(3)])
    store.evaluations.append(job_id, [evaluation(3), evaluation(6)])  # held over an outage, then sent again
    assert store.redis.xlen(evaluations_key(job_id)) == 2
    assert [e.step for e in store.evaluations.read(job_id, 0, 100).evaluations] == [3, 6]


def test_a_rewind_drops_the_evaluations_after_the_checkpoint_and_the_resumed_attempt_writes_them_once(
        store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    store.streams.append_steps(job_id, [record(s) for s in range(1, 21)], [])
    store.evaluations.append(job_id, [evaluation(5), evaluation(10), evaluation(15)])
    store.streams.rewind_metrics(job_id, keep_step=10)
    assert [e.step for e in store.evaluations.read(job_id, 0, 100).evaluations] == [5, 10]
    store.evaluations.append(job_id, [evaluation(15, loss=0.25), evaluation(20)])
    assert store.evaluations.read(job_id, 0, 100).evaluations == [evaluation(5), evaluation(10),
                                                                   evaluation(15, loss=0.25), evaluation(20)]


def test_a_purge_deletes_the_evaluations_with_the_job(store: JobStore) -> None:
    job_id = job_with_steps(store, [1])
    store.evaluations.append(job_id, [evaluation(1)])
    assert evaluations_key(job_id) in job_keys(job_id, services.CACHED_VIEW_SIZES)
    store.jobs.transition(job_id, JobState.SUCCEEDED, [JobState.RUNNING], "done")
    assert store.purges.purge(TENANT, [job_id], services.CACHED_VIEW_SIZES) is None
    assert not store.redis.exists(evaluations_key(job_id))

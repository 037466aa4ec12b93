"""The cancel of an attempt presumed dead (app/store/cancel.py), against a real redis-server: it lands only on
the attempt the caller watched, never under a live worker, and no reaper brings the job back."""

from __future__ import annotations

import pytest

from app.core import clock
from app.store import JobStore
from app.store.cancel import Attempt
from app.store.keys import RUNNING, index_key, job_key, lease_key
from mpjobs.contract.jobs import JobState
from mpjobs.contract.spec import JobSpec

TENANT = "t-cancel"
SPEC = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": 10}})
ERROR = {"reason": "canceled", "message": "Canceled at step 0; its worker (w1) did not answer, presumed dead."}


def running(store: JobStore, owner: str | None = "w1") -> str:
    """A job in `running` as attempt 1, its lease held by `owner` (None: the lease has expired)."""
    job_id, _ = store.jobs.create(SPEC, TENANT, "cpu", lambda job_id, pipe: None, store.redis.pipeline())
    if owner is not None:
        store.leases.renew_lease(job_id, owner, 60)
    moved, _ = store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "attempt 1", started_at=clock.iso(),
                                attempt=1)
    assert moved
    return job_id


def cancel(store: JobStore, job_id: str, watched: Attempt) -> JobState | None:
    return store.cancels.cancel_lost(watched, job_id, "canceled: presumed dead", ERROR)


def test_a_silent_attempt_is_canceled_with_its_lease_and_no_reaper_brings_it_back(store: JobStore) -> None:
    job_id = running(store)
    watched = store.cancels.attempt(job_id)
    assert watched == Attempt(state=JobState.RUNNING, number=1, lease_owner="w1", answered=False, step=0)
    assert cancel(store, job_id, watched) is JobState.CANCELED
    job = store.jobs.get(job_id)
    assert job is not None and job.state is JobState.CANCELED and job.finished_at is not None
    assert job.error is not None and job.error.model_dump() == ERROR
    assert [(t.state, t.message) for t in job.transitions][1:] == [
        (JobState.RUNNING, "attempt 1"), (JobState.CANCELED, "canceled: presumed dead")]
    assert not store.redis.exists(lease_key(job_id)) and not store.redis.sismember(RUNNING, job_id)
    assert store.redis.zscore(index_key(TENANT, JobState.CANCELED), job_id) is not None
    assert store.redis.zscore(index_key(TENANT, JobState.RUNNING), job_id) is None
    assert store.leases.reap(job_id, max_attempts=3) == "alive"
    assert cancel(store, job_id, watched) is JobState.CANCELED  # once: the second finds it ended
    assert len(store.jobs.get(job_id).transitions) == 3  # type: ignore[union-attr]


def test_an_attempt_whose_lease_expired_is_canceled_even_if_it_had_answered(store: JobStore) -> None:
    job_id = running(store, owner=None)
    store.cancels.acknowledge_cancel(job_id, "w1")
    watched = store.cancels.attempt(job_id)
    assert (watched.lease_owner, watched.answered) == (None, True)
    assert cancel(store, job_id, watched) is JobState.CANCELED


@pytest.mark.parametrize("change", ["lease to another worker", "worker answered", "next attempt", "lease taken"])
def test_a_live_worker_or_a_new_attempt_is_never_canceled_under_it(store: JobStore, change: str) -> None:
    job_id = running(store, owner=None if change == "lease taken" else "w1")
    watched = store.cancels.attempt(job_id)
    if change in ("lease to another worker", "lease taken"):
        store.leases.renew_lease(job_id, "w2", 60)
    elif change == "worker answered":
        store.cancels.acknowledge_cancel(job_id, "w1")
    else:
        store.jobs.set_fields(job_id, attempt=2)
    before = store.redis.hgetall(job_key(job_id))
    assert cancel(store, job_id, watched) is JobState.RUNNING
    assert store.redis.hgetall(job_key(job_id)) == before
    assert store.redis.exists(lease_key(job_id)) and store.redis.sismember(RUNNING, job_id)


def test_a_job_that_left_running_first_is_left_as_it_is(store: JobStore) -> None:
    job_id = running(store)
    watched = store.cancels.attempt(job_id)
    assert store.leases.reap(job_id, max_attempts=3) == "alive"  # its lease lives
    store.leases.drop_lease(job_id)
    assert store.leases.reap(job_id, max_attempts=3) == "queued"
    assert cancel(store, job_id, watched) is JobState.QUEUED
    assert store.jobs.get(job_id).state is JobState.QUEUED  # type: ignore[union-attr]
    assert cancel(store, "no-such-job", watched) is None

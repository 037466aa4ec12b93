"""Deleting ended jobs and comparisons for good: Redis in one atomic step, then RQ's records, then the files.

Order matters for a crash. Redis goes first, in one Lua script that checks every job may go
(app/store/purge.py): a refusal deletes nothing. RQ's records of the job's attempts and the job's
folder (checkpoint, model.keras, TensorBoard logs, archived history) go after, once Redis no longer
knows the job: a crash in between leaves only those, which no read can reach and which are safe to
remove by hand (the folder is `<ARTIFACTS_DIR>/<job id>`; RQ expires its records after
RESULT_TTL_S). An Idempotency-Key that named the job is not looked for (the job does not record
it): a repeat request with it finds no job, and the key is taken as stale.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence

from redis import Redis

from app.api import services
from app.core.config import Settings
from app.core.errors import (
    ComparisonNotEnded,
    ComparisonNotFound,
    DeleteRefused,
    JobInComparison,
    JobNotEnded,
    JobNotFound,
    JobStillHeld,
)
from app.store import JobStore, PurgeRefusal
from app.store import queue as queues
from mpjobs.contract.jobs import JobRecord

log = logging.getLogger("mpjobs.api")

SETTLE_S = 2.0
"""How long a delete waits for the worker that ended a job to let go of it: the attempt drops its lease
just after the job's last transition, and RQ records the end of its task just after that; either,
written after the delete, would leave a trace. A worker that died holding the job never lets go:
past this, a lease still held refuses the delete (retry once it lapses, within LEASE_S) and RQ's
record is deleted as it is."""
SETTLE_POLL_S = 0.02


def purge_job(store: JobStore, rq_redis: Redis, settings: Settings, job_id: str, tenant: str) -> None:
    """Delete an ended job and every trace of it. Another tenant's job is JobNotFound, as a missing one."""
    job = services.get(store, job_id, tenant)
    if not job.state.terminal:
        raise JobNotEnded(job_id, job.state.value)
    _purge(store, rq_redis, settings, tenant, [job])


def purge_comparison(store: JobStore, rq_redis: Redis, settings: Settings, comparison_id: str,
                     tenant: str) -> None:
    """Delete a comparison and all its jobs, once every one has ended; else nothing."""
    record = store.comparisons.get_comparison(comparison_id, tenant)
    if record is None:
        raise ComparisonNotFound(comparison_id)
    jobs = [job for job in store.jobs.get_many(record.job_ids) if job is not None]
    active = {job.id: job.state.value for job in jobs if not job.state.terminal}
    if active:
        raise ComparisonNotEnded(comparison_id, active)
    _purge(store, rq_redis, settings, tenant, jobs, comparison_id)


def _purge(store: JobStore, rq_redis: Redis, settings: Settings, tenant: str, jobs: Sequence[JobRecord],
           comparison_id: str | None = None) -> None:
    job_ids = [job.id for job in jobs]
    rq_jobs = {job.id: store.jobs.rq_job_id(job.id) for job in jobs}
    _settle(store, rq_redis, job_ids, list(rq_jobs.values()))
    refusal = store.purges.purge(tenant, job_ids, services.CACHED_VIEW_SIZES, comparison_id)
    if refusal is not None:
        raise _refused(refusal, settings, comparison_id)
    for job in jobs:
        queues.delete_rq_jobs(rq_redis, queues.rq_job_ids(job.id, job.attempt, rq_jobs[job.id]))
        _remove_folder(settings, job.id)


def _settle(store: JobStore, rq_redis: Redis, job_ids: list[str], rq_job_ids: list[str]) -> None:
    """Wait, up to SETTLE_S, until no attempt holds a lease on these jobs and RQ has recorded each task's end."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if not store.leases.leases_held(job_ids) and not any(queues.rq_job_started(rq_redis, i) for i in rq_job_ids):
            return
        time.sleep(SETTLE_POLL_S)


def _refused(refusal: PurgeRefusal, settings: Settings, comparison_id: str | None) -> Exception:
    """The error for a delete the script refused (the state changed since it was read)."""
    if refusal.reason == "missing":
        return JobNotFound(refusal.job_id) if comparison_id is None else ComparisonNotFound(comparison_id)
    if refusal.reason == "active":
        return (JobNotEnded(refusal.job_id, refusal.detail) if comparison_id is None
                else ComparisonNotEnded(comparison_id, {refusal.job_id: refusal.detail}))
    if refusal.reason == "in_comparison":
        return JobInComparison(refusal.job_id, refusal.detail)
    if refusal.reason == "held":
        return JobStillHeld(refusal.job_id, settings.lease_s)
    return DeleteRefused(f"Job {refusal.job_id!r} was not deleted: {refusal.reason}.")


def _remove_folder(settings: Settings, job_id: str) -> None:
    """Remove `<ARTIFACTS_DIR>/<job id>`, which the API shares with the workers. A folder that cannot be
    removed is logged and left: the job is already gone from Redis, and the folder holds nothing a read
    can reach."""
    folder = settings.job_dir(job_id)
    if folder.resolve().parent != settings.artifacts_dir.resolve():  # a job id is one plain path segment
        raise ValueError(f"Expected a job folder directly under ARTIFACTS_DIR. Received: {folder}")
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("job %s is deleted, but its folder %s could not be removed: %s", job_id, folder, exc)

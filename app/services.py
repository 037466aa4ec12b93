"""What the routes do, one function per route; HTTP-free and typed."""

from __future__ import annotations

from pathlib import Path

from redis import Redis
from rq import Queue, Worker

from app import queue as queues
from app.config import Settings
from app.errors import ArtifactNotFound, JobNotFound
from app.resources import Health, Job, JobPage, JobState, MetricsBuckets, MetricsPage
from app.schemas import JobSpec
from app.store import JobStore

MODEL_ARTIFACT = "model.keras"
MAX_PAGE = 10_000
"""Most step records one metrics page returns."""


def submit(store: JobStore, rq_redis: Redis, spec: JobSpec) -> Job:
    job_id = store.create(spec, queues.queue_for(spec), lambda jid, pipe: queues.enqueue(rq_redis, spec, jid, pipe),
                          rq_redis.pipeline(transaction=True))
    return get(store, job_id)


def get(store: JobStore, job_id: str) -> Job:
    job = store.get(job_id)
    if job is None:
        raise JobNotFound(job_id)
    return job


def list_jobs(store: JobStore, state: JobState | None, limit: int, cursor: int | None) -> JobPage:
    jobs, next_cursor = store.list(state, limit, cursor)
    return JobPage(jobs=jobs, next_cursor=None if next_cursor is None else str(next_cursor))


def cancel(store: JobStore, rq_redis: Redis, job_id: str) -> Job:
    """Queued: canceled at once. Running: stops at its next step. Terminal: unchanged."""
    job = get(store, job_id)
    if job.state is JobState.QUEUED:
        moved, _ = store.transition(job_id, JobState.CANCELED, [JobState.QUEUED], "canceled before it started",
                                    error={"reason": "canceled", "message": "Canceled before it started."})
        if moved:
            Queue(job.queue, connection=rq_redis).remove(job_id)
            return get(store, job_id)
    if get(store, job_id).state is JobState.RUNNING:
        store.request_cancel(job_id)
    return get(store, job_id)


def metrics(store: JobStore, job_id: str, after: int, limit: int) -> MetricsPage:
    get(store, job_id)
    return store.read_metrics(job_id, after, min(limit, MAX_PAGE))


def buckets(store: JobStore, job_id: str, max_points: int) -> MetricsBuckets:
    get(store, job_id)
    return store.read_buckets(job_id, max_points)


def artifact(store: JobStore, settings: Settings, job_id: str) -> Path:
    get(store, job_id)
    path = settings.artifacts_dir / job_id / MODEL_ARTIFACT
    if not path.is_file():
        raise ArtifactNotFound(job_id, MODEL_ARTIFACT)
    return path


def readiness(rq_redis: Redis) -> Health:
    rq_redis.ping()
    workers = {
        name: Worker.count(connection=rq_redis, queue=Queue(name, connection=rq_redis)) for name in queues.QUEUES
    }
    return Health(status="ok" if any(workers.values()) else "no_workers", redis="ok", workers=workers)

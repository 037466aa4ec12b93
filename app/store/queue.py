"""RQ queues by device class, and how the API enqueues a training job.

The API names the task by its import path, so it never imports `worker`.
"""

from __future__ import annotations

from redis import Redis
from redis.client import Pipeline
from rq import Queue

from app.core.spec import JobSpec

QUEUES = ("gpu", "cpu", "any")
TASK = "worker.tasks.run_training"
NO_TIMEOUT = -1
"""RQ's `job_timeout` when the spec sets no `training.max_seconds`: never RQ's 180 s default."""
TIMEOUT_GRACE_S = 60
"""Headroom over `max_seconds` for building, loading and saving, so the engine's own
`timeout` failure (with its checkpoint) comes before RQ kills the job."""
RESULT_TTL_S = 7 * 24 * 3600


def queue_for(spec: JobSpec) -> str:
    return spec.device


def listening_queues(device_kind: str) -> list[str]:
    """A GPU worker takes `gpu` then `any`; a CPU worker takes `cpu` then `any`."""
    return [device_kind, "any"]


def job_timeout(spec: JobSpec) -> int:
    max_seconds = getattr(spec.training, "max_seconds", None)
    return NO_TIMEOUT if max_seconds is None else int(max_seconds) + TIMEOUT_GRACE_S


def enqueue(redis: Redis, spec: JobSpec, job_id: str, pipe: Pipeline, rq_job_id: str | None = None) -> None:
    """Queue the task for `job_id`; a retry gets its own RQ job id (`rq_job_id`)."""
    Queue(queue_for(spec), connection=redis).enqueue_call(
        TASK, args=(job_id,), job_id=rq_job_id or job_id, timeout=job_timeout(spec),
        result_ttl=RESULT_TTL_S, failure_ttl=RESULT_TTL_S, pipeline=pipe,
        description=f"train {spec.model_dump(include={'model'})['model'].get('name', 'keras_json')} "
                    f"{spec.precision_policy.value}",
    )

"""RQ queues by device class and device count, and how the API enqueues a training job.

A one-device job waits on `gpu`, `cpu` or `any`; a job on N devices
(`training.devices`) on `gpu-x2`, `cpu-x2` or `any-x2` and so on, which only
workers with at least N devices listen on. The API names the task by its
import path, so it never imports `worker`.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis import Redis
from redis.client import Pipeline
from rq import Queue
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job as RQJob
from rq.job import JobStatus

from mpjobs.contract.spec import JobSpec

QUEUES = ("gpu", "cpu", "any")
TASK = "worker.service.tasks.run_training"
NO_TIMEOUT = -1
"""RQ's `job_timeout` when the spec sets no `training.max_seconds`: never RQ's 180 s default."""
TIMEOUT_GRACE_S = 60
"""Headroom over `max_seconds` for building, loading and saving, so the engine's own
`timeout` failure (with its checkpoint) comes before RQ kills the job."""
RESULT_TTL_S = 7 * 24 * 3600


def queue_name(device: str, devices: int = 1) -> str:
    """`gpu` for one device, `gpu-x2` for two: the queue a job on that many devices waits on."""
    return device if devices == 1 else f"{device}-x{devices}"


def devices_of(queue: str) -> int:
    """How many devices a job on `queue` trains on: 2 for `gpu-x2`, 1 for `gpu`."""
    _, _, count = queue.partition("-x")
    return int(count) if count.isdigit() else 1


def queue_for(spec: JobSpec) -> str:
    return queue_name(spec.device, spec.training.devices)


def listening_queues(device_kind: str, devices: int = 1) -> list[str]:
    """The queues a worker with `devices` devices of `device_kind` can serve, widest jobs first.

    A GPU worker takes `gpu` then `any`; a CPU worker `cpu` then `any`. With two devices or more,
    it first takes the jobs that need them all, then fewer: `gpu-x2`, `any-x2`, `gpu`, `any`.

    >>> listening_queues("cpu", 2)
    ['cpu-x2', 'any-x2', 'cpu', 'any']
    """
    return [name for n in range(max(devices, 1), 0, -1) for name in (queue_name(device_kind, n),
                                                                       queue_name("any", n))]


def job_timeout(spec: JobSpec) -> int:
    max_seconds = getattr(spec.training, "max_seconds", None)
    return NO_TIMEOUT if max_seconds is None else int(max_seconds) + TIMEOUT_GRACE_S


def enqueue(redis: Redis, spec: JobSpec, job_id: str, pipe: Pipeline, rq_job_id: str | None = None,
            at_front: bool = False) -> None:
    """Queue the task for `job_id`; a retry gets its own RQ job id (`rq_job_id`). A new job waits at the back
    of its queue; a retry goes `at_front`: it has trained part of its run, and loses the least by going first."""
    Queue(queue_for(spec), connection=redis).enqueue_call(
        TASK, args=(job_id,), job_id=rq_job_id or job_id, timeout=job_timeout(spec), at_front=at_front,
        result_ttl=RESULT_TTL_S, failure_ttl=RESULT_TTL_S, pipeline=pipe,
        description=f"train {spec.model_dump(include={'model'})['model'].get('name', 'keras_json')} "
                    f"{spec.precision_policy.value}",
    )


def retry_id(job_id: str, attempt: int) -> str:
    """The RQ job id of attempt `attempt` (2 or more) of a job, which the reaper requeues: `{job_id}-a{attempt}`.
    The first attempt's is the job id itself."""
    return f"{job_id}-a{attempt}"


def rq_job_ids(job_id: str, attempts: int, current: str) -> set[str]:
    """Every RQ job a job may have had: its first (`job_id`), each retry's (`retry_id`: the reaper's,
    worker/service/reaper.py, one past `attempts` for a retry canceled before it began) and `current`,
    the one its record names."""
    return {job_id, current, *(retry_id(job_id, n) for n in range(2, attempts + 2))}


def rq_job_started(redis: Redis, rq_job_id: str) -> bool:
    """Whether RQ holds `rq_job_id` as started: a worker is in its task, or RQ has not yet recorded its end."""
    try:
        return RQJob(rq_job_id, connection=redis).get_status() == JobStatus.STARTED
    except InvalidJobOperation:  # no such RQ job
        return False


def delete_rq_jobs(redis: Redis, rq_job_ids: Iterable[str]) -> None:
    """Delete RQ's records of these jobs with RQ itself: the job hash, its results and executions, and
    its place in the queue and registries. Those already gone are skipped."""
    for rq_job_id in sorted(rq_job_ids):
        try:
            RQJob.fetch(rq_job_id, connection=redis).delete()
        except NoSuchJobError:
            continue

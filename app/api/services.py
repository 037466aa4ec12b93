"""What the routes do, HTTP-free and typed: each function reads what it needs once and does one thing."""

from __future__ import annotations

import time
from pathlib import Path

from redis import Redis
from rq import Queue, worker_registration

from app.api import reports
from app.api.redis_memory import MemoryGauge
from app.api.resources import ComparisonPage, ComparisonReport, Health, JobPage
from app.core.config import MODEL_ARTIFACT, Settings
from app.core.errors import ArtifactNotFound, ComparisonNotFound, JobAlreadyEnded, JobNotFound, PlanNotFound
from app.store import VIEW_TTL_S, ComparisonRecord, IdempotencyKey, JobStore
from app.store import queue as queues
from mpjobs.contract.data_specs import UploadedDataset
from mpjobs.contract.jobs import EvaluationsPage, JobRecord, JobState, LayersPage
from mpjobs.contract.plan import PlanView, keras_lines, spec_fragment
from mpjobs.contract.spec import ComparisonSpec, JobSpec

MAX_PAGE = 10_000
"""Most step records one metrics page returns, and most layer checks one layers page returns."""


def submit(store: JobStore, rq_redis: Redis, spec: JobSpec, tenant: str,
           idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
    """Queue `spec`. Returns (job, created); a repeated Idempotency-Key returns the first job."""
    once = None if idempotency_key is None else IdempotencyKey.for_job(tenant, idempotency_key,
                                                                       spec.model_dump_json())
    job_id, created = store.jobs.create(spec, tenant, queues.queue_for(spec),
                                   lambda jid, pipe: queues.enqueue(rq_redis, spec, jid, pipe),
                                   rq_redis.pipeline(transaction=True), once)
    _note_dataset_use(store, spec, tenant, [job_id])
    return get(store, job_id, tenant), created


def _note_dataset_use(store: JobStore, spec: JobSpec | ComparisonSpec, tenant: str, job_ids: list[str]) -> None:
    """Name the new jobs among their uploaded dataset's users, so it is not deleted while they may train on it."""
    job_spec = spec.spec if isinstance(spec, ComparisonSpec) else spec
    for dataset in (job_spec.dataset, getattr(job_spec.validation, "dataset", None)):  # training, held-out
        if isinstance(dataset, UploadedDataset):
            for job_id in job_ids:
                store.datasets.add_job(tenant, dataset.id, job_id)


def get(store: JobStore, job_id: str, tenant: str) -> JobRecord:
    """The job, or JobNotFound: another tenant's job is indistinguishable from none. (`GET /jobs/{id}` reads
    it on the async client, with `waiting_reason` for a queued job no live worker can take: job_views.py.)"""
    job = store.jobs.get(job_id, tenant)
    if job is None:
        raise JobNotFound(job_id)
    return job


def waiting_reason(queue: str) -> str:
    """Why a job on `queue` waits when no live worker listens there, and what would take it."""
    devices = queues.devices_of(queue)
    kind = queue.partition("-x")[0]
    if devices == 1:
        worker = {"gpu": "a GPU worker", "cpu": "a CPU worker"}.get(kind, "a worker")
        return f"No live worker listens on queue '{queue}': it waits until {worker} starts (python -m worker)."
    units = {"gpu": f"{devices} GPUs", "cpu": f"{devices} CPU devices"}.get(kind, f"{devices} devices")
    return (f"No live worker has {units} for this job (training.devices={devices}, queue '{queue}'): it waits "
            f"until a worker with at least {units} starts (python -m worker; on a CPU host with "
            f"CPU_LOGICAL_DEVICES={devices}).")


class LiveWorkers:
    """Live workers per queue, as one API process sees them: each queue counted at most once a second."""

    TTL_S = 1.0

    def __init__(self, rq_redis: Redis) -> None:
        self.rq_redis = rq_redis
        self._counts: dict[str, tuple[float, int]] = {}

    def recent(self, queue: str) -> int | None:
        """The count of `queue` made in the last TTL_S, or None."""
        counted = self._counts.get(queue)
        return counted[1] if counted is not None and time.monotonic() - counted[0] < self.TTL_S else None

    def count(self, queue: str) -> int:
        """Workers registered on `queue` whose RQ key has not expired. A killed worker stays in RQ's
        per-queue set until someone cleans it, and only live workers do: so clean it here, then count.
        The count is reused for TTL_S, so polling a queued job does not redo this each time."""
        now = time.monotonic()
        counted = self._counts.get(queue)
        if counted is not None and now - counted[0] < self.TTL_S:
            return counted[1]
        worker_registration.clean_worker_registry(Queue(queue, connection=self.rq_redis))
        count = int(self.rq_redis.scard(worker_registration.WORKERS_BY_QUEUE_KEY % queue))
        self._counts[queue] = (now, count)
        return count


def list_jobs(store: JobStore, tenant: str, state: JobState | None, limit: int, cursor: int | None) -> JobPage:
    jobs, next_cursor = store.jobs.list(tenant, state, limit, cursor)
    return JobPage(jobs=jobs, next_cursor=None if next_cursor is None else str(next_cursor))


CANCEL_ANSWER_S = 3.0
"""How long a cancel of a running job waits for its worker to answer the flag (its watcher reads it every
0.25 s) before the worker is presumed dead and the API cancels the job itself. A worker only slow to
answer loses nothing it was asked to keep: it finds the job canceled at its next look and stops."""
CANCEL_POLL_S = 0.05


def cancel(store: JobStore, rq_redis: Redis, job_id: str, tenant: str) -> JobRecord:
    """Queued: canceled at once. Running: its worker stops at its next step; if that worker's lease is
    gone, or it does not answer within CANCEL_ANSWER_S, it is presumed dead and the job is canceled here.
    Ended: JobAlreadyEnded (409), the job unchanged."""
    job = get(store, job_id, tenant)
    if job.state.terminal:
        raise JobAlreadyEnded(job_id, job.state.value)
    state: JobState | None = job.state
    if state is JobState.QUEUED:
        state = _cancel_queued(store, rq_redis, job)  # `running` if it started in between
    if state is JobState.RUNNING:
        state = _cancel_running(store, job)
    if state is JobState.QUEUED:
        _cancel_queued(store, rq_redis, job)  # a reaper requeued it first
    return get(store, job_id, tenant)


def _cancel_queued(store: JobStore, rq_redis: Redis, job: JobRecord) -> JobState | None:
    """Cancel a queued job and take its RQ job off the queue. Returns the state it was in."""
    moved, now = store.jobs.transition(job.id, JobState.CANCELED, [JobState.QUEUED], "canceled before it started",
                                  error={"reason": "canceled", "message": "Canceled before it started."})
    if moved:
        Queue(job.queue, connection=rq_redis).remove(store.jobs.rq_job_id(job.id))
    return now


def _cancel_running(store: JobStore, job: JobRecord) -> JobState | None:
    """Raise the flag and wait for the worker to answer while its lease lives. A silent worker's attempt
    is canceled here, unless its lease changed hands. Returns the job's state after."""
    store.cancels.request_cancel(job.id)
    attempt = store.cancels.attempt(job.id)
    deadline = time.monotonic() + CANCEL_ANSWER_S
    while (attempt.state is JobState.RUNNING and attempt.lease_owner and not attempt.answered
           and time.monotonic() < deadline):
        time.sleep(CANCEL_POLL_S)
        attempt = store.cancels.attempt(job.id)
    if attempt.state is not JobState.RUNNING or (attempt.answered and attempt.lease_owner):
        return attempt.state  # it ended, was requeued, or its live worker stops it
    worker = attempt.lease_owner or (f"{job.worker.host}:{job.worker.pid}" if job.worker else "unknown")
    why = f"did not answer within {CANCEL_ANSWER_S:g} s" if attempt.lease_owner else "lost its lease"
    return store.cancels.cancel_lost(
        attempt, job.id, f"canceled at step {attempt.step}: worker {worker} {why}, presumed dead",
        error={"reason": "canceled",
               "message": f"Canceled at step {attempt.step}; its worker ({worker}) {why}, presumed dead."})


def layers(store: JobStore, job_id: str, tenant: str, after: int, limit: int) -> LayersPage:
    get(store, job_id, tenant)
    return store.history.read_layers(job_id, after, min(limit, MAX_PAGE))


def plan(store: JobStore, job_id: str, tenant: str) -> PlanView:
    """The precision plan of the job's first flagged layer check (docs/numerics.md, "Precision plan")."""
    job = get(store, job_id, tenant)
    after, flagged = 0, False
    while True:
        page = store.history.read_layers(job_id, after, MAX_PAGE)
        for check in page.checks:
            if check.plan is not None:
                fragment = spec_fragment(check.plan, job.spec.loss_scale.mode if job.spec.loss_scale else "none")
                fragment["layer_policies"] = {**{k: v.value for k, v in job.spec.layer_policies.items()},
                                              **check.plan.layer_policies}
                return PlanView(job_id=job_id, plan=check.plan, spec_fragment=fragment, keras=keras_lines(check.plan))
            flagged = flagged or check.underflow_layer is not None or check.overflow_layer is not None
        if page.next_after is None:
            break
        after = page.next_after
    if flagged:
        raise PlanNotFound(job_id, "its search failed on the first flagged layer check (the worker's log says why).")
    if job.spec.precision_policy.compute_dtype == "float32" and job.spec.fp8 is None:
        raise PlanNotFound(job_id, "it computes in float32, so nothing is planned.")
    if not job.state.terminal:
        raise PlanNotFound(job_id, f"it is {job.state.value}, and no layer check has found underflow or overflow "
                                   "yet; the first that does proposes one.")
    raise PlanNotFound(job_id, "no layer check found underflow or overflow: nothing needs pinning or scaling.")


def evaluations(store: JobStore, job_id: str, tenant: str, after: int, limit: int) -> EvaluationsPage:
    get(store, job_id, tenant)
    return store.evaluations.read(job_id, after, min(limit, MAX_PAGE))


CACHED_VIEW_SIZES = frozenset({500, 1000})
"""`max_points` values whose views are cached: the dashboard's and the documented ones. Others are
computed each time, so no client can fill Redis with a key per size."""
LIVE_VIEW_TTL_S = 1.0
"""A running job's cached view is at most this old; the SSE stream carries the newest steps."""


def buckets_json(store: JobStore, job_id: str, tenant: str, max_points: int) -> str:
    """The bucketed view as JSON, cached in Redis for the common sizes. An ended job's view can no
    longer change. A running job's is recomputed at most once a second by one caller, while
    the others are served the view from under a second ago: however many dashboards poll it,
    they never pile up recomputing it at once."""
    ended = get(store, job_id, tenant).state.terminal
    if max_points not in CACHED_VIEW_SIZES:
        return store.history.read_buckets(job_id, max_points).model_dump_json()
    fresh_s = VIEW_TTL_S if ended else LIVE_VIEW_TTL_S
    cached, fresh = store.views.cached_view(job_id, max_points)
    if cached is not None and (fresh or not store.views.claim_view_refresh(job_id, max_points, fresh_s)):
        return cached
    body = store.history.read_buckets(job_id, max_points).model_dump_json()
    store.views.cache_view(job_id, max_points, body, fresh_s)
    return body


def artifact(store: JobStore, settings: Settings, job_id: str, tenant: str) -> Path:
    get(store, job_id, tenant)
    path = settings.model_path(job_id)
    if not path.is_file():
        raise ArtifactNotFound(job_id, MODEL_ARTIFACT)
    return path


def readiness(rq_redis: Redis, workers: LiveWorkers, memory: MemoryGauge) -> Health:
    """Redis answers; live workers per queue; Redis's memory (a full Redis still serves reads and deletes)."""
    rq_redis.ping()
    counts = {name: workers.count(name) for name in queues.QUEUES}
    return Health(status="ok" if any(counts.values()) else "no_workers", redis="ok", workers=counts,
                  redis_memory=memory.read())


# -- precision comparisons ---------------------------------------------------------


def submit_comparison(store: JobStore, rq_redis: Redis, spec: ComparisonSpec, tenant: str,
                      idempotency_key: str | None = None) -> tuple[ComparisonReport, bool]:
    """Queue one job per variant, same seed and data, all or none. Returns (comparison, created);
    a repeated Idempotency-Key returns the first comparison."""
    jobs = [(job_spec, queues.queue_for(job_spec)) for job_spec in spec.job_specs()]
    once = None if idempotency_key is None else IdempotencyKey.for_comparison(tenant, idempotency_key,
                                                                              spec.model_dump_json())
    comparison_id, created = store.comparisons.create_comparison(
        spec, tenant, jobs, lambda job_id, job_spec, pipe: queues.enqueue(rq_redis, job_spec, job_id, pipe),
        rq_redis.pipeline(transaction=True), once)
    report = get_comparison(store, comparison_id, tenant)
    control = [report.seed_control.job_id] if report.seed_control else []
    _note_dataset_use(store, spec, tenant, [variant.job_id for variant in report.variants] + control)
    return report, created


def _report(store: JobStore, record: ComparisonRecord) -> ComparisonReport:
    jobs = store.jobs.get_many(record.job_ids)
    if any(job is None for job in jobs):
        raise ComparisonNotFound(record.id)  # its jobs were deleted from Redis by hand
    return reports.build(record.id, record.name, record.created_at, record.spec,
                         [job for job in jobs if job is not None], store.artifacts_dir)


def get_comparison(store: JobStore, comparison_id: str, tenant: str) -> ComparisonReport:
    record = store.comparisons.get_comparison(comparison_id, tenant)
    if record is None:
        raise ComparisonNotFound(comparison_id)
    return _report(store, record)


def list_comparisons(store: JobStore, tenant: str, limit: int, cursor: int | None) -> ComparisonPage:
    records, next_cursor = store.comparisons.list_comparisons(tenant, limit, cursor)
    return ComparisonPage(comparisons=[_report(store, record) for record in records],
                          next_cursor=None if next_cursor is None else str(next_cursor))


def cancel_comparison(store: JobStore, rq_redis: Redis, comparison_id: str, tenant: str) -> ComparisonReport:
    """Cancel every variant that has not ended."""
    report = get_comparison(store, comparison_id, tenant)
    for variant in report.variants + ([report.seed_control] if report.seed_control else []):
        if not variant.state.terminal:
            cancel(store, rq_redis, variant.job_id, tenant)
    return get_comparison(store, comparison_id, tenant)

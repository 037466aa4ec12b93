"""What the API returns: job resources, pages, metric points and buckets."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel

from app.schemas import (
    ComparisonSpec,
    Diagnosis,
    JobSpec,
    LossScale,
    PrecisionPolicy,
    PrecisionSpeed,
    StepRecord,
    Summary,
)


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED})


class Transition(BaseModel):
    state: JobState
    at: str
    message: str


class Progress(BaseModel):
    step: int
    total_steps: int


class JobError(BaseModel):
    reason: str
    message: str


class WorkerInfo(BaseModel):
    host: str
    pid: int
    device: dict[str, Any]


class Job(BaseModel):
    id: str
    name: str | None
    state: JobState
    queue: str
    spec: JobSpec
    created_at: str
    started_at: str | None
    finished_at: str | None
    transitions: list[Transition]
    progress: Progress
    summary: Summary | None
    error: JobError | None
    attempt: int
    worker: WorkerInfo | None
    waiting_reason: str | None = None
    """Why a queued job is not starting, when no live worker listens on its queue."""
    comparison_id: str | None = None
    """The precision comparison this job is one variant of."""


class JobPage(BaseModel):
    jobs: list[Job]
    next_cursor: str | None
    """Pass as `cursor` for the next (older) page; null on the last page."""


class MetricsPage(BaseModel):
    job_id: str
    points: list[StepRecord]
    next_after: int | None
    """Pass as `after` for the next page; null when no more steps exist yet."""
    missing_steps: list[tuple[int, int]] = []
    """Inclusive step ranges that were trained but lost (e.g. to a Redis restart): gaps inside this
    page and, on an ended job's last page, the steps after the last one stored. Never filled in."""


class Stat(BaseModel):
    min: float | None
    mean: float | None
    max: float | None


class Bucket(BaseModel):
    first_step: int
    last_step: int
    steps: int
    loss: Stat
    grad_norm: Stat
    loss_scale: Stat
    skipped: int


class MetricsBuckets(BaseModel):
    job_id: str
    buckets: list[Bucket]
    total_steps: int
    """Steps recorded so far, all covered by the buckets."""


class VariantResult(BaseModel):
    label: str
    precision_policy: PrecisionPolicy
    loss_scale: LossScale | None
    baseline: bool
    """The float32 variant every other one is measured against."""
    job_id: str
    state: JobState
    progress: Progress
    final_loss: float | None
    loss_gap: float | None
    """(final_loss - float32's) / |float32's|: 0.008 is 0.8% worse than float32."""
    examples_per_sec: float | None
    """Throughput of the variant's own training run. Variants may run at different times or on
    different workers, so it is not their speed against float32: `speed` is."""
    speed: PrecisionSpeed | None = None
    """Step time against float32's, all variants timed in turns by the baseline job (worker/speed.py)."""
    speed_error: str | None = None
    """Why the variant could not be timed, when it could not."""
    skipped_steps: int | None
    peak_zero_grad_fraction: float | None
    peak_excess_zero_fraction: float | None = None
    """Largest share of gradient values zero under the variant's policy but not in float32 (checked steps)."""
    diagnoses: list[Diagnosis]
    error: JobError | None
    device: str | None
    """The device kind the variant trained on."""


class Comparison(BaseModel):
    id: str
    name: str | None
    created_at: str
    state: str
    """`running` until every variant's job has ended, then `done`."""
    spec: ComparisonSpec
    variants: list[VariantResult]
    verdict: str
    """The result in one paragraph of plain words."""


class ComparisonPage(BaseModel):
    comparisons: list[Comparison]
    next_cursor: str | None


class ErrorBody(BaseModel):
    detail: str


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "API keys are configured and this request has no valid one"},
    503: {"model": ErrorBody, "description": "Redis is unreachable"},
}
JOB_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    404: {"model": ErrorBody, "description": "No such job (or another tenant's)"},
}


class Health(BaseModel):
    status: str
    redis: str | None = None
    workers: dict[str, int] | None = None

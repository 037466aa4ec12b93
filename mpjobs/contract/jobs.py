"""A job as the store keeps it and both processes read it: states, transitions, progress, worker, metric pages."""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import Any

from pydantic import BaseModel

from mpjobs.contract.records import EvalRecord, LayerCheck, StepRecord, Summary
from mpjobs.contract.spec import JobSpec


class FailureReason(StrEnum):
    """Why a job failed. Stable strings: they are part of the API."""

    INVALID_SPEC = "invalid_spec"
    INVALID_MODEL = "invalid_model"
    INVALID_DATASET = "invalid_dataset"
    DIVERGED = "diverged"
    UNSUPPORTED_PRECISION_ON_DEVICE = "unsupported_precision_on_device"
    TIMEOUT = "timeout"
    OUT_OF_MEMORY = "out_of_memory"
    CANCELED = "canceled"
    WORKER_LOST = "worker_lost"
    INTERNAL = "internal"


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
    gpus: list[str] = []
    """The host's GPUs the worker was pinned to (its slot's CUDA_VISIBLE_DEVICES); [] when not pinned."""


class JobRecord(BaseModel):
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
    notes: list[str] = []
    """What the spec asks for that will not do what it seems to (app/core/notes.py), e.g. loss scaling
    under float32."""
    phase: str | None = None
    """What a running job's attempt is doing: "building the model", "preparing the data", "training",
    "saving the model", "measuring speed against float32"... (published within a quarter second). None
    unless running."""


class JobPage(BaseModel):
    jobs: list[JobRecord]
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


class LayersPage(BaseModel):
    job_id: str
    checks: list[LayerCheck]
    """Layer checks in step order, each once."""
    next_after: int | None
    """Pass as `after` for the next page; null when no more checks exist yet."""


class EvaluationsPage(BaseModel):
    job_id: str
    evaluations: list[EvalRecord]
    """Evaluations on the held-out rows in step order, each once."""
    next_after: int | None
    """Pass as `after` for the next page; null when no more evaluations exist yet."""


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

"""A precision comparison as the API reports it: each variant's result against float32, and the verdict."""

from __future__ import annotations

from pydantic import BaseModel

from mpjobs.contract.jobs import JobError, JobState, Progress
from mpjobs.contract.records import Diagnosis, PrecisionSpeed
from mpjobs.contract.spec import ComparisonSpec, LossScale, PrecisionPolicy


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
    """Step time against float32's, all variants timed in turns by the baseline job (worker/numerics/speed.py)."""
    speed_error: str | None = None
    """Why the variant could not be timed, when it could not."""
    skipped_steps: int | None
    peak_zero_grad_fraction: float | None
    peak_excess_zero_fraction: float | None = None
    """Largest share of gradient values zero under the variant's policy but not in float32 (checked steps)."""
    underflow_layer: str | None = None
    """The first layer that loses gradients: where underflow begins, at the variant's first layer check
    that found one (its summary's `underflow_layer`)."""
    underflow_step: int | None = None
    diagnoses: list[Diagnosis]
    error: JobError | None
    device: str | None
    """The device kind the variant trained on."""


class ComparisonReport(BaseModel):
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
    comparisons: list[ComparisonReport]
    next_cursor: str | None

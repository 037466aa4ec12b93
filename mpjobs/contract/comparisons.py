"""A precision comparison as the API reports it: each variant's result against float32, and the verdict."""

from __future__ import annotations

from pydantic import BaseModel

from mpjobs.contract.fp8 import Fp8Spec
from mpjobs.contract.jobs import JobError, JobState, Progress
from mpjobs.contract.records import Diagnosis, PrecisionSpeed
from mpjobs.contract.spec import ComparisonSpec, LossScale, PrecisionPolicy


class HeldOut(BaseModel):
    """A variant's final held-out metric against float32's, paired on the same examples (docs/numerics.md)."""

    metric: str
    """`accuracy` (or the accuracy metric the spec names) when examples are classified, else `loss`."""
    value: float
    float32_value: float
    against: str = "float32"
    """The label of the run compared with: the float32 baseline, or float32 with another seed."""
    difference: float
    """value − float32_value: positive is better for accuracy, worse for loss."""
    low: float
    high: float
    """The interval of the difference at `confidence`."""
    confidence: float
    method: str
    """`mcnemar_exact_conditional` (0/1 decisions) or `paired_bootstrap` (2000 resamples, seed 0)."""
    examples: int
    p_value: float | None
    """Exact McNemar p-value (0/1 decisions only)."""


def held_out_words(h: HeldOut) -> str:
    """`held-out accuracy 0.950 vs float32's 0.947, difference +0.3 points (95% interval -0.8 to +1.4)`.

    Accuracy differences are in percentage points; loss differences in the loss's own units.
    """
    level = f"{h.confidence:.0%} interval"
    if h.metric == "loss":
        figures = f"{h.difference:+.4g} ({level} {h.low:+.4g} to {h.high:+.4g})"
        return f"held-out loss {h.value:.4g} vs {h.against}'s {h.float32_value:.4g}, difference {figures}"
    figures = f"{100 * h.difference:+.1f} points ({level} {100 * h.low:+.1f} to {100 * h.high:+.1f})"
    return f"held-out {h.metric} {h.value:.3f} vs {h.against}'s {h.float32_value:.3f}, difference {figures}"


class VariantResult(BaseModel):
    label: str
    precision_policy: PrecisionPolicy
    loss_scale: LossScale | None
    fp8: Fp8Spec | None = None
    """The variant's FP8 (None: none)."""
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
    held_out: HeldOut | None = None
    """The final held-out metric against float32's, when the spec has validation and both runs ended."""
    held_out_error: str | None = None
    """Why `held_out` could not be computed (for example, the runs held out different rows)."""


class ComparisonReport(BaseModel):
    id: str
    name: str | None
    created_at: str
    state: str
    """`running` until every variant's job has ended, then `done`."""
    spec: ComparisonSpec
    variants: list[VariantResult]
    seed_control: VariantResult | None = None
    """float32 trained with the next seed (`float32_seeds: 2`); its `held_out` is the seed noise."""
    verdict: str
    """The result in one paragraph of plain words."""


class ComparisonPage(BaseModel):
    comparisons: list[ComparisonReport]
    next_cursor: str | None

"""What a run reports: one record per step, diagnoses, speed checks and the summary (JSON has no NaN: null)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import (
    ConfigDict,
)

from mpjobs.contract.fp8 import Fp8Layers, Fp8Tensor
from mpjobs.contract.plan import PrecisionPlan
from mpjobs.contract.strict import Strict

# --- telemetry --------------------------------------------------------------


class StepRecord(Strict):
    """One optimizer step. Non-finite values are null (JSON has no NaN)."""

    step: int
    loss: float | None
    """That batch's unscaled loss, not Keras's running mean."""
    loss_scale: float
    grad_norm: float | None
    """Global L2 norm of the unscaled gradients."""
    grads_finite: bool
    skipped: bool
    """True when the update was not applied."""
    zero_grad_fraction: float
    """Share of gradient elements that are exactly zero, in float32 before any cast back
    to the variables' dtype. Zeros that float32 has too are not underflow: see below."""
    regularization_loss: float | None = None
    """The model's weight penalties at this step (None: the model has none). Not in `loss`."""
    excess_zero_fraction: float | None = None
    """On checked steps only: share of gradient values zero under the policy but not in float32."""
    grad_rel_error: float | None = None
    """On checked steps only: ||g_policy - g_float32|| / ||g_float32||, both unscaled."""
    fp8: list[Fp8Tensor] | None = None
    """An FP8 job's scaling state: each FP8 layer's inputs, kernel and output gradient (mpjobs/contract/fp8.py)."""
    learning_rate: float
    examples_per_sec: float
    step_time_ms: float
    time: float
    """Unix time at the end of the step."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


STEP_SCALARS = tuple(name for name in StepRecord.model_fields if name != "fp8")
"""The StepRecord fields that are one number or boolean each: the archive's typed columns and the CSV's."""


class DiagnosisCode(StrEnum):
    """Every diagnosis a summary can carry; docs/numerics.md says what earns each."""

    GRADIENT_UNDERFLOW = "gradient_underflow"
    OVERFLOW_SKIPS = "overflow_skips"
    DIVERGED = "diverged"
    SLOW_PRECISION_ON_DEVICE = "slow_precision_on_device"
    FLOAT32_FALLBACK = "float32_fallback"
    HALF_PRECISION_OUTPUT = "half_precision_output"
    LAYER_UNDERFLOW = "layer_underflow"
    ACTIVATION_OVERFLOW_RISK = "activation_overflow_risk"
    FP8_SATURATION = "fp8_saturation"
    FP8_UNDERFLOW = "fp8_underflow"
    FP8_SCALE_ZERO = "fp8_scale_zero"
    FP8_SCALE_STUCK = "fp8_scale_stuck"


class Diagnosis(Strict):
    code: DiagnosisCode
    message: str
    first_step: int | None
    layer: str | None = None
    """The layer the diagnosis names (a key of the job's layer checks), for the dashboard and CLI to link to."""


# --- per-layer numerics -----------------------------------------------------


class LayerNumerics(Strict):
    """One layer at one layer check (worker/numerics/layer_numerics.py): its gradient and its output activation.

    The gradient fields cover the layer's own trainable variables, unscaled, in float32, as
    the float32 check computes them; a layer without trainable variables has `values` 0 and
    null gradient fields. The activation fields describe the layer's output in the dtype it
    computes in (float16 under mixed_float16, float32 for a layer kept in float32).
    Magnitudes are given as base-2 logarithms: -24.0 is 2^-24, float16's smallest subnormal.
    """

    name: str
    kind: str
    """The layer's class, e.g. "Conv3D"."""
    values: int
    """Gradient values (its trainable variables' sizes added up); 0: nothing to train."""
    zero_fraction: float | None = None
    """Share of its gradient values that are exactly zero."""
    excess_zero_fraction: float | None = None
    """Share of its gradient values zero under the policy but not in float32 (null: no float32 reference)."""
    grads_finite: bool = True
    grad_norm: float | None = None
    """L2 norm of its unscaled gradient (null: no values, or not finite)."""
    grad_max_log2: float | None = None
    """log2 of its largest |g| (null: all zero, or not finite)."""
    grad_min_log2: float | None = None
    """log2 of its smallest non-zero |g|."""
    lost_min_log2: float | None = None
    """log2 of the smallest float32 |g| among the values the policy lost (null: none lost)."""
    grad_rel_error: float | None = None
    """||g_policy - g_float32|| / ||g_float32|| over its weights (null: no float32 reference, not finite, or
    float32's all zero)."""
    signal_values: int = 0
    """Values of the gradient that backpropagation brings to its output (0: not measured)."""
    signal_zero_fraction: float | None = None
    """Share of the gradient reaching its output that is exactly zero."""
    signal_excess_zero_fraction: float | None = None
    """Share of the gradient reaching its output that is zero under the policy but not in float32: where this
    starts, underflow begins, and every layer nearer the input inherits it."""
    activation_dtype: str | None = None
    """The dtype of its output (null: its output could not be read, e.g. a layer called twice)."""
    activation_finite: bool = True
    activation_max: float | None = None
    """Largest |a| of its output (null: not finite)."""
    activation_headroom_log2: float | None = None
    """log2(dtype's largest value / activation_max): doublings left before it overflows (null: all zero or
    not finite; 0 or less once it overflowed)."""
    activation_subnormal_fraction: float | None = None
    """Share of its output values that are not zero but below the dtype's smallest normal (2^-14 for float16)."""
    activation_zero_fraction: float | None = None
    """Share of its output values that are exactly zero (ReLU zeros included: not an underflow by itself)."""


class LayerCheck(Strict):
    """Every layer's numerics at one step, the layers in the model's order (input side first)."""

    step: int
    compute_dtype: str
    loss_scale: float
    """The loss scale in force at the step (the gradients are unscaled by it)."""
    layers: list[LayerNumerics]
    underflow_layer: str | None = None
    """The layer where gradient underflow begins at this step: the layer nearest the output (backpropagation
    reaches it first) where the gradient reaching its output loses values to zero, or else, where its weights'
    gradient does. Null: none flagged."""
    overflow_layer: str | None = None
    """The first layer, from the input, whose activations are within two doublings of overflow (or overflowed)."""
    recovery: Literal["recovered", "overflows_first", "not_by_scaling"] | None = None
    """On the first check that names an underflow layer, the same step tried again at doubling loss scales:
    "recovered" at `recovery_scale`, the smallest at which that layer loses no values and its gradient is
    within RECOVERED_REL_ERROR (10%) of float32's; "overflows_first": the
    step's gradients overflow at `recovery_scale` before the layer's come back; "not_by_scaling": up to
    `recovery_scale`, the largest at which they fit the dtype, the layer's stay lost. Null: not tried."""
    recovery_scale: float | None = None
    recovery_excess_zero_fraction: float | None = None
    """The underflow layer's excess zeros at `recovery_scale`."""
    recovery_grad_rel_error: float | None = None
    """The underflow layer's gradient error against float32 at `recovery_scale` (relative L2)."""
    plan: PrecisionPlan | None = None
    """On the first check that names an underflow or overflow layer: the precision plan proposed on its step."""
    time: float
    """Unix time of the check."""


SpeedDifference = Literal["slower", "faster", "none"]
"""What a speed check can tell: measurably slower or faster than float32, or no measurable difference."""


class PrecisionSpeed(Strict):
    """A policy's training speed against float32 on one device, measured in turns (worker/numerics/speed.py).

    Fresh copies of the model, built, compiled and warmed the same way, take turns
    training a few steps each on the same batches, round after round, in rotated
    order: the policy, float32, and a second float32 copy (the A/A pair that shows
    how much two identical sides differ on this machine now). Each round gives one
    ratio per side, its step time over float32's in that round; the figures are the
    median of those ratios and its 95% interval, so drift that hits all sides alike cancels.
    """

    policy_ms: float
    """Median step time under the policy."""
    float32_ms: float
    slowdown: float
    """Median over rounds of policy / float32 step time: above 1 the policy is slower here."""
    steps: int
    """Timed steps on each side."""
    low: float | None = None
    """Lower end of the median ratio's 95% interval (worker/numerics/speed.py `median_interval`; None on a
    record from before the interval existed)."""
    high: float | None = None
    """Upper end of that interval."""
    noise_low: float | None = None
    """Lower end of the same interval for float32 against float32 (the A/A noise of this measurement)."""
    noise_high: float | None = None
    rounds: int = 0
    difference: SpeedDifference = "none"
    """"slower" only when the whole interval lies above both 1 and the A/A noise, "faster" only when
    it lies below both; otherwise no measurable difference. See `speed_difference`."""

    @property
    def interval(self) -> tuple[float, float]:
        return (self.slowdown if self.low is None else self.low, self.slowdown if self.high is None else self.high)


def speed_difference(low: float, high: float, noise_low: float, noise_high: float) -> SpeedDifference:
    """Whether a slowdown interval [low, high] is beyond the A/A noise [noise_low, noise_high] and 1.

    >>> speed_difference(1.3, 1.5, 0.96, 1.05), speed_difference(0.97, 1.08, 0.96, 1.05)
    ('slower', 'none')
    >>> speed_difference(0.6, 0.7, 0.96, 1.05), speed_difference(1.03, 1.04, 0.99, 1.05)
    ('faster', 'none')
    """
    if low > max(1.0, noise_high):
        return "slower"
    if high < min(1.0, noise_low):
        return "faster"
    return "none"


class VariantSpeed(Strict):
    """One comparison variant timed by the float32 baseline job against float32 (worker/numerics/speed.py)."""

    label: str
    speed: PrecisionSpeed | None
    error: str | None = None
    """Why this variant could not be timed (it could not be built or trained here)."""
    slow_precision: str | None = None
    """The `slow_precision_on_device` message the measurement earned, if any."""


class EvalRecord(Strict):
    """One evaluation of the trained model, in the job's precision, on all held-out rows (null: not finite)."""

    step: int
    loss: float | None
    """The mean per-example loss over the held-out rows, the training loss's function, no weight penalties."""
    metrics: dict[str, float | None] = {}
    """Each of `validation.metrics` by name, over the held-out rows."""
    examples: int
    """Held-out rows evaluated: all of them, in batches of training.batch_size."""
    seconds: float
    """Wall time of this evaluation (predictions, loss and metrics)."""
    time: float
    """Unix time at its end."""


class DataUse(Strict):
    """What training did with the data (worker/engine/data.py): stated, so no one has to guess."""

    rows: int
    """Rows trained on (after any held-out split)."""
    held_out_rows: int = 0
    """Rows evaluated on, never trained on: a split of the data, or a dataset of their own."""
    steps_per_epoch: int
    """rows // batch_size: each epoch is one pass over a fresh permutation of the rows."""
    epochs: float
    """Steps done / steps_per_epoch."""
    dropped_per_epoch: int
    """rows % batch_size: the last partial batch of each epoch is dropped (other rows each epoch)."""
    shuffle: str = "each epoch e: numpy.random.default_rng([training.seed, e]).permutation(rows)"


class Summary(Strict):
    steps_done: int
    final_loss: float | None
    """Mean batch loss over the last steps (up to 10), so one batch cannot decide it."""
    skipped_steps: int
    loss_scale_min: float | None
    loss_scale_max: float | None
    loss_scale_final: float | None
    peak_zero_grad_fraction: float | None
    mean_examples_per_sec: float | None
    float32_checks: int = 0
    """Steps whose gradient was compared with float32's."""
    peak_excess_zero_fraction: float | None = None
    """Largest `excess_zero_fraction` over the checked steps."""
    peak_grad_rel_error: float | None = None
    """Largest `grad_rel_error` over the checked steps."""
    float32_check_error: str | None = None
    """Why the float32 check stopped, if it failed (the job trained on without it)."""
    precision_speed: PrecisionSpeed | None = None
    """On a CPU, for a float16/bfloat16 policy that succeeded: its speed against float32 there."""
    variant_speeds: list[VariantSpeed] = []
    """A comparison's float32 baseline only: every other variant's speed against float32, timed in turns."""
    layer_checks: int = 0
    """Steps whose per-layer numerics were recorded (GET /jobs/{id}/layers)."""
    underflow_layer: str | None = None
    """The layer where gradient underflow begins, at the first layer check that found one."""
    underflow_step: int | None = None
    overflow_layer: str | None = None
    """The first layer whose activations came within two doublings of overflow, at the first check that saw one."""
    overflow_step: int | None = None
    diagnoses: list[Diagnosis] = []
    validation: EvalRecord | None = None
    """The final evaluation on the held-out rows (null: no `validation` in the spec)."""
    data: DataUse | None = None
    """What training did with the data: rows, epochs, shuffling, the dropped partial batch."""
    plan: PrecisionPlan | None = None
    """With `spec.plan: "auto"`: the precision plan of the job's step 1, which it trained with."""
    fp8: Fp8Layers | None = None
    """An FP8 job's FP8 layers and the layers that kept their policy."""
    steps_per_call: int | None = None
    """The most steps one compiled call ran in the last attempt (`training.steps_per_execution`); each step's
    `step_time_ms` is its call's time shared evenly. None before the first call."""

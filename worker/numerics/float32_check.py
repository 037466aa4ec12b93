"""The float32 check: a step's gradient under the job's policy against the same step in float32.

Zeros alone do not mean underflow. Dead ReLUs, unused embedding rows and masked
positions have zero gradients in float32 too, and no loss scale can change
that. So a job whose policy computes in float16 or bfloat16 checks itself: at
step 1 and at every step that is a multiple of `training.underflow_check_every`,
before that step trains, it computes the step's gradient twice, on the step's
own weights and batch:

- under the job's policy, at the loss scale in force, unscaled in float32;
- in a float32 twin of the model (same layers, every one in float32), unscaled.

The step's record then carries `excess_zero_fraction` (the share of gradient values that are zero
under the policy but not in float32) and `grad_rel_error` (||g_policy - g_float32|| / ||g_float32||).
A check whose excess zeros reach `UNDERFLOW_EXCESS` of all values, or `UNDERFLOW_EXCESS_ONE_TENSOR` of
one weight tensor's, is flagged. The first flagged check also tries the step again at a larger scale
(from the smallest lost float32 magnitudes against the dtype's smallest value, capped where the largest
gradients would overflow) to say whether scaling recovers the lost values, and at about what scale.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
from keras import ops

from mpjobs.contract.plan import PrecisionPlan
from mpjobs.contract.records import LayerCheck
from worker.numerics.fp8_counts import Fp8Counter
from worker.numerics.gradients import GradientFn, current_values, gradient_fn
from worker.numerics.layer_numerics import (
    SMALLEST,
    LayerProbe,
    StepArrays,
    flagged_share,
    floor_percent,
    layer_check,
    measure,
    scale_text,
)
from worker.numerics.plan import Candidates, search
from worker.numerics.scale_search import doublings, how_to_scale, largest_scale, layer_recovery, power_of_two
from worker.telemetry.fp8_state import weight_indices
from worker.telemetry.optimizer import TelemetryOptimizer
from worker.telemetry.step_vector import CALL_STEPS_KEY

log = logging.getLogger(__name__)

UNDERFLOW_EXCESS = 0.01  # A check is flagged when this share of all gradient values is zero only under the policy,
__all__ = ["UNDERFLOW_EXCESS", "CheckResult", "Float32Check", "floor_percent"]


@dataclass(frozen=True)
class CheckResult:
    step: int
    scale: float
    """The loss scale in force at the step."""
    excess_zero_fraction: float
    grad_rel_error: float | None
    """None when the policy's gradient is not finite, or float32's is all zero."""
    worst_variable: str | None
    """The weight tensor with the largest share of excess zeros (None: no excess zeros)."""
    worst_share: float
    flagged: bool
    advice: str | None = None
    """On the first flagged check: whether a larger scale recovers the lost values, and at what scale."""


@dataclass(frozen=True)
class _Comparison:
    excess: float
    rel_error: float | None
    per_tensor: list[float]
    counts: list[int]
    sizes: list[int]
    finite: bool


def _compare(policy: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> _Comparison:
    total = sum(g.size for g in reference)
    lost = [(p == 0) & (r != 0) for p, r in zip(policy, reference, strict=True)]
    counts = [int(np.count_nonzero(m)) for m in lost]
    finite = all(bool(np.isfinite(p).all()) for p in policy)
    ref_sq = math.fsum(float(np.sum(np.square(r, dtype=np.float64))) for r in reference)
    diff_sq = math.fsum(float(np.sum(np.square(p.astype(np.float64) - r))) for p, r in
                        zip(policy, reference, strict=True))
    rel = math.sqrt(diff_sq / ref_sq) if finite and ref_sq > 0 else None
    return _Comparison(sum(counts) / total if total else 0.0, rel,
                       [c / g.size if g.size else 0.0 for c, g in zip(counts, reference, strict=True)],
                       counts, [g.size for g in reference], finite)


def _flagged(c: _Comparison) -> bool:
    return c.excess >= UNDERFLOW_EXCESS or any(map(flagged_share, c.counts, c.sizes))


def _due(every: int, step: int) -> bool:
    return every > 0 and (step == 1 or step % every == 0)


class Float32Check(keras.callbacks.Callback):
    """Runs the checks before the steps they are due on; the results wait in `results` and
    `layer_results` for the step's record.

    Args:
        build_twin: builds the float32 twin (called once, at the first check).
        loss: the compiled loss (`worker.telemetry.batch_loss.compiled_loss`).
        every: check at step 1 and at multiples of this; 0 never (always 0 under a float32 policy).
        layer_every: record the layer checks (worker/numerics/layer_numerics.py) at step 1 and multiples of
            this; 0 never.
        start_step: the step before the first one this attempt trains.
        batch_size: rows per step in the segments `fit` trains.
        compute_dtype: the policy's compute dtype ("float16", "bfloat16", or "float32": layer checks only,
            without a twin).
        mode: the loss-scale mode ("none", "fixed", "dynamic").
        need_advice: whether a flagged check should still try a larger scale.
        on_error: told, in words, when a check fails; checks then stop and training goes on.
        build_pinned: builds the job's model with some layers in float32 (worker/numerics/plan.py): with it,
            the first layer check that flags a layer carries a precision plan; None, no plan.
        always_plan: search for a plan on the first layer check even when it flags nothing (`plan: "auto"`).
        fp8: the model has FP8 layers: compare with float32 whatever `compute_dtype`, and count each FP8 tensor's
            saturated and lost values at every check (worker/numerics/fp8_counts.py) into `fp8_counts`.
    """

    def __init__(self, *, build_twin: Callable[[], keras.Model], loss: keras.losses.Loss, every: int,
                 start_step: int, batch_size: int, compute_dtype: str, mode: str,
                 need_advice: Callable[[], bool], on_error: Callable[[str], None] = lambda message: None,
                 layer_every: int = 0, clock: Callable[[], float] = time.time, always_plan: bool = False,
                 build_pinned: Callable[[dict[str, str]], keras.Model] | None = None, fp8: bool = False) -> None:
        super().__init__()
        self.on_error, self.clock = on_error, clock
        self.build_twin, self.loss = build_twin, loss
        self.compare, self.fp8 = compute_dtype != "float32" or fp8, None if not fp8 else Fp8Counter(loss)
        self.fp8_counts: dict[int, dict[tuple[str, str], tuple[float, float]]] = {}
        self.every, self.layer_every = (every if self.compare else 0), layer_every
        self.step, self.batch_size = start_step, batch_size
        self.compute_dtype, self.mode, self.need_advice = compute_dtype, mode, need_advice
        self.segment: tuple[np.ndarray, np.ndarray] | None = None
        """The (x, y) that the current `fit` call trains: set by the engine before each call."""
        self.results: dict[int, CheckResult] = {}
        self.layer_results: dict[int, LayerCheck] = {}
        self._twin: keras.Model | None = None
        self._probe: LayerProbe | None = None
        self._policy_grads: GradientFn | None = None
        self._twin_grads: GradientFn | None = None
        self._scale_index: int | None = None
        self._recovery_tried = False
        self.build_pinned, self._plan_tried, self.always_plan = build_pinned, False, always_plan

    def due(self, step: int) -> bool:
        return _due(self.every, step) or _due(self.layer_every, step)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Check the call's first step (`batch`: its index in the segment) when due; a call of several
        steps (logs' CALL_STEPS_KEY) starts at its check step, and the steps after it are not due."""
        step = self.step + 1
        self.step += int((logs or {}).get(CALL_STEPS_KEY, 1))
        if not self.due(step) or self.segment is None:
            return
        x, y = self.segment
        rows = slice(batch * self.batch_size, (batch + 1) * self.batch_size)
        try:
            self.check(step, x[rows], y[rows])
        except Exception as exc:  # a diagnostic: the job trains on without it, and says why
            log.warning("the float32 check failed at step %d; no more checks this attempt", step, exc_info=True)
            what = "float32 check" if self.compare else "layer check"
            self.every = self.layer_every = 0
            self.on_error(f"The {what} failed at step {step} and was turned off: "
                          f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}")

    def _scale(self) -> float:
        if self.mode == "none":
            return 1.0
        optimizer: TelemetryOptimizer = self.model.optimizer
        state = getattr(self.model, "_jax_state", None)
        if state:
            if self._scale_index is None:
                self._scale_index = [v.path for v in optimizer.variables].index(optimizer.loss_scale.path)
            return float(np.asarray(state["optimizer_variables"][self._scale_index]))
        return float(ops.convert_to_numpy(optimizer.loss_scale.value))

    def _policy(self, x: np.ndarray, y: np.ndarray, scale: float) -> tuple[list[np.ndarray], Any, list[Any]]:
        """The policy's unscaled gradient at `scale` as float32 NumPy arrays, the probe's statistics, and the
        gradient reaching each probed layer's output."""
        if self._policy_grads is None:
            if self.layer_every > 0:
                self._probe = self._start_probe()
            self._policy_grads = gradient_fn(self.model, self.loss, self._probe)
        trainable, non_trainable = current_values(self.model)
        grads, stats, signals = self._policy_grads(trainable, non_trainable, x, y,
                                                   ops.convert_to_tensor(scale, "float32"))
        return ([np.asarray(ops.convert_to_numpy(g)) for g in grads], [ops.convert_to_numpy(s) for s in stats],
                [ops.convert_to_numpy(g) for g in signals])

    def _start_probe(self) -> LayerProbe | None:
        """The layer probe, or None with the layer checks off (said in words) when the model's layers cannot
        be read one by one: the float32 check goes on without them."""
        try:
            return LayerProbe(self.model)
        except Exception as exc:
            log.warning("layer checks could not start; the float32 check goes on without them", exc_info=True)
            self.layer_every = 0
            self.on_error(f"The layer checks could not start and were turned off: {type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}")
            return None

    def _reference(self, x: np.ndarray, y: np.ndarray) -> tuple[list[np.ndarray], list[Any]]:
        """The float32 twin's gradient on the model's weights, as float32 NumPy arrays, and its signals."""
        if self._twin is None:
            self._twin = self.build_twin()
            probe = LayerProbe(self._twin) if self.layer_every > 0 else None
            self._twin_grads = gradient_fn(self._twin, self.loss, probe)
        assert self._twin_grads is not None
        trainable, non_trainable = current_values(self.model)
        trainable = [trainable[i] for i in weight_indices(self.model.trainable_variables)]  # no FP8 state
        as_float32 = [ops.cast(v, "float32") if "float" in str(v.dtype) else v for v in trainable]
        twin_non_trainable = [ops.cast(v, t.dtype) for v, t in zip(non_trainable, self._twin.non_trainable_variables,
                                                                  strict=True)]
        grads, _, signals = self._twin_grads(as_float32, twin_non_trainable, x, y,
                                             ops.convert_to_tensor(1.0, "float32"))
        return [np.asarray(ops.convert_to_numpy(g)) for g in grads], [ops.convert_to_numpy(g) for g in signals]

    def check(self, step: int, x: np.ndarray, y: np.ndarray) -> None:
        """The checks due at `step`, on its batch: into `results` and `layer_results`."""
        scale = self._scale()
        if self.fp8 is not None:
            self.fp8_counts[step] = self.fp8(self.model, x, y, scale)
        policy, stats, signals = self._policy(x, y, scale)
        reference, reference_signals = self._reference(x, y) if self.compare else (None, [])
        if _due(self.layer_every, step) and self._probe is not None:
            arrays = StepArrays(policy, reference, stats, signals, reference_signals)
            result = layer_check(step, self.compute_dtype, scale, self.clock(), measure(self._probe.groups, arrays))
            if result.underflow_layer is not None and reference is not None and not self._recovery_tried:
                self._recovery_tried = True
                result = self._layer_recovery(result, x, y, arrays)
            flagged = result.underflow_layer is not None or result.overflow_layer is not None or self.always_plan
            if flagged and reference is not None and not self._plan_tried and self.build_pinned is not None:
                self._plan_tried = True
                result = result.model_copy(update={"plan": self._plan(result, x, y, reference, reference_signals)})
            self.layer_results[step] = result
        if reference is None or not _due(self.every, step):
            return
        c = _compare(policy, reference)
        names = [self.model.trainable_variables[i].path for i in weight_indices(self.model.trainable_variables)]
        worst = int(np.argmax(c.per_tensor)) if c.per_tensor and max(c.per_tensor) > 0 else None
        flagged = _flagged(c)
        advice = None
        if flagged and self.need_advice():
            lost = np.concatenate([np.abs(r[(p == 0) & (r != 0)]) for p, r in zip(policy, reference, strict=True)])
            advice = self._advice(step, x, y, scale, c, reference, lost)
        self.results[step] = CheckResult(step, scale, c.excess, c.rel_error, None if worst is None else names[worst],
                                         0.0 if worst is None else c.per_tensor[worst], flagged, advice)

    def _plan(self, check: LayerCheck, x: np.ndarray, y: np.ndarray, reference: list[np.ndarray],
              reference_signals: list[Any]) -> PrecisionPlan | None:
        """The precision plan of this step (worker/numerics/plan.py); None, logged, when the search fails."""
        assert self._probe is not None and self.build_pinned is not None
        try:
            candidates = Candidates(self.build_pinned, self.loss, self.model, current_values(self.model), x, y,
                                    reference, reference_signals)
            names = [g.name for g in self._probe.groups if g.name != self.model.name]
            return search(check, self.model.dtype_policy.name, names, candidates,
                          largest_scale(reference, self.compute_dtype))
        except Exception:
            log.warning("the precision plan's search failed at step %d", check.step, exc_info=True)
            return None

    def _layer_recovery(self, check: LayerCheck, x: np.ndarray, y: np.ndarray, arrays: StepArrays) -> LayerCheck:
        assert self._probe is not None
        group = next(g for g in self._probe.groups if g.name == check.underflow_layer)
        return layer_recovery(check, group, arrays, self.compute_dtype, lambda scale: self._policy(x, y, scale))

    def _advice(self, step: int, x: np.ndarray, y: np.ndarray, scale: float, c: _Comparison,
                reference: list[np.ndarray], lost: np.ndarray) -> str:
        """Try the step again at doubling scales (worker/numerics/scale_search.py): does one recover the lost values
        without overflow?"""
        dtype = self.compute_dtype
        cap = largest_scale(reference, dtype)
        estimate = power_of_two(SMALLEST[dtype] / float(lost.min()), up=True)
        lost_share = floor_percent(c.excess)
        what = f"{lost_share} of gradient values were lost at loss scale {scale_text(scale)} (the smallest " + (
            f"lost float32 magnitude, {lost.min():.2g}, would need {scale_text(estimate)} to clear {dtype}'s smallest "
            f"value, {SMALLEST[dtype]:.2g})" if estimate > scale else
            f"lost float32 magnitude, {lost.min():.2g}, is far above {dtype}'s smallest value, {SMALLEST[dtype]:.2g})")
        keep_float32 = ("Keep the layers with the smallest gradients in float32"
                        + (", or use mixed_bfloat16, whose range is float32's." if dtype == "float16" else "."))
        after, tried = c, scale
        for tried in doublings(scale, cap):
            policy, _, _ = self._policy(x, y, tried)
            after = _compare(policy, reference)
            if not after.finite:
                return (f"No loss scale fits: on step {step}, {what}; up to {scale_text(tried / 2)} too many stay "
                        f"lost, and at {scale_text(tried)} the same step's gradients overflow {dtype}. {keep_float32}")
            if not _flagged(after):
                return (f"A larger scale recovers them: on step {step}, {what}; at {scale_text(tried)}, the smallest "
                        f"scale that recovered them, the same step lost only {floor_percent(after.excess)}. "
                        + how_to_scale(self.mode, tried))
        return (
            f"A larger loss scale does not help: on step {step}, {what}, and at {scale_text(tried)} (the largest at "
            f"which its gradients fit in {dtype}) it still lost {floor_percent(after.excess)}. These values are "
            f"lost to {dtype}'s precision in the forward pass (activations that round to zero or tip a ReLU), not to "
            "gradient underflow. Run the most affected layer in float32 if they matter."
        )

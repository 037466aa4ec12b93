"""The float32 check: a step's gradient under the job's policy against the same step in float32.

Zeros alone do not mean underflow. Dead ReLUs, unused embedding rows and masked
positions have zero gradients in float32 too, and no loss scale can change
that. So a job whose policy computes in float16 or bfloat16 checks itself: at
step 1 and at every step that is a multiple of `training.underflow_check_every`,
before that step trains, it computes the step's gradient twice, on the step's
own weights and batch:

- under the job's policy, at the loss scale in force, unscaled in float32;
- in a float32 twin of the model (same layers, every one in float32), unscaled.

The step's record then carries `excess_zero_fraction` (the share of gradient
values that are zero under the policy but not in float32) and
`grad_rel_error` (||g_policy - g_float32|| / ||g_float32||). A check whose
excess zeros reach `UNDERFLOW_EXCESS` of all values, or `UNDERFLOW_EXCESS_ONE_TENSOR`
of one weight tensor's, is flagged. The first flagged check also tries the
step again at a larger scale (estimated from the smallest float32 magnitudes
that were lost, against the compute dtype's smallest positive value, and capped
where the largest gradients would overflow) to say whether scaling recovers
the lost values, and at about what scale.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
from keras import ops

from worker.optimizer import TelemetryOptimizer, dense

log = logging.getLogger(__name__)

UNDERFLOW_EXCESS = 0.01
"""A check is flagged when this share of all gradient values is zero under the policy but not in float32,"""
UNDERFLOW_EXCESS_ONE_TENSOR = 0.05
"""... or this share of one weight tensor's values (partial underflow of one layer),"""
UNDERFLOW_MIN_VALUES_ONE_TENSOR = 16
"""... when that is at least this many values: one bias value of 16 that float16 rounds to exactly
zero where float32 keeps a remainder is rounding, not a layer that stopped learning. Below these
thresholds lie the zeros that half precision makes by rounding alone: on our small CNN under
mixed_bfloat16, 0.13% of values (max-pooling ties, ReLUs tipped by rounding), no layer over 0.2%."""
MAX_TRIED_SCALE = 2.0**40
"""No recovery scale above this is tried: larger than any scale used in practice."""
SMALLEST = {"float16": 2.0**-24, "bfloat16": 2.0**-133}
"""The smallest positive value (subnormal) of each compute dtype."""
LARGEST = {"float16": 65504.0, "bfloat16": 3.3895e38}


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


def _gradient_fn(model: keras.Model, loss: keras.losses.Loss) -> Callable[..., list[Any]]:
    """(trainable, non_trainable, x, y, scale) -> the unscaled float32 gradient, one dense array per weight."""

    def scaled_loss(trainable: list[Any], non_trainable: list[Any], x: Any, y: Any, scale: Any) -> Any:
        y_pred, _, penalties = model.stateless_call(trainable, non_trainable, x, training=True, return_losses=True)
        value = ops.cast(loss(y, y_pred), "float32")
        for penalty in penalties:
            value = value + ops.cast(ops.sum(penalty), "float32")
        return value * scale

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function(reduce_retracing=True)
        def tf_gradients(trainable: list[Any], non_trainable: list[Any], x: Any, y: Any, scale: Any) -> list[Any]:
            with tf.GradientTape() as tape:
                tape.watch(trainable)
                value = scaled_loss(trainable, non_trainable, x, y, scale)
            grads = tape.gradient(value, trainable)
            return [tf.zeros(t.shape, "float32") if g is None else tf.cast(dense(g), "float32") / scale
                    for g, t in zip(grads, trainable, strict=True)]

        return tf_gradients
    if backend == "jax":
        import jax

        def jax_gradients(trainable: list[Any], non_trainable: list[Any], x: Any, y: Any, scale: Any) -> list[Any]:
            grads = jax.grad(scaled_loss)(trainable, non_trainable, x, y, scale)
            return [ops.cast(g, "float32") / scale for g in grads]

        return jax.jit(jax_gradients)
    raise NotImplementedError(f"the float32 check supports the tensorflow and jax backends, not {backend}")


def _values(model: keras.Model) -> tuple[list[Any], list[Any]]:
    """The model's current weights: under JAX, `fit` keeps them outside the variables."""
    state = getattr(model, "_jax_state", None)
    if state:
        return list(state["trainable_variables"]), list(state["non_trainable_variables"])
    return [v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables]


@dataclass(frozen=True)
class _Comparison:
    excess: float
    rel_error: float | None
    per_tensor: list[float]
    counts: list[int]
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
                       counts, finite)


def _flagged(c: _Comparison) -> bool:
    return c.excess >= UNDERFLOW_EXCESS or any(
        share >= UNDERFLOW_EXCESS_ONE_TENSOR and count >= UNDERFLOW_MIN_VALUES_ONE_TENSOR
        for share, count in zip(c.per_tensor, c.counts, strict=True))


def floor_percent(share: float) -> str:
    """A share as a percentage, never rounded up to 100% (nor down to 0% when not zero)."""
    if 0 < share < 0.0001:
        return "<0.01%"
    return f"{math.floor(share * 10000) / 100:g}%"


def _scale(value: float) -> str:
    """A loss scale as people write it: 1024, or 2^40 when long."""
    exponent = math.log2(value)
    return f"2^{exponent:g}" if exponent.is_integer() and value >= 2**20 else f"{value:g}"


def _power_of_two(value: float, up: bool) -> float:
    return 2.0 ** (math.ceil(math.log2(value)) if up else math.floor(math.log2(value)))


class Float32Check(keras.callbacks.Callback):
    """Runs the check before the steps it is due on; the results wait in `results` for the step's record.

    Args:
        build_twin: builds the float32 twin (called once, at the first check).
        loss: the compiled loss (`worker.telemetry.compiled_loss`).
        every: check at step 1 and at multiples of this; 0 never.
        start_step: the step before the first one this attempt trains.
        batch_size: rows per step in the segments `fit` trains.
        compute_dtype: the policy's compute dtype ("float16" or "bfloat16").
        mode: the loss-scale mode ("none", "fixed", "dynamic").
        need_advice: whether a flagged check should still try a larger scale.
        on_error: told, in words, when a check fails; checks then stop and training goes on.
    """

    def __init__(self, *, build_twin: Callable[[], keras.Model], loss: keras.losses.Loss, every: int,
                 start_step: int, batch_size: int, compute_dtype: str, mode: str,
                 need_advice: Callable[[], bool], on_error: Callable[[str], None] = lambda message: None) -> None:
        super().__init__()
        self.on_error = on_error
        self.build_twin, self.loss, self.every = build_twin, loss, every
        self.step, self.batch_size = start_step, batch_size
        self.compute_dtype, self.mode, self.need_advice = compute_dtype, mode, need_advice
        self.segment: tuple[np.ndarray, np.ndarray] | None = None
        """The (x, y) that the current `fit` call trains: set by the engine before each call."""
        self.results: dict[int, CheckResult] = {}
        self._twin: keras.Model | None = None
        self._policy_grads: Callable[..., list[Any]] | None = None
        self._twin_grads: Callable[..., list[Any]] | None = None
        self._scale_index: int | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and (step == 1 or step % self.every == 0)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.step += 1
        if not self.due(self.step) or self.segment is None:
            return
        x, y = self.segment
        rows = slice(batch * self.batch_size, (batch + 1) * self.batch_size)
        try:
            self.results[self.step] = self.check(self.step, x[rows], y[rows])
        except Exception as exc:  # a diagnostic: the job trains on without it, and says why
            log.warning("the float32 check failed at step %d; no more checks this attempt", self.step, exc_info=True)
            self.every = 0
            self.on_error(f"The float32 check failed at step {self.step} and was turned off: "
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

    def _gradients(self, x: np.ndarray, y: np.ndarray, scale: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(policy's unscaled gradient at `scale`, float32 twin's gradient), as float32 NumPy arrays."""
        model = self.model
        if self._twin is None:
            self._twin = self.build_twin()
            self._policy_grads = _gradient_fn(model, self.loss)
            self._twin_grads = _gradient_fn(self._twin, self.loss)
        assert self._policy_grads is not None and self._twin_grads is not None
        trainable, non_trainable = _values(model)
        policy = self._policy_grads(trainable, non_trainable, x, y, ops.convert_to_tensor(scale, "float32"))
        as_float32 = [ops.cast(v, "float32") if "float" in str(v.dtype) else v for v in trainable]
        twin_non_trainable = [ops.cast(v, t.dtype) for v, t in zip(non_trainable, self._twin.non_trainable_variables,
                                                                  strict=True)]
        reference = self._twin_grads(as_float32, twin_non_trainable, x, y, ops.convert_to_tensor(1.0, "float32"))
        return [np.asarray(ops.convert_to_numpy(g)) for g in policy], [np.asarray(ops.convert_to_numpy(g))
                                                                         for g in reference]

    def check(self, step: int, x: np.ndarray, y: np.ndarray) -> CheckResult:
        scale = self._scale()
        policy, reference = self._gradients(x, y, scale)
        c = _compare(policy, reference)
        names = [v.path for v in self.model.trainable_variables]
        worst = int(np.argmax(c.per_tensor)) if c.per_tensor and max(c.per_tensor) > 0 else None
        flagged = _flagged(c)
        advice = None
        if flagged and self.need_advice():
            lost = np.concatenate([np.abs(r[(p == 0) & (r != 0)]) for p, r in zip(policy, reference, strict=True)])
            advice = self._advice(step, x, y, scale, c, reference, lost)
        return CheckResult(step, scale, c.excess, c.rel_error, None if worst is None else names[worst],
                           0.0 if worst is None else c.per_tensor[worst], flagged, advice)

    def _advice(self, step: int, x: np.ndarray, y: np.ndarray, scale: float, c: _Comparison,
                reference: list[np.ndarray], lost: np.ndarray) -> str:
        """Try the step again at doubling scales: does one recover the lost values without overflow?

        The smallest float32 magnitude lost against the dtype's smallest positive value says
        about how far the gradient fell short, but the gradients flowing between layers can be
        smaller than any weight's, so the scales are tried on the step itself: from twice the
        scale in force up to where the largest float32 gradient would no longer fit the dtype.
        """
        dtype = self.compute_dtype
        peak = max((float(np.abs(r).max()) for r in reference if r.size), default=0.0)
        cap = min(MAX_TRIED_SCALE, _power_of_two(LARGEST[dtype] / peak, up=False) if peak > 0 else MAX_TRIED_SCALE)
        estimate = _power_of_two(SMALLEST[dtype] / float(lost.min()), up=True)
        lost_share = floor_percent(c.excess)
        what = f"{lost_share} of gradient values were lost at loss scale {_scale(scale)} (the smallest " + (
            f"lost float32 magnitude, {lost.min():.2g}, would need {_scale(estimate)} to clear {dtype}'s smallest "
            f"value, {SMALLEST[dtype]:.2g})" if estimate > scale else
            f"lost float32 magnitude, {lost.min():.2g}, is far above {dtype}'s smallest value, {SMALLEST[dtype]:.2g})")
        keep_float32 = ("Keep the layers with the smallest gradients in float32"
                        + (", or use mixed_bfloat16, whose range is float32's." if dtype == "float16" else "."))
        after, tried = c, scale
        while tried * 2 <= cap:
            tried *= 2
            policy, _ = self._gradients(x, y, tried)
            after = _compare(policy, reference)
            if not after.finite:
                return (f"No loss scale fits: on step {step}, {what}; up to {_scale(tried / 2)} too many stay "
                        f"lost, and at {_scale(tried)} the same step's gradients overflow {dtype}. {keep_float32}")
            if not _flagged(after):
                return (f"A larger scale recovers them: on step {step}, {what}; at {_scale(tried)}, the smallest "
                        f"scale that recovered them, the same step lost only {floor_percent(after.excess)}. "
                        + self._how(tried))
        return (
            f"A larger loss scale does not help: on step {step}, {what}, and at {_scale(tried)} (the largest at "
            f"which its gradients fit in {dtype}) it still lost {floor_percent(after.excess)}. These values are "
            f"lost to {dtype}'s precision in the forward pass (activations that round to zero or tip a ReLU), not to "
            "gradient underflow. Run the most affected layer in float32 if they matter."
        )

    def _how(self, scale: float) -> str:
        dynamic = ("'dynamic' (it starts at 32768 and halves only on overflow)" if scale <= 32768
                   else f"'dynamic' with initial_scale {_scale(scale)}")
        if self.mode == "none":
            return f"Turn on loss scaling: loss_scale {dynamic}, or 'fixed' with a scale of at least {_scale(scale)}."
        if self.mode == "fixed":
            return f"Raise the fixed scale to at least {_scale(scale)}, or use loss_scale {dynamic}."
        return (f"The dynamic scale was lower than that at this step: start it at initial_scale {_scale(scale)} "
                "or more; if overflow keeps pulling it down, the gradients span more than float16's range, so keep "
                "the most affected layer in float32 or use mixed_bfloat16.")

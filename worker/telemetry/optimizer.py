"""`TelemetryOptimizer`: loss scaling (none, fixed, dynamic) that shows its work.

Keras 3's `LossScaleOptimizer` is dynamic only and keeps its scale and its
skipped steps to itself. This wrapper implements the three modes and, inside
the compiled step, writes one small `telemetry` vector per step:

    [total_loss, loss_scale used, grad_norm, grads_finite, skipped, zeros_high, zeros_low,
     regularization_loss]

Every gradient statistic is of the unscaled gradient in float32 (see
`_measure`). `total_loss` is the unscaled loss `scale_loss` received, penalties
included (stateful backends; under JAX that assignment is discarded); the data
loss a record reports comes from the `BatchLoss` metric on every backend, and
`regularization_loss` is the model's weight penalties, computed here from the
weights the step's gradient was taken at.

Dynamic mode follows Keras exactly: a non-finite step halves the scale and is
skipped; after `growth_steps` finite steps in a row the scale doubles.

>>> import keras
>>> opt = TelemetryOptimizer(keras.optimizers.SGD(), mode="fixed", initial_scale=8.0)
>>> float(opt.scale_loss(2.0))
16.0
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from app.core.errors import NoGradient
from worker.telemetry.fp8_state import FIELDS_PER_TENSOR, is_state, slots, step_state
from worker.telemetry.gradient_kinds import dense, unscale
from worker.telemetry.replicas import all_reduce_sum, apply_on_every_replica, replica_context
from worker.telemetry.step_vector import GRADS_FINITE, TELEMETRY_FIELDS, ZERO_COUNT_SPLIT, Telemetry

SIGN_COUNT_MAX_ELEMENTS = 2**24
"""Up to this many elements, a gradient counts its non-zero values as the float32
sum of sign(g)**2: every partial sum is an integer below 2**24, so the count is
exact, and on CPU it is several times cheaper than building a boolean tensor
and casting it. Larger tensors count `g == 0` in int32."""
MODES = ("none", "fixed", "dynamic")


def _total(values: list[Any]) -> Any:
    return values[0] if len(values) == 1 else ops.sum(ops.stack(values))


def _zero_count(grads: list[Any], sign: bool) -> Any:
    """How many gradient values are exactly zero, in int32.

    `sign=True` is the fast path for finite gradients (sign(NaN) is NaN);
    `sign=False` compares with zero, which any value survives, NaN included.
    """
    counts = []
    for g in grads:
        size = math.prod(g.shape)
        if sign and size <= SIGN_COUNT_MAX_ELEMENTS:
            counts.append(size - ops.cast(ops.sum(ops.square(ops.sign(g))), "int32"))
        else:
            counts.append(ops.sum(ops.cast(ops.equal(g, 0.0), "int32")))
    return _total(counts)


FAST_NORM_MIN_SQUARES = 2.0**-60
"""A finite sum of squares at least this large is the norm's own: values whose squares
underflow float32 (below 1e-19) change it by less than one part in 1e19."""


def gradient_statistics(grads: list[Any]) -> tuple[Any, Any, Any]:
    """(global L2 norm, all finite?, zero count) of float32 tensors, for any finite norm up to float32's max.

    The plain sum of squares answers both when it is finite and not tiny: a NaN or inf
    anywhere would make it non-finite. Otherwise (an overflow past a norm of 1.8e19, an
    underflow below 1e-19, or a truly non-finite value) every value is divided by the power
    of two at or below the largest magnitude M before squaring, which is exact, and
    finiteness is tested on the values: M is inf when any value is, and a NaN anywhere
    makes the scaled sum NaN. One branch point a step: each costs tens of microseconds on CPU.
    """
    squares = _total([ops.sum(ops.square(g)) for g in grads])
    plain = ops.logical_and(ops.isfinite(squares), squares >= FAST_NORM_MIN_SQUARES)

    def careful() -> tuple[Any, Any, Any]:
        norm, finite = _scaled_norm(grads)
        return norm, finite, _zero_count(grads, sign=False)

    return ops.cond(plain, lambda: (ops.sqrt(squares), ops.convert_to_tensor(True), _zero_count(grads, sign=True)),
                    careful)


def _scaled_norm(grads: list[Any]) -> tuple[Any, Any]:
    peaks = [ops.max(ops.abs(g)) for g in grads]
    peak = peaks[0] if len(peaks) == 1 else ops.max(ops.stack(peaks))
    usable = ops.logical_and(ops.isfinite(peak), peak > 0.0)
    unit = ops.where(usable, ops.power(2.0, ops.floor(ops.log2(ops.where(usable, peak, 1.0)))), 1.0)
    squares = _total([ops.sum(ops.square(g / unit)) for g in grads])
    finite = ops.logical_and(ops.isfinite(peak), ops.isfinite(squares))
    return unit * ops.sqrt(squares), finite


@keras.saving.register_keras_serializable(package="mpjobs")
class TelemetryOptimizer(keras.optimizers.Optimizer):
    """Wraps `inner_optimizer`, scales the loss and measures every step.

    Args:
        inner_optimizer: the optimizer that applies the unscaled gradients.
        mode: `"none"`, `"fixed"` or `"dynamic"`.
        initial_scale: the scale for `fixed`, the starting scale for `dynamic`.
        growth_steps: finite steps in a row before a dynamic scale doubles.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        mode: str = "dynamic",
        initial_scale: float = 2.0**15,
        growth_steps: int = 2000,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"Expected mode to be one of {MODES}. Received: mode={mode!r}")
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self.inner_optimizer = inner_optimizer
        self.mode = mode
        self.initial_scale = 1.0 if mode == "none" else float(initial_scale)
        self.growth_steps = int(growth_steps)
        # Scaling is ours: the inner optimizer must not scale a second time.
        self.inner_optimizer.loss_scale_factor = None
        self.penalties: list[tuple[int, Callable[[Any], Any]]] = []
        """(index in the trainable variables, penalty): the model's weight regularizers, set by
        the engine, so `regularization_loss` is reported beside the data loss."""
        self.gradient_elements = 0
        """Gradient values per step, known once the step is traced: the zero fraction's denominator."""
        self.fp8_slots: list[Any] = []
        """The FP8 layers' tensors (worker/engine/fp8.py), whose state follows the vector's 8 fields."""
        self._state: list[bool] = []

    def build(self, var_list: list[keras.Variable]) -> None:
        self.fp8_slots, self._state = slots(var_list), [is_state(v) for v in var_list]
        self.loss_scale = self.add_variable(
            shape=(), dtype="float32", initializer=keras.initializers.Constant(self.initial_scale),
            aggregation="none", name="loss_scale",
        )
        self.good_steps = self.add_variable(
            shape=(), dtype="int32", initializer="zeros", aggregation="none", name="good_steps"
        )
        self.batch_loss = self.add_variable(
            shape=(), dtype="float32", initializer="zeros", aggregation="none", name="batch_loss"
        )
        self.telemetry = self.add_variable(
            shape=(len(TELEMETRY_FIELDS) + FIELDS_PER_TENSOR * len(self.fp8_slots),), dtype="float32",
            initializer="zeros", aggregation="none", name="telemetry",
        )
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self) -> list[keras.Variable]:
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self) -> keras.Variable:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Any) -> Any:
        if self.built:
            self.batch_loss.assign(ops.cast(loss, "float32"))
        if self.mode == "none":
            return loss
        scale = self.loss_scale if self.built else self.initial_scale
        return loss * ops.cast(scale, loss.dtype) if hasattr(loss, "dtype") else loss * scale

    # -- the step ----------------------------------------------------------

    def _measure(self, grads: list[Any], trainable_variables: list[Any],
                 total_loss: Any = None) -> tuple[Any, list[Any], Any]:
        """Unscale, measure and decide. Returns (apply?, unscaled grads, telemetry)."""
        scale = ops.convert_to_tensor(1.0, "float32") if self.mode == "none" else ops.cast(self.loss_scale.value,
                                                                                            "float32")
        # Every statistic is of the unscaled gradient in float32, taken before any cast back to
        # a float16/bfloat16 variable's dtype: that cast flushes what backprop itself produced.
        # Division by a scale >= 1 cannot turn a float32 value into exactly zero, so the zero
        # count is backprop's own. Sparse gradients are summed into dense ones first. An FP8 layer's scales
        # and amax histories are not gradients but their new values (worker/engine/fp8.py): left out, as is.
        state = self._state if len(self._state) == len(grads) else [False] * len(grads)
        present = [ops.cast(dense(g), "float32") for g, fp8 in zip(grads, state, strict=True)
                   if g is not None and not fp8]
        if self.mode != "none":
            present = [g / scale for g in present]
        self.gradient_elements = sum(math.prod(g.shape) for g in present)
        norm, finite, zeros = gradient_statistics(present)
        unscaled = list(grads) if self.mode == "none" else [g if fp8 else unscale(g, scale)
                                                            for g, fp8 in zip(grads, state, strict=True)]
        if self.mode == "none":  # Plain Keras applies every step.
            apply, skipped = ops.convert_to_tensor(True), ops.convert_to_tensor(0.0)
        else:
            apply, skipped = finite, ops.logical_not(finite)
        parts = Telemetry(
            total_loss=self.batch_loss.value if total_loss is None else total_loss, loss_scale=scale,
            grad_norm=norm, grads_finite=finite, skipped=skipped,
            zeros_high=zeros // ZERO_COUNT_SPLIT, zeros_low=zeros % ZERO_COUNT_SPLIT,
            regularization_loss=self._penalty(trainable_variables))
        telemetry = ops.stack([ops.cast(p, "float32") for p in parts])
        if self.fp8_slots:  # the FP8 layers' state after the eight fields (worker/telemetry/fp8_state.py)
            telemetry = ops.concatenate([telemetry, step_state(self.fp8_slots, trainable_variables, grads, apply)])
        return apply, unscaled, telemetry

    def _penalty(self, trainable_variables: list[Any]) -> Any:
        """The model's weight penalties at the weights this step's gradient was taken at, in float32."""
        if not self.penalties:
            return ops.convert_to_tensor(0.0, "float32")
        return _total([ops.cast(penalty(trainable_variables[i]), "float32") for i, penalty in self.penalties])

    def _update_scale(self, finite: Any) -> None:
        """Keras's dynamic rule, branch-free so it runs in any backend."""
        if self.mode != "dynamic":
            return
        scale, good = self.loss_scale.value, self.good_steps.value
        grow = ops.logical_and(finite, ops.equal(good, self.growth_steps - 1))
        self.loss_scale.assign(ops.where(finite, ops.where(grow, scale * 2.0, scale), scale / 2.0))
        self.good_steps.assign(ops.where(finite, ops.where(grow, 0, good + 1), 0))

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        if not self.built:  # type: ignore[has-type]
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables or [])
            self.built = True
        grads, total_loss, replicas = list(grads), None, replica_context()
        if grads and all(g is None for g in grads):  # seen while tracing: fail named, not as Keras's ValueError
            raise NoGradient(len(grads))
        if replicas is not None:  # several replicas: measure the all-reduced gradients (worker/telemetry/replicas.py)
            grads, total_loss = all_reduce_sum(replicas, grads, self.batch_loss.value)
        apply, unscaled, telemetry = self._measure(grads, list(trainable_variables or []), total_loss)
        self.telemetry.assign(telemetry)
        finite = ops.cast(telemetry[GRADS_FINITE], "bool")
        if replicas is not None:
            apply_on_every_replica(replicas, self.inner_optimizer, None if self.mode == "none" else apply,
                                   unscaled, trainable_variables)
        elif self.mode == "none":
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
        else:
            ops.cond(apply, lambda: self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables),
                     lambda: None)
        self._update_scale(finite)

    def stateless_apply(
        self, optimizer_variables: list[Any], grads: list[Any], trainable_variables: list[Any]
    ) -> tuple[list[Any], list[Any]]:
        own_count = len(self._variables)
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            apply, unscaled, telemetry = self._measure(list(grads), list(trainable_variables))
            self.telemetry.assign(telemetry)
            self._update_scale(ops.cast(telemetry[GRADS_FINITE], "bool"))
            own = [scope.get_current_value(v) for v in self._variables]
        inner_vars = list(optimizer_variables[own_count:])

        def step() -> tuple[list[Any], list[Any]]:
            return self.inner_optimizer.stateless_apply(inner_vars, unscaled, trainable_variables)

        def skip() -> tuple[list[Any], list[Any]]:
            return list(trainable_variables), inner_vars

        new_trainable, new_inner = ops.cond(apply, step, skip) if self.mode != "none" else step()
        return list(new_trainable), own + list(new_inner)

    def finalize_variable_values(self, var_list: list[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "mode": self.mode,
            "initial_scale": self.initial_scale,
            "growth_steps": self.growth_steps,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> TelemetryOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)

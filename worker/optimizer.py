"""`TelemetryOptimizer`: loss scaling (none, fixed, dynamic) that shows its work.

Keras 3's `LossScaleOptimizer` is dynamic only and keeps its scale and its
skipped steps to itself. This wrapper implements the three modes and, inside
the compiled step, writes one small `telemetry` vector per step:

    [loss, loss_scale used, grad_norm (unscaled), grads_finite, skipped, zero_grad_fraction]

`loss` is the unscaled loss `scale_loss` received (stateful backends; under
JAX that assignment is discarded and the `BatchLoss` metric reports it).

Dynamic mode follows Keras exactly: a non-finite step halves the scale and is
skipped; after `growth_steps` finite steps in a row the scale doubles.

>>> import keras
>>> opt = TelemetryOptimizer(keras.optimizers.SGD(), mode="fixed", initial_scale=8.0)
>>> float(opt.scale_loss(2.0))
16.0
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

TELEMETRY_FIELDS = ("loss", "loss_scale", "grad_norm", "grads_finite", "skipped", "zero_grad_fraction")
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

    def build(self, var_list: list[keras.Variable]) -> None:
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
            shape=(len(TELEMETRY_FIELDS),), dtype="float32", initializer="zeros",
            aggregation="none", name="telemetry",
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

    def _measure(self, grads: list[Any]) -> tuple[Any, list[Any], Any]:
        """Unscale, measure and decide. Returns (apply?, unscaled grads, telemetry)."""
        if self.mode == "none":
            scale, unscaled = ops.convert_to_tensor(1.0, "float32"), list(grads)
        else:
            scale = ops.cast(self.loss_scale.value, "float32")
            unscaled = [
                None if g is None else ops.cast(ops.cast(g, "float32") / scale, g.dtype) for g in grads
            ]
        # Measured after unscaling, in float32: a scaled norm could overflow float32
        # where the true one does not. Division by a scale >= 1 cannot turn a
        # float32 gradient into exactly zero, so the zero count is backprop's own.
        # Finiteness is read off the squared norm: inf or NaN anywhere makes it
        # non-finite, which saves two passes over every gradient. (A norm beyond
        # float32's range, 1.8e19, also counts as an overflow.)
        present = [ops.cast(g, "float32") for g in unscaled if g is not None]
        elements = sum(math.prod(g.shape) for g in present)
        sq = _total([ops.sum(ops.square(g)) for g in present])
        finite = ops.isfinite(sq)
        zeros = ops.cond(finite, lambda: _zero_count(present, sign=True), lambda: _zero_count(present, sign=False))
        zero_fraction = ops.cast(zeros, "float32") / float(elements)
        if self.mode == "none":  # Plain Keras applies every step.
            apply, skipped = ops.convert_to_tensor(True), ops.convert_to_tensor(0.0)
        else:
            apply, skipped = finite, ops.logical_not(finite)
        parts = [self.batch_loss.value, scale, ops.sqrt(sq), finite, skipped, zero_fraction]
        telemetry = ops.stack([ops.cast(p, "float32") for p in parts])
        return apply, unscaled, telemetry

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
        apply, unscaled, telemetry = self._measure(list(grads))
        self.telemetry.assign(telemetry)
        finite = ops.cast(telemetry[3], "bool")
        if self.mode == "none":
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
        else:
            ops.cond(
                apply,
                lambda: self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables),
                lambda: None,
            )
        self._update_scale(finite)

    def stateless_apply(
        self, optimizer_variables: list[Any], grads: list[Any], trainable_variables: list[Any]
    ) -> tuple[list[Any], list[Any]]:
        own_count = len(self._variables)
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            apply, unscaled, telemetry = self._measure(list(grads))
            self.telemetry.assign(telemetry)
            self._update_scale(ops.cast(telemetry[3], "bool"))
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

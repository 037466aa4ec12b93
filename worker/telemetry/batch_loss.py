"""The batch loss and the optimizer's telemetry vector as Keras metrics: read inside the compiled step.

Everything a step reports is computed inside the compiled train step: the batch
loss arrives in `logs` (which `fit` already copies to the host), the gradient
statistics in the optimizer's one `telemetry` vector (worker/telemetry/step_vector.py).
"""

from __future__ import annotations

from typing import Any

import keras
from keras.src.losses.loss import unscale_loss_for_distribution  # not exported
from keras.src.losses.losses import LossFunctionWrapper  # what compile wraps a function in; not exported

from worker.telemetry.optimizer import TelemetryOptimizer

TELEMETRY_LOG_KEY = "step_telemetry"


def compiled_loss(loss: Any) -> keras.losses.Loss:
    """The `Loss` that `model.compile(loss=loss)` computes: a function is wrapped, as Keras
    wraps it, so it reduces over the batch and computes in float32 whatever the output's dtype."""
    loss_obj = keras.losses.get(loss)
    if isinstance(loss_obj, keras.losses.Loss):
        return loss_obj
    name = loss if isinstance(loss, str) else getattr(loss_obj, "__name__", "loss")
    return LossFunctionWrapper(loss_obj, name=name)


@keras.saving.register_keras_serializable(package="mpjobs")
class BatchLoss(keras.metrics.Metric):
    """The loss of the current batch alone, unscaled (Keras's `loss` is a running mean)."""

    def __init__(self, loss: Any = None, name: str = "batch_loss", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self._loss_fn = compiled_loss(loss) if loss is not None else None
        self.value = self.add_variable(shape=(), initializer="zeros", name="value")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        assert self._loss_fn is not None
        # Training uses no sample weights; the Loss reduces as the compiled loss does. Under a
        # tf.distribute strategy a Loss divides by the replica count; `fit` then averages the
        # replicas' metrics, so each replica keeps its own rows' mean.
        value = unscale_loss_for_distribution(self._loss_fn(y_true, y_pred))
        self.value.assign(keras.ops.cast(value, "float32"))

    def result(self) -> Any:
        return keras.ops.convert_to_tensor(self.value)  # a tensor, not the Variable (JAX traces this)

    def reset_state(self) -> None:
        self.value.assign(0.0)


@keras.saving.register_keras_serializable(package="mpjobs")
class StepTelemetry(BatchLoss):
    """Puts the optimizer's telemetry vector into `logs`, read inside the compiled step.

    `fit` already brings `logs` to the host each step, so this costs one
    variable read in the graph instead of an eager read per step. Stateful
    backends only (TensorFlow, torch): under JAX, metrics cannot see the
    optimizer's new state, and the callback reads the trainer's state instead.
    """

    def __init__(self, optimizer: TelemetryOptimizer | None = None, loss: Any = None,
                 name: str = TELEMETRY_LOG_KEY, **kwargs: Any) -> None:
        # The batch's data loss (BatchLoss's) rides in the same vector: one metric and one log
        # entry a step, not two (a second metric cost about 4% of a small model's step).
        super().__init__(loss, name=name, **kwargs)
        self._read = (lambda: optimizer.telemetry.value) if optimizer is not None else None

    def result(self) -> Any:
        """[data loss, *the optimizer's telemetry vector]."""
        assert self._read is not None
        return keras.ops.concatenate([keras.ops.reshape(self.value.value, (1,)), self._read()])

"""One step's gradient outside `fit`, on the model's current weights: for the float32 check and the layer checks.

`gradient_fn` differentiates the compiled loss (plus the model's penalties) times a
scale with respect to the trainable weights, unscales in float32 and returns one
dense float32 array per weight. Given a `LayerProbe`, the same forward pass also
measures every probed layer's output (worker/numerics/layer_numerics.py), so the
activations are those of exactly the step whose gradient is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras
from keras import ops

from worker.telemetry.fp8_state import weight_indices
from worker.telemetry.gradient_kinds import dense

if TYPE_CHECKING:
    from worker.numerics.layer_numerics import LayerProbe

GradientFn = Callable[..., tuple[list[Any], Any, list[Any]]]
"""(trainable, non_trainable, x, y, scale) -> (the unscaled float32 gradient, one array per weight (an FP8
layer's scales and amax histories are not weights: `worker.telemetry.fp8_state.weight_indices`);
the probe's activation statistics, or an empty tuple without a probe; the gradient reaching each probed
layer's output, scaled, in its dtype: empty without a probe, and under JAX; an empty array for an output the
loss does not depend on)."""
NO_STATISTICS: Any = ()


def gradient_fn(model: keras.Model, loss: keras.losses.Loss, probe: LayerProbe | None = None) -> GradientFn:
    """A compiled function of the model's weights that returns the step's gradient (and layer statistics)."""

    def scaled_loss(trainable: list[Any], non_trainable: list[Any], x: Any, y: Any,
                    scale: Any) -> tuple[Any, Any, list[Any]]:
        if probe is None:
            y_pred, _, penalties = model.stateless_call(trainable, non_trainable, x, training=True,
                                                        return_losses=True)
            stats, layer_outputs = NO_STATISTICS, []
        else:
            outputs, _, penalties = probe.model.stateless_call(
                probe.reorder_trainable(trainable), probe.reorder_non_trainable(non_trainable), x,
                training=True, return_losses=True)
            y_pred, layer_outputs = outputs[0], list(outputs[1:])
            stats = probe.statistics(layer_outputs)
        value = ops.cast(loss(y, y_pred), "float32")
        for penalty in penalties:
            value = value + ops.cast(ops.sum(penalty), "float32")
        return value * scale, stats, layer_outputs

    weights = weight_indices(model.trainable_variables)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function(reduce_retracing=True)
        def tf_gradients(trainable: list[Any], non_trainable: list[Any], x: Any, y: Any,
                         scale: Any) -> tuple[list[Any], Any, list[Any]]:
            with tf.GradientTape() as tape:
                tape.watch(trainable)
                value, stats, layer_outputs = scaled_loss(trainable, non_trainable, x, y, scale)
            grads, signals = tape.gradient(value, [trainable, layer_outputs])
            # The gradient reaching each layer's output, in its dtype, as backpropagation had it (scaled). None:
            # the output is not on the loss's path, so nothing was measured there (empty, never zeros read as lost).
            signals = [tf.zeros((0,), o.dtype) if g is None else g for g, o in zip(signals, layer_outputs, strict=True)]
            return [tf.zeros(trainable[i].shape, "float32") if grads[i] is None
                    else tf.cast(dense(grads[i]), "float32") / scale for i in weights], stats, signals

        return tf_gradients
    if backend == "jax":
        import jax

        def jax_gradients(trainable: list[Any], non_trainable: list[Any], x: Any, y: Any,
                          scale: Any) -> tuple[list[Any], Any, list[Any]]:
            # JAX differentiates functions, not intermediate tensors: no signals at the layers' outputs.
            def value_and_stats(*args: Any) -> tuple[Any, Any]:
                value, stats, _ = scaled_loss(*args)
                return value, stats

            grads, stats = jax.grad(value_and_stats, has_aux=True)(trainable, non_trainable, x, y, scale)
            return [ops.cast(grads[i], "float32") / scale for i in weights], stats, []

        return jax.jit(jax_gradients)
    raise NotImplementedError(f"the float32 check supports the tensorflow and jax backends, not {backend}")


def current_values(model: keras.Model) -> tuple[list[Any], list[Any]]:
    """The model's current weights: under JAX, `fit` keeps them outside the variables."""
    state = getattr(model, "_jax_state", None)
    if state:
        return list(state["trainable_variables"]), list(state["non_trainable_variables"])
    return [v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables]

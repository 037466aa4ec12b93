"""One optimizer step over several replicas (`tf.distribute.MirroredStrategy`): reduce once, measure, decide once.

Under a strategy each replica differentiates its share of the batch, its loss
already divided by the number of replicas, so the SUM of the replicas'
gradients is the gradient of the whole batch's mean loss. `TelemetryOptimizer`
all-reduces the scaled gradients itself, before it measures anything: the norm,
the zero count and finiteness are those of the all-reduced gradients, every
replica computes the same ones, and so every replica makes the same skip
decision and writes the same telemetry and loss scale into its own copy of
those variables (aggregation "none": a replica-context write touches only the
replica's copy).

The inner optimizer must then not reduce a second time: `pre_reduced` marks it
so. And a skip cannot be a `cond` in replica context whose branch reaches the
inner optimizer's `merge_call` (keras#18666): as in Keras's own LossScaleOptimizer
(keras#18691), the decision is taken in cross-replica context and the update runs
back in each replica. A merge call cannot run inside an XLA-compiled step (keras#21366), so
the engine compiles a multi-device step without `jit_compile`.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


def replica_context() -> Any:
    """The replica context of a step on two replicas or more; None otherwise (and on other backends)."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync < 2:
        return None
    return context


def all_reduce_sum(context: Any, grads: list[Any], loss: Any) -> tuple[list[Any], Any]:
    """(every gradient summed over the replicas, None kept; the replicas' losses summed)."""
    import tensorflow as tf

    present = [g for g in grads if g is not None]
    reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [*present, loss])
    values = iter(reduced[:-1])
    return [None if g is None else next(values) for g in grads], reduced[-1]


def _already_reduced(grads_and_vars: Any) -> list[Any]:
    return list(grads_and_vars)


def pre_reduced(inner: keras.optimizers.Optimizer) -> None:
    """Tell a Keras TensorFlow optimizer that the gradients it gets are already summed over replicas."""
    inner._all_reduce_sum_gradients = _already_reduced


def apply_on_every_replica(context: Any, inner: keras.optimizers.Optimizer, apply: Any, grads: list[Any],
                           trainable_variables: list[Any] | None) -> None:
    """`inner.apply(grads)` on every replica when `apply` is true (None: always), decided once.

    `apply` is the same on every replica (it was computed from all-reduced gradients), so
    the first replica's value decides for all.
    """
    pre_reduced(inner)
    if apply is None:
        inner.apply(grads, trainable_variables=trainable_variables)
        return

    def decide(strategy: Any, apply: Any, grads: list[Any], trainable_variables: Any) -> None:
        def step() -> None:
            strategy.extended.call_for_each_replica(
                inner.apply, args=(grads,), kwargs={"trainable_variables": trainable_variables})

        ops.cond(strategy.experimental_local_results(apply)[0], step, lambda: None)

    context.merge_call(decide, args=(apply, grads, trainable_variables))

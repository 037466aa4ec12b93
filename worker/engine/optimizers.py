"""The job's optimizer from its spec: Keras's own by name, inside a `TelemetryOptimizer` with the spec's scaling."""

from __future__ import annotations

import keras

from mpjobs.contract.spec import DynamicLossScale, FixedLossScale, JobSpec
from worker.telemetry.optimizer import TelemetryOptimizer

_OPTIMIZERS = {
    "adam": keras.optimizers.Adam,
    "adamw": keras.optimizers.AdamW,
    "sgd": keras.optimizers.SGD,
    "rmsprop": keras.optimizers.RMSprop,
}


def make_optimizer(spec: JobSpec) -> TelemetryOptimizer:
    t, ls = spec.training, spec.loss_scale
    inner = _OPTIMIZERS[t.optimizer](learning_rate=t.learning_rate)
    if isinstance(ls, FixedLossScale):
        return TelemetryOptimizer(inner, mode="fixed", initial_scale=ls.scale)
    if isinstance(ls, DynamicLossScale):
        return TelemetryOptimizer(inner, mode="dynamic", initial_scale=ls.initial_scale, growth_steps=ls.growth_steps)
    return TelemetryOptimizer(inner, mode="none")

"""How fast this job's model trains in its policy against float32, on the device it ran on.

On a CPU nothing general can be said: half-precision speed depends on the
processor's vector units and on which of the backend's kernels have a float16
or bfloat16 path. Measured with TensorFlow on our 2-core VMs, the same MLP step
under `mixed_float16` was about float32's speed on one machine and 40x slower
on another. So a CPU job in float16/bfloat16 that succeeds ends with a short
measurement of its own model instead of a guess:

- two fresh copies of the model, one under the job's policy and loss scaling,
  one in float32, built and compiled the way the job was;
- one warm-up step each (tracing), then `rounds` rounds in which the two take
  turns training `steps` steps on the same batches;
- each step timed from its start until its loss is on the host; each side's
  figure is the median of its steps.

Taking turns cancels the drift of a shared, noisy machine; medians drop the
odd slow step. The copies are discarded: the job's weights are untouched.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from app.schemas import JobSpec, NoLossScale, PrecisionPolicy, PrecisionSpeed
from worker.models import build_model

ROUNDS = 3


def float32_twin(spec: JobSpec) -> JobSpec:
    """The same job in float32, without loss scaling."""
    return spec.model_copy(update={"precision_policy": PrecisionPolicy.FLOAT32, "loss_scale": NoLossScale()})


class _StepClock(keras.callbacks.Callback):
    """Each step's seconds, from `on_train_batch_begin` until its loss is a host number."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if logs and "loss" in logs:
            float(keras.ops.convert_to_numpy(logs["loss"]))  # waits for the step under async dispatch
        self.seconds.append(time.perf_counter() - self._start)


class _Copy:
    def __init__(self, spec: JobSpec, on_cpu_tf: bool, make_optimizer: Callable[[JobSpec], Any]) -> None:
        keras.utils.set_random_seed(spec.training.seed)
        built = build_model(spec, on_cpu_tf=on_cpu_tf)
        self.model, self.batch_size = built.model, spec.training.batch_size
        self.model.compile(optimizer=make_optimizer(spec), loss=built.loss, auto_scale_loss=False)
        self.clock = _StepClock()

    def fit(self, x: np.ndarray, y: np.ndarray, *, timed: bool) -> None:
        callbacks = [self.clock] if timed else []
        self.model.fit(x, y, batch_size=self.batch_size, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


def measure(
    spec: JobSpec,
    x: np.ndarray,
    y: np.ndarray,
    *,
    on_cpu_tf: bool,
    make_optimizer: Callable[[JobSpec], Any],
    rounds: int = ROUNDS,
    should_stop: Callable[[], bool] = lambda: False,
) -> PrecisionSpeed | None:
    """Median step time of `spec`'s model in its policy and in float32, on batches `x`, `y`.

    None when `should_stop()` turns true between two pieces (a cancel after the run's last step).
    """
    bs = spec.training.batch_size
    policy = _Copy(spec, on_cpu_tf, make_optimizer)
    float32 = _Copy(float32_twin(spec), on_cpu_tf, make_optimizer)
    # Alternate which side goes first, so neither always runs right after the other's cache misses.
    order = [(side, False) for side in (policy, float32)] + [
        (side, True) for r in range(rounds) for side in ((policy, float32) if r % 2 == 0 else (float32, policy))]
    for side, timed in order:
        if should_stop():
            return None
        # Untimed: one warm-up step (tracing).
        side.fit(x if timed else x[:bs], y if timed else y[:bs], timed=timed)
    policy_s, float32_s = statistics.median(policy.clock.seconds), statistics.median(float32.clock.seconds)
    return PrecisionSpeed(
        policy_ms=policy_s * 1e3, float32_ms=float32_s * 1e3, slowdown=policy_s / float32_s,
        steps=len(policy.clock.seconds),
    )

"""Several steps per call: one compiled loop runs k steps and keeps each step's telemetry row on the device.

`fit` brings its logs to the host after every call, and at one step per call that read stops
the device from running ahead. `Stepper` runs the model's own `train_step` k times inside one
compiled function (a `tf.while_loop` under TensorFlow) and writes each step's row, the data
loss and the optimizer's telemetry vector (worker/telemetry/step_vector.py), into a
`TensorArray`: the buffer is read to the host once per call, as a (k, 1 + fields) array.
Each step is the same arithmetic as one `fit` step, so a seeded run's records and weights are
identical at any number of steps per call (tests/worker/engine/test_steps_per_execution.py).

k varies from call to call without retracing (the leading dimension is left unknown), so a call
ends early where the run needs a boundary (`call_sizes`): a checkpoint, an evaluation, or the step
before a float32 or layer check, which reads the weights as they are before its step.

`AutoSize` picks k when the spec says `steps_per_execution: "auto"`: enough steps for a call to last
about `TARGET_CALL_S` (20 ms), from the measured time of the calls so far.

>>> list(call_sizes(0, 10, 4, lambda b: b % 5 == 0))
[4, 1, 4, 1]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from worker.telemetry.batch_loss import TELEMETRY_LOG_KEY
from worker.telemetry.step_vector import CALL_STEPS_KEY

TARGET_CALL_S = 0.02
"""An automatic call lasts about this long: the host's per-call cost (dispatch and one read of the
buffer, about 0.1-0.3 ms on CPU) stays near 1% of it, while a cancel, the time limit and the live
stream wait at most one call, well under the 100 ms a stream adds."""
MAX_STEPS_PER_CALL = 256
"""The most steps one call runs, automatic or asked for: the bound on a cancel's wait is one call."""


def call_sizes(done: int, steps: int, most: int | Callable[[], int], must_end: Callable[[int], bool]) -> Iterator[int]:
    """The steps of each call that trains steps done+1..done+steps, at most `most` each (read before each
    call when a function), ending a call early after every step b where `must_end(b)`."""
    step, end = done, done + steps
    while step < end:
        limit = min(most() if callable(most) else most, end - step)
        k = 1
        while k < limit and not must_end(step + k):
            k += 1
        yield k
        step += k


class AutoSize:
    """Steps per call for a call of about `target_s`: from the median seconds per step of the last calls.

    The first call traces the function and is never counted; until a call has been timed, one step.
    """

    def __init__(self, target_s: float = TARGET_CALL_S, most: int = MAX_STEPS_PER_CALL) -> None:
        self.target_s, self.most = target_s, most
        self.per_step: list[float] = []
        self.calls = 0

    def __call__(self) -> int:
        if not self.per_step:
            return 1
        seconds = statistics.median(self.per_step[-9:])
        return max(1, min(self.most, math.floor(self.target_s / seconds))) if seconds > 0 else self.most

    def timed(self, steps: int, seconds: float) -> None:
        self.calls += 1
        if self.calls > 1 and steps > 0:
            self.per_step.append(seconds / steps)


class Stepper:
    """Runs k of `model`'s training steps per call (TensorFlow, one device); returns each step's row."""

    def __init__(self, model: keras.Model, batch_size: int) -> None:
        import tensorflow as tf  # only this backend's models come here

        self.model, self.batch_size = model, batch_size
        self._function: Any = None
        self._tf = tf

    def _build(self, x: np.ndarray, y: np.ndarray) -> Any:
        tf, model = self._tf, self.model
        step = model.train_step
        if model.jit_compile:  # as fit compiles one step: XLA inside, the loop outside
            step = tf.function(step, jit_compile=True, reduce_retracing=True)

        def run(xs: Any, ys: Any) -> Any:
            count = tf.shape(xs)[0]
            rows = tf.TensorArray(tf.float32, size=count)
            for i in tf.range(count):
                logs = step((xs[i], ys[i]))
                rows = rows.write(i, tf.cast(logs[TELEMETRY_LOG_KEY], tf.float32))
            return rows.stack()

        signature = [tf.TensorSpec((None, self.batch_size, *x.shape[1:]), tf.as_dtype(x.dtype)),
                     tf.TensorSpec((None, self.batch_size, *y.shape[1:]), tf.as_dtype(y.dtype))]
        return tf.function(run, input_signature=signature)

    def __call__(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Train one step per batch of (x, y): the (steps, 1 + telemetry fields) rows, read once."""
        if self._function is None:
            self._function = self._build(x, y)
        steps, bs = len(x) // self.batch_size, self.batch_size
        xs = x[: steps * bs].reshape(steps, bs, *x.shape[1:])
        ys = y[: steps * bs].reshape(steps, bs, *y.shape[1:])
        return np.asarray(self._function(xs, ys))


class Calls:
    """Trains segments call by call, with the engine's callbacks around each call (instead of `fit`).

    Before each call every callback's `on_train_batch_begin(index of its first step, logs)` runs, after
    it `on_train_batch_end(index of its last step, logs)`; `logs` carries CALL_STEPS_KEY (the call's
    steps) and, after the call, TELEMETRY_LOG_KEY (its rows). A callback stops training as under `fit`,
    with `model.stop_training`, which is read after each call: a cancel or the time limit waits one call.
    """

    def __init__(self, model: keras.Model, batch_size: int, steps_per_execution: int | str,
                 must_end: Callable[[int], bool]) -> None:
        self.model, self.batch_size, self.must_end = model, batch_size, must_end
        self.stepper = Stepper(model, batch_size)
        self.auto = AutoSize()
        self.fixed = None if steps_per_execution == "auto" else int(steps_per_execution)
        self.sizes: list[int] = []
        """Every call's steps, in order (the tests and the benchmarks read them)."""

    def most(self) -> int:
        return self.fixed if self.fixed is not None else self.auto()

    def fit(self, x: np.ndarray, y: np.ndarray, done: int, callbacks: list[keras.callbacks.Callback]) -> None:
        """Train steps done+1.. on the batches of (x, y), until they end or a callback stops training."""
        bs, model = self.batch_size, self.model
        model.stop_training = False
        for callback in callbacks:
            callback.set_model(model)
        index = 0
        for k in call_sizes(done, len(x) // bs, self.most, self.must_end):
            logs: dict[str, Any] = {CALL_STEPS_KEY: k}
            for callback in callbacks:
                callback.on_train_batch_begin(index, logs)
            begin = time.perf_counter()
            rows = self.stepper(x[index * bs:(index + k) * bs], y[index * bs:(index + k) * bs])
            self.auto.timed(k, time.perf_counter() - begin)
            self.sizes.append(k)
            logs = {CALL_STEPS_KEY: k, TELEMETRY_LOG_KEY: rows}
            for callback in callbacks:
                callback.on_train_batch_end(index + k - 1, logs)
            index += k
            if model.stop_training:
                return

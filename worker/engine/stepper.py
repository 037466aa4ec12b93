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


def by_step(values: np.ndarray, batch_size: int) -> np.ndarray:
    """The whole batches of `values`, one per step: (steps, batch_size, ...), a view."""
    steps = len(values) // batch_size
    return values[: steps * batch_size].reshape(steps, batch_size, *values.shape[1:])


def crossed(step: int, ran: int, every: int) -> bool:
    """Whether the call that ran `ran` steps up to `step` passed a multiple of `every` (it ends there)."""
    return step // every > (step - ran) // every


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

        @tf.autograph.experimental.do_not_convert  # as `fit`'s functions: errors raised while tracing stay as raised
        def steps_on_data(xs: Any, ys: Any) -> Any:
            def body(i: Any, rows: Any) -> Any:
                logs = step((xs[i], ys[i]))
                return i + 1, rows.write(i, tf.cast(logs[TELEMETRY_LOG_KEY], tf.float32))

            count = tf.shape(xs)[0]
            rows = tf.TensorArray(tf.float32, size=count)
            _, rows = tf.while_loop(lambda i, rows: i < count, body, [tf.constant(0), rows])
            return rows.stack()

        signature = [tf.TensorSpec((None, self.batch_size, *x.shape[1:]), tf.as_dtype(x.dtype)),
                     tf.TensorSpec((None, self.batch_size, *y.shape[1:]), tf.as_dtype(y.dtype))]
        return tf.function(steps_on_data, input_signature=signature)

    def __call__(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Train one step per batch of (x, y): the (steps, 1 + telemetry fields) rows, read once."""
        if self._function is None:
            self._function = self._build(x, y)
        return np.asarray(self._function(by_step(x, self.batch_size), by_step(y, self.batch_size)))


class MirroredStepper:
    """`Stepper` under a `tf.distribute` strategy: each step runs on every replica through `strategy.run`,
    as `fit` runs it, each replica taking its consecutive share of the step's rows (as a distributed
    dataset splits a batch); a step's row is reduced across replicas as `fit` reduces its logs."""

    def __init__(self, model: keras.Model, batch_size: int, strategy: Any) -> None:
        import tensorflow as tf
        from keras.src.backend.tensorflow.trainer import reduce_per_replica  # how `fit` reduces logs; not exported

        self.model, self.batch_size, self.strategy, self._tf = model, batch_size, strategy, tf
        self.share = batch_size // strategy.num_replicas_in_sync
        step = model.train_step

        @tf.autograph.experimental.do_not_convert
        def steps_on_data(xs: Any, ys: Any, count: Any) -> Any:
            def body(i: Any, rows: Any) -> Any:
                logs = strategy.run(lambda x, y, i: step((x[i], y[i])), args=(xs, ys, i))
                row = reduce_per_replica(logs[TELEMETRY_LOG_KEY], strategy, reduction="auto")
                return i + 1, rows.write(i, tf.cast(row, tf.float32))

            rows = tf.TensorArray(tf.float32, size=count)
            _, rows = tf.while_loop(lambda i, rows: i < count, body, [tf.constant(0), rows])
            return rows.stack()

        self._function = tf.function(steps_on_data, reduce_retracing=True)

    def _per_replica(self, values: np.ndarray) -> Any:
        share = self.share
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: values[:, context.replica_id_in_sync_group * share:][:, :share])

    def __call__(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        xs, ys = by_step(x, self.batch_size), by_step(y, self.batch_size)
        return np.asarray(self._function(self._per_replica(xs), self._per_replica(ys), self._tf.constant(len(xs))))


class JaxStepper:
    """`Stepper` under JAX: a `lax.scan` over the trainer's stateless `train_step`, its rows the scan's output.

    The scan has a fixed length, the power of two at or above the most steps a call may run, and a
    step past the call's count passes the state through untouched (`lax.cond`): a call that ends
    early compiles nothing new. The state is the trainer's own (`_jax_state`), as `fit` keeps it,
    so the engine's callbacks read and sync it as they do under `fit`.
    """

    KEYS = ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables")

    def __init__(self, model: keras.Model, batch_size: int, most: Callable[[], int]) -> None:
        import jax

        self.model, self.batch_size, self.most, self._jax = model, batch_size, most, jax
        paths = [v.path for v in model.optimizer.variables]
        self.index = paths.index(model.optimizer.telemetry.path)
        self.width = 1 + int(model.optimizer.telemetry.shape[0])
        self._function = jax.jit(self._run, donate_argnums=0)

    def _run(self, state: Any, xs: Any, ys: Any, count: Any) -> Any:
        jax, jnp, model, index, width = self._jax, self._jax.numpy, self.model, self.index, self.width

        def body(state: Any, item: Any) -> Any:
            i, x, y = item

            def step(state: Any) -> Any:
                logs, state = model.train_step(state, (x, y))
                loss = jnp.reshape(logs["batch_loss"], (1,)).astype("float32")
                return tuple(state), jnp.concatenate([loss, state[2][index].astype("float32")])

            return jax.lax.cond(i < count, step, lambda state: (state, jnp.zeros((width,), "float32")), state)

        return jax.lax.scan(body, tuple(state), (jnp.arange(xs.shape[0]), xs, ys))

    def __call__(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        model, bs = self.model, self.batch_size
        steps = len(x) // bs
        length = 1 << max(0, (max(steps, self.most()) - 1).bit_length())
        xs = np.zeros((length, bs, *x.shape[1:]), x.dtype)
        ys = np.zeros((length, bs, *y.shape[1:]), y.dtype)
        xs[:steps], ys[:steps] = by_step(x, bs), by_step(y, bs)
        if getattr(model, "_jax_state_synced", True) or not getattr(model, "_jax_state", None):
            model._symbolic_build(data_batch=(x[:bs], y[:bs]))  # as `fit` builds the compiled metrics first
            state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                         optimizer_variables=True, metrics_variables=True, purge_model_variables=True)
            model._jax_state_synced = False
        else:
            state = tuple(model._jax_state[key] for key in self.KEYS)
        state, rows = self._function(state, xs, ys, np.int32(steps))
        model._jax_state = dict(zip(self.KEYS, state, strict=True))
        return np.asarray(rows)[:steps]


class Calls:
    """Trains segments call by call, with the engine's callbacks around each call (instead of `fit`).

    Before each call every callback's `on_train_batch_begin(index of its first step, logs)` runs, after
    it `on_train_batch_end(index of its last step, logs)`; `logs` carries CALL_STEPS_KEY (the call's
    steps) and, after the call, TELEMETRY_LOG_KEY (its rows). A callback stops training as under `fit`,
    with `model.stop_training`, which is read after each call: a cancel or the time limit waits one call.
    """

    def __init__(self, model: keras.Model, batch_size: int, steps_per_execution: int | str,
                 must_end: Callable[[int], bool], strategy: Any = None) -> None:
        self.model, self.batch_size, self.must_end = model, batch_size, must_end
        self.auto = AutoSize()
        self.fixed = None if steps_per_execution == "auto" else int(steps_per_execution)
        self.stepper: Callable[[np.ndarray, np.ndarray], np.ndarray] = (
            JaxStepper(model, batch_size, self.most) if keras.backend.backend() == "jax"
            else MirroredStepper(model, batch_size, strategy) if strategy is not None else Stepper(model, batch_size))
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
                break
        sync = getattr(model, "jax_state_sync", None)
        if sync is not None:  # as `fit` does at the end of its epoch: the variables hold the trained values
            sync()

"""Per-step telemetry: the batch-loss metric, the reporter protocol and the
callback that turns each optimizer step into one `StepRecord`.

Everything the callback reads was computed inside the compiled train step:
the batch loss arrives in `logs` (which `fit` already copies to the host),
the gradient statistics in the optimizer's one `telemetry` vector.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import keras
import numpy as np
from keras.src.losses.losses import LossFunctionWrapper  # what compile wraps a function in; not exported

from app.errors import Diverged
from app.schemas import LossScaleMode, StepRecord, Summary
from worker.float32_check import CheckResult
from worker.optimizer import TELEMETRY_FIELDS, TelemetryOptimizer, zero_fraction
from worker.summary import SummaryBuilder

TELEMETRY_LOG_KEY = "step_telemetry"
_FIELD = {name: index for index, name in enumerate(TELEMETRY_FIELDS)}
DIVERGENCE_PATIENCE = 10
"""Consecutive non-finite losses after which a scaled run is declared diverged."""


class Reporter(Protocol):
    """Receives step records in batches, and the summary."""

    def steps(self, records: Sequence[StepRecord]) -> None: ...

    def summary(self, summary: Summary) -> None: ...


class ListReporter:
    """Keeps everything in memory: for tests and for library users."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.batches: int = 0
        self.summaries: list[Summary] = []

    def steps(self, records: Sequence[StepRecord]) -> None:
        self.batches += 1
        self.records.extend(records)

    def summary(self, summary: Summary) -> None:
        self.summaries.append(summary)


class FanOut:
    """A Reporter that hands every batch and summary to each of `reporters` in turn."""

    def __init__(self, *reporters: Reporter) -> None:
        self.reporters = reporters

    def steps(self, records: Sequence[StepRecord]) -> None:
        for reporter in self.reporters:
            reporter.steps(records)

    def summary(self, summary: Summary) -> None:
        for reporter in self.reporters:
            reporter.summary(summary)


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
        # Training uses no sample weights; the Loss reduces as the compiled loss does.
        self.value.assign(keras.ops.cast(self._loss_fn(y_true, y_pred), "float32"))

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


_RawStep = tuple[int, float, list[float], float, float]
"""(step, batch loss, telemetry vector, step seconds, unix time at its end)."""


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _scale_as_given(value: float, initial: float) -> float:
    """The float32 scale `value` as the spec's scale times a power of two, in float64.

    Every scale in force is the spec's (initial) scale times 2**k; the variable holds it in
    float32, so a fixed scale of 3.7 reads back as 3.700000047. Naming it by k reports 3.7.
    """
    rounded = float(np.float32(initial))
    if value <= 0 or not math.isfinite(value) or rounded <= 0:
        return value
    k = round(math.log2(value / rounded))
    return initial * 2.0**k if float(np.float32(rounded * 2.0**k)) == value else value


class TelemetryCallback(keras.callbacks.Callback):
    """Builds one record per step, batches them to the reporter, checkpoints, stops.

    Between two steps the training thread only keeps the step's raw numbers
    and makes the decisions that cannot wait (divergence, stop, checkpoint).
    The records themselves are built when a batch is handed to the reporter:
    on a small model a step takes about a millisecond, and work between steps
    delays the next one by more than its own time (the runtime's worker
    threads go to sleep and must be woken).
    """

    def __init__(
        self,
        *,
        reporter: Reporter,
        summary: SummaryBuilder,
        start_step: int,
        batch_size: int,
        learning_rate: float,
        checkpoint_every: int,
        save_checkpoint: Callable[[int], None],
        should_stop: Callable[[], bool],
        report_interval_s: float,
        report_max_records: int,
        max_seconds: float | None = None,
        checks: dict[int, CheckResult] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.reporter, self.builder = reporter, summary
        self.step, self.first_step = start_step, start_step + 1
        self.batch_size, self.learning_rate = batch_size, learning_rate
        self.checkpoint_every, self.save_checkpoint = checkpoint_every, save_checkpoint
        self.should_stop = should_stop
        self.report_interval_s, self.report_max_records = report_interval_s, report_max_records
        self.clock = clock
        self.checks: dict[int, CheckResult] = checks if checks is not None else {}
        """The float32 checks' results by step (worker.float32_check), read when records are built."""
        self.pending: list[_RawStep] = []
        self.pending_since = 0.0
        self.stopped = False
        self.timed_out = False
        self.deadline = None if max_seconds is None else time.monotonic() + max_seconds
        self.failure: Diverged | None = None
        self.nonfinite_losses = 0
        self._scaled = summary.context.loss_scale_mode is not LossScaleMode.NONE
        self._dynamic = summary.context.loss_scale_mode is LossScaleMode.DYNAMIC
        self._t0 = 0.0
        self._telemetry_index: int | None = None

    def _read_telemetry(self, logs: dict[str, Any]) -> tuple[float, list[float]]:
        """(the batch's data loss, the optimizer's telemetry vector)."""
        if TELEMETRY_LOG_KEY in logs:
            values: list[float] = np.asarray(logs[TELEMETRY_LOG_KEY]).tolist()
            return values[0], values[1:]
        return float(logs["batch_loss"]), self._read_optimizer()

    def _read_optimizer(self) -> list[float]:
        optimizer: TelemetryOptimizer = self.model.optimizer
        jax_state = getattr(self.model, "_jax_state", None)
        if jax_state:  # JAX keeps the live values outside the variables during fit.
            if self._telemetry_index is None:
                paths = [v.path for v in optimizer.variables]
                self._telemetry_index = paths.index(optimizer.telemetry.path)
            return np.asarray(jax_state["optimizer_variables"][self._telemetry_index]).tolist()
        return keras.ops.convert_to_numpy(optimizer.telemetry.value).tolist()

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        elapsed = time.perf_counter() - self._t0
        now = self.clock()
        self.step += 1
        logs = logs or {}
        loss, telemetry = self._read_telemetry(logs)
        if not self.pending:
            self.pending_since = now
        self.pending.append((self.step, loss, telemetry, elapsed, now))
        self._check_divergence(self.step, loss, telemetry)
        if self.failure is not None:
            self.model.stop_training = True
            return
        if len(self.pending) >= self.report_max_records or now - self.pending_since >= self.report_interval_s:
            self.flush()
        if self.step % self.checkpoint_every == 0:
            self.flush()
            self.save_checkpoint(self.step)
        if self.should_stop():
            self.stopped = True
            self.model.stop_training = True
        elif self.deadline is not None and time.monotonic() > self.deadline:
            self.timed_out = True
            self.model.stop_training = True

    def _check_divergence(self, step: int, loss: float, telemetry: list[float]) -> None:
        scale, finite, skipped = (telemetry[_FIELD[name]] for name in ("loss_scale", "grads_finite", "skipped"))
        loss_finite = math.isfinite(loss)
        self.nonfinite_losses = 0 if loss_finite else self.nonfinite_losses + 1
        message = None
        if not self._scaled and (not loss_finite or not finite):
            message = (
                f"At step {step} the {'gradients' if loss_finite else 'loss'} became inf or NaN with "
                "no loss scaling, and the update was applied, so the weights are no longer finite. "
                "Lower the learning rate, or use loss_scale 'dynamic', which skips such steps."
            )
        elif self.nonfinite_losses >= DIVERGENCE_PATIENCE:
            message = (
                f"The loss itself was inf or NaN for {self.nonfinite_losses} steps in a row up to step "
                f"{step}. Loss scaling only protects gradients; a forward pass that overflows needs a "
                "lower learning rate, float32 for the overflowing layers, or mixed_bfloat16."
            )
        elif self._dynamic and skipped and scale <= 1.0:
            message = (
                f"At step {step} the gradients overflowed even at loss scale {scale:g}: there is "
                "nothing left to back off. The gradients themselves exceed float16's range (65504); "
                "lower the learning rate or clip gradients."
            )
        if message is not None:
            self.builder.mark_diverged(step, message)
            self.failure = Diverged(message)

    def _records(self) -> list[StepRecord]:
        """Turn the pending raw steps into records, folded into the summary in order."""
        records = []
        elements = self.model.optimizer.gradient_elements
        penalized = bool(self.model.optimizer.penalties)
        initial_scale = self.model.optimizer.initial_scale
        for step, loss, telemetry, elapsed, now in self.pending:
            t = dict(zip(TELEMETRY_FIELDS, telemetry, strict=True))
            check = self.checks.pop(step, None)
            record = StepRecord(
                step=step,
                loss=_finite_or_none(loss),
                loss_scale=_scale_as_given(t["loss_scale"], initial_scale),
                grad_norm=_finite_or_none(t["grad_norm"]),
                grads_finite=bool(t["grads_finite"]),
                skipped=bool(t["skipped"]),
                zero_grad_fraction=zero_fraction(telemetry, elements),
                regularization_loss=_finite_or_none(t["regularization_loss"]) if penalized else None,
                excess_zero_fraction=None if check is None else check.excess_zero_fraction,
                grad_rel_error=None if check is None else check.grad_rel_error,
                learning_rate=self.learning_rate,
                examples_per_sec=self.batch_size / elapsed if elapsed > 0 else 0.0,
                step_time_ms=elapsed * 1000.0,
                time=now,
            )
            self.builder.add(record, timed=step != self.first_step, batch_size=self.batch_size)
            if check is not None:
                self.builder.add_check(check)
            records.append(record)
        self.pending = []
        return records

    def flush(self) -> None:
        """Hand the steps since the last flush to the reporter, then the summary so far."""
        if self.pending:
            self.reporter.steps(self._records())
            self.reporter.summary(self.builder.summary())

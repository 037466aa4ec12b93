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

from app.errors import Diverged
from app.schemas import LossScaleMode, StepRecord, Summary
from worker.optimizer import TelemetryOptimizer
from worker.summary import SummaryBuilder

TELEMETRY_LOG_KEY = "step_telemetry"
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


@keras.saving.register_keras_serializable(package="mpjobs")
class BatchLoss(keras.metrics.Metric):
    """The loss of the current batch alone, unscaled (Keras's `loss` is a running mean)."""

    def __init__(self, loss: Any = None, name: str = "batch_loss", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self._loss_fn = keras.losses.get(loss) if loss is not None else None
        self.value = self.add_variable(shape=(), initializer="zeros", name="value")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        assert self._loss_fn is not None
        # Training uses no sample weights. Keras's compiled loss averages
        # per-sample values ("sum_over_batch_size"), and so does this.
        value = keras.ops.cast(self._loss_fn(y_true, y_pred), "float32")
        self.value.assign(keras.ops.mean(value))

    def result(self) -> Any:
        return keras.ops.convert_to_tensor(self.value)  # a tensor, not the Variable (JAX traces this)

    def reset_state(self) -> None:
        self.value.assign(0.0)


@keras.saving.register_keras_serializable(package="mpjobs")
class StepTelemetry(keras.metrics.Metric):
    """Puts the optimizer's telemetry vector into `logs`, read inside the compiled step.

    `fit` already brings `logs` to the host each step, so this costs one
    variable read in the graph instead of an eager read per step. Stateful
    backends only (TensorFlow, torch): under JAX, metrics cannot see the
    optimizer's new state, and the callback reads the trainer's state instead.
    """

    def __init__(self, optimizer: TelemetryOptimizer | None = None, name: str = TELEMETRY_LOG_KEY,
                 **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self._read = (lambda: optimizer.telemetry.value) if optimizer is not None else None

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Nothing to accumulate: the optimizer wrote this step's values."""

    def result(self) -> Any:
        assert self._read is not None
        return self._read()

    def reset_state(self) -> None:
        """Nothing to reset."""


_RawStep = tuple[int, float, list[float], float, float]
"""(step, batch loss, telemetry vector, step seconds, unix time at its end)."""


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


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

    def _read_telemetry(self, logs: dict[str, Any]) -> list[float]:
        if TELEMETRY_LOG_KEY in logs:
            values: list[float] = np.asarray(logs[TELEMETRY_LOG_KEY]).tolist()
            return values
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
        telemetry = self._read_telemetry(logs)
        loss = float(logs.get("batch_loss", telemetry[0]))
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
        _, scale, _, finite, skipped, _ = telemetry
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
        for step, loss, (_, scale, grad_norm, finite, skipped, zero_fraction), elapsed, now in self.pending:
            record = StepRecord(
                step=step,
                loss=_finite_or_none(loss),
                loss_scale=scale,
                grad_norm=_finite_or_none(grad_norm),
                grads_finite=bool(finite),
                skipped=bool(skipped),
                zero_grad_fraction=zero_fraction,
                learning_rate=self.learning_rate,
                examples_per_sec=self.batch_size / elapsed if elapsed > 0 else 0.0,
                step_time_ms=elapsed * 1000.0,
                time=now,
            )
            self.builder.add(record, timed=step != self.first_step, batch_size=self.batch_size)
            records.append(record)
        self.pending = []
        return records

    def flush(self) -> None:
        """Hand the steps since the last flush to the reporter, then the summary so far."""
        if self.pending:
            self.reporter.steps(self._records())
            self.reporter.summary(self.builder.summary())

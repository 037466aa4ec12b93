"""The step recorder: each optimizer step's numbers into one `StepRecord`, handed to the reporter in batches.

A call may run several steps (worker/engine/stepper.py): its logs then carry one telemetry row per
step, and each step gets its own record, timed as the call's seconds shared evenly.

Between two steps the training thread only keeps the step's raw numbers. The
records are built when a batch is handed to the reporter: on a small model a
step takes about a millisecond, and work between steps delays the next one by
more than its own time (the runtime's worker threads go to sleep and must be
woken).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from mpjobs.contract.records import LayerCheck, StepRecord
from worker.numerics.float32_check import CheckResult
from worker.numerics.summary import SummaryBuilder
from worker.telemetry.batch_loss import TELEMETRY_LOG_KEY
from worker.telemetry.fp8_state import rows as fp8_rows
from worker.telemetry.optimizer import TelemetryOptimizer
from worker.telemetry.reporters import Reporter
from worker.telemetry.step_vector import Telemetry, split


@dataclass(frozen=True)
class RawStep:
    """What a step leaves between two steps: its number, batch loss, telemetry and timing."""

    step: int
    loss: float
    telemetry: Telemetry
    fp8: tuple[float, ...]
    """The FP8 layers' state after the step (worker/telemetry/fp8_state.py); empty without FP8 layers."""
    seconds: float
    """From `on_train_batch_begin` to `on_train_batch_end`, over the steps of the call."""
    time: float
    """Unix time at its end (inside a call of several steps: the call's end, less the later steps' share)."""


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


class StepRecorder(keras.callbacks.Callback):
    """Keeps each step's raw numbers; builds and reports them as records, with the summary, in batches."""

    def __init__(
        self,
        *,
        reporter: Reporter,
        summary: SummaryBuilder,
        start_step: int,
        batch_size: int,
        learning_rate: float,
        report_interval_s: float,
        report_max_records: int,
        checks: dict[int, CheckResult] | None = None,
        layer_checks: dict[int, LayerCheck] | None = None,
        fp8_counts: dict[int, dict[tuple[str, str], tuple[float, float]]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.reporter, self.builder = reporter, summary
        self.step, self.first_step = start_step, start_step + 1
        self.batch_size, self.learning_rate = batch_size, learning_rate
        self.report_interval_s, self.report_max_records = report_interval_s, report_max_records
        self.clock = clock
        self.checks: dict[int, CheckResult] = checks if checks is not None else {}
        """The float32 checks' results by step (worker.numerics.float32_check), read when records are built."""
        self.layer_checks: dict[int, LayerCheck] = layer_checks if layer_checks is not None else {}
        """The layer checks by step (worker.numerics.layer_numerics), reported with the batch that holds their step."""
        self.fp8_counts: dict[int, dict[tuple[str, str], tuple[float, float]]] = fp8_counts if fp8_counts is not None \
            else {}
        """The FP8 tensors' exact (saturated, underflow) shares on the checked steps (worker.numerics.fp8_counts)."""
        self.pending: list[RawStep] = []
        self.pending_since = 0.0
        self.latest: RawStep | None = None
        """The step that just ended, for the callbacks after this one."""
        self.latest_steps: list[RawStep] = []
        """Every step of the call that just ended, in order (one under `fit`)."""
        self._t0 = 0.0
        self._telemetry_index: int | None = None

    def _read(self, logs: dict[str, Any]) -> list[tuple[float, Telemetry, tuple[float, ...]]]:
        """(the batch's data loss, the optimizer's telemetry, the FP8 state) of each step of the call."""
        if TELEMETRY_LOG_KEY in logs:
            rows: list[list[float]] = np.atleast_2d(np.asarray(logs[TELEMETRY_LOG_KEY])).tolist()
            return [(row[0], *split(row[1:])) for row in rows]
        return [(float(logs["batch_loss"]), *split(self._read_optimizer()))]

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
        rows = self._read(logs or {})
        if not self.pending:
            self.pending_since = now
        share = elapsed / len(rows)
        self.latest_steps = []
        for i, (loss, telemetry, fp8) in enumerate(rows):
            self.step += 1
            self.latest_steps.append(RawStep(self.step, loss, telemetry, fp8, share,
                                             now - (len(rows) - 1 - i) * share))
        self.latest = self.latest_steps[-1]
        self.pending.extend(self.latest_steps)

    def truncate(self, step: int) -> None:
        """Forget the steps after `step` (a call ran on past the step that diverged): they never happened."""
        self.pending = [raw for raw in self.pending if raw.step <= step]
        self.latest_steps = [raw for raw in self.latest_steps if raw.step <= step]
        self.latest = self.latest_steps[-1] if self.latest_steps else None
        self.step = min(self.step, step)

    def maybe_publish(self) -> None:
        """Publish once enough steps or seconds have gathered (after the divergence guard judged them)."""
        if self.pending and (len(self.pending) >= self.report_max_records
                             or self.clock() - self.pending_since >= self.report_interval_s):
            self.publish()

    def _records(self) -> list[StepRecord]:
        """Turn the pending raw steps into records, folded into the summary in order."""
        records = []
        elements = self.model.optimizer.gradient_elements
        penalized = bool(self.model.optimizer.penalties)
        initial_scale, slots = self.model.optimizer.initial_scale, self.model.optimizer.fp8_slots
        for raw in self.pending:
            t, step = raw.telemetry, raw.step
            check = self.checks.pop(step, None)
            fp8 = fp8_rows(slots, raw.fp8, self.fp8_counts.pop(step, None)) if slots else None
            record = StepRecord(
                step=step,
                loss=_finite_or_none(raw.loss),
                loss_scale=_scale_as_given(t.loss_scale, initial_scale),
                grad_norm=_finite_or_none(t.grad_norm),
                grads_finite=bool(t.grads_finite),
                skipped=bool(t.skipped),
                zero_grad_fraction=t.zero_fraction(elements),
                regularization_loss=_finite_or_none(t.regularization_loss) if penalized else None,
                excess_zero_fraction=None if check is None else check.excess_zero_fraction,
                grad_rel_error=None if check is None else check.grad_rel_error,
                fp8=fp8,
                learning_rate=self.learning_rate,
                examples_per_sec=self.batch_size / raw.seconds if raw.seconds > 0 else 0.0,
                step_time_ms=raw.seconds * 1000.0,
                time=raw.time,
            )
            self.builder.add(record, timed=step != self.first_step, batch_size=self.batch_size)
            if check is not None:
                self.builder.add_check(check)
            records.append(record)
        self.pending = []
        return records

    def publish(self, *, final: bool = False) -> None:
        """Hand the steps since the last publish to the reporter, then the summary so far.

        The only place a summary is reported: after each batch of steps, and once more
        with `final` when the run has ended (after its speed check, if any).
        """
        if self.pending:
            last = self.pending[-1].step
            layers = [self.layer_checks.pop(step) for step in sorted(self.layer_checks) if step <= last]
            for check in layers:
                self.builder.add_layer_check(check)
            if layers:
                self.reporter.layers(layers)
            self.reporter.steps(self._records())
        elif not final:
            return
        self.reporter.summary(self.builder.summary())

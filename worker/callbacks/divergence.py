"""The divergence guard: ends a run whose numbers can no longer recover, and says why in plain words."""

from __future__ import annotations

import math
from typing import Any

import keras

from app.core.errors import Diverged
from mpjobs.contract.spec import LossScaleMode
from worker.callbacks.recorder import StepRecorder
from worker.numerics.summary import SummaryBuilder

DIVERGENCE_PATIENCE = 10
"""Consecutive non-finite losses after which a scaled run is declared diverged."""


class DivergenceGuard(keras.callbacks.Callback):
    """After the recorder, each step: stop training once the run has diverged (as `TerminateOnNaN`,
    but it knows loss scaling: a scaled run may skip a non-finite step, an unscaled one may not).

    A call of several steps is judged step by step: the run fails at the exact step, and the steps the
    call ran after it are dropped (no record, no checkpoint: the last good checkpoint is kept). It also
    lets the recorder publish, so no record past a divergence is ever reported."""

    def __init__(self, recorder: StepRecorder, summary: SummaryBuilder) -> None:
        super().__init__()
        self.recorder, self.builder = recorder, summary
        self.failure: Diverged | None = None
        self.nonfinite_losses = 0
        self._scaled = summary.context.loss_scale_mode is not LossScaleMode.NONE
        self._dynamic = summary.context.loss_scale_mode is LossScaleMode.DYNAMIC

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        """Judge each step of the call in order; a failure drops the steps the call ran after it."""
        for raw in list(self.recorder.latest_steps):
            if self.failure is not None:
                break
            message = self._why(raw.step, raw.loss, raw.telemetry.loss_scale, bool(raw.telemetry.grads_finite),
                                bool(raw.telemetry.skipped))
            if message is not None:
                self.recorder.truncate(raw.step)
                self.builder.mark_diverged(raw.step, message)
                self.failure = Diverged(message)
                self.model.stop_training = True
        self.recorder.maybe_publish()

    def _why(self, step: int, loss: float, scale: float, finite: bool, skipped: bool) -> str | None:
        loss_finite = math.isfinite(loss)
        self.nonfinite_losses = 0 if loss_finite else self.nonfinite_losses + 1
        if not self._scaled and (not loss_finite or not finite):
            return (
                f"At step {step} the {'gradients' if loss_finite else 'loss'} became inf or NaN with "
                "no loss scaling, and the update was applied, so the weights are no longer finite. "
                "Lower the learning rate, or use loss_scale 'dynamic', which skips such steps."
            )
        if self.nonfinite_losses >= DIVERGENCE_PATIENCE:
            return (
                f"The loss itself was inf or NaN for {self.nonfinite_losses} steps in a row up to step "
                f"{step}. Loss scaling only protects gradients; a forward pass that overflows needs a "
                "lower learning rate, float32 for the overflowing layers, or mixed_bfloat16."
            )
        if self._dynamic and skipped and scale <= 1.0:
            return (
                f"At step {step} the gradients overflowed even at loss scale {scale:g}: there is "
                "nothing left to back off. The gradients themselves exceed float16's range (65504); "
                "lower the learning rate or clip gradients."
            )
        return None

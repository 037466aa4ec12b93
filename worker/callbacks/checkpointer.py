"""The checkpoint callback: every few steps or seconds, publish the steps so far and save where the run can resume."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import keras

from worker.callbacks.recorder import StepRecorder
from worker.engine.stepper import crossed


class Checkpointer(keras.callbacks.Callback):
    """Every `every` steps, or once `interval_s` seconds passed since the last save (on `clock`), whichever
    comes first: report the steps so far, then save (a diverged step is never saved)."""

    def __init__(self, recorder: StepRecorder, every: int, save: Callable[[int], None], interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.recorder, self.every, self.save, self.interval_s, self.clock = recorder, every, save, interval_s, clock
        self.saved_at = clock()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = self.recorder.step
        ran = len(self.recorder.latest_steps) or 1  # a call of several steps ends at its checkpoint step
        due = crossed(step, ran, self.every) or self.clock() - self.saved_at >= self.interval_s
        if due and not self.model.stop_training:  # the divergence guard stops first
            self.recorder.publish()
            self.save(step)
            self.saved_at = self.clock()

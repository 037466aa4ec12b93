"""The checkpoint callback: every few steps, publish the steps so far and save where the run can resume."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from worker.callbacks.recorder import StepRecorder


class Checkpointer(keras.callbacks.Callback):
    """Every `every` steps: report the steps so far, then save (a diverged step is never saved)."""

    def __init__(self, recorder: StepRecorder, every: int, save: Callable[[int], None]) -> None:
        super().__init__()
        self.recorder, self.every, self.save = recorder, every, save

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = self.recorder.step
        if step % self.every == 0 and not self.model.stop_training:  # the divergence guard stops first
            self.recorder.publish()
            self.save(step)

"""When a run pauses to checkpoint, and when it stops early: asked to, or out of time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import keras

from worker.recorder import StepRecorder


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


class StopControl(keras.callbacks.Callback):
    """Stops training after the step in which `should_stop()` turned true, or `max_seconds` ran out."""

    def __init__(self, should_stop: Callable[[], bool], max_seconds: float | None = None) -> None:
        super().__init__()
        self.should_stop = should_stop
        self.deadline = None if max_seconds is None else time.monotonic() + max_seconds
        self.stopped = False
        self.timed_out = False

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.model.stop_training:  # diverged: that is the run's end, whatever else holds
            return
        if self.should_stop():
            self.stopped = True
            self.model.stop_training = True
        elif self.deadline is not None and time.monotonic() > self.deadline:
            self.timed_out = True
            self.model.stop_training = True

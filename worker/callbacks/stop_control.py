"""The stop callback: ends training after the current step when the job is canceled or out of time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from worker.engine.stopping import TimeLimit


class StopControl(keras.callbacks.Callback):
    """Stops training after the step in which `should_stop()` turned true, or the time limit ran out."""

    def __init__(self, should_stop: Callable[[], bool], limit: TimeLimit | None = None) -> None:
        super().__init__()
        self.should_stop = should_stop
        self.limit = limit
        self.stopped = False
        self.timed_out = False

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.model.stop_training:  # diverged: that is the run's end, whatever else holds
            return
        if self.should_stop():
            self.stopped = True
            self.model.stop_training = True
        elif self.limit is not None and self.limit.passed():
            self.timed_out = True
            self.model.stop_training = True

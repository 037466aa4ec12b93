"""When a run pauses to checkpoint, and when it stops early: asked to, or out of time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras

from app.core.config import Settings
from app.core.spec import JobSpec
from worker.recorder import StepRecorder


@dataclass(frozen=True)
class TimeLimit:
    """How long an attempt may run, from the moment its worker took it, and which setting said so.

    >>> limit = TimeLimit.of(JobSpec.model_validate({"model": {"name": "mlp"}}), Settings(max_job_seconds=60))
    >>> limit.seconds, limit.source
    (60, 'MAX_JOB_SECONDS')
    """

    seconds: int
    source: str
    """`training.max_seconds`, or `MAX_JOB_SECONDS` (the deployment's) when the spec sets none or more."""
    deadline: float
    """On `time.monotonic()`'s clock."""

    @classmethod
    def of(cls, spec: JobSpec, settings: Settings, started: float | None = None) -> TimeLimit:
        asked = spec.training.max_seconds
        if asked is not None and asked <= settings.max_job_seconds:
            seconds, source = asked, "training.max_seconds"
        else:
            seconds, source = settings.max_job_seconds, "MAX_JOB_SECONDS"
        return cls(seconds, source, (time.monotonic() if started is None else started) + seconds)

    def passed(self) -> bool:
        return time.monotonic() > self.deadline

    def message(self, where: str) -> str:
        """Why the attempt ended, e.g. where="at step 40 of 100"."""
        return f"The time limit ran out {where}: {self.source}={self.seconds} s per attempt."


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

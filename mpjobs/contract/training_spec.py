"""A job's training settings: steps, batch, optimizer, seed, checkpoints, checks and devices."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, model_validator

from mpjobs.contract.strict import Integer, Number, Strict

MAX_STEPS = 10_000_000
"""The most steps a job trains: step numbers (a metrics page's `after`, Last-Event-ID) go up to it."""
UNDERFLOW_CHECK_EVERY = 100
"""The float32 check's default interval: two extra gradient computations per 100 steps."""
MAX_STEPS_PER_EXECUTION = 256
"""The most steps one compiled call may run (worker/engine/stepper.py): a cancel waits at most one call."""


def _steps_per_call(value: Any, info: ValidationInfo) -> Any:
    """"auto", or a whole number of steps from 1 to MAX_STEPS_PER_EXECUTION (`8.0` too; never `"8"` or `true`)."""
    if value == "auto":
        return value
    whole = isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
    if not whole or not 1 <= value <= MAX_STEPS_PER_EXECUTION:
        shown = (json.dumps(value) if isinstance(value, bool | str | int | float | list | None) else repr(value))[:100]
        raise ValueError(f'Expected {info.field_name} to be "auto" or a whole number of steps from 1 to '
                         f"{MAX_STEPS_PER_EXECUTION}. Received: {info.field_name}={shown}")
    return int(value)


StepsPerCall = Annotated[int | Literal["auto"], BeforeValidator(_steps_per_call)]
MAX_DEVICES = 16
"""The most devices one job may train on: the most GPUs one host holds (worker/engine/devices.py)."""


class TrainingSpec(Strict):
    steps: Integer = Field(200, ge=1, le=MAX_STEPS)
    batch_size: Integer = Field(32, ge=1, le=65_536)
    optimizer: Literal["adam", "adamw", "sgd", "rmsprop"] = "adam"
    learning_rate: Number = Field(0.001, gt=0.0, le=10.0)
    seed: Integer = Field(0, ge=0, le=2**31 - 1)
    checkpoint_every: Integer = Field(50, ge=1, le=MAX_STEPS)
    max_seconds: Integer | None = Field(None, ge=1, le=30 * 24 * 3600)
    """Fail with reason `timeout` once an attempt has trained this long. None: no limit."""
    underflow_check_every: Integer = Field(UNDERFLOW_CHECK_EVERY, ge=0, le=10_000_000)
    """Under a float16/bfloat16 compute policy, compare the step's gradient with float32's at
    step 1 and every multiple of this step (worker/numerics/float32_check.py). 0 turns the check off."""
    layer_check_every: Integer | None = Field(None, ge=0, le=10_000_000)
    """Record every layer's gradient and activation numerics (GET /jobs/{id}/layers) at step 1 and
    every multiple of this step. None: on the float32 check's steps (`underflow_check_every`) under a
    float16/bfloat16 compute policy, and never under float32. 0 turns the layer checks off, at no cost."""
    steps_per_execution: StepsPerCall = "auto"
    """Steps per compiled call, each step's telemetry kept on the device and read once per call
    (worker/engine/stepper.py). "auto": calls of about 20 ms, sized from the calls so far. The records
    are the same at any setting; a call also ends early at a checkpoint, an evaluation or a check."""
    devices: Integer = Field(1, ge=1, le=MAX_DEVICES)
    """Train on this many devices of one worker with `tf.distribute.MirroredStrategy`, each replica
    taking `batch_size / devices` rows of every step. Queued only to workers with that many devices."""

    @model_validator(mode="after")
    def _batch_splits_evenly(self) -> TrainingSpec:
        if self.batch_size % self.devices:
            raise ValueError(f"Expected training.batch_size to be a multiple of training.devices, so each "
                             f"replica gets the same rows. Received: batch_size={self.batch_size}, "
                             f"devices={self.devices}")
        return self

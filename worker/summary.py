"""Running summary and plain-words diagnoses, updated one step record at a time.

Its state is a small JSON-able dict, saved in every checkpoint, so a resumed
run's summary covers the steps before the interruption too.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from app.schemas import Diagnosis, LossScaleMode, PrecisionSpeed, StepRecord, Summary

UNDERFLOW_ZERO_FRACTION = 0.9
"""Share of exactly-zero gradient elements that, under float16, means underflow."""
FINAL_LOSS_WINDOW = 10
"""`final_loss` averages this many last steps, so one batch cannot decide it."""
FLOAT16_SUBNORMAL_MIN = 2.0**-24


@dataclass(frozen=True)
class RunContext:
    policy: str
    compute_dtype: str
    loss_scale_mode: LossScaleMode
    slow_precision_message: str | None = None
    float32_layers: tuple[str, ...] = ()


class SummaryBuilder:
    def __init__(self, context: RunContext, state: dict[str, Any] | None = None) -> None:
        self.context = context
        s = state or {}
        self.steps_done: int = s.get("steps_done", 0)
        self.recent_losses: deque[float | None] = deque(s.get("recent_losses", []), FINAL_LOSS_WINDOW)
        self.skipped_steps: int = s.get("skipped_steps", 0)
        self.first_skip: int | None = s.get("first_skip")
        self.scale_min: float | None = s.get("scale_min")
        self.scale_max: float | None = s.get("scale_max")
        self.scale_final: float | None = s.get("scale_final")
        self.peak_zero: float | None = s.get("peak_zero")
        self.underflow_steps: int = s.get("underflow_steps", 0)
        self.first_underflow: int | None = s.get("first_underflow")
        self.timed_examples: float = s.get("timed_examples", 0.0)
        self.timed_seconds: float = s.get("timed_seconds", 0.0)
        self.precision_speed: PrecisionSpeed | None = None
        """Measured at the end of a run (worker.speed), never carried across a resume."""
        diverged = s.get("diverged")
        self.diverged: tuple[int, str] | None = (int(diverged[0]), str(diverged[1])) if diverged else None

    def state(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done,
            "recent_losses": list(self.recent_losses),
            "skipped_steps": self.skipped_steps,
            "first_skip": self.first_skip,
            "scale_min": self.scale_min,
            "scale_max": self.scale_max,
            "scale_final": self.scale_final,
            "peak_zero": self.peak_zero,
            "underflow_steps": self.underflow_steps,
            "first_underflow": self.first_underflow,
            "timed_examples": self.timed_examples,
            "timed_seconds": self.timed_seconds,
            "diverged": list(self.diverged) if self.diverged else None,
        }

    def set_speed(self, speed: PrecisionSpeed, slow_precision_message: str | None) -> None:
        """The run's speed check, and the `slow_precision_on_device` message it earned (None: none)."""
        self.precision_speed = speed
        self.context = replace(self.context, slow_precision_message=slow_precision_message)

    def add(self, r: StepRecord, *, timed: bool = True, batch_size: int = 0) -> None:
        """Fold in one step. `timed=False` leaves warm-up steps out of examples/s."""
        self.steps_done = r.step
        self.recent_losses.append(r.loss)
        if r.skipped:
            self.skipped_steps += 1
            self.first_skip = self.first_skip or r.step
        self.scale_min = r.loss_scale if self.scale_min is None else min(self.scale_min, r.loss_scale)
        self.scale_max = r.loss_scale if self.scale_max is None else max(self.scale_max, r.loss_scale)
        self.scale_final = r.loss_scale
        self.peak_zero = max(self.peak_zero or 0.0, r.zero_grad_fraction)
        if self.context.compute_dtype == "float16" and r.zero_grad_fraction >= UNDERFLOW_ZERO_FRACTION:
            self.underflow_steps += 1
            self.first_underflow = self.first_underflow or r.step
        if timed:
            self.timed_examples += batch_size
            self.timed_seconds += r.step_time_ms / 1000.0

    def mark_diverged(self, step: int, message: str) -> None:
        self.diverged = (step, message)

    def final_loss(self) -> float | None:
        if not self.recent_losses or any(v is None for v in self.recent_losses):
            return None
        return math.fsum(v for v in self.recent_losses if v is not None) / len(self.recent_losses)

    def diagnoses(self) -> list[Diagnosis]:
        c, out = self.context, []
        if self.first_underflow is not None:
            advice = {
                LossScaleMode.NONE: "Turn on loss scaling: loss_scale 'dynamic', or 'fixed' with a scale such as 1024.",
                LossScaleMode.FIXED: "The fixed scale is too low for these gradients: raise it, or use 'dynamic'.",
                LossScaleMode.DYNAMIC: "The dynamic scale was too low at those steps; raise initial_scale.",
            }[c.loss_scale_mode]
            out.append(Diagnosis(
                code="gradient_underflow",
                first_step=self.first_underflow,
                message=(
                    f"On {self.underflow_steps} of {self.steps_done} steps at least "
                    f"{UNDERFLOW_ZERO_FRACTION:.0%} of gradient elements were exactly zero (peak "
                    f"{(self.peak_zero or 0):.1%}) under {c.policy}: the gradients fell below float16's "
                    f"smallest subnormal ({FLOAT16_SUBNORMAL_MIN:.1e}) and flushed to zero, so those weights "
                    f"did not learn. {advice}"
                ),
            ))
        if self.skipped_steps:
            out.append(Diagnosis(
                code="overflow_skips",
                first_step=self.first_skip,
                message=(
                    f"{self.skipped_steps} of {self.steps_done} steps were skipped because their gradients "
                    f"were inf or NaN at the loss scale in force; the weights were not updated on those steps. "
                    + (
                        "The dynamic scale halves after each such step, so a few skips at the start are normal."
                        if c.loss_scale_mode is LossScaleMode.DYNAMIC
                        else "The fixed scale never backs off: lower it, or use loss_scale 'dynamic'."
                    )
                ),
            ))
        if self.diverged is not None:
            out.append(Diagnosis(code="diverged", first_step=self.diverged[0], message=self.diverged[1]))
        if c.slow_precision_message:
            out.append(Diagnosis(code="slow_precision_on_device", first_step=None, message=c.slow_precision_message))
        if c.float32_layers:
            out.append(Diagnosis(
                code="float32_fallback",
                first_step=None,
                message=(
                    f"This device has no {c.compute_dtype} kernel for {', '.join(c.float32_layers)}, so "
                    "those layers ran in float32 (pooling is exact in either precision); the rest of the "
                    f"model ran under {c.policy}."
                ),
            ))
        return out

    def summary(self) -> Summary:
        return Summary(
            steps_done=self.steps_done,
            final_loss=self.final_loss(),
            skipped_steps=self.skipped_steps,
            loss_scale_min=self.scale_min,
            loss_scale_max=self.scale_max,
            loss_scale_final=self.scale_final,
            peak_zero_grad_fraction=self.peak_zero,
            mean_examples_per_sec=(self.timed_examples / self.timed_seconds) if self.timed_seconds > 0 else None,
            precision_speed=self.precision_speed,
            diagnoses=self.diagnoses(),
        )

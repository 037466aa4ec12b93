"""Running summary and plain-words diagnoses, updated one step record at a time.

Its state is a small JSON-able dict, saved in every checkpoint, so a resumed
run's summary covers the steps before the interruption too.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mpjobs.contract.fp8 import Fp8Layers
from mpjobs.contract.plan import PrecisionPlan
from mpjobs.contract.records import (
    DataUse,
    Diagnosis,
    DiagnosisCode,
    EvalRecord,
    LayerCheck,
    PrecisionSpeed,
    StepRecord,
    Summary,
    VariantSpeed,
)
from mpjobs.contract.spec import LossScaleMode
from worker.numerics.float32_check import CheckResult
from worker.numerics.fp8_diagnoses import Fp8Watch
from worker.numerics.layer_diagnoses import overflow_words, underflow_words
from worker.numerics.layer_numerics import floor_percent, scale_text

FINAL_LOSS_WINDOW = 10
"""`final_loss` averages this many last steps, so one batch cannot decide it."""


SKIP_KINDS = ("descent", "probe", "spike")
"""Why a dynamic scale's step was skipped: coming down from the initial scale (before it ever grew); probing
upward (its last change was a doubling, which this step overflowed); or at a scale that had held since it
last halved: the gradients grew."""


def _finding(saved: Any) -> tuple[int, str, str] | None:
    return (int(saved[0]), str(saved[1]), str(saved[2])) if saved else None


@dataclass(frozen=True)
class RunContext:
    policy: str
    compute_dtype: str
    loss_scale_mode: LossScaleMode
    slow_precision_message: str | None = None
    float32_layers: tuple[str, ...] = ()
    output_dtype: str = "float32"
    """The dtype of the model's output as built."""


class SummaryBuilder:
    def __init__(self, context: RunContext, state: dict[str, Any] | None = None) -> None:
        self.context = context
        s = state or {}
        self.steps_done: int = s.get("steps_done", 0)
        self.recent_losses: deque[float | None] = deque(s.get("recent_losses", []), FINAL_LOSS_WINDOW)
        self.skipped_steps: int = s.get("skipped_steps", 0)
        self.first_skip: int | None = s.get("first_skip")
        self.skip_kinds: dict[str, list[int]] = s.get("skip_kinds") or {kind: [0, 0] for kind in SKIP_KINDS}
        """[count, first step] of the skips of each kind (see `_skip_words`)."""
        self.scale_first: float | None = s.get("scale_first")
        self.scale_grew: bool = s.get("scale_grew", False)
        self.scale_rose_last: bool = s.get("scale_rose_last", False)
        """Whether the scale's last change was a doubling (a skip then is its probe failing)."""
        self.scale_min: float | None = s.get("scale_min")
        self.scale_max: float | None = s.get("scale_max")
        self.scale_final: float | None = s.get("scale_final")
        self.peak_zero: float | None = s.get("peak_zero")
        self.float32_checks: int = s.get("float32_checks", 0)
        self.underflow_checks: int = s.get("underflow_checks", 0)
        self.first_underflow: int | None = s.get("first_underflow")
        self.peak_excess: float | None = s.get("peak_excess")
        self.peak_rel_error: float | None = s.get("peak_rel_error")
        self.worst_variable: tuple[str, float] | None = (
            (str(s["worst_variable"][0]), float(s["worst_variable"][1])) if s.get("worst_variable") else None)
        self.underflow_advice: str | None = s.get("underflow_advice")
        self.check_error: str | None = s.get("check_error")
        self.timed_examples: float = s.get("timed_examples", 0.0)
        self.timed_seconds: float = s.get("timed_seconds", 0.0)
        self.precision_speed: PrecisionSpeed | None = None
        """Measured at the end of a run (worker.numerics.speed), never carried across a resume."""
        self.variant_speeds: list[VariantSpeed] = []
        """A comparison baseline's measurement of the other variants, at the end of its run."""
        self.layer_checks: int = s.get("layer_checks", 0)
        self.underflow_layer: tuple[int, str, str] | None = _finding(s.get("underflow_layer"))
        """(step, layer, message) of the first layer check that found where underflow begins."""
        self.overflow_layer: tuple[int, str, str] | None = _finding(s.get("overflow_layer"))
        diverged = s.get("diverged")
        self.diverged: tuple[int, str] | None = (int(diverged[0]), str(diverged[1])) if diverged else None
        self.validation = EvalRecord.model_validate(s["validation"]) if s.get("validation") else None
        """The latest evaluation on the held-out rows (worker/callbacks/evaluator.py), across a resume too."""
        self.data_use: Callable[[int], DataUse] | None = None
        self.plan: PrecisionPlan | None = None  # `plan: "auto"`: derived again by every attempt, so not in `state`
        self.steps_per_call: Callable[[], int | None] = lambda: None  # set by the engine: its calls so far
        self.fp8: Fp8Layers | None = None  # set by the engine: the FP8 layers, and the rest
        self.fp8_watch = Fp8Watch(s.get("fp8"))
        """What training does with the data, for a number of steps done (worker.engine.data.data_use)."""

    def state(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done, "recent_losses": list(self.recent_losses),
            "skipped_steps": self.skipped_steps, "first_skip": self.first_skip, "skip_kinds": self.skip_kinds,
            "scale_first": self.scale_first, "scale_grew": self.scale_grew, "scale_rose_last": self.scale_rose_last,
            "scale_min": self.scale_min, "scale_max": self.scale_max, "scale_final": self.scale_final,
            "peak_zero": self.peak_zero,
            "float32_checks": self.float32_checks,
            "underflow_checks": self.underflow_checks,
            "first_underflow": self.first_underflow,
            "peak_excess": self.peak_excess,
            "peak_rel_error": self.peak_rel_error,
            "worst_variable": list(self.worst_variable) if self.worst_variable else None,
            "underflow_advice": self.underflow_advice,
            "check_error": self.check_error,
            "timed_examples": self.timed_examples,
            "timed_seconds": self.timed_seconds,
            "diverged": list(self.diverged) if self.diverged else None,
            "layer_checks": self.layer_checks,
            "underflow_layer": list(self.underflow_layer) if self.underflow_layer else None,
            "overflow_layer": list(self.overflow_layer) if self.overflow_layer else None,
            "validation": self.validation.model_dump(mode="json") if self.validation else None,
            "fp8": self.fp8_watch.state(),
        }

    def _skip_words(self) -> str:
        """The skips of a dynamic scale by kind, each with what it means."""
        words = []
        (descent, first_descent), (probe, first_probe), (spike, first_spike) = (
            self.skip_kinds[kind] for kind in SKIP_KINDS)
        if descent:
            start = f" from its initial {scale_text(self.scale_first)}" if self.scale_first else ""
            words.append(f"{descent} while the scale came down{start} to one the gradients fit, halving after "
                         f"each (from step {first_descent}): normal at the start of a run")
        if probe:
            words.append(f"{probe} when the scale probed upward (first at step {first_probe}): after each growth "
                         f"interval of finite steps it doubles, and a step that overflows at the doubled scale is "
                         f"skipped and halves it back; that is how a dynamic scale stays near its ceiling, at the "
                         f"cost of one step per probe")
        if spike:
            words.append(f"{spike} at a scale that had held (first at step {first_spike}): the gradients themselves "
                         f"grew past {self.context.compute_dtype}'s range on those steps; if they recur, look for "
                         f"loss spikes, or lower the learning rate")
        return "Of those, " + "; ".join(words) + "."

    def set_speed(self, speed: PrecisionSpeed, slow_precision_message: str | None) -> None:
        """The run's speed check, and the `slow_precision_on_device` message it earned (None: none)."""
        self.precision_speed = speed
        self.context = replace(self.context, slow_precision_message=slow_precision_message)

    def set_variant_speeds(self, speeds: list[VariantSpeed]) -> None:
        """A comparison baseline's speed check: each other variant against float32."""
        self.variant_speeds = speeds

    def add(self, r: StepRecord, *, timed: bool = True, batch_size: int = 0) -> None:
        """Fold in one step. `timed=False` leaves warm-up steps out of examples/s."""
        self.steps_done = r.step
        self.recent_losses.append(r.loss)
        if self.scale_final is not None and r.loss_scale != self.scale_final:
            self.scale_rose_last = r.loss_scale > self.scale_final
            self.scale_grew = self.scale_grew or self.scale_rose_last
        if r.skipped:
            self.skipped_steps += 1
            self.first_skip = self.first_skip or r.step
            counted = self.skip_kinds[
                "descent" if not self.scale_grew else "probe" if self.scale_rose_last else "spike"]
            counted[0], counted[1] = counted[0] + 1, counted[1] or r.step
        self.scale_first = r.loss_scale if self.scale_first is None else self.scale_first
        self.scale_min = r.loss_scale if self.scale_min is None else min(self.scale_min, r.loss_scale)
        self.scale_max = r.loss_scale if self.scale_max is None else max(self.scale_max, r.loss_scale)
        self.scale_final = r.loss_scale
        self.peak_zero = max(self.peak_zero or 0.0, r.zero_grad_fraction)
        if r.fp8:
            self.fp8_watch.add(r)
        if timed:
            self.timed_examples += batch_size
            self.timed_seconds += r.step_time_ms / 1000.0

    def add_check(self, c: CheckResult) -> None:
        """Fold in one float32 check (worker.numerics.float32_check)."""
        self.float32_checks += 1
        self.peak_excess = max(self.peak_excess or 0.0, c.excess_zero_fraction)
        if c.grad_rel_error is not None:
            self.peak_rel_error = max(self.peak_rel_error or 0.0, c.grad_rel_error)
        if not c.flagged:
            return
        self.underflow_checks += 1
        self.first_underflow = self.first_underflow or c.step
        if c.worst_variable is not None and (self.worst_variable is None or c.worst_share > self.worst_variable[1]):
            self.worst_variable = (c.worst_variable, c.worst_share)
        self.underflow_advice = self.underflow_advice or c.advice

    def add_layer_check(self, check: LayerCheck) -> None:
        """Fold in one layer check (worker.numerics.layer_numerics): the first that names a layer is the diagnosis's."""
        self.layer_checks += 1
        if check.underflow_layer is not None and self.underflow_layer is None:
            self.underflow_layer = (check.step, check.underflow_layer, underflow_words(check, self.context.policy))
        if check.overflow_layer is not None and self.overflow_layer is None:
            self.overflow_layer = (check.step, check.overflow_layer, overflow_words(check))

    def set_check_error(self, message: str) -> None:
        self.check_error = message

    def mark_diverged(self, step: int, message: str) -> None:
        self.diverged = (step, message)

    def final_loss(self) -> float | None:
        if not self.recent_losses or any(v is None for v in self.recent_losses):
            return None
        return math.fsum(v for v in self.recent_losses if v is not None) / len(self.recent_losses)

    def diagnoses(self) -> list[Diagnosis]:
        c, out = self.context, []
        if self.first_underflow is not None:
            worst = (f" The most affected weight was {self.worst_variable[0]} ({self.worst_variable[1]:.1%} of its "
                     "values).") if self.worst_variable else ""
            out.append(Diagnosis(
                code=DiagnosisCode.GRADIENT_UNDERFLOW,
                first_step=self.first_underflow,
                layer=self.underflow_layer[1] if self.underflow_layer else None,
                message=(
                    f"On {self.underflow_checks} of {self.float32_checks} checked steps, gradient values that "
                    f"are not zero in float32 came out exactly zero under {c.policy} (at most "
                    f"{floor_percent(self.peak_excess or 0.0)} of all values, first at step "
                    f"{self.first_underflow}), so those weights did not learn on those steps.{worst} "
                    + (self.underflow_advice or "")
                ).strip(),
            ))
        for code, finding in ((DiagnosisCode.LAYER_UNDERFLOW, self.underflow_layer),
                              (DiagnosisCode.ACTIVATION_OVERFLOW_RISK, self.overflow_layer)):
            if finding is not None:
                out.append(Diagnosis(code=code, first_step=finding[0], layer=finding[1], message=finding[2]))
        if self.skipped_steps:
            out.append(Diagnosis(
                code=DiagnosisCode.OVERFLOW_SKIPS,
                first_step=self.first_skip,
                message=(
                    f"{self.skipped_steps} of {self.steps_done} steps were skipped because their gradients "
                    f"were inf or NaN at the loss scale in force; the weights were not updated on those steps. "
                    + (self._skip_words() if c.loss_scale_mode is LossScaleMode.DYNAMIC
                       else "The fixed scale never backs off: lower it, or use loss_scale 'dynamic'.")
                ),
            ))
        if self.diverged is not None:
            out.append(Diagnosis(code=DiagnosisCode.DIVERGED, first_step=self.diverged[0], message=self.diverged[1]))
        if c.slow_precision_message:
            out.append(Diagnosis(code=DiagnosisCode.SLOW_PRECISION_ON_DEVICE, first_step=None,
                                 message=c.slow_precision_message))
        if c.policy.startswith("mixed_") and c.output_dtype != "float32":
            out.append(Diagnosis(
                code=DiagnosisCode.HALF_PRECISION_OUTPUT,
                first_step=None,
                message=(
                    f"The model's output is {c.output_dtype} under {c.policy}: its last layer computes in "
                    f"{c.output_dtype}, so the outputs the loss sees (a softmax's probabilities, say) were "
                    f"rounded to {c.output_dtype} first. Small probabilities lose most of their digits or "
                    "become 0, which the loss's log then makes inf. Keras's mixed-precision guide keeps the "
                    "last layer in float32: give it dtype='float32'. In a keras_json, a layer keeps float32 "
                    "when the other layers have another dtype, so build the model under the mixed policy and "
                    "pin the head."
                ),
            ))
        if c.float32_layers:
            out.append(Diagnosis(
                code=DiagnosisCode.FLOAT32_FALLBACK,
                first_step=None,
                message=(
                    f"This device has no {c.compute_dtype} kernel for {', '.join(c.float32_layers)}, so "
                    "those layers ran in float32 (pooling is exact in either precision); the rest of the "
                    f"model ran under {c.policy}."
                ),
            ))
        if self.fp8 is not None:
            out += self.fp8_watch.diagnoses(self.fp8.amax_history_length, self.steps_done)
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
            float32_checks=self.float32_checks,
            peak_excess_zero_fraction=self.peak_excess,
            peak_grad_rel_error=self.peak_rel_error,
            float32_check_error=self.check_error,
            mean_examples_per_sec=(self.timed_examples / self.timed_seconds) if self.timed_seconds > 0 else None,
            precision_speed=self.precision_speed,
            variant_speeds=self.variant_speeds,
            layer_checks=self.layer_checks,
            underflow_layer=self.underflow_layer[1] if self.underflow_layer else None,
            underflow_step=self.underflow_layer[0] if self.underflow_layer else None,
            overflow_layer=self.overflow_layer[1] if self.overflow_layer else None,
            overflow_step=self.overflow_layer[0] if self.overflow_layer else None,
            diagnoses=self.diagnoses(),
            validation=self.validation,
            data=self.data_use(self.steps_done) if self.data_use else None, plan=self.plan,
            steps_per_call=self.steps_per_call(), fp8=self.fp8,
        )

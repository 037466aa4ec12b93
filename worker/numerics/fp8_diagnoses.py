"""FP8 diagnoses in plain words, from each step's FP8 rows: saturation, underflow, a zero scale, a stuck scale.

Each names the layer, the tensor and the steps. They follow Keras's delayed scaling (mpjobs/contract/fp8.py):
the scale a step uses comes from the amax history as it stood two steps before, so a tensor whose range
jumps saturates for two steps, and one outlier sets the scale for as many steps as the history is long.
The state is a plain dict, carried across a resume in the summary's checkpointed state.
"""

from __future__ import annotations

from typing import Any

from mpjobs.contract.fp8 import FORMATS, Fp8Tensor
from mpjobs.contract.records import Diagnosis, DiagnosisCode, StepRecord

SATURATION_NAMED = 2.0
"""A step is counted as saturating when its largest |x| is at least twice what the format holds at the scale in
force. With Keras's margin of 0, any amax above the history's clips a few values by a little: that is the
design, not a finding; the exact share on a checked step is named from SHARE_NAMED."""
WARM_UP_STEPS = 2
"""Steps 1 and 2 run at the initial scale of 1 (the first scale computed from data is used at step 3): not
counted."""
SHARE_NAMED = 0.01
"""An exact count on a checked step is named when at least this share of a tensor's values was clipped, or of
its non-zero values lost."""
UNDERFLOW_SHARE = SHARE_NAMED
"""An exact count on a checked step is named when at least this share of a tensor's non-zero values was lost."""
LAG_NAMED = 16.0
"""An underflow is put down to an outlier in the history when the history's largest amax is at least this many
times the step's own."""


def _key(row: Fp8Tensor) -> str:
    return f"{row.layer}|{row.tensor}"


def _what(key: str) -> str:
    layer, tensor = key.split("|")
    return f"{layer}'s {'output gradient' if tensor == 'outputs_grad' else tensor} ({FORMATS[tensor].name})"


def _saturation(key: str, sat: dict[str, Any] | None, exact: list[Any] | None) -> Diagnosis:
    layer, tensor = key.split("|")
    fmt = FORMATS[tensor]
    checked = f" On checked step {exact[1]}, {exact[0]:.1%} of its values were clipped." if exact else ""
    if sat is None:
        return Diagnosis(code=DiagnosisCode.FP8_SATURATION, first_step=exact[1] if exact else None, layer=layer,
                         message=f"{_what(key)} saturated: values past {fmt.max:g} × its scale were clipped.{checked}")
    steps = f"{sat['steps']} step{'s' * (sat['steps'] != 1)}"
    return Diagnosis(code=DiagnosisCode.FP8_SATURATION, first_step=sat["first"], layer=layer, message=(
        f"{_what(key)} saturated on {steps} (first at step {sat['first']}, last at {sat['last']}): its largest |x| "
        f"reached up to {sat['peak']:.3g} times {fmt.max:g} × its scale, the most the format holds at the scale in "
        f"force, and everything past that was clipped.{checked} The scale follows the largest values two steps "
        "late, so a tensor whose range jumps saturates until the history catches up, and a jump that recurs is "
        "clipped each time. Keep this layer out of FP8 (pin it in layer_policies) if the clipped values matter."))


class Fp8Watch:
    """Folds each step's FP8 rows into per-tensor episodes; `diagnoses` says what they mean."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.s: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (state or {}).items()}

    def state(self) -> dict[str, Any]:
        return {k: dict(v) for k, v in self.s.items()}

    def _count(self, key: str, kind: str, step: int, **last: Any) -> None:
        entry = self.s.setdefault(key, {})
        seen = entry.setdefault(kind, {"steps": 0, "first": step})
        seen["steps"] += 1
        seen.update(last=step, **last)

    def add(self, record: StepRecord) -> None:
        for row in record.fp8 or ():
            key, step = _key(row), record.step
            if step <= WARM_UP_STEPS:
                continue
            if row.range_use is not None and row.range_use >= SATURATION_NAMED:
                self._count(key, "saturated", step, amax=row.amax, scale=row.scale,
                            peak=max(row.range_use, self.s.get(key, {}).get("saturated", {}).get("peak", 0.0)))
            if row.underflowing:
                self._count(key, "underflow", step, amax=row.amax)
                if row.lag is not None and row.lag >= LAG_NAMED:  # an outlier in the history sets the scale
                    self.s[key]["underflow"].update(source=step - row.peak_age, peak=row.history_max)
            if row.scale == 0.0:
                self._count(key, "zero", step)
            if (row.history_max is None or row.history_max == 0.0) and row.scale != 0.0:
                self._count(key, "stuck", step, scale=row.scale, nonfinite=row.history_max is None)
            for kind, share in (("exact_saturated", row.saturated_fraction), ("exact_underflow",
                                                                               row.underflow_fraction)):
                if share is not None and share > self.s.get(key, {}).get(kind, [0.0])[0]:
                    self.s.setdefault(key, {})[kind] = [share, step]

    def diagnoses(self, history: int, steps_done: int) -> list[Diagnosis]:
        out = []
        for key, e in self.s.items():
            layer = key.split("|")[0]
            exact_sat, exact_under = e.get("exact_saturated"), e.get("exact_underflow")
            if (sat := e.get("saturated")) is not None or (exact_sat and exact_sat[0] >= SHARE_NAMED):
                out.append(_saturation(key, sat, exact_sat))
            under = e.get("underflow")
            if under is not None or (exact_under and exact_under[0] >= UNDERFLOW_SHARE):
                out.append(self._underflow(key, under, exact_under, history, steps_done))
            if (zero := e.get("zero")) is not None:
                out.append(Diagnosis(code=DiagnosisCode.FP8_SCALE_ZERO, first_step=zero["first"], layer=layer, message=(
                    f"{_what(key)} had a scale of 0 on {zero['steps']} step{'s' * (zero['steps'] != 1)} (first at "
                    f"step {zero['first']}): dividing by 0 sends every value to the format's largest, and "
                    "multiplying back by 0 makes it 0, so the layer computed on zeros and its output was a "
                    "constant, while the loss can look fine. Keras writes a zero scale when the step that updates "
                    "it called the model without training=True (under JAX, the custom gradient that returns the "
                    "new scale never ran and its gradient, 0, was assigned).")))
            if (stuck := e.get("stuck")) is not None:
                why = ("held a value that is not finite (inf or NaN), and Keras keeps the last scale until it "
                       f"leaves the history ({history} steps)") if stuck["nonfinite"] else (
                       "held only zeros: this tensor was all zeros on every step of the window (for an output "
                       "gradient: no gradient reached the layer), and Keras keeps the last scale then")
                out.append(Diagnosis(code=DiagnosisCode.FP8_SCALE_STUCK, first_step=stuck["first"], layer=layer,
                                     message=(f"The scale of {_what(key)} could not follow its values on "
                                              f"{stuck['steps']} step{'s' * (stuck['steps'] != 1)} (first at step "
                                              f"{stuck['first']}, "
                                              f"at scale {stuck['scale']:.3g}): its amax history {why}.")))
        return out

    def _underflow(self, key: str, under: dict[str, Any] | None, exact: list[Any] | None, history: int,
                   steps_done: int) -> Diagnosis:
        layer, tensor = key.split("|")
        fmt = FORMATS[tensor]
        checked = (f" On checked step {exact[1]}, {exact[0]:.1%} of its non-zero values became 0." if exact else "")
        if under is None:  # only the exact count saw it
            return Diagnosis(code=DiagnosisCode.FP8_UNDERFLOW, first_step=exact[1] if exact else None, layer=layer,
                             message=f"{_what(key)} lost values below {fmt.name}'s smallest, {fmt.smallest:g} × its "
                                     f"scale.{checked}")
        steps = f"{under['steps']} step{'s' * (under['steps'] != 1)}"
        text = (f"{_what(key)} fell below {fmt.name}'s normal range on {steps} (first at step {under['first']}, last "
                f"at {under['last']}): its largest |x| sat under {fmt.smallest_normal:g} × the scale in force, so its "
                f"values lost their precision and those under {fmt.smallest / 2:g} × scale became 0.{checked}")
        if (source := under.get("source")) is not None:
            # The scale of step t comes from the history after step t - 2: the outlier of step `source` sets the
            # scales of steps source + 2 .. source + history + 1.
            recovered_at = source + history + 2
            left = recovered_at - 1 - steps_done
            peak, amax = under["peak"], under["amax"]
            text += (f" The scale was set by an amax of {peak:.3g} from step {source}, {peak / amax:.3g} times this "
                     f"tensor's latest ({amax:.3g}): delayed scaling takes the largest amax of the last {history} "
                     "steps.")
            text += (f" The scale will recover in {left} step{'s' * (left != 1)}, when the outlier leaves the history."
                     if under["last"] == steps_done and left > 0 else
                     f" The scale recovered at step {recovered_at}, when the outlier left the history."
                     if recovered_at <= steps_done else "")
            text += " A shorter fp8.amax_history_length forgets an outlier sooner."
        return Diagnosis(code=DiagnosisCode.FP8_UNDERFLOW, first_step=under["first"], layer=layer, message=text)


"""Precision comparisons: one job per variant, read back as one report with a verdict.

The report is computed on every read from the variants' jobs, so it is never
stale and needs no writer: a comparison record is only its spec and job ids.
"""

from __future__ import annotations

import math
from datetime import datetime

from app.resources import Comparison, Job, JobState, VariantResult
from app.schemas import ComparisonSpec, PrecisionPolicy, Variant

UNDERFLOW = "gradient_underflow"
FASTER = 1.05
"""A speedup below this is within run-to-run noise: not worth a recommendation."""
MIN_STEPS_FOR_SPEED = 100
"""Fewer steps than this time mostly start-up noise: the verdict then recommends no variant for speed."""


def build(comparison_id: str, name: str | None, created_at: str, spec: ComparisonSpec,
          jobs: list[Job]) -> Comparison:
    variants = spec.variants or []
    base_index = next(i for i, v in enumerate(variants) if v.precision_policy is PrecisionPolicy.FLOAT32)
    base = jobs[base_index]
    results = [_result(v, job, base, i == base_index) for i, (v, job) in enumerate(zip(variants, jobs, strict=True))]
    done = all(job.state.terminal for job in jobs)
    return Comparison(id=comparison_id, name=name, created_at=created_at, state="done" if done else "running",
                      spec=spec, variants=results,
                      verdict=verdict(results, jobs, spec.tolerance, spec.spec.training.steps) if done else
                      _progress(jobs))


def _result(variant: Variant, job: Job, base: Job, is_base: bool) -> VariantResult:
    summary, base_summary = job.summary, base.summary
    final = summary.final_loss if summary else None
    base_final = base_summary.final_loss if base_summary else None
    speed = summary.mean_examples_per_sec if summary else None
    base_speed = base_summary.mean_examples_per_sec if base_summary else None
    return VariantResult(
        label=variant.label, precision_policy=variant.precision_policy, loss_scale=variant.loss_scale,
        baseline=is_base, job_id=job.id, state=job.state, progress=job.progress,
        final_loss=final,
        loss_gap=(final - base_final) / abs(base_final) if final is not None and base_final else None,
        examples_per_sec=speed,
        speedup=speed / base_speed if speed and base_speed else None,
        skipped_steps=summary.skipped_steps if summary else None,
        peak_zero_grad_fraction=summary.peak_zero_grad_fraction if summary else None,
        peak_excess_zero_fraction=summary.peak_excess_zero_fraction if summary else None,
        diagnoses=summary.diagnoses if summary else [],
        error=job.error,
        device=_device(job),
    )


def _device(job: Job) -> str | None:
    if job.worker is None:
        return None
    device = job.worker.device
    return f"{device.get('kind')} ({device['name']})" if device.get("name") else str(device.get("kind"))


def _progress(jobs: list[Job]) -> str:
    finished = sum(job.state.terminal for job in jobs)
    return f"{finished} of {len(jobs)} variants finished; the verdict comes when all have."


def _percent(fraction: float, sign: bool = False) -> str:
    """0.008 -> "0.8%", 3.9e-06 -> "0.00039%": small gaps keep two significant digits."""
    value = fraction * 100
    text = f"{value:+.2g}%" if sign else f"{value:.2g}%"
    return text if abs(value) < 10 else (f"{value:+.0f}%" if sign else f"{value:.0f}%")


def _speed(speedup: float | None) -> str:
    if speedup is None:
        return "at unknown speed"
    if 1 / FASTER < speedup < FASTER:
        return f"at the same speed ({speedup:.2f}×)"
    if speedup > 1:
        return f"at {speedup:.2g}× speed"
    return f"at {speedup:.2g}× speed ({1 / speedup:.2g}× slower)"


def _phrase(r: VariantResult, tolerance: float) -> str:
    if r.state is not JobState.SUCCEEDED:
        why = f" ({r.error.reason}: {r.error.message})" if r.error else ""
        return f"{r.label} {r.state.value}{why}"
    codes = {d.code for d in r.diagnoses}
    gap = r.loss_gap
    if UNDERFLOW in codes:
        cause = "without loss scaling" if r.loss_scale is None or r.loss_scale.mode == "none" else "even with scaling"
        excess = r.peak_excess_zero_fraction
        zero = f" (up to {math.floor(excess * 1000) / 10:g}% of gradient values zero that are not zero in float32)" \
            if excess is not None else ""
        end = f", and its loss ends {_percent(gap, sign=True)} from float32's" if gap is not None else ""
        return f"{r.label}: {cause} gradients underflow{zero}{end}"
    if gap is None:
        return f"{r.label} has no final loss to compare"
    skips = f", skipping {r.skipped_steps} overflow steps" if r.skipped_steps else ""
    if abs(gap) <= tolerance:
        return f"{r.label} matches float32 within {_percent(abs(gap))} {_speed(r.speedup)}{skips}"
    return f"{r.label} ends {_percent(gap, sign=True)} from float32's loss {_speed(r.speedup)}{skips}"


def _risk_of(compute_dtype: str, mode: str) -> int:
    """How much can go wrong numerically: bfloat16 keeps float32's range; float16 needs scaling."""
    if compute_dtype != "float16":
        return 0
    return {"dynamic": 1, "fixed": 2}.get(mode, 3)


def _risk(r: VariantResult) -> int:
    full_low = r.precision_policy.variable_dtype != "float32"  # weights stored in 16 bits too
    mode = r.loss_scale.mode if r.loss_scale is not None else "none"
    return _risk_of(r.precision_policy.compute_dtype, mode) + (4 if full_low else 0)


def _overlapped(jobs: list[Job]) -> bool:
    """Whether two variants trained at the same time on the same host, sharing it."""
    spans = sorted((job.worker.host, datetime.fromisoformat(job.started_at), datetime.fromisoformat(job.finished_at))
                   for job in jobs if job.worker and job.started_at and job.finished_at)
    return any(a[0] == b[0] and b[1] < a[2] for a, b in zip(spans, spans[1:], strict=False))


def verdict(results: list[VariantResult], jobs: list[Job], tolerance: float,
            steps: int = MIN_STEPS_FOR_SPEED) -> str:
    """Each variant against float32 in a clause, then what to use."""
    base = next(r for r in results if r.baseline)
    if base.state is not JobState.SUCCEEDED or base.final_loss is None:
        return f"The float32 baseline {base.state.value}, so there is nothing to compare against."
    others = [r for r in results if not r.baseline]
    text = "; ".join(_phrase(r, tolerance) for r in others) + "."
    good = [r for r in others if r.state is JobState.SUCCEEDED and r.loss_gap is not None
            and abs(r.loss_gap) <= tolerance and UNDERFLOW not in {d.code for d in r.diagnoses}]
    faster = [r for r in good if r.speedup is not None and r.speedup >= FASTER]
    if good and steps < MIN_STEPS_FOR_SPEED:
        text += (f" {steps} steps are too few to judge speed; run at least {MIN_STEPS_FOR_SPEED} before choosing "
                 "a precision for speed.")
    elif faster:
        # Speeds within noise of the fastest are a tie; a tie goes to the safest numerics.
        top = max(r.speedup or 0.0 for r in faster)
        best = min((r for r in faster if (r.speedup or 0.0) * FASTER >= top), key=_risk)
        text += f" Use {best.label}."
        if _risk(best) >= _risk_of("float16", "none"):
            text += (" It has no loss scaling: gradients below float16's range would silently become zero "
                     "on other data; dynamic scaling costs little.")
    elif good:
        device = base.device or "this device"
        text += (f" Mixed precision keeps float32's accuracy here but is not faster on {device}: "
                 "keep float32 on this device, and compare again on one with float16/bfloat16 hardware.")
    else:
        text += f" No variant matched float32's loss within {tolerance:.0%}: keep float32."
    devices = {r.device for r in results if r.device}
    if len(devices) > 1:
        text += f" Speeds are not comparable: the variants ran on different devices ({', '.join(sorted(devices))})."
    elif _overlapped(jobs):
        text += " Speeds are approximate: some variants trained at the same time and shared the machine."
    return text

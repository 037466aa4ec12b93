"""Precision comparisons: one job per variant, read back as one report with a verdict.

The report is computed on every read from the variants' jobs, so it is never
stale and needs no writer: a comparison record is only its spec and job ids. With
validation, each variant is judged on its final held-out metric against float32's,
paired on the same examples (app/api/heldout.py; the method in docs/numerics.md).
"""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path

from app.api import heldout
from app.api.fp8_report import FP8_RISK, fp8_lost, fp8_phrase
from app.api.plan_report import own_speed, plan_label, plan_sentence
from app.api.resources import ComparisonReport, VariantResult
from mpjobs.contract.comparisons import HeldOut, held_out_words
from mpjobs.contract.formats import percent, speed_words
from mpjobs.contract.jobs import JobRecord, JobState
from mpjobs.contract.records import Diagnosis, DiagnosisCode, VariantSpeed
from mpjobs.contract.spec import ComparisonSpec, Variant

TRAINING_LOSS_ONLY = "Judged on training loss only: the comparison has no held-out data (validation)."
UNDERFLOW = DiagnosisCode.GRADIENT_UNDERFLOW
SLOW = DiagnosisCode.SLOW_PRECISION_ON_DEVICE


def build(comparison_id: str, name: str | None, created_at: str, spec: ComparisonSpec,
          jobs: list[JobRecord], artifacts_dir: Path | None = None) -> ComparisonReport:
    variants = spec.variants or []
    base_index = spec.baseline_index
    base = jobs[base_index]
    speeds = {s.label: s for s in (base.summary.variant_speeds if base.summary else [])}
    results = [_result(v, job, base, i == base_index, speeds.get(v.label))
               for i, (v, job) in enumerate(zip(variants, jobs[:len(variants)], strict=True))]
    after = len(variants) + (spec.plan is not None)
    if spec.plan is not None:  # the plan variant, after the variants (app/api/plan_report.py)
        label = plan_label(variants[spec.planned_index])
        results.append(_result(variants[spec.planned_index], jobs[len(variants)], base, False,
                               own_speed(jobs[len(variants)], label)).model_copy(update={"label": label}))
    control = None
    if len(jobs) > after:  # the seed control (float32_seeds: 2), last
        control = _result(variants[base_index], jobs[after], base, False, None).model_copy(
            update={"label": spec.seed_control_label})
    done = all(job.state.terminal for job in jobs)
    if done and spec.spec.validation is not None and artifacts_dir is not None:
        results = [_held_out(r, base, artifacts_dir, spec.spec.validation.metrics) for r in results]
        control = _held_out(control, base, artifacts_dir, spec.spec.validation.metrics) if control else None
    text = verdict(results, base, spec.tolerance, control) if done else _progress(jobs)
    if done and spec.plan is not None:
        r = results[-1]
        text += " " + plan_sentence(jobs[spec.planned_index], jobs[len(variants)], r.label, r.loss_gap,
                                    spec.tolerance, _speed(r), held_out_words(r.held_out) if r.held_out else None)
    return ComparisonReport(id=comparison_id, name=name, created_at=created_at, state="done" if done else "running",
                            spec=spec, variants=results, seed_control=control, verdict=text)


def _result(variant: Variant, job: JobRecord, base: JobRecord, is_base: bool,
            timed: VariantSpeed | None) -> VariantResult:
    summary, base_summary = job.summary, base.summary
    final = summary.final_loss if summary else None
    base_final = base_summary.final_loss if base_summary else None
    diagnoses = list(summary.diagnoses) if summary else []
    if timed is not None and timed.slow_precision and not any(d.code == SLOW for d in diagnoses):
        diagnoses.append(Diagnosis(code=SLOW, first_step=None, message=timed.slow_precision))
    return VariantResult(
        label=variant.label, precision_policy=variant.precision_policy, loss_scale=variant.loss_scale,
        fp8=variant.fp8, baseline=is_base, job_id=job.id, state=job.state, progress=job.progress,
        final_loss=final,
        loss_gap=(final - base_final) / abs(base_final) if final is not None and base_final else None,
        examples_per_sec=summary.mean_examples_per_sec if summary else None,
        speed=timed.speed if timed else None,
        speed_error=timed.error if timed else None,
        skipped_steps=summary.skipped_steps if summary else None,
        peak_zero_grad_fraction=summary.peak_zero_grad_fraction if summary else None,
        peak_excess_zero_fraction=summary.peak_excess_zero_fraction if summary else None,
        underflow_layer=summary.underflow_layer if summary else None,
        underflow_step=summary.underflow_step if summary else None,
        diagnoses=diagnoses,
        error=job.error,
        device=_device(job),
    )


def _held_out(r: VariantResult, base: JobRecord, artifacts_dir: Path, metrics: list[str]) -> VariantResult:
    if r.baseline or r.state is not JobState.SUCCEEDED or base.state is not JobState.SUCCEEDED:
        return r
    try:
        return r.model_copy(update={"held_out": heldout.compare(artifacts_dir, r.job_id, base.id, metrics)})
    except heldout.NotPaired as error:
        return r.model_copy(update={"held_out_error": str(error)})


def _worse(h: HeldOut) -> bool:
    """The whole interval lies on the worse side of zero: measurably worse than float32 on held-out data."""
    return h.low > 0 if h.metric == "loss" else h.high < 0


def _device(job: JobRecord) -> str | None:
    if job.worker is None:
        return None
    device = job.worker.device
    return f"{device.get('kind')} ({device['name']})" if device.get("name") else str(device.get("kind"))


def _progress(jobs: list[JobRecord]) -> str:
    finished = sum(job.state.terminal for job in jobs)
    return f"{finished} of {len(jobs)} variants finished; the verdict comes when all have."


def _speed(r: VariantResult) -> str:
    if r.speed is not None:
        low, high = r.speed.interval
        return speed_words(r.speed.slowdown, low, high, r.speed.difference)
    if r.speed_error is not None:
        return "not timed (it could not train beside float32)"
    return "speed not measured"


def _against_seeds(h: HeldOut, noise: HeldOut | None) -> str:
    """Whether mixed precision moves the held-out metric more than another float32 seed does."""
    if noise is None:
        return ""
    return (", within the difference between two float32 seeds" if abs(h.difference) <= abs(noise.difference)
            else ", larger than the difference between two float32 seeds")


def _phrase(r: VariantResult, tolerance: float, noise: HeldOut | None = None) -> str:
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
        end = f", and its loss ends {percent(gap, sign=True)} from float32's" if gap is not None else ""
        return f"{r.label}: {cause} gradients underflow{zero}{end}"
    if fp8_lost(r):
        return fp8_phrase(r)
    if r.held_out is not None:
        skips = f", skipping {r.skipped_steps} overflow steps" if r.skipped_steps else ""
        worse = ", measurably worse" if _worse(r.held_out) else ""
        seeds = _against_seeds(r.held_out, noise)
        return f"{r.label}: {held_out_words(r.held_out)}{seeds}{worse}, {_speed(r)}{skips}"
    if r.held_out_error is not None:
        return f"{r.label}: no held-out verdict ({r.held_out_error})"
    if gap is None:
        return f"{r.label} has no final loss to compare"
    skips = f", skipping {r.skipped_steps} overflow steps" if r.skipped_steps else ""
    if abs(gap) <= tolerance:
        return f"{r.label} matches float32 within {percent(abs(gap))}, {_speed(r)}{skips}"
    return f"{r.label} ends {percent(gap, sign=True)} from float32's loss, {_speed(r)}{skips}"


def _risk_of(compute_dtype: str, mode: str) -> int:
    """How much can go wrong numerically: bfloat16 keeps float32's range; float16 needs scaling."""
    if compute_dtype != "float16":
        return 0
    return {"dynamic": 1, "fixed": 2}.get(mode, 3)


def _risk(r: VariantResult) -> int:
    full_low = r.precision_policy.variable_dtype != "float32"  # weights stored in 16 bits too
    mode = r.loss_scale.mode if r.loss_scale is not None else "none"
    return _risk_of(r.precision_policy.compute_dtype, mode) + (4 if full_low else 0) + (FP8_RISK if r.fp8 else 0)


class Outcome(str, Enum):
    """What one variant's row shows against float32, decided once (`outcome`): the verdict's closing
    sentence is built from these alone, so it cannot say of a row what its clause does not."""

    MATCHED = "matched"
    """Within the tolerance of float32's loss (or not measurably worse on held-out data), with no warning."""
    FLAGGED = "flagged"
    """Matched, but its gradients underflow: some weights did not learn on some steps. Never recommended."""
    OFF = "off"
    """Its final training loss is further from float32's than the tolerance."""
    WORSE = "worse"
    """Measurably worse than float32 on held-out data."""
    NO_LOSS = "no_loss"
    """Succeeded without a final loss to compare (a non-finite loss among its last steps)."""
    UNFINISHED = "unfinished"
    """Failed or canceled: its clause names the reason."""


def outcome(r: VariantResult, tolerance: float) -> Outcome:
    """`r`'s row in one word: a held-out verdict, when there is one, decides whether it matched, else the loss gap."""
    if r.state is not JobState.SUCCEEDED:
        return Outcome.UNFINISHED
    if r.held_out is not None:
        if _worse(r.held_out):
            return Outcome.WORSE
    elif r.loss_gap is None:
        return Outcome.NO_LOSS
    elif abs(r.loss_gap) > tolerance:
        return Outcome.OFF
    return Outcome.FLAGGED if UNDERFLOW in {d.code for d in r.diagnoses} or fp8_lost(r) else Outcome.MATCHED


def _names(rows: list[VariantResult]) -> str:
    labels = [r.label for r in rows]
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"


def _what(o: Outcome, r: VariantResult, tolerance: float, many: bool) -> str:
    """What the rows with outcome `o` did (their verb phrase, past tense), as `r` shows it."""
    basis = f"held-out {r.held_out.metric}" if r.held_out is not None else f"loss within {percent(tolerance)}"
    return {
        Outcome.MATCHED: f"matched float32's {basis}",
        Outcome.FLAGGED: f"matched float32's {basis} but {'their' if many else 'its'} "
                         + ("FP8 lost values" if fp8_lost(r) else "gradients underflow"),
        Outcome.OFF: f"ended more than {percent(tolerance)} from float32's loss",
        Outcome.WORSE: "ended measurably worse than float32 on held-out data",
        Outcome.NO_LOSS: "had no final loss to compare",
        Outcome.UNFINISHED: r.state.value,
    }[o]


def _tally(rows: list[tuple[VariantResult, Outcome]], tolerance: float) -> str:
    """Every variant by outcome, in one sentence: ` a matched float32's loss within 2%; b and c failed.`"""
    groups: dict[tuple[Outcome, str], list[VariantResult]] = {}
    for o in Outcome:
        for r in (r for r, ro in rows if ro is o):
            groups.setdefault((o, _what(o, r, tolerance, False)), []).append(r)
    parts = [f"{_names(rs)} {_what(o, rs[0], tolerance, len(rs) > 1)}" for (o, _), rs in groups.items()]
    return f" {'; '.join(parts)}."


def _closing(rows: list[tuple[VariantResult, Outcome]], tolerance: float, device: str) -> str:
    """What to use, from the rows' outcomes (and the matched rows' speeds) only."""
    matched = [r for r, o in rows if o is Outcome.MATCHED]
    outcomes = {o for _, o in rows}
    faster = [r for r in matched if r.speed is not None and r.speed.difference == "faster"]
    if faster:
        top = min(faster, key=lambda r: r.speed.slowdown if r.speed else math.inf)
        top_high = top.speed.interval[1] if top.speed else math.inf
        tied = [r for r in faster if r.speed is not None and r.speed.interval[0] <= top_high]
        best = min(tied, key=_risk)
        text = f" Use {best.label}."
        if _risk(best) >= _risk_of("float16", "none"):
            text += (" It has no loss scaling: gradients below float16's range would silently become zero "
                     "on other data; dynamic scaling costs little.")
        return text
    everyone = outcomes == {Outcome.MATCHED}
    tally = "" if everyone else _tally(rows, tolerance)
    untimed = [r for r in matched if r.speed is None]
    timed = [r for r in matched if r.speed is not None]
    not_faster = f"{_names(timed)} {'is' if len(timed) == 1 else 'are'} not measurably faster on {device}" \
        if timed else ""
    if untimed:
        who = "every variant" if len(untimed) == len(rows) else _names(untimed)
        also = f", and {not_faster}" if timed else ""
        return tally + (f" Speed was not measured for {who}{also}, so no precision is recommended for speed: "
                        f"keep float32 until a comparison has timed {'it' if len(untimed) == 1 else 'them'}.")
    hardware = "keep float32 on this device, and compare again on one with float16/bfloat16 hardware."
    if everyone:
        judged = [r.held_out for r in matched if r.held_out is not None]
        kept = f"float32's held-out {judged[0].metric}" if judged else "float32's training loss"
        return f" Mixed precision keeps {kept} here but none of it is measurably faster on {device}: {hardware}"
    if matched:
        return f"{tally} {not_faster}: {hardware}"
    if Outcome.FLAGGED in outcomes:
        lost = ", or whose FP8 lost values," if any(fp8_lost(r) for r, _ in rows) else ""
        return tally + f" A variant whose gradients underflow{lost} is not recommended: keep float32."
    if outcomes == {Outcome.UNFINISHED}:
        return " No variant finished: keep float32."
    if Outcome.WORSE not in outcomes:
        return f" No variant matched float32's loss within {percent(tolerance)}: keep float32."
    if outcomes <= {Outcome.WORSE, Outcome.UNFINISHED}:
        return " Every variant is measurably worse than float32 on held-out data, or did not finish: keep float32."
    return tally + " No variant matched float32: keep float32."


def verdict(results: list[VariantResult], base_job: JobRecord, tolerance: float,
            control: VariantResult | None = None) -> str:
    """Each variant against float32 in a clause, then what to use.

    Each variant is classified once (`outcome`), and the closing sentence is built from
    those outcomes only, so it never contradicts a clause: a variant that matched is never
    called unmatched, and one that matched but is not recommended is named with the reason.
    Speed is the baseline job's one measurement of every variant in turns, never the
    training runs' examples/s: a variant counts as faster only when its whole interval
    is. Among the faster ones, those not measurably slower than the fastest tie, and
    the tie goes to the safest numerics; when none is faster, float32 is the safest.
    """
    base = next(r for r in results if r.baseline)
    if base.state is not JobState.SUCCEEDED or base.final_loss is None:
        return f"The float32 baseline {base.state.value}, so there is nothing to compare against."
    others = [r for r in results if not r.baseline]
    noise = control.held_out if control is not None else None
    text = "; ".join(_phrase(r, tolerance, noise) for r in others) + "."
    if noise is not None:
        text += f" Seed noise: {control.label if control else ''}, {held_out_words(noise)}."
    elif control is not None:
        why = control.held_out_error or f"it {control.state.value}"
        text += f" No seed noise: the float32 run with another seed has no held-out result ({why})."
    text += _closing([(r, outcome(r, tolerance)) for r in others], tolerance, base.device or "this device")
    if base_job.summary and base_job.summary.variant_speeds:
        text += (" Speeds: step time against float32's, every variant timed in turns in one process after the "
                 "float32 run; intervals hold the median per-round ratio with 95% confidence.")
    if not any(r.held_out is not None or r.held_out_error for r in others):
        text += f" {TRAINING_LOSS_ONLY}"
    return text

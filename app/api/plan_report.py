"""A comparison's plan variant (`ComparisonSpec.plan`): its row, and the sentence of the verdict about it.

The plan variant is the planned variant's job with `plan: "auto"`: it found the precision plan of its
own step 1 and trained with it (worker/engine/planned.py). Its speed against float32 is its own
measurement in turns after its run (worker/numerics/speed.py), not the baseline's: the baseline
could not time a plan that did not exist yet.
"""

from __future__ import annotations

from mpjobs.contract.formats import percent
from mpjobs.contract.jobs import JobRecord, JobState
from mpjobs.contract.records import VariantSpeed
from mpjobs.contract.spec import Variant


def plan_label(planned: Variant) -> str:
    return f"{planned.label} + plan"


def own_speed(job: JobRecord, label: str) -> VariantSpeed | None:
    """The plan job's measurement of its own planned model against float32, as a variant's speed."""
    summary = job.summary
    if summary is None or summary.precision_speed is None:
        return None
    return VariantSpeed(label=label, speed=summary.precision_speed)


def _found(job: JobRecord) -> tuple[str | None, str | None]:
    s = job.summary
    return (s.underflow_layer, s.overflow_layer) if s else (None, None)


def plan_sentence(planned: JobRecord, plan_job: JobRecord, label: str, loss_gap: float | None, tolerance: float,
                  speed: str, held_out: str | None) -> str:
    """Whether the plan removed what the planned variant lost, and whether it matched float32."""
    if plan_job.state is not JobState.SUCCEEDED:
        why = f" ({plan_job.error.reason}: {plan_job.error.message})" if plan_job.error else ""
        return f"The plan variant {plan_job.state.value}{why}."
    plan = plan_job.summary.plan if plan_job.summary else None
    if plan is None:
        return f"{label}: no plan was found at step 1 (the search failed; the worker's log says why)."
    pins = ", ".join(f"`{name}`" for name in plan.layer_policies)
    what = " and ".join(p for p in (f"{pins} in float32" if pins else "",
                                    f"a loss scale of {plan.proposed_scale:g}" if plan.proposed_scale else "") if p)
    before, after = _found(planned), _found(plan_job)
    words = (f"underflow at `{before[0]}`", f"overflow at `{before[1]}`")
    kinds = [(word, a) for word, b, a in zip(words, before, after, strict=True) if b is not None]
    if not kinds:
        removed = "the planned variant had no underflow or overflow to remove"
    elif all(a is None for _, a in kinds):
        removed = "it removed the " + " and the ".join(w for w, _ in kinds)
    else:
        left = ", ".join(f"`{a}`" for _, a in kinds if a is not None)
        removed = f"it did not remove all of it: still flagged at {left}"
    if held_out is not None:
        match = f"held out, {held_out}"
    elif loss_gap is None:
        match = "it has no final loss to compare"
    elif abs(loss_gap) <= tolerance:
        match = f"it matched float32 within {percent(abs(loss_gap))}"
    else:
        match = f"it ended {percent(loss_gap, sign=True)} from float32's loss"
    return (f"{label} ({what or 'nothing pinned, no scale: the step matched float32'}; found at step {plan.step}): "
            f"{removed}; {match}; {speed}.")

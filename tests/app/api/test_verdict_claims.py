"""Issue 31 item 6 as a class: over every combination of row outcomes, the verdict's closing claims agree with the rows.

Each variant's row is set to one of a few states; the closing words (everything after the variants' clauses) are
read back claim by claim, and each claim is checked against the states written here, not against app/api/reports.py's
own classification.
"""

from __future__ import annotations

import itertools
import re

from app.api import reports
from mpjobs.contract.comparisons import HeldOut, VariantResult
from mpjobs.contract.jobs import JobError, JobRecord, JobState, Progress
from mpjobs.contract.records import Diagnosis, PrecisionSpeed, SpeedDifference
from mpjobs.contract.spec import ComparisonSpec

SPEC = ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}}})
VARIANTS = SPEC.variants or []
TOLERANCE = 0.02
LOST = JobError(reason="worker_lost", message="The worker running this job disappeared on each of its 3 attempts.")

MATCHED = {"matched_faster", "matched_same", "matched_untimed", "held_out_matched"}
"""Unflagged rows that matched float32: on training loss within 2%, or not measurably worse on held-out data."""
STATES = [*sorted(MATCHED), "flagged", "off", "worse", "no_loss", "failed", "canceled"]
"""`flagged`: matched but diagnosed with gradient underflow; `off`: loss +30%; `worse`: measurably worse on held-out
data though its training loss is within 2%; `no_loss`: succeeded without a final loss. The rows that must never be
recommended are timed faster than float32, so that only the verdict's rules keep them out."""


def measured(difference: SpeedDifference) -> PrecisionSpeed:
    low, high = {"faster": (0.45, 0.55), "none": (0.95, 1.05)}[difference]
    return PrecisionSpeed(policy_ms=1.0, float32_ms=2.0, slowdown=(low + high) / 2, steps=36, low=low, high=high,
                          noise_low=0.96, noise_high=1.04, rounds=9, difference=difference)


def held_out(low: float, high: float) -> HeldOut:
    return HeldOut(metric="accuracy", value=0.9, float32_value=0.9, difference=(low + high) / 2, low=low, high=high,
                   confidence=0.95, method="mcnemar_exact_conditional", examples=400, p_value=0.5)


def row(index: int, state: str) -> VariantResult:
    variant = VARIANTS[index]
    finished = state not in ("failed", "canceled")
    gap = {"off": 0.3, "no_loss": None, "held_out_matched": 0.05}.get(state, 0.001) if finished else None
    return VariantResult(
        label=variant.label, precision_policy=variant.precision_policy, loss_scale=variant.loss_scale,
        baseline=index == SPEC.baseline_index, job_id=f"j{index}",
        state=JobState.SUCCEEDED if finished else JobState(state), progress=Progress(step=10, total_steps=10),
        final_loss=None if gap is None else 1.0 + gap, loss_gap=gap, examples_per_sec=100.0,
        speed=None if state in ("matched_untimed", "held_out_matched") else measured(
            "none" if state == "matched_same" else "faster"),
        skipped_steps=0, peak_zero_grad_fraction=0.0, peak_excess_zero_fraction=0.2 if state == "flagged" else 0.0,
        diagnoses=[Diagnosis(code="gradient_underflow", first_step=1, message="underflow")] if state == "flagged"
        else [],
        error=LOST if state == "failed" else None, device="cpu",
        held_out=held_out(-0.04, -0.01) if state == "worse" else held_out(-0.02, 0.02) if state.startswith(
            "held_out") else None,
    )


BASE_JOB = JobRecord(
    id="j0", name="float32", state=JobState.SUCCEEDED, queue="any", spec=SPEC.job_specs()[0],
    created_at="2026-12-01T00:00:00+00:00", started_at="2026-12-01T00:00:00+00:00",
    finished_at="2026-12-01T00:01:00+00:00", transitions=[], progress=Progress(step=10, total_steps=10), summary=None,
    error=None, attempt=1, worker=None)
"""The float32 job: without a summary, so without the baseline's speed note."""

CLAIMS = [
    # (what a clause of the closing says of the variants it names, the states it may name)
    (re.compile(r"^Use "), {"matched_faster"}),
    (re.compile(r" matched float32's .* but (its|their) gradients underflow$"), {"flagged"}),
    (re.compile(r" matched float32's loss within 2%$"), MATCHED - {"held_out_matched"}),
    (re.compile(r" matched float32's held-out accuracy$"), {"held_out_matched"}),
    (re.compile(r" ended more than 2% from float32's loss$"), {"off"}),
    (re.compile(r" ended measurably worse than float32 on held-out data$"), {"worse"}),
    (re.compile(r" had no final loss to compare$"), {"no_loss"}),
    (re.compile(r" failed$"), {"failed"}),
    (re.compile(r" canceled$"), {"canceled"}),
    (re.compile(r"^Speed was not measured for "), {"matched_untimed", "held_out_matched"}),
    (re.compile(r" (is|are) not measurably faster on cpu$"), {"matched_same"}),
]


def closing_of(verdict: str) -> str:
    """The words after the variants' clauses (which hold no ". "), without the notes every verdict may end with."""
    closing = verdict.split(". ", 1)[1]
    for note in (" " + reports.TRAINING_LOSS_ONLY, reports.TRAINING_LOSS_ONLY):
        closing = closing.removesuffix(note)
    return closing


def named(text: str, labels: list[str]) -> list[str]:
    """The variants `text` names as a subject or object (a label is never inside another)."""
    return [label for label in labels
            if re.search(rf"(^|, | and | for |Use ){re.escape(label)}($|,| and | [a-z])", text)]


def check(states: dict[str, str]) -> None:
    rows = [row(0, "baseline"), *(row(i + 1, state) for i, state in enumerate(states.values()))]
    verdict = reports.verdict(rows, BASE_JOB, TOLERANCE)
    closing = closing_of(verdict)
    labels = list(states)
    said: dict[str, set[str]] = {label: set() for label in labels}  # the claims the closing makes of each variant
    for sentence in re.split(r"\. ", closing.removesuffix(".")):
        for part in sentence.split("; "):
            for claim in re.split(r", and |, so ", part.split(":")[0]):
                for label in named(claim, labels):
                    allowed = [states for pattern, states in CLAIMS if pattern.search(claim)]
                    assert allowed, f"an unknown claim about {label}: {claim!r} in {verdict!r}"
                    assert states[label] in allowed[0], f"{label} is {states[label]}, but: {claim!r} in {verdict!r}"
                    said[label].add(states[label])
    used = re.findall(r"Use ([^.]+)\.", closing)
    faster = [label for label, state in states.items() if state == "matched_faster"]
    matched = [label for label, state in states.items() if state in MATCHED]
    # A variant that matched and is unflagged is never passed over in silence: one of them is recommended,
    # or the closing names every one of them with why not ("every variant" when it is all of them).
    assert len(used) == (1 if faster else 0) and set(used) <= set(faster), verdict
    if matched and not used:
        assert all(said[label] for label in matched) or "Mixed precision keeps" in closing or \
            "for every variant" in closing, verdict
    if "No variant matched" in closing:
        assert not matched and "flagged" not in states.values(), verdict
    if "No variant matched float32's loss within 2%" in closing:  # no row's training loss is within 2% of float32's
        assert not {"flagged", "worse", *MATCHED} & set(states.values()), verdict
    if "No variant finished" in closing:
        assert set(states.values()) <= {"failed", "canceled"}, verdict
    if "Every variant is measurably worse" in closing:
        assert set(states.values()) <= {"worse", "failed", "canceled"}, verdict
    if "for every variant" in closing:
        assert all(states[label] in ("matched_untimed", "held_out_matched") for label in labels), verdict
    if "Mixed precision keeps" in closing:
        assert all(states[label] == "matched_same" for label in labels), verdict
    if "gradients underflow is not recommended" in closing:
        assert "flagged" in states.values() and not matched, verdict
    # Whenever float32 is kept although something matched, every variant is accounted for by name.
    if (matched or "flagged" in states.values()) and not used and not ("Mixed precision keeps" in closing
                                                                          or "for every variant" in closing):
        assert all(said[label] for label in labels), verdict


def test_every_combination_of_two_and_three_variants_gets_a_verdict_true_of_its_rows() -> None:
    labels = [v.label for v in VARIANTS[1:]]
    combinations = 0
    for count in (2, 3):
        for states in itertools.product(STATES, repeat=count):
            check(dict(zip(labels[:count], states, strict=True)))
            combinations += 1
    assert combinations == len(STATES) ** 2 + len(STATES) ** 3


def test_the_soak_comparison_names_mixed_bfloat16_and_never_says_no_variant_matched() -> None:
    for bfloat16 in ("matched_untimed", "flagged"):
        states = {"mixed_float16 + dynamic": "failed", "mixed_float16 + none": "failed", "mixed_bfloat16": bfloat16}
        check(states)
        rows = [row(0, "baseline"), *(row(i + 1, s) for i, s in enumerate(states.values()))]
        closing = closing_of(reports.verdict(rows, BASE_JOB, TOLERANCE))
        assert "No variant matched" not in closing and closing.startswith(
            "mixed_bfloat16 matched float32's loss within 2%"), closing
        assert "mixed_float16 + dynamic and mixed_float16 + none failed." in closing, closing

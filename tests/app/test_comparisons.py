"""The comparison report and its verdict, from job records (no processes needed)."""

from __future__ import annotations

from typing import Any

from app import comparisons
from app.resources import Job, JobError, JobState, Progress, WorkerInfo
from app.schemas import ComparisonSpec, Diagnosis, Summary

SPEC = ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}}})
LABELS = ["float32", "mixed_float16 + dynamic", "mixed_float16 + none", "mixed_bfloat16"]


def job(index: int, loss: float | None, speed: float, state: JobState = JobState.SUCCEEDED,
        codes: tuple[str, ...] = (), host: str = "a", start: int = 0, device: str = "gpu",
        **summary: Any) -> Job:
    spec = SPEC.job_specs()[index]
    return Job(
        id=f"j{index}", name=spec.name, state=state, queue="any", spec=spec, created_at="2026-12-01T00:00:00+00:00",
        started_at=f"2026-12-01T00:{start:02d}:00+00:00", finished_at=f"2026-12-01T00:{start + 1:02d}:00+00:00",
        transitions=[], progress=Progress(step=100, total_steps=100),
        summary=Summary(steps_done=100, final_loss=loss, skipped_steps=summary.get("skipped", 0),
                        loss_scale_min=1.0, loss_scale_max=1.0, loss_scale_final=1.0,
                        peak_zero_grad_fraction=summary.get("zero", 0.01), mean_examples_per_sec=speed,
                        peak_excess_zero_fraction=summary.get("zero", 0.01),
                        diagnoses=[Diagnosis(code=c, message=c, first_step=1) for c in codes]),  # type: ignore[arg-type]
        error=JobError(reason="diverged", message="Loss was NaN for 10 steps.") if state is JobState.FAILED else None,
        attempt=1, worker=WorkerInfo(host=host, pid=1, device={"kind": device}),
    )


def report(jobs: list[Job]) -> comparisons.Comparison:
    return comparisons.build("c1", None, "2026-12-01T00:00:00+00:00", SPEC, jobs)


def test_gaps_speedups_and_a_recommendation() -> None:
    result = report([
        job(0, 1.000, 1000, start=0),
        job(1, 1.008, 2100, start=2, skipped=3),
        job(2, 1.400, 2200, start=4, codes=("gradient_underflow",), zero=1.0),
        job(3, 1.012, 2400, start=6),
    ])
    by_label = {v.label: v for v in result.variants}
    assert [v.label for v in result.variants] == LABELS and result.state == "done"
    assert by_label["mixed_float16 + dynamic"].loss_gap is not None
    assert abs(by_label["mixed_float16 + dynamic"].loss_gap - 0.008) < 1e-12
    assert by_label["mixed_bfloat16"].speedup == 2.4 and by_label["float32"].speedup == 1.0
    assert result.verdict == (
        "mixed_float16 + dynamic matches float32 within 0.8% at 2.1× speed, skipping 3 overflow steps; "
        "mixed_float16 + none: without loss scaling gradients underflow (up to 100% of gradient values zero that are "
        "not zero in float32), and its loss ends +40% from float32's; "
        "mixed_bfloat16 matches float32 within 1.2% at 2.4× speed. Use mixed_bfloat16.")


def test_a_speed_tie_goes_to_the_safest_numerics() -> None:
    result = report([job(0, 1.0, 1000), job(1, 1.0, 2000, start=2), job(2, 1.0, 2080, start=4),
                     job(3, 1.0, 1990, start=6, zero=0.996)])
    assert result.verdict.endswith(" Use mixed_bfloat16.")
    no_bf16 = report([job(0, 1.0, 1000), job(1, 1.0, 2000, start=2), job(2, 1.0, 2080, start=4),
                      job(3, 1.0, 1000, start=6)])
    assert no_bf16.verdict.endswith(" Use mixed_float16 + dynamic.")
    only_unscaled = report([job(0, 1.0, 1000), job(1, 1.0, 1000, start=2), job(2, 1.0, 2080, start=4),
                            job(3, 1.0, 1000, start=6)])
    assert "Use mixed_float16 + none. It has no loss scaling" in only_unscaled.verdict


def test_peak_zero_fraction_is_never_rounded_up() -> None:
    result = report([job(0, 1.0, 1000), job(1, 1.0, 2000, start=2),
                     job(2, 1.4, 2000, start=4, codes=("gradient_underflow",), zero=0.996), job(3, 1.0, 2000, start=6)])
    assert "(up to 99.6% of gradient values zero that are not zero in float32)" in result.verdict


def test_no_match_keeps_float32_and_failures_are_named() -> None:
    result = report([
        job(0, 1.0, 1000), job(1, None, 0, state=JobState.FAILED, start=2),
        job(2, 1.5, 2000, start=4), job(3, 1.1, 2000, start=6),
    ])
    assert result.verdict.startswith("mixed_float16 + dynamic failed (diverged: Loss was NaN for 10 steps.); "
                                     "mixed_float16 + none ends +50% from float32's loss at 2× speed;")
    assert result.verdict.endswith("No variant matched float32's loss within 2%: keep float32.")


def test_accurate_but_slower_says_keep_float32_on_this_device() -> None:
    result = report([job(0, 1.0, 1000, device="cpu"), job(1, 1.0, 30, start=2, device="cpu"),
                     job(2, 1.0, 30, start=4, device="cpu"), job(3, 1.0, 60, start=6, device="cpu")])
    assert "at 0.03× speed (33× slower)" in result.verdict
    assert result.verdict.endswith("is not faster on cpu: keep float32 on this device, and compare again on one "
                                   "with float16/bfloat16 hardware.")


def test_speed_caveats_for_shared_hosts_and_mixed_devices() -> None:
    overlapping = report([job(0, 1.0, 1000), job(1, 1.0, 2000), job(2, 1.0, 2000, start=4),
                          job(3, 1.0, 2000, start=6)])
    assert overlapping.verdict.endswith("some variants trained at the same time and shared the machine.")
    apart = report([job(0, 1.0, 1000), job(1, 1.0, 2000, host="b"), job(2, 1.0, 2000, start=4),
                    job(3, 1.0, 2000, start=6)])
    assert "shared the machine" not in apart.verdict
    mixed = report([job(0, 1.0, 1000, device="cpu"), job(1, 1.0, 2000, start=2), job(2, 1.0, 2000, start=4),
                    job(3, 1.0, 2000, start=6)])
    assert mixed.verdict.endswith("Speeds are not comparable: the variants ran on different devices (cpu, gpu).")


def test_too_few_steps_recommend_nothing_for_speed() -> None:
    short = ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}, "training": {"steps": 20}}})
    jobs = [job(0, 1.0, 1000), job(1, 1.0, 3000, start=2), job(2, 1.0, 3000, start=4), job(3, 1.0, 3000, start=6)]
    result = comparisons.build("c1", None, "2026-12-01T00:00:00+00:00", short, jobs)
    assert "Use " not in result.verdict
    assert result.verdict.endswith("20 steps are too few to judge speed; run at least 100 before choosing a "
                                   "precision for speed.")


def test_running_comparison_reports_progress() -> None:
    result = report([job(0, 1.0, 1000), job(1, None, 0, state=JobState.RUNNING), job(2, 1.0, 1), job(3, 1.0, 1)])
    assert result.state == "running"
    assert result.verdict == "3 of 4 variants finished; the verdict comes when all have."


def test_the_cli_table_shows_the_gaps_the_verdict_words() -> None:
    from app.cli import comparison_report

    result = report([job(0, 1.0, 1000), job(1, 1.00053, 2000, start=2), job(2, 1.0 - 3.9e-9, 1300, start=4),
                     job(3, 1.0, 2000, start=6)])
    assert "mixed_float16 + dynamic matches float32 within 0.053% at 2× speed" in result.verdict
    rows = [line.split("  ") for line in comparison_report(result.model_dump(mode="json")).splitlines()[2:6]]
    cells = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    # VARIANT, STATE, STEP, FINAL LOSS, VS FLOAT32, EXAMPLES/S, SPEEDUP, SKIPPED, ZERO GRADS, EXCESS ZEROS, ...
    assert [c[3:10] for c in cells] == [
        ["1", "0%", "1,000", "1.00×", "0", "1%", "1%"],
        ["1.001", "+0.053%", "2,000", "2.00×", "0", "1%", "1%"],
        ["1", "-0.00000039%", "1,300", "1.30×", "0", "1%", "1%"],
        ["1", "0%", "2,000", "2.00×", "0", "1%", "1%"],
    ]

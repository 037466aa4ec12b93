"""The comparison report and its verdict, from job records (no processes needed).

Speed comes from the float32 baseline's one measurement of every variant (`variant_speeds`),
never from the variant jobs' examples/s: the jobs below are given throughputs that disagree
with the measured speeds on purpose.
"""

from __future__ import annotations

from typing import Any

from app.api import reports, services
from app.store import JobStore
from mpjobs.contract.formats import percent
from mpjobs.contract.jobs import JobError, JobRecord, JobState, Progress, WorkerInfo
from mpjobs.contract.records import Diagnosis, PrecisionSpeed, SpeedDifference, Summary, VariantSpeed
from mpjobs.contract.spec import ComparisonSpec

SPEC = ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}}})
LABELS = ["float32", "mixed_float16 + dynamic", "mixed_float16 + none", "mixed_bfloat16"]
NOISE = (0.95, 1.05)
DIVERGED = JobError(reason="diverged", message="Loss was NaN for 10 steps.")
LOST = JobError(reason="worker_lost", message="The worker running this job disappeared on each of its 3 attempts.")


def speed(median: float, low: float, high: float, difference: SpeedDifference,
          noise: tuple[float, float] = NOISE) -> PrecisionSpeed:
    """A measured speed with its call written by hand: the verdict words the call, never re-judges the figures."""
    return PrecisionSpeed(policy_ms=2.0 * median, float32_ms=2.0, slowdown=median, steps=36, low=low, high=high,
                          noise_low=noise[0], noise_high=noise[1], rounds=9, difference=difference)


def timed(*speeds: PrecisionSpeed | None, slow: str | None = None) -> list[VariantSpeed]:
    """The baseline's measurement of variants 1, 2, 3 in order."""
    return [VariantSpeed(label=label, speed=s, error=None if s else "unsupported_precision_on_device: no kernel",
                         slow_precision=slow if s and s.difference == "slower" else None)
            for label, s in zip(LABELS[1:], speeds, strict=True)]


def job(index: int, loss: float | None, throughput: float = 1000.0, state: JobState = JobState.SUCCEEDED,
        codes: tuple[str, ...] = (), device: str = "cpu", speeds: list[VariantSpeed] | None = None,
        error: JobError = DIVERGED, **summary: Any) -> JobRecord:
    spec = SPEC.job_specs()[index]
    return JobRecord(
        id=f"j{index}", name=spec.name, state=state, queue="any", spec=spec, created_at="2026-12-01T00:00:00+00:00",
        started_at="2026-12-01T00:00:00+00:00", finished_at="2026-12-01T00:01:00+00:00",
        transitions=[], progress=Progress(step=100, total_steps=100),
        summary=Summary(steps_done=100, final_loss=loss, skipped_steps=summary.get("skipped", 0),
                        loss_scale_min=1.0, loss_scale_max=1.0, loss_scale_final=1.0,
                        peak_zero_grad_fraction=summary.get("zero", 0.01), mean_examples_per_sec=throughput,
                        peak_excess_zero_fraction=summary.get("zero", 0.01), variant_speeds=speeds or [],
                        diagnoses=[Diagnosis(code=c, message=c, first_step=1) for c in codes]),  # type: ignore[arg-type]
        error=error if state is JobState.FAILED else None,
        attempt=1, worker=WorkerInfo(host="a", pid=1, device={"kind": device}),
    )


def report(jobs: list[JobRecord]) -> reports.Comparison:
    return reports.build("c1", None, "2026-12-01T00:00:00+00:00", SPEC, jobs)


def test_gaps_measured_speeds_and_a_recommendation() -> None:
    speeds = timed(speed(0.48, 0.45, 0.50, "faster"), speed(0.47, 0.45, 0.49, "faster"),
                   speed(0.42, 0.40, 0.44, "faster"))
    result = report([
        job(0, 1.000, speeds=speeds),
        job(1, 1.008, throughput=400, skipped=3),  # its own run was slow: a busy machine, not its precision
        job(2, 1.400, codes=("gradient_underflow",), zero=1.0),
        job(3, 1.012, throughput=900),
    ])
    by_label = {v.label: v for v in result.variants}
    assert [v.label for v in result.variants] == LABELS and result.state == "done"
    assert by_label["mixed_float16 + dynamic"].loss_gap is not None
    assert abs(by_label["mixed_float16 + dynamic"].loss_gap - 0.008) < 1e-12
    assert by_label["mixed_bfloat16"].speed == speeds[2].speed and by_label["float32"].speed is None
    assert by_label["mixed_float16 + dynamic"].examples_per_sec == 400  # throughput, kept and labelled as such
    assert result.verdict == (
        "mixed_float16 + dynamic matches float32 within 0.8%, 2.08× faster than float32 (2.00–2.22×), "
        "skipping 3 overflow steps; "
        "mixed_float16 + none: without loss scaling gradients underflow (up to 100% of gradient values zero that are "
        "not zero in float32), and its loss ends +40% from float32's; "
        "mixed_bfloat16 matches float32 within 1.2%, 2.38× faster than float32 (2.27–2.50×). Use mixed_bfloat16. "
        "Speeds: step time against float32's, every variant timed in turns in one process after the float32 run; "
        "intervals hold the median per-round ratio with 95% confidence. " + reports.TRAINING_LOSS_ONLY)


def test_variants_not_measurably_slower_than_the_fastest_tie_and_the_safest_wins() -> None:
    tie = report([job(0, 1.0, speeds=timed(speed(0.50, 0.46, 0.54, "faster"), speed(0.45, 0.43, 0.47, "faster"),
                                           speed(0.51, 0.46, 0.55, "faster"))),
                  job(1, 1.0), job(2, 1.0), job(3, 1.0, zero=0.996)])
    assert " Use mixed_bfloat16. " in tie.verdict  # its interval reaches the fastest's: a tie, and bfloat16 is safest
    apart = report([job(0, 1.0, speeds=timed(speed(0.30, 0.28, 0.32, "faster"), speed(0.29, 0.27, 0.31, "faster"),
                                             speed(0.50, 0.46, 0.54, "faster"))),
                    job(1, 1.0), job(2, 1.0), job(3, 1.0)])
    assert " Use mixed_float16 + dynamic. " in apart.verdict  # dynamic scaling is safer than none
    only_unscaled = report([job(0, 1.0, speeds=timed(speed(1.0, 0.96, 1.04, "none"),
                                                     speed(0.5, 0.48, 0.52, "faster"),
                                                     speed(1.0, 0.97, 1.03, "none"))),
                            job(1, 1.0), job(2, 1.0), job(3, 1.0)])
    assert "Use mixed_float16 + none. It has no loss scaling" in only_unscaled.verdict


def test_no_measurable_difference_keeps_float32_whatever_the_throughputs_say() -> None:
    result = report([job(0, 1.0, speeds=timed(speed(1.01, 0.93, 1.06, "none"), speed(0.98, 0.94, 1.02, "none"),
                                              speed(0.97, 0.96, 1.1, "none"))),
                     job(1, 1.0, throughput=2000), job(2, 1.0, throughput=3000), job(3, 1.0, throughput=2500)])
    assert "mixed_float16 + dynamic matches float32 within 0%, no measurable speed difference from float32 " \
           "(step time 0.93–1.06× float32's)" in result.verdict
    assert " Use " not in result.verdict
    assert "none of it is measurably faster on cpu: keep float32 on this device" in result.verdict
    # Within the A/A noise is no difference either, however far from 1 the median is.
    noisy = report([job(0, 1.0, speeds=timed(speed(0.7, 0.6, 0.8, "none", noise=(0.55, 1.6)),
                                             speed(1.0, 0.9, 1.1, "none"), speed(1.0, 0.9, 1.1, "none"))),
                    job(1, 1.0), job(2, 1.0), job(3, 1.0)])
    assert " Use " not in noisy.verdict and "× faster" not in noisy.verdict


def test_a_slower_variant_gets_its_figure_and_the_slow_precision_diagnosis() -> None:
    message = "On this CPU ... 25.0× slower than float32 (23.8–26.7×) ..."
    result = report([job(0, 1.0, speeds=timed(speed(25.0, 23.8, 26.7, "slower"), speed(24.9, 23.5, 26.2, "slower"),
                                              speed(1.0, 0.96, 1.08, "none"), slow=message)),
                     job(1, 1.0), job(2, 1.0), job(3, 1.0)])
    assert "mixed_float16 + dynamic matches float32 within 0%, 25.00× slower than float32 (23.80–26.70×)" \
        in result.verdict
    by_label = {v.label: v for v in result.variants}
    slow = [d for d in by_label["mixed_float16 + dynamic"].diagnoses if d.code == "slow_precision_on_device"]
    assert [d.message for d in slow] == [message]
    assert not [d for d in by_label["mixed_bfloat16"].diagnoses if d.code == "slow_precision_on_device"]
    assert result.verdict.endswith("intervals hold the median per-round ratio with 95% confidence. "
                                   + reports.TRAINING_LOSS_ONLY)
    assert "keep float32 on this device" in result.verdict


def test_unmeasured_speed_recommends_nothing_for_speed() -> None:
    result = report([job(0, 1.0), job(1, 1.0, throughput=3000), job(2, 1.0, throughput=3000),
                     job(3, 1.0, throughput=3000)])
    assert " Use " not in result.verdict and "speed not measured" in result.verdict
    assert "Speed was not measured for every variant, so no precision is recommended for speed" in result.verdict
    untimed = report([job(0, 1.0, speeds=timed(speed(0.5, 0.45, 0.55, "faster"), None,
                                               speed(0.5, 0.45, 0.55, "faster"))),
                      job(1, 1.0), job(2, 1.0), job(3, 1.0)])
    by_label = {v.label: v for v in untimed.variants}
    assert by_label["mixed_float16 + none"].speed_error == "unsupported_precision_on_device: no kernel"
    assert "mixed_float16 + none matches float32 within 0%, not timed" in untimed.verdict


def test_no_match_keeps_float32_and_failures_are_named() -> None:
    result = report([
        job(0, 1.0, speeds=timed(speed(0.5, 0.45, 0.55, "faster"), speed(0.5, 0.45, 0.55, "faster"),
                                 speed(0.5, 0.45, 0.55, "faster"))),
        job(1, None, state=JobState.FAILED), job(2, 1.5), job(3, 1.1),
    ])
    assert result.verdict.startswith("mixed_float16 + dynamic failed (diverged: Loss was NaN for 10 steps.); "
                                     "mixed_float16 + none ends +50% from float32's loss, 2.00× faster than float32")
    assert "No variant matched float32's loss within 2%: keep float32." in result.verdict


def test_a_verdict_with_failed_variants_names_the_one_that_matched() -> None:
    """Issue 31 item 6: float32 succeeded, both float16 variants failed worker_lost, bfloat16 ended -0.0054% from
    float32, and its speed was lost with the baseline's timing. The verdict said no variant matched."""
    lost = (f"mixed_float16 + dynamic failed (worker_lost: {LOST.message}); "
            f"mixed_float16 + none failed (worker_lost: {LOST.message}); ")
    failed = [job(1, None, state=JobState.FAILED, error=LOST), job(2, None, state=JobState.FAILED, error=LOST)]
    untimed = report([job(0, 1.0), *failed, job(3, 0.999946)])
    assert untimed.verdict == (
        lost + "mixed_bfloat16 matches float32 within 0.0054%, speed not measured. "
        "mixed_bfloat16 matched float32's loss within 2%; mixed_float16 + dynamic and mixed_float16 + none failed. "
        "Speed was not measured for mixed_bfloat16, so no precision is recommended for speed: keep float32 until a "
        "comparison has timed it. " + reports.TRAINING_LOSS_ONLY)
    # The soak's row: its excess zeros (1.2% of gradient values) earned a gradient_underflow diagnosis.
    flagged = report([job(0, 1.0), *failed, job(3, 0.999946, codes=("gradient_underflow",), zero=0.012)])
    assert flagged.verdict == (
        lost + "mixed_bfloat16: without loss scaling gradients underflow (up to 1.2% of gradient values zero that "
        "are not zero in float32), and its loss ends -0.0054% from float32's. "
        "mixed_bfloat16 matched float32's loss within 2% but its gradients underflow; mixed_float16 + dynamic and "
        "mixed_float16 + none failed. A variant whose gradients underflow is not recommended: keep float32. "
        + reports.TRAINING_LOSS_ONLY)
    speeds = timed(speed(0.5, 0.45, 0.55, "faster"), speed(0.5, 0.45, 0.55, "faster"), speed(1.0, 0.95, 1.05, "none"))
    timed_none = report([job(0, 1.0, speeds=speeds), *failed, job(3, 0.999946)])
    assert timed_none.verdict == (
        lost + "mixed_bfloat16 matches float32 within 0.0054%, no measurable speed difference from float32 (step "
        "time 0.95–1.05× float32's). mixed_bfloat16 matched float32's loss within 2%; mixed_float16 + dynamic and "
        "mixed_float16 + none failed. mixed_bfloat16 is not measurably faster on cpu: keep float32 on this device, "
        "and compare again on one with float16/bfloat16 hardware. Speeds: step time against float32's, every variant "
        "timed in turns in one process after the float32 run; intervals hold the median per-round ratio with 95% "
        "confidence. "
        + reports.TRAINING_LOSS_ONLY)
    every = report([job(0, 1.0), *failed, job(3, None, state=JobState.FAILED, error=LOST)])
    assert every.verdict.endswith(" No variant finished: keep float32. " + reports.TRAINING_LOSS_ONLY)


def test_the_speed_words_at_each_call_and_at_the_tie_boundary() -> None:
    """Expected words written by hand: equal speed, faster, slower, not timed, not measured; a variant whose interval
    starts where the fastest's ends ties with it (the safest wins), a hair above does not."""
    words = report([job(0, 1.0, speeds=timed(speed(1.0, 1.0, 1.0, "none"), speed(4.0, 3.2, 5.0, "slower"), None)),
                    job(1, 1.0), job(2, 1.0), job(3, 1.0)]).verdict
    assert words.startswith(
        "mixed_float16 + dynamic matches float32 within 0%, no measurable speed difference from float32 (step time "
        "1.00–1.00× float32's); mixed_float16 + none matches float32 within 0%, 4.00× slower than float32 "
        "(3.20–5.00×); mixed_bfloat16 matches float32 within 0%, not timed (it could not train beside float32). "
        "Speed was not measured for mixed_bfloat16, and mixed_float16 + dynamic and mixed_float16 + none are not "
        "measurably faster on cpu, so no precision is recommended for speed: keep float32 until a comparison has "
        "timed it.")
    unmeasured = report([job(0, 1.0), job(1, 1.0), job(2, 1.0), job(3, 1.0)]).verdict
    assert unmeasured.startswith("mixed_float16 + dynamic matches float32 within 0%, speed not measured; ")
    at = timed(speed(0.25, 0.2, 0.3, "faster"), speed(0.5, 0.45, 0.55, "faster"), speed(0.4, 0.3, 0.5, "faster"))
    assert " Use mixed_bfloat16. " in report([job(0, 1.0, speeds=at), job(1, 1.0), job(2, 1.0), job(3, 1.0)]).verdict
    past = timed(speed(0.25, 0.2, 0.3, "faster"), speed(0.5, 0.45, 0.55, "faster"), speed(0.4, 0.31, 0.5, "faster"))
    assert " Use mixed_float16 + dynamic. " in report([job(0, 1.0, speeds=past), job(1, 1.0), job(2, 1.0),
                                                     job(3, 1.0)]).verdict
    assert "2.00× faster than float32 (1.82–2.22×)" in report([job(0, 1.0, speeds=past), job(1, 1.0), job(2, 1.0),
                                                               job(3, 1.0)]).verdict


def test_running_comparison_reports_progress() -> None:
    result = report([job(0, 1.0), job(1, None, state=JobState.RUNNING), job(2, 1.0), job(3, 1.0)])
    assert result.state == "running"
    assert result.verdict == "3 of 4 variants finished; the verdict comes when all have."


def test_the_cli_table_shows_the_gaps_and_speeds_the_verdict_words() -> None:
    from mpjobs.cli import comparison_report

    speeds = timed(speed(0.5, 0.45, 0.55, "faster"), speed(1.01, 0.93, 1.06, "none"),
                   speed(25.0, 23.8, 26.7, "slower"))
    result = report([job(0, 1.0, speeds=speeds), job(1, 1.00053, 2000), job(2, 1.0 - 3.9e-9, 1300),
                     job(3, 1.0, 2000)])
    assert f"mixed_float16 + dynamic matches float32 within {percent(0.00053)}" in result.verdict
    rows = [line.split("  ") for line in comparison_report(result.model_dump(mode="json")).splitlines()[2:6]]
    cells = [[cell.strip() for cell in row if cell.strip()] for row in rows]
    # VARIANT, STATE, STEP, FINAL LOSS, VS FLOAT32, THROUGHPUT EX/S, STEP TIME VS FLOAT32, SKIPPED, ZERO GRADS, ...
    assert [c[3:10] for c in cells] == [
        ["1", "0%", "1,000", "1 (baseline)", "0", "1%", "1%"],
        ["1.001", "+0.053%", "2,000", "0.50× (0.45–0.55)", "0", "1%", "1%"],
        ["1", "-0.00000039%", "1,300", "1.01× (0.93–1.06)", "0", "1%", "1%"],
        ["1", "0%", "2,000", "25.00× (23.80–26.70)", "0", "1%", "1%"],
    ]


def finished_summary(loss: float) -> str:
    return Summary(steps_done=100, final_loss=loss, skipped_steps=0, loss_scale_min=1.0, loss_scale_max=1.0,
                   loss_scale_final=1.0, peak_zero_grad_fraction=0.01, mean_examples_per_sec=1000.0,
                   peak_excess_zero_fraction=0.01).model_dump_json()


def test_the_report_follows_its_jobs_records_on_every_read(store: JobStore) -> None:
    """A comparison's report is never stale: each read sees the variant jobs as they are now."""
    spec = ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}}, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16"}]})
    comparison_id, _ = store.comparisons.create_comparison(spec, "t-stale", [(s, "any") for s in spec.job_specs()],
                                               lambda job_id, job_spec, pipe: None, store.redis.pipeline())
    record = store.comparisons.get_comparison(comparison_id, "t-stale")
    assert record is not None
    base_id, bf16_id = record.job_ids

    def read() -> reports.Comparison:
        return services.get_comparison(store, comparison_id, "t-stale")

    assert [v.state for v in read().variants] == [JobState.QUEUED, JobState.QUEUED]
    for job_id in (base_id, bf16_id):
        store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "started")
    running = read()
    assert [v.state for v in running.variants] == [JobState.RUNNING, JobState.RUNNING]
    assert running.verdict == "0 of 2 variants finished; the verdict comes when all have."

    store.jobs.transition(base_id, JobState.SUCCEEDED, [JobState.RUNNING], "finished", summary=finished_summary(1.0))
    store.jobs.transition(bf16_id, JobState.SUCCEEDED, [JobState.RUNNING], "finished", summary=finished_summary(1.5))
    ended = read()
    assert ended.state == "done" and [v.final_loss for v in ended.variants] == [1.0, 1.5]
    assert ended.variants[1].loss_gap == 0.5
    assert ended.verdict == ("mixed_bfloat16 ends +50% from float32's loss, speed not measured. "
                             "No variant matched float32's loss within 2%: keep float32. " + reports.TRAINING_LOSS_ONLY)

    store.jobs.set_fields(bf16_id, summary=finished_summary(1.25))  # the record changes: the next read shows it
    changed = read()
    assert [v.final_loss for v in changed.variants] == [1.0, 1.25]
    assert changed.variants[1].loss_gap == 0.25
    assert changed.verdict == ("mixed_bfloat16 ends +25% from float32's loss, speed not measured. "
                               "No variant matched float32's loss within 2%: keep float32. "
                               + reports.TRAINING_LOSS_ONLY)

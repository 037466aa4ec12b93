"""Verdicts on the final held-out metric: paired per-example results from final.npz, and the words with and without."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from app.api import reports
from app.store import JobStore
from mpjobs.contract.jobs import JobRecord, JobState, Progress, WorkerInfo
from mpjobs.contract.records import Summary
from mpjobs.contract.spec import ComparisonSpec, JobSpec

VARIANTS = [{"precision_policy": "float32"}, {"precision_policy": "mixed_float16", "loss_scale": {"mode": "dynamic"}},
            {"precision_policy": "mixed_bfloat16"}]
VALIDATION = {"split": 0.2, "seed": 0, "metrics": ["accuracy"]}


def spec(validation: dict[str, object] | None) -> ComparisonSpec:
    body = {"model": {"name": "mlp"}, **({"validation": validation} if validation else {})}
    return ComparisonSpec.model_validate({"spec": body, "variants": VARIANTS})


def job(comparison: ComparisonSpec, index: int, loss: float) -> JobRecord:
    s = comparison.job_specs()[index]
    return JobRecord(
        id=f"j{index}", name=s.name, state=JobState.SUCCEEDED, queue="any", spec=s,
        created_at="2026-12-01T00:00:00+00:00", started_at="2026-12-01T00:00:00+00:00",
        finished_at="2026-12-01T00:01:00+00:00", transitions=[], progress=Progress(step=50, total_steps=50),
        summary=Summary(steps_done=50, final_loss=loss, skipped_steps=0, loss_scale_min=1.0, loss_scale_max=1.0,
                        loss_scale_final=1.0, peak_zero_grad_fraction=0.0, mean_examples_per_sec=100.0,
                        peak_excess_zero_fraction=0.0),
        error=None, attempt=1, worker=WorkerInfo(host="a", pid=1, device={"kind": "cpu"}))


def write_final(root: Path, job_id: str, rows: np.ndarray, loss: np.ndarray, correct: np.ndarray | None) -> None:
    folder = root / job_id / "evaluation"
    folder.mkdir(parents=True)
    arrays = {"rows": rows, "loss": loss.astype(np.float32), "step": np.array(50)}
    np.savez(folder / "final.npz", **arrays, **({"correct": correct.astype(np.float32)} if correct is not None else {}))


def test_accuracy_verdicts_pair_the_same_examples(tmp_path: Path) -> None:
    comparison = spec(VALIDATION)
    rows = np.arange(100, 140)
    rng = np.random.default_rng(5)
    hits = [rng.random(40) < p for p in (0.8, 0.7, 0.8)]
    hits[2] = hits[0].copy()  # bfloat16 decides every example as float32 does
    for i, h in enumerate(hits):
        write_final(tmp_path, f"j{i}", rows, rng.random(40), h)
    result = reports.build("c1", None, "2026-12-01T00:00:00+00:00", comparison,
                           [job(comparison, i, 1.0) for i in range(3)], tmp_path)
    f16 = result.variants[1].held_out
    assert f16 is not None and result.variants[0].held_out is None
    b, c = int((hits[1] & ~hits[0]).sum()), int((hits[0] & ~hits[1]).sum())
    d = b + c
    assert (f16.metric, f16.examples, f16.method) == ("accuracy", 40, "mcnemar_exact_conditional")
    assert f16.value == hits[1].mean() and f16.float32_value == hits[0].mean()
    assert f16.difference == pytest.approx(hits[1].mean() - hits[0].mean())
    assert f16.p_value == pytest.approx(min(1.0, 2 * sum(math.comb(d, k) for k in range(min(b, c) + 1)) / 2**d))
    pi_low, pi_high = (f16.low * 40 / d + 1) / 2, (f16.high * 40 / d + 1) / 2  # back to the share b / d
    tail_up = math.fsum(math.comb(d, k) * pi_low**k * (1 - pi_low) ** (d - k) for k in range(b, d + 1))
    tail_down = math.fsum(math.comb(d, k) * pi_high**k * (1 - pi_high) ** (d - k) for k in range(b + 1))
    assert (tail_up, tail_down) == (pytest.approx(0.025, abs=1e-9), pytest.approx(0.025, abs=1e-9))
    bf16 = result.variants[2].held_out
    assert bf16 is not None and (bf16.difference, bf16.low, bf16.high, bf16.p_value) == (0.0, 0.0, 0.0, 1.0)
    words = (f"mixed_float16 + dynamic: held-out accuracy {f16.value:.3f} vs float32's {f16.float32_value:.3f}, "
             f"difference {100 * f16.difference:+.1f} points (95% interval {100 * f16.low:+.1f} to "
             f"{100 * f16.high:+.1f})")
    assert words in result.verdict, result.verdict
    assert "training loss only" not in result.verdict


def test_different_rows_are_refused_with_the_reason(tmp_path: Path) -> None:
    comparison = spec(VALIDATION)
    for i, rows in enumerate([np.arange(10), np.arange(1, 11), np.arange(10)]):
        write_final(tmp_path, f"j{i}", rows, np.ones(10), np.ones(10))
    result = reports.build("c1", None, "now", comparison, [job(comparison, i, 1.0) for i in range(3)], tmp_path)
    assert result.variants[1].held_out is None and result.variants[2].held_out is not None
    assert "same rows" in (result.variants[1].held_out_error or "")
    assert "mixed_float16 + dynamic: no held-out verdict (Expected both runs to hold out the same rows" \
        in result.verdict


def test_without_classes_the_loss_is_bootstrapped(tmp_path: Path) -> None:
    comparison = spec({"split": 0.2, "seed": 0, "metrics": []})
    losses = [np.linspace(0.5, 1.5, 30) * s for s in (1.0, 1.1, 1.0)]
    for i, loss in enumerate(losses):
        write_final(tmp_path, f"j{i}", np.arange(30), loss, None)
    result = reports.build("c1", None, "now", comparison, [job(comparison, i, 1.0) for i in range(3)], tmp_path)
    held = result.variants[1].held_out
    assert held is not None and (held.metric, held.method, held.p_value) == ("loss", "paired_bootstrap", None)
    diff = losses[1].astype(np.float32).astype(np.float64) - losses[0].astype(np.float32).astype(np.float64)
    rng = np.random.default_rng(0)
    means = [diff[rng.integers(0, 30, size=30)].mean() for _ in range(2000)]
    assert (held.difference, held.low, held.high) == pytest.approx(
        (diff.mean(), np.quantile(means, 0.025), np.quantile(means, 0.975)), rel=1e-12)
    assert held.low > 0 and "held-out loss" in result.verdict and "measurably worse" in result.verdict


@pytest.mark.parametrize("losses", [(1.0, 1.001, 1.0), (1.0, 1.5, 2.0), (1.0, 0.999, 1.3)])
def test_no_verdict_without_validation_speaks_of_accuracy(losses: tuple[float, float, float], tmp_path: Path) -> None:
    comparison = spec(None)
    result = reports.build("c1", None, "now", comparison,
                           [job(comparison, i, loss) for i, loss in enumerate(losses)], tmp_path)
    assert "accuracy" not in result.verdict.lower()
    assert result.verdict.endswith(reports.TRAINING_LOSS_ONLY)
    assert all(v.held_out is None for v in result.variants)


def test_the_seed_control_sets_the_noise_the_verdict_weighs(tmp_path: Path) -> None:
    comparison = ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}, "validation": VALIDATION},
                                                "variants": VARIANTS, "float32_seeds": 2})
    specs = comparison.job_specs()
    assert len(specs) == 4 and specs[3].precision_policy.value == "float32" and specs[3].training.seed == 1
    assert specs[3].name == "mlp · float32 seed 1" and specs[3].speed_check == []
    base = np.zeros(20, dtype=bool)
    base[:10] = True  # float32 gets 10 of 20 right
    f16, bf16, control = base.copy(), base.copy(), base.copy()
    f16[10:12] = True  # +2 examples: +10 points
    control[10] = True  # the other seed: +1 example, +5 points
    bf16[0] = False  # -1 example: -5 points, as far from float32 as the other seed
    for i, hits in enumerate([base, f16, bf16, control]):
        write_final(tmp_path, f"j{i}", np.arange(20), np.ones(20), hits)
    result = reports.build("c1", None, "now", comparison, [job(comparison, i, 1.0) for i in range(4)], tmp_path)
    assert [v.label for v in result.variants] == ["float32", "mixed_float16 + dynamic", "mixed_bfloat16"]
    assert result.seed_control is not None and result.seed_control.label == "float32 seed 1"
    noise = result.seed_control.held_out
    assert noise is not None and noise.difference == pytest.approx(0.05) and noise.p_value == 1.0
    assert "mixed_float16 + dynamic: held-out accuracy 0.600 vs float32's 0.500, difference +10.0 points" \
        in result.verdict and "larger than the difference between two float32 seeds" in result.verdict
    assert "mixed_bfloat16: held-out accuracy 0.450 vs float32's 0.500, difference -5.0 points (95% interval " \
        in result.verdict
    assert "-5.0 points" in result.verdict.split("mixed_bfloat16: ")[1].split("within the difference")[0]
    assert (f"Seed noise: float32 seed 1, held-out accuracy 0.550 vs float32's 0.500, difference +5.0 points "
            f"(95% interval {100 * noise.low:+.1f} to {100 * noise.high:+.1f}).") in result.verdict


def test_a_seed_control_needs_held_out_data() -> None:
    with pytest.raises(ValueError, match=r"float32_seeds=2 .* give the spec a 'validation'"):
        spec_body = {"spec": {"model": {"name": "mlp"}}, "float32_seeds": 2}
        ComparisonSpec.model_validate(spec_body)


def test_the_cli_report_shows_held_out_figures_and_seed_noise(tmp_path: Path) -> None:
    from mpjobs.cli import comparison_report

    comparison = ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}, "validation": VALIDATION},
                                                "variants": VARIANTS[:2], "float32_seeds": 2})
    for i, hits in enumerate([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]):
        write_final(tmp_path, f"j{i}", np.arange(4), np.ones(4), np.array(hits))
    result = reports.build("c1", None, "now", comparison, [job(comparison, i, 1.0) for i in range(3)], tmp_path)
    text = comparison_report(result.model_dump(mode="json"))
    assert "  mixed_float16 + dynamic: held-out accuracy 0.750 vs float32's 0.500, difference +25.0 points" in text
    assert "McNemar p=1, 4 examples (mcnemar_exact_conditional)" in text
    assert "  seed noise, float32 seed 1 (succeeded, job j2): held-out accuracy 0.250 vs float32's 0.500" in text


def test_an_uploaded_validation_dataset_must_be_the_tenants(store: JobStore) -> None:
    from app.api.dataset_fit import DatasetRefused, check_dataset
    from app.core.config import Settings

    spec = JobSpec.model_validate({"model": {"name": "mlp"},
                                   "validation": {"dataset": {"kind": "uploaded", "id": "a" * 64}}})
    with pytest.raises(DatasetRefused, match="names none of yours") as refused:
        check_dataset(spec, store, Settings(), "t-held")
    assert refused.value.loc == ("validation", "dataset", "id")

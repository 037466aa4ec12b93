"""The speed check: how much slower (or faster) a half-precision policy trains than float32 on this CPU."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from app.cli.words import precision_speed_words
from app.config import Settings
from app.schemas import JobSpec, PrecisionSpeed
from tests.worker.conftest import Train, spec_of, trained_weights
from worker import engine
from worker.devices import CPU_HALF_FLAGS, SLOW_RATIO, DeviceInfo, slow_precision_message
from worker.engine import make_optimizer
from worker.speed import ROUNDS, float32_twin, measure

CPU = DeviceInfo("cpu", "Test CPU", "tensorflow", None, frozenset({"avx2", "avx512_bf16"}))


@pytest.fixture
def checked(tmp_path: Path) -> Settings:
    return Settings(data_root=tmp_path / "data", artifacts_dir=tmp_path / "artifacts", speed_check_steps=2)


def slow_diagnosis(result: engine.RunResult) -> list[str]:
    return [d.message for d in result.summary.diagnoses if d.code == "slow_precision_on_device"]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_half_precision_job_on_cpu_ends_with_its_speed_against_float32(
        train: Train, checked: Settings, tmp_path: Path, policy: str) -> None:
    spec = spec_of(precision_policy=policy, training={"steps": 12})
    result, _ = train(spec, settings=checked)
    speed = result.summary.precision_speed
    assert result.status == "succeeded" and result.device.kind == "cpu" and speed is not None
    assert speed.steps == 2 * ROUNDS and speed.policy_ms > 0 and speed.float32_ms > 0
    assert speed.slowdown == pytest.approx(speed.policy_ms / speed.float32_ms)
    # The diagnosis follows the measurement, whichever way this processor goes.
    expected = slow_precision_message(result.device, spec.precision_policy.compute_dtype, policy, speed)
    assert slow_diagnosis(result) == ([expected] if speed.slowdown >= SLOW_RATIO else [])
    # The copies it timed are thrown away: the job's own weights are those of a run without the check.
    unchecked, _ = train(spec)
    assert unchecked.summary.precision_speed is None and not slow_diagnosis(unchecked)
    for a, b in zip(trained_weights(result), trained_weights(unchecked), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_short_run_gets_a_short_check(train: Train, checked: Settings) -> None:
    """At most about half as many steps as the run trained, and never none: 3 steps get 1 per round."""
    result, _ = train(spec_of(precision_policy="mixed_bfloat16", training={"steps": 3}), settings=checked)
    assert result.summary.precision_speed is not None and result.summary.precision_speed.steps == ROUNDS


def test_float32_jobs_and_stopped_jobs_are_not_timed(train: Train, checked: Settings) -> None:
    result, _ = train(spec_of(training={"steps": 4}), settings=checked)
    assert result.summary.precision_speed is None
    stopped, _ = train(spec_of(precision_policy="mixed_float16", training={"steps": 4}), settings=checked,
                       should_stop=lambda: True)
    assert stopped.status == "stopped" and stopped.summary.precision_speed is None


def test_a_failed_speed_check_leaves_the_job_succeeded_without_a_figure(
        train: Train, checked: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object, **kwargs: object) -> PrecisionSpeed:
        raise MemoryError("no room for two more copies of the model")

    monkeypatch.setattr(engine, "measure_speed", broken)
    with caplog.at_level(logging.WARNING, logger="worker.engine"):
        result, _ = train(spec_of(precision_policy="mixed_float16", training={"steps": 4}), settings=checked)
    assert result.status == "succeeded" and result.summary.precision_speed is None
    assert "speed check failed" in caplog.text and "MemoryError" in caplog.text


def cnn_batches(spec: JobSpec, steps: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((steps * spec.training.batch_size, 32, 32, 3)).astype("float32")
    return x, np.zeros(len(x), dtype="int64")


def test_float32_against_float32_measures_the_same_speed() -> None:
    """An A/A run: both sides built, warmed and timed alike, so the ratio is 1 within this VM's noise."""
    spec = float32_twin(spec_of(model={"name": "cnn"}, training={"steps": 4}))
    speed = measure(spec, *cnn_batches(spec, 4), on_cpu_tf=True, make_optimizer=make_optimizer)
    assert speed is not None and speed.steps == 4 * ROUNDS
    assert 0.67 < speed.slowdown < 1.5, speed


def test_a_stop_during_the_check_abandons_it() -> None:
    """A cancel that arrives after the run's last step ends the check at the next piece, with no figure."""
    spec = spec_of(model={"name": "cnn"}, precision_policy="mixed_bfloat16", training={"steps": 4})
    asked: list[int] = []

    def after_warm_up() -> bool:
        asked.append(1)
        return len(asked) > 2  # the two warm-up pieces run, the first timed one does not

    assert measure(spec, *cnn_batches(spec, 2), on_cpu_tf=True, make_optimizer=make_optimizer,
                   should_stop=after_warm_up) is None
    assert len(asked) == 3


def test_the_float32_twin_changes_only_the_precision() -> None:
    spec = JobSpec.model_validate({"model": {"name": "cnn"}, "precision_policy": "mixed_float16",
                                   "loss_scale": {"mode": "fixed", "scale": 128}, "training": {"steps": 7}})
    twin = float32_twin(spec)
    assert twin.precision_policy.value == "float32" and twin.loss_scale is not None
    assert twin.loss_scale.mode == "none"
    assert twin.model == spec.model and twin.training == spec.training and twin.dataset == spec.dataset


def test_the_slow_precision_message_gives_the_measured_figures() -> None:
    speed = PrecisionSpeed(policy_ms=92.1, float32_ms=16.2, slowdown=92.1 / 16.2, steps=12)
    message = slow_precision_message(CPU, "float16", "mixed_float16", speed)
    assert message is not None
    assert "took 92.1 ms under mixed_float16 against 16.2 ms in float32: 5.7x slower" in message
    assert "median of 12 steps each" in message and "Test CPU; it has avx512_bf16" in message
    bare = DeviceInfo("cpu", "Old CPU", "tensorflow")
    assert f"it has none of {', '.join(CPU_HALF_FLAGS)}" in (slow_precision_message(bare, "float16", "p", speed) or "")
    # Below the threshold, or not measured, a CPU earns no diagnosis: nothing is claimed unmeasured.
    near = PrecisionSpeed(policy_ms=1.4, float32_ms=1.0, slowdown=1.4, steps=12)
    assert slow_precision_message(CPU, "float16", "mixed_float16", near) is None
    assert slow_precision_message(CPU, "float16", "mixed_float16", None) is None
    assert slow_precision_message(CPU, "float32", "float32", speed) is None


def test_a_gpu_is_judged_by_its_compute_capability() -> None:
    pascal = DeviceInfo("gpu", "Tesla P100", "tensorflow", (6, 0))
    volta = DeviceInfo("gpu", "Tesla V100", "tensorflow", (7, 0))
    message = slow_precision_message(pascal, "float16", "mixed_float16")
    assert message is not None and "compute capability 6.0" in message and "7.0 or newer" in message
    assert slow_precision_message(volta, "float16", "mixed_float16") is None
    assert "8.0 or newer" in (slow_precision_message(volta, "bfloat16", "mixed_bfloat16") or "")


@pytest.mark.parametrize(("ratio", "words"), [
    (5.68, "5.7x slower than float32 on this CPU (92.1 ms against 16.2 ms per step, median of 12 steps each)"),
    (1.02, "about float32's speed on this CPU"),
    (0.5, "2x faster than float32 on this CPU"),
])
def test_the_cli_says_the_speed_in_words(ratio: float, words: str) -> None:
    ps = {"policy_ms": 92.1 if ratio > 5 else ratio, "float32_ms": 16.2 if ratio > 5 else 1.0,
          "slowdown": ratio, "steps": 12}
    assert precision_speed_words(ps).startswith(words)

"""The speed check: how much slower (or faster) a half-precision policy trains than float32 on this CPU."""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from pydantic import ValidationError

from app.core.config import MIN_SPEED_ROUNDS, Settings
from app.core.errors import UnsupportedPrecision
from mpjobs.cli.words import precision_speed_words
from mpjobs.contract.formats import speed_words
from mpjobs.contract.records import PrecisionSpeed, SpeedDifference
from mpjobs.contract.spec import JobSpec, PrecisionPolicy, Variant
from tests.worker.conftest import Train, spec_of, trained_weights
from worker.engine import training as engine
from worker.engine.devices import DeviceInfo, slow_precision_message
from worker.engine.optimizers import make_optimizer
from worker.engine.stopping import TimeLimit
from worker.numerics import speed as speed_module
from worker.numerics.speed import ROUNDS, float32_twin, measure, measure_all, variant_spec

pytestmark = pytest.mark.slow
"""Each test times training against float32 over several rounds: a speed measurement, never a fast check."""

CPU = DeviceInfo("cpu", "Test CPU", "tensorflow", None, frozenset({"avx2", "avx512_bf16"}))
SLOW = 1.5
"""docs/numerics.md: `slow_precision_on_device` on a CPU when the call is `slower` and `low` is at least 1.5."""
HALF_FLAGS = ("avx512_fp16", "amx_fp16", "avx512_bf16", "amx_bf16")
"""The processor flags the message names, present or missing."""


@pytest.fixture
def checked(tmp_path: Path) -> Settings:
    return Settings(data_root=tmp_path / "data", artifacts_dir=tmp_path / "artifacts", speed_check_steps=2)


def slow_diagnosis(result: engine.RunResult) -> list[str]:
    return [d.message for d in result.summary.diagnoses if d.code == "slow_precision_on_device"]


def expected_difference(speed: PrecisionSpeed) -> str:
    """The rule of docs/numerics.md, restated: beyond 1 and the A/A interval, or no measurable difference."""
    assert speed.low is not None and speed.high is not None
    assert speed.noise_low is not None and speed.noise_high is not None
    if speed.low > max(1.0, speed.noise_high):
        return "slower"
    if speed.high < min(1.0, speed.noise_low):
        return "faster"
    return "none"


def two_decimals(value: float) -> str:
    """A ratio as the messages write it: the exact binary value to two decimals, ties away from zero;
    under 0.1 (an A/A interval end on a very noisy machine), two significant digits instead."""
    exact = Decimal(value)
    fixed = exact.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    if fixed >= Decimal("0.1"):
        return str(fixed)
    return format(exact.quantize(Decimal(1).scaleb(exact.adjusted() - 1), rounding=ROUND_HALF_UP).normalize(), "f")


def expected_slow_message(device: DeviceInfo, compute_dtype: str, policy: str, speed: PrecisionSpeed) -> str | None:
    """The CPU's `slow_precision_on_device` message, written out here from the measured figures."""
    assert speed.low is not None and speed.high is not None
    assert speed.noise_low is not None and speed.noise_high is not None
    if speed.difference != "slower" or speed.low < SLOW:
        return None
    present = sorted(device.cpu_flags & set(HALF_FLAGS))
    units = f"it has {', '.join(present)}" if present else f"it has none of {', '.join(HALF_FLAGS)}"
    return (
        f"On this CPU ({device.name}; {units}) a training step of this model took {speed.policy_ms:.3g} ms "
        f"under {policy} against {speed.float32_ms:.3g} ms in float32: {two_decimals(speed.slowdown)}× slower than "
        f"float32 ({two_decimals(speed.low)}–{two_decimals(speed.high)}×), the 95% interval of {speed.rounds} rounds "
        "timed in turns after the run on fresh copies of the model; float32 against itself: "
        f"{two_decimals(speed.noise_low)}–{two_decimals(speed.noise_high)}×. {device.backend} has no fast "
        f"{compute_dtype} path on this CPU for some of the ops this model uses. It runs correctly: use it on CPU "
        "to check numerics, and train for speed in float32 here or in mixed precision on a GPU."
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_half_precision_job_on_cpu_ends_with_its_speed_against_float32(
        train: Train, checked: Settings, tmp_path: Path, policy: str) -> None:
    spec = spec_of(precision_policy=policy, training={"steps": 12})
    result, _ = train(spec, settings=checked)
    speed = result.summary.precision_speed
    assert result.status == "succeeded" and result.device.kind == "cpu" and speed is not None
    assert speed.rounds == checked.speed_check_rounds and speed.steps == checked.speed_check_rounds
    assert speed.policy_ms > 0 and speed.float32_ms > 0
    assert speed.low is not None and speed.high is not None and speed.low <= speed.slowdown <= speed.high
    assert speed.difference == expected_difference(speed)
    # The diagnosis follows the measurement, whichever way this processor goes: only a whole
    # interval beyond the threshold earns it, and it gives the job's own figures.
    expected = expected_slow_message(result.device, spec.precision_policy.compute_dtype, policy, speed)
    assert slow_diagnosis(result) == ([] if expected is None else [expected])
    # The copies it timed are thrown away: the job's own weights are those of a run without the check.
    unchecked, _ = train(spec)
    assert unchecked.summary.precision_speed is None and not slow_diagnosis(unchecked)
    for a, b in zip(trained_weights(result), trained_weights(unchecked), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_short_run_gets_a_short_check(train: Train, checked: Settings) -> None:
    """At most about half as many steps as the run trained, and never none: 3 steps get 1 per round."""
    result, _ = train(spec_of(precision_policy="mixed_bfloat16", training={"steps": 3}), settings=checked)
    speed = result.summary.precision_speed
    assert speed is not None and speed.steps == speed.rounds == checked.speed_check_rounds


def test_float32_jobs_and_stopped_jobs_are_not_timed(train: Train, checked: Settings) -> None:
    result, _ = train(spec_of(training={"steps": 4}), settings=checked)
    assert result.summary.precision_speed is None and result.summary.variant_speeds == []
    stopped, _ = train(spec_of(precision_policy="mixed_float16", training={"steps": 4}), settings=checked,
                       should_stop=lambda: True)
    assert stopped.status == "stopped" and stopped.summary.precision_speed is None
    # A comparison's variant job leaves its speed to the baseline's one measurement.
    variant, _ = train(spec_of(precision_policy="mixed_bfloat16", training={"steps": 4}, speed_check=[]),
                       settings=checked)
    assert variant.summary.precision_speed is None and variant.summary.variant_speeds == []


def test_a_failed_speed_check_leaves_the_job_succeeded_without_a_figure(
        train: Train, checked: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: object, **kwargs: object) -> PrecisionSpeed:
        raise MemoryError("no room for two more copies of the model")

    monkeypatch.setattr(speed_module, "measure_all", broken)
    with caplog.at_level(logging.WARNING, logger="worker.numerics.speed"):
        result, _ = train(spec_of(precision_policy="mixed_float16", training={"steps": 4}), settings=checked)
    assert result.status == "succeeded" and result.summary.precision_speed is None
    assert "speed check failed" in caplog.text and "MemoryError" in caplog.text


def test_a_comparison_baseline_times_every_variant_in_one_measurement(train: Train, checked: Settings) -> None:
    variants = [{"precision_policy": "mixed_float16"}, {"precision_policy": "mixed_bfloat16"},
                {"precision_policy": "mixed_float16", "loss_scale": "none"}]
    result, _ = train(spec_of(training={"steps": 8}, speed_check=variants), settings=checked)
    speeds = result.summary.variant_speeds
    assert result.summary.precision_speed is None
    assert [s.label for s in speeds] == ["mixed_float16 + dynamic", "mixed_bfloat16", "mixed_float16 + none"]
    float32_ms = {s.speed.float32_ms for s in speeds if s.speed}
    noise = {(s.speed.noise_low, s.speed.noise_high) for s in speeds if s.speed}
    assert len(float32_ms) == 1 and len(noise) == 1, "one float32 reference and one A/A pair for all"
    for s in speeds:
        assert s.speed is not None and s.error is None
        assert s.speed.rounds == checked.speed_check_rounds and s.speed.difference == expected_difference(s.speed)
        policy = {"mixed_float16 + dynamic": "mixed_float16", "mixed_bfloat16": "mixed_bfloat16",
                  "mixed_float16 + none": "mixed_float16"}[s.label]
        assert s.slow_precision == expected_slow_message(result.device, policy.removeprefix("mixed_"), policy,
                                                         s.speed)


def mlp_batches(spec: JobSpec, steps: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((steps * spec.training.batch_size, 784)).astype("float32")
    return x, np.zeros(len(x), dtype="int64")


def cnn_batches(spec: JobSpec, steps: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((steps * spec.training.batch_size, 32, 32, 3)).astype("float32")
    return x, np.zeros(len(x), dtype="int64")


def test_float32_against_float32_shows_no_measurable_difference() -> None:
    """An A/A run: a float32 side timed like a policy is within the noise of the A/A pair."""
    spec = float32_twin(spec_of(model={"name": "cnn"}, training={"steps": 4}))
    speed = measure(spec, *cnn_batches(spec, 2), on_cpu_tf=True, make_optimizer=make_optimizer)
    assert speed is not None and speed.steps == 2 * ROUNDS and speed.rounds == ROUNDS
    assert speed.difference == expected_difference(speed) == "none", speed


class Delay(keras.callbacks.Callback):
    """A test hook: every step of one side takes `seconds` longer, as a truly slower policy would."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        time.sleep(self.seconds)


def test_a_truly_slower_policy_is_called_slower_with_an_interval_that_excludes_1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    original = speed_module._Side.__init__

    def with_delay(self: speed_module._Side, spec: JobSpec, *args: Any) -> None:
        original(self, spec, *args)
        if spec.precision_policy.value == "mixed_bfloat16":
            self.callbacks.insert(0, Delay(0.01))  # before the clock: inside the timed step

    monkeypatch.setattr(speed_module._Side, "__init__", with_delay)
    base = spec_of(training={"steps": 4})
    specs = [variant_spec(base, Variant(precision_policy=p)) for p in (PrecisionPolicy.MIXED_BFLOAT16,
                                                                      PrecisionPolicy.FLOAT32)]
    timed = measure_all(specs, *mlp_batches(base, 2), on_cpu_tf=True, make_optimizer=make_optimizer)
    assert timed is not None
    slowed, same = (t.speed for t in timed)
    assert slowed is not None and same is not None
    assert slowed.difference == "slower" and slowed.interval[0] > 1.0 and slowed.interval[0] > (slowed.noise_high or 0)
    # 10 ms on top of a step of about a millisecond: a sleep never ends early, so the policy's median step grew by
    # at least that, less what bfloat16 may save (up to its float32 step here). No upper bound: on a processor
    # without native bfloat16 its own step costs milliseconds more.
    assert slowed.policy_ms - slowed.float32_ms >= 10 - slowed.float32_ms
    assert same.difference == "none", same
    assert "slower than float32" in speed_words(slowed.slowdown, *slowed.interval, slowed.difference)


def test_a_policy_that_cannot_train_here_is_named_and_the_rest_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    original = speed_module.build_model

    def refuse_float16(spec: JobSpec, **kwargs: Any) -> Any:
        if spec.precision_policy.value == "float16":
            raise UnsupportedPrecision("no float16 kernel for this op here")
        return original(spec, **kwargs)

    monkeypatch.setattr(speed_module, "build_model", refuse_float16)
    base = spec_of(training={"steps": 4})
    specs = [variant_spec(base, Variant(precision_policy=p)) for p in (PrecisionPolicy.FLOAT16,
                                                                      PrecisionPolicy.MIXED_BFLOAT16)]
    timed = measure_all(specs, *mlp_batches(base, 1), on_cpu_tf=True, make_optimizer=make_optimizer, rounds=3)
    assert timed is not None
    assert timed[0].speed is None
    assert timed[0].error == "unsupported_precision_on_device: no float16 kernel for this op here"
    assert timed[1].speed is not None and timed[1].error is None and timed[1].speed.rounds == 3


def test_a_slow_check_shortens_its_pieces_and_ends_after_the_fewest_rounds_past_its_budget() -> None:
    """A policy that trains slowly cannot hold the job: past `max_seconds`, one batch a piece, then 5 rounds."""
    base = spec_of(training={"steps": 4})
    specs = [variant_spec(base, Variant(precision_policy=PrecisionPolicy.MIXED_BFLOAT16))]
    timed = measure_all(specs, *mlp_batches(base, 3), on_cpu_tf=True, make_optimizer=make_optimizer,
                        rounds=9, max_seconds=1e-6)
    assert timed is not None and timed[0].speed is not None
    assert timed[0].speed.rounds == MIN_SPEED_ROUNDS
    assert timed[0].speed.steps == 3 + (MIN_SPEED_ROUNDS - 1)  # three batches in round one, then one a round
    with pytest.raises(ValidationError, match="speed_check_rounds"):
        Settings(speed_check_rounds=MIN_SPEED_ROUNDS - 1)


def test_a_stop_during_the_check_abandons_it() -> None:
    """A cancel that arrives after the run's last step ends the check at the next piece, with no figure."""
    spec = spec_of(model={"name": "cnn"}, precision_policy="mixed_bfloat16", training={"steps": 4})
    asked: list[int] = []

    def after_two_pieces() -> bool:
        asked.append(1)
        return len(asked) > 2  # two timed pieces run, the third does not

    assert measure(spec, *cnn_batches(spec, 2), on_cpu_tf=True, make_optimizer=make_optimizer,
                   should_stop=after_two_pieces) is None
    assert len(asked) == 3


SPEED_PHASE = "measuring speed against float32"


def test_the_time_limit_running_out_during_the_check_abandons_it_and_the_job_succeeds(
        train: Train, checked: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The attempt's time limit, reached once training has ended: the check trains no piece, the job has its steps."""
    limit = TimeLimit(3600, "training.max_seconds", time.monotonic() + 3600)
    real_phase, pieces, expired_at = engine.phase, [], []

    def phase_that_runs_out(name: str) -> AbstractContextManager[None]:
        if name == SPEED_PHASE:  # the deadline is the moment the check begins, as a real one may be
            object.__setattr__(limit, "deadline", time.monotonic())
            expired_at.append(limit.deadline)
        return real_phase(name)

    real_piece = speed_module._Side.piece

    def counted_piece(side: Any, x: np.ndarray, y: np.ndarray) -> None:
        pieces.append(time.monotonic())
        real_piece(side, x, y)

    monkeypatch.setattr(engine, "phase", phase_that_runs_out)
    monkeypatch.setattr(speed_module._Side, "piece", counted_piece)
    spec = spec_of(precision_policy="mixed_bfloat16", training={"steps": 8, "batch_size": 8},
                   dataset={"samples": 64}, model={"name": "mlp", "input_dim": 16, "hidden_units": 8})
    with caplog.at_level(logging.INFO, logger="worker.numerics.speed"):
        result, reporter = train(spec, settings=checked, limit=limit)
    assert expired_at and limit.passed()  # the check began, and the limit had run out by its first piece
    assert result.status == "succeeded" and result.model_path is not None and result.model_path.exists()
    assert [r.step for r in reporter.records] == list(range(1, 9))
    assert result.summary.precision_speed is None  # no figure: the check was abandoned, not run
    assert pieces == []  # before its first timed piece: at most the copies' building and one warm-up step each
    assert "speed check abandoned" in caplog.text


def test_the_float32_twin_changes_only_the_precision() -> None:
    spec = JobSpec.model_validate({"model": {"name": "cnn"}, "precision_policy": "mixed_float16",
                                   "loss_scale": {"mode": "fixed", "scale": 128}, "training": {"steps": 7}})
    twin = float32_twin(spec)
    assert twin.precision_policy.value == "float32" and twin.loss_scale is not None
    assert twin.loss_scale.mode == "none"
    assert twin.model == spec.model and twin.training == spec.training and twin.dataset == spec.dataset


def timed(policy_ms: float, float32_ms: float, low: float, high: float, difference: SpeedDifference,
          noise: tuple[float, float] = (0.97, 1.04)) -> PrecisionSpeed:
    """A measured speed whose call is written by hand (the rule's own test: test_speed_difference.py)."""
    slowdown = policy_ms / float32_ms
    return PrecisionSpeed(policy_ms=policy_ms, float32_ms=float32_ms, slowdown=slowdown, steps=36, low=low,
                          high=high, noise_low=noise[0], noise_high=noise[1], rounds=9, difference=difference)


def test_the_slow_precision_message_gives_the_measured_figures() -> None:
    speed = timed(92.1, 16.2, 5.1, 6.3, "slower")  # 92.1 / 16.2 = 5.685...
    assert slow_precision_message(CPU, "float16", "mixed_float16", speed) == (
        "On this CPU (Test CPU; it has avx512_bf16) a training step of this model took 92.1 ms under mixed_float16 "
        "against 16.2 ms in float32: 5.69× slower than float32 (5.10–6.30×), the 95% interval of 9 rounds timed in "
        "turns after the run on fresh copies of the model; float32 against itself: 0.97–1.04×. tensorflow has no "
        "fast float16 path on this CPU for some of the ops this model uses. It runs correctly: use it on CPU to "
        "check numerics, and train for speed in float32 here or in mixed precision on a GPU."
    )
    # Three significant digits of a millisecond, and ratios rounded half away from zero (2.125 is exact in binary).
    bare = DeviceInfo("cpu", "Old CPU", "tensorflow")
    at_the_threshold = timed(1234.5, 617.25, 1.5, 2.125, "slower")
    assert (slow_precision_message(bare, "bfloat16", "mixed_bfloat16", at_the_threshold) or "").startswith(
        "On this CPU (Old CPU; it has none of avx512_fp16, amx_fp16, avx512_bf16, amx_bf16) a training step of this "
        "model took 1.23e+03 ms under mixed_bfloat16 against 617 ms in float32: 2.00× slower than float32 "
        "(1.50–2.13×), the 95% interval of 9 rounds")
    # Only a whole interval beyond the threshold earns it: a median above 1.5 is not enough.
    straddles = timed(16.2 * 1.6, 16.2, 1.3, 1.9, "slower")
    assert slow_precision_message(CPU, "float16", "mixed_float16", straddles) is None
    noisy = timed(16.2 * 1.8, 16.2, 1.6, 2.0, "none", noise=(0.5, 2.1))  # beyond 1.5 but inside this machine's noise
    assert slow_precision_message(CPU, "float16", "mixed_float16", noisy) is None
    assert slow_precision_message(CPU, "float16", "mixed_float16", None) is None
    assert slow_precision_message(CPU, "float32", "float32", speed) is None


def test_a_gpu_is_judged_by_its_compute_capability() -> None:
    pascal = DeviceInfo("gpu", "Tesla P100", "tensorflow", (6, 0))
    volta = DeviceInfo("gpu", "Tesla V100", "tensorflow", (7, 0))
    assert slow_precision_message(pascal, "float16", "mixed_float16") == (
        "mixed_float16 computes in float16, but Tesla P100 (compute capability 6.0) has no fast float16 units; "
        "they need 7.0 or newer. Expect no speedup over float32; keep float32 on this GPU.")
    assert slow_precision_message(volta, "float16", "mixed_float16") is None
    assert "8.0 or newer" in (slow_precision_message(volta, "bfloat16", "mixed_bfloat16") or "")


@pytest.mark.parametrize(("low", "high", "call", "words"), [
    (5.1, 6.3, "slower", "5.69× slower than float32 (5.10–6.30×) (92.1 ms against 16.2 ms per step, 95% interval of 9 "
                         "rounds; float32 against itself 0.97–1.04×)"),
    (0.9, 1.06, "none", "no measurable speed difference from float32 (step time 0.90–1.06× float32's)"),
    (0.45, 0.55, "faster", "2.00× faster than float32 (1.82–2.22×)"),
])
def test_the_cli_says_the_speed_in_words(low: float, high: float, call: SpeedDifference, words: str) -> None:
    median = (low + high) / 2 if high < 5 else 92.1 / 16.2
    speed = timed(median * 16.2, 16.2, low, high, call)
    assert precision_speed_words(speed.model_dump(mode="json")).startswith(words)

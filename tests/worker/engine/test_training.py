"""The engine's "Must show" cases, on this machine's CPU, through `run_job`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from app.core.config import Settings
from mpjobs.contract.model_specs import Conv3dUnetModel
from mpjobs.contract.spec import JobSpec
from tests.worker.conftest import Train, initial_weights, spec_of, trained_weights
from worker.engine.models import build_model

pytestmark = pytest.mark.slow
"""The engine's cases train for seconds each: about 35 s in all, left to `make test`."""

# --- 1. the zero-gradient case, and 7. the missing float16 MaxPool3D kernel ---

UNET = {"name": "conv3d_unet", "volume": 16, "filters": 8, "reference_edge": 384}
# One plain SGD step with a large rate: the weight change / rate is the gradient.
ONE_SGD_STEP = {"steps": 1, "batch_size": 2, "optimizer": "sgd", "learning_rate": 10.0}
SGD_RATE = 10.0


def first_step_gradient(train: Train, policy: str, loss_scale: object) -> tuple[np.ndarray, object]:
    spec = spec_of(model=UNET, precision_policy=policy, loss_scale=loss_scale,
                   training=ONE_SGD_STEP, dataset={"samples": 8})
    result, reporter = train(spec)
    before, after = initial_weights(spec), trained_weights(result)
    grads = [(b - a).ravel() / SGD_RATE for b, a in zip(before, after, strict=True) if b.dtype == np.float32]
    return np.concatenate(grads), (result, reporter)


def relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_float16_without_loss_scale_flushes_every_gradient_to_zero(train: Train) -> None:
    reference, _ = first_step_gradient(train, "float32", "none")
    assert np.count_nonzero(reference) > 0.9 * reference.size

    _, (result, reporter) = first_step_gradient(train, "mixed_float16", "none")
    record = reporter.records[0]
    assert record.zero_grad_fraction >= 0.99
    assert record.grad_norm == 0.0
    # float32 has almost no zeros here: nearly every zero is underflow, and nothing is left of the gradient.
    assert record.excess_zero_fraction is not None and record.excess_zero_fraction >= 0.99
    assert record.grad_rel_error == 1.0
    codes = {d.code: d for d in result.summary.diagnoses}
    assert codes["gradient_underflow"].first_step == 1
    assert "A larger scale recovers them" in codes["gradient_underflow"].message
    assert "Turn on loss scaling" in codes["gradient_underflow"].message


@pytest.mark.parametrize("loss_scale", [{"mode": "fixed", "scale": 1024}, "dynamic"])
def test_loss_scaling_recovers_the_float32_gradient(train: Train, loss_scale: object) -> None:
    reference, _ = first_step_gradient(train, "float32", "none")
    grads, (result, reporter) = first_step_gradient(train, "mixed_float16", loss_scale)
    assert reporter.records[0].zero_grad_fraction < 0.01
    assert reporter.records[0].excess_zero_fraction is not None and reporter.records[0].excess_zero_fraction < 1e-3
    assert relative_l2(grads, reference) < 0.02
    assert "gradient_underflow" not in {d.code for d in result.summary.diagnoses}


def test_maxpool3d_runs_under_mixed_float16_on_cpu_in_float32(train: Train) -> None:
    spec = spec_of(model=UNET, precision_policy="mixed_float16", training={"steps": 3, "batch_size": 2},
                   dataset={"samples": 8})
    result, reporter = train(spec)
    assert result.status == "succeeded"
    assert [r.step for r in reporter.records] == [1, 2, 3]
    fallback = next(d for d in result.summary.diagnoses if d.code == "float32_fallback")
    assert "max_pooling3d" in fallback.message and "float32" in fallback.message


def test_missing_kernel_error_becomes_a_named_failure() -> None:
    import tensorflow as tf

    from mpjobs.contract.jobs import FailureReason
    from worker.engine.devices import detect_device
    from worker.engine.failures import named_failure

    device = detect_device()

    spec = spec_of(model=UNET, precision_policy="mixed_float16")
    volume = tf.zeros((1, 4, 4, 4, 1), tf.float16)
    for run in (tf.nn.max_pool3d, tf.function(tf.nn.max_pool3d)):  # eager and graph say it differently
        with pytest.raises(Exception) as raised:
            run(volume, 2, 2, "VALID")
        failure = named_failure(raised.value, spec.precision_policy.compute_dtype, device.backend, device.kind)
        assert failure.reason is FailureReason.UNSUPPORTED_PRECISION_ON_DEVICE
        assert "MaxPool3D" in failure.message and "Fix:" in failure.message
        assert "Traceback" not in failure.message


# --- grad_norm: the norm of the plain gradient ------------------------------------------

GRAD_NORM_REL_TOL = 1e-5
"""The reported norm is a float32 value (one ulp is 1.2e-7 of it), the root of a float32 sum of squares
over up to 9,000 values, of gradients that the compiled step may sum in another order than an eager
tape: each is a few ulps (here they agree to 4e-9). 1e-5 is about 80 ulps, a thousand times below a 1% error."""
SMALL_MLP = {"name": "mlp", "input_dim": 20, "hidden_units": 16, "classes": 4}


def plain_gradient_norm(spec: JobSpec, x: np.ndarray, y: np.ndarray) -> float:
    """The float64 norm of a float32 GradientTape gradient of the batch loss at the job's initial weights."""
    assert spec.precision_policy.value == "float32"
    model = build_model(spec, on_cpu_tf=True).model
    model.set_weights(initial_weights(spec))
    with tf.GradientTape() as tape:
        out = tf.cast(model(x, training=True), tf.float32)
        if isinstance(spec.model, Conv3dUnetModel):  # docs/numerics.md: sum(outputs) / reference_edge**3
            loss = tf.reduce_sum(out) / float(spec.model.reference_edge) ** 3
        else:  # the built-in classifiers' sparse categorical crossentropy, averaged over the batch
            loss = tf.reduce_mean(-tf.math.log(tf.gather(out, y, axis=1, batch_dims=1)))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in grads)))


@pytest.mark.parametrize(("model", "loss_scale"), [
    pytest.param(SMALL_MLP, "none", id="mlp-unscaled"),
    # Scaling by a power of two and back is exact in float32: the same norm, unscaled.
    pytest.param(SMALL_MLP, {"mode": "fixed", "scale": 1024}, id="mlp-fixed-1024"),
    pytest.param(SMALL_MLP, "dynamic", id="mlp-dynamic-32768"),
    pytest.param(UNET, "none", id="conv3d_unet"),
])
def test_the_reported_grad_norm_is_the_norm_of_the_plain_gradient(
        train: Train, settings: Settings, model: dict[str, object], loss_scale: object) -> None:
    rng = np.random.default_rng(5)
    if model is UNET:
        x, y = rng.standard_normal((2, 16, 16, 16, 1)).astype(np.float32), np.zeros((2, 1), np.float32)
    else:
        x, y = rng.standard_normal((32, 20)).astype(np.float32), rng.integers(0, 4, 32).astype(np.int32)
    settings.data_root.mkdir(parents=True, exist_ok=True)
    np.savez(settings.data_root / "batch.npz", x=x, y=y)
    spec = spec_of(model=model, loss_scale=loss_scale, dataset={"kind": "npz", "path": "batch.npz"},
                   training={"steps": 1, "batch_size": len(x), "optimizer": "sgd"})
    _, reporter = train(spec)
    # One batch of the whole file, in the first epoch's order: the permutation of default_rng([seed, 0]).
    order = np.random.default_rng([spec.training.seed, 0]).permutation(len(x))
    expected = plain_gradient_norm(spec, x[order], y[order])
    assert expected > 0
    assert reporter.records[0].grad_norm == pytest.approx(expected, rel=GRAD_NORM_REL_TOL)


# --- 2. plain Keras: mlp under mixed_float16 with dynamic scaling ---------------


def test_mlp_mixed_float16_dynamic_trains(train: Train) -> None:
    spec = spec_of(precision_policy="mixed_float16", loss_scale="dynamic", training={"steps": 200})
    result, reporter = train(spec)
    losses = [r.loss for r in reporter.records]
    assert [r.step for r in reporter.records] == list(range(1, 201))
    assert reporter.records[0].loss_scale == 32768.0
    assert result.summary.final_loss is not None and losses[0] is not None
    assert result.summary.final_loss <= 0.7 * losses[0]
    assert reporter.batches < 200, "records must reach the reporter in batches"
    assert result.model_path is not None and result.model_path.exists()


# --- 3. overflow: dynamic scaling from 2**40 -----------------------------------


def test_dynamic_scale_halves_on_overflow_then_trains(train: Train) -> None:
    spec = spec_of(precision_policy="mixed_float16",
                   loss_scale={"mode": "dynamic", "initial_scale": 2.0**40}, training={"steps": 40})
    result, reporter = train(spec)
    records = reporter.records
    first_applied = next(i for i, r in enumerate(records) if not r.skipped)
    assert first_applied > 5
    for i, r in enumerate(records[:first_applied]):
        assert r.skipped and not r.grads_finite
        assert r.loss_scale == 2.0 ** (40 - i)
    # Every skip halves the scale for the next step; applied steps keep it (growth is 2000 steps away).
    for r, following in zip(records, records[1:], strict=False):
        assert following.loss_scale == (r.loss_scale / 2 if r.skipped else r.loss_scale)
    halvings = sum(1 for a, b in zip(records, records[1:], strict=False) if b.loss_scale == a.loss_scale / 2)
    halvings += records[-1].skipped
    assert result.summary.skipped_steps == halvings
    assert sum(not r.skipped for r in records[first_applied:]) >= 0.8 * (len(records) - first_applied)
    assert all(r.loss is not None for r in records)
    assert next(d for d in result.summary.diagnoses if d.code == "overflow_skips").first_step == 1

    skipped_only = spec.model_copy(update={"training": spec.training.model_copy(update={"steps": first_applied})})
    result, _ = train(skipped_only)
    for before, after in zip(initial_weights(skipped_only), trained_weights(result), strict=True):
        np.testing.assert_array_equal(before, after)


# --- 4. fixed mode ---------------------------------------------------------------


def test_fixed_scale_stays_constant_and_counts_skips(train: Train) -> None:
    spec = spec_of(precision_policy="mixed_float16", loss_scale={"mode": "fixed", "scale": 2.0**40},
                   training={"steps": 6})
    result, reporter = train(spec)
    assert [r.loss_scale for r in reporter.records] == [2.0**40] * 6
    assert all(r.skipped and not r.grads_finite for r in reporter.records)
    assert result.summary.skipped_steps == 6
    assert "never backs off" in next(d for d in result.summary.diagnoses if d.code == "overflow_skips").message
    for before, after in zip(initial_weights(spec), trained_weights(result), strict=True):
        np.testing.assert_array_equal(before, after)

    spec = spec_of(precision_policy="mixed_float16", loss_scale={"mode": "fixed", "scale": 1024},
                   training={"steps": 30})
    result, reporter = train(spec)
    assert [r.loss_scale for r in reporter.records] == [1024.0] * 30
    assert result.summary.skipped_steps == 0


# --- 5. fidelity -----------------------------------------------------------------


@pytest.mark.parametrize(("model", "steps"), [({"name": "mlp"}, 200), ({"name": "cnn", "filters": 8}, 60)])
def test_mixed_float16_matches_float32(train: Train, model: dict[str, object], steps: int) -> None:
    finals = {}
    for policy in ("float32", "mixed_float16"):
        spec = spec_of(model=model, precision_policy=policy, training={"steps": steps}, dataset={"samples": 1024})
        result, _ = train(spec)
        finals[policy] = result.summary.final_loss
    assert finals["float32"] is not None and finals["mixed_float16"] is not None
    assert abs(finals["mixed_float16"] - finals["float32"]) <= 0.02 * finals["float32"]


def test_mixed_bfloat16_runs_without_loss_scale(train: Train) -> None:
    spec = spec_of(precision_policy="mixed_bfloat16", training={"steps": 8})
    result, reporter = train(spec)
    assert spec.loss_scale is not None and spec.loss_scale.mode == "none"
    assert [r.loss_scale for r in reporter.records] == [1.0] * 8
    assert all(r.loss is not None and r.grads_finite for r in reporter.records)
    assert result.summary.loss_scale_max == 1.0


# --- 6. resume -------------------------------------------------------------------


def test_resume_continues_exactly_where_it_stopped(train: Train, tmp_path: Path) -> None:
    # growth_steps=7 makes the scale change across the stop, so its counter must be restored.
    spec = spec_of(precision_policy="mixed_float16",
                   loss_scale={"mode": "dynamic", "initial_scale": 256, "growth_steps": 7},
                   training={"steps": 40, "checkpoint_every": 10, "steps_per_execution": 1}, dataset={"samples": 320})
    _, whole = train(spec)

    out = tmp_path / "interrupted"
    stop_at, checks = 17, []

    def should_stop() -> bool:  # Asked once after every call: here, every step.
        checks.append(True)
        return len(checks) >= stop_at

    first, part1 = train(spec, out=out, should_stop=should_stop)
    assert first.status == "stopped"
    assert first.summary.steps_done == stop_at
    assert [r.step for r in part1.records] == list(range(1, stop_at + 1))
    second, part2 = train(spec, out=out)
    assert second.start_step == stop_at
    assert [r.step for r in part2.records] == list(range(stop_at + 1, 41))
    resumed = part1.records[:stop_at] + part2.records
    assert [r.step for r in resumed] == list(range(1, 41))
    assert [r.loss for r in resumed] == [r.loss for r in whole.records]
    assert [r.loss_scale for r in resumed] == [r.loss_scale for r in whole.records]
    assert second.summary.steps_done == 40
    assert second.summary.loss_scale_max == max(r.loss_scale for r in whole.records)

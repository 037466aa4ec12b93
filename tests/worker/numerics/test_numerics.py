"""Reported numbers on the models users bring, each against a plain float32 GradientTape on the same
weights and batch (never the engine's own statistics).

Every job here trains on one `.npz` batch: `batch_size` equals the sample count, so step 1's batch
is the whole file (in the engine's order, which a mean over the batch does not see).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from app.core.config import Settings
from mpjobs.contract.spec import JobSpec, PrecisionPolicy
from tests.worker.conftest import Train, initial_weights, spec_of
from worker.engine.devices import detect_device
from worker.engine.models import build_model
from worker.engine.training import Training, never
from worker.telemetry.reporters import ListReporter

FLOAT16_ROUNDS_TO_ZERO = 2.0**-25
"""float16 rounds magnitudes up to half its smallest subnormal (2**-24) to zero."""


def npz_spec(settings: Settings, name: str, x: np.ndarray, y: np.ndarray, model: dict[str, Any],
             **fields: Any) -> JobSpec:
    settings.data_root.mkdir(parents=True, exist_ok=True)
    np.savez(settings.data_root / f"{name}.npz", x=x, y=y)
    training = {"steps": 1, "batch_size": len(x), "optimizer": "sgd", "learning_rate": 1e-3,
                **fields.pop("training", {})}
    return spec_of(model=model, dataset={"kind": "npz", "path": f"{name}.npz"}, training=training, **fields)


def reference_gradients(model_json: str, spec: JobSpec, x: np.ndarray, y: np.ndarray,
                        loss: keras.losses.Loss) -> list[np.ndarray]:
    """The float32 gradient of the mean data loss (plus penalties) at the job's initial weights, dense, float64."""
    model = keras.models.model_from_json(model_json)
    model.set_weights([w.astype(np.float32) for w in initial_weights(spec)])
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True)) + sum(model.losses)
    grads = tape.gradient(value, model.trainable_variables)
    return [tf.convert_to_tensor(g).numpy().astype(np.float64) for g in grads]


def zero_share(grads: list[np.ndarray]) -> float:
    return sum(int(np.sum(g == 0)) for g in grads) / sum(g.size for g in grads)


def global_norm(grads: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(np.square(g)) for g in grads)))


# --- 1. sparse gradients ----------------------------------------------------------------------


def embedding_json(vocab: int) -> str:
    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(vocab, 4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3, activation="softmax")])
    return str(model.to_json())


@pytest.mark.parametrize(("policy", "loss_scale", "rel"), [("float32", "none", 1e-6),
                                                           ("mixed_float16", "dynamic", 2e-3)])
def test_embedding_with_repeated_rows_reports_the_dense_gradient(
    train: Train, settings: Settings, policy: str, loss_scale: str, rel: float
) -> None:
    rng = np.random.default_rng(3)
    x = rng.integers(0, 8, (16, 6)).astype(np.int32)  # 8 of 50 rows used, each many times
    y = rng.integers(0, 3, 16).astype(np.int32)
    model_json = embedding_json(50)
    spec = npz_spec(settings, "tokens", x, y, {"keras_json": model_json, "loss": "sparse_categorical_crossentropy"},
                    precision_policy=policy, loss_scale=loss_scale)
    expected = reference_gradients(model_json, spec, x, y, keras.losses.SparseCategoricalCrossentropy())
    assert np.count_nonzero(np.bincount(x.ravel()) > 1) == 8

    _, reporter = train(spec)
    record = reporter.records[0]
    assert 0.0 <= record.zero_grad_fraction <= 1.0
    assert record.zero_grad_fraction == pytest.approx(zero_share(expected), abs=1e-12)
    assert record.grad_norm == pytest.approx(global_norm(expected), rel=rel)


def test_large_vocabulary_zeros_are_not_underflow(train: Train, settings: Settings) -> None:
    rng = np.random.default_rng(4)
    x = rng.integers(0, 300, (32, 8)).astype(np.int32)  # 300 of 20,000 rows get a gradient
    model = {"name": "transformer", "seq_len": 8, "vocab_size": 20_000, "d_model": 8, "heads": 2, "layers": 1,
             "ffn_dim": 16}
    spec = npz_spec(settings, "words", x, rng.integers(0, 10, 32).astype(np.int32), model,
                    precision_policy="mixed_float16")
    result, reporter = train(spec)
    record = reporter.records[0]
    weights = initial_weights(spec)
    unused_rows = 20_000 - len(np.unique(x))
    assert record.zero_grad_fraction >= unused_rows * 8 / sum(w.size for w in weights if w.dtype == np.float32)
    assert record.zero_grad_fraction > 0.9
    assert record.excess_zero_fraction is not None and record.excess_zero_fraction < 1e-3
    assert "gradient_underflow" not in {d.code for d in result.summary.diagnoses}


# --- 3. underflow judged against float32 ---------------------------------------------------------


def test_dead_relu_zeros_are_not_underflow(train: Train, settings: Settings) -> None:
    rng = np.random.default_rng(5)
    model = keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(256, activation="relu", bias_initializer=keras.initializers.Constant(-100.0)),
        keras.layers.Dense(10),
        keras.layers.Activation("softmax", dtype="float32"),
    ])
    model_json = str(model.to_json())
    x, y = rng.standard_normal((32, 32)).astype(np.float32), rng.integers(0, 10, 32).astype(np.int32)
    spec = npz_spec(settings, "dead", x, y, {"keras_json": model_json, "loss": "sparse_categorical_crossentropy"},
                    precision_policy="mixed_float16", loss_scale="none")
    expected = reference_gradients(model_json, spec, x, y, keras.losses.SparseCategoricalCrossentropy())
    assert zero_share(expected) > 0.99  # float32 has the zeros too

    result, reporter = train(spec)
    record = reporter.records[0]
    assert record.zero_grad_fraction == pytest.approx(zero_share(expected), abs=1e-12)
    assert record.excess_zero_fraction == 0.0
    assert record.grad_rel_error is not None and record.grad_rel_error < 1e-2
    assert result.summary.float32_checks == 1
    assert "gradient_underflow" not in {d.code for d in result.summary.diagnoses}


def partial_underflow_case(settings: Settings, loss_scale: object) -> tuple[JobSpec, list[np.ndarray]]:
    """Two of eight input features are 1e-5 times smaller: their rows of the first kernel get
    gradients of about 1e-9 in float32, below what float16 can hold; every other value is far above."""
    rng = np.random.default_rng(6)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, use_bias=False, name="first",
                                                                    kernel_initializer=keras.initializers.Constant(0.5)),
                              keras.layers.Dense(1, use_bias=False, name="second",
                                                 kernel_initializer=keras.initializers.Constant(1e-4))])
    model_json = str(model.to_json())
    x = rng.standard_normal((16, 8)).astype(np.float32)
    x[:, 6:] *= 1e-5
    y = rng.standard_normal((16, 1)).astype(np.float32)
    spec = npz_spec(settings, "partial", x, y, {"keras_json": model_json, "loss": "mean_squared_error"},
                    precision_policy="mixed_float16", loss_scale=loss_scale)
    return spec, reference_gradients(model_json, spec, x, y, keras.losses.MeanSquaredError())


def test_partial_underflow_of_one_layer_is_found_and_a_scale_named(train: Train, settings: Settings) -> None:
    spec, expected = partial_underflow_case(settings, "none")
    first = expected[0]
    lost = (np.abs(first) < FLOAT16_ROUNDS_TO_ZERO) & (first != 0)
    assert lost[6:].all() and not lost[:6].any()  # the case is what it says
    assert np.abs(first[:6]).min() > 50 * FLOAT16_ROUNDS_TO_ZERO and np.abs(first[6:]).max() < FLOAT16_ROUNDS_TO_ZERO
    total = sum(g.size for g in expected)

    result, reporter = train(spec)
    record = reporter.records[0]
    assert record.excess_zero_fraction == pytest.approx(lost.sum() / total, abs=1e-12)  # 8 of 36
    underflow = next(d for d in result.summary.diagnoses if d.code == "gradient_underflow")
    assert underflow.first_step == 1
    # Its last layer computes in float16 (no layer is pinned): the loss sees float16 outputs.
    output = next(d for d in result.summary.diagnoses if d.code == "half_precision_output")
    assert "output is float16 under mixed_float16" in output.message and "dtype='float32'" in output.message
    assert "first/kernel (25.0% of its values)" in underflow.message
    assert "A larger scale recovers them" in underflow.message
    named = float(underflow.message.split("'fixed' with a scale of at least ")[1].split(".")[0])
    # The named scale is what the smallest lost value needs to reach float16's smallest subnormal.
    assert named * np.abs(first[lost]).min() >= 2.0**-25
    rescued, rescued_reporter = train(partial_underflow_case(settings, {"mode": "fixed", "scale": named})[0])
    assert rescued_reporter.records[0].excess_zero_fraction == 0.0
    assert "gradient_underflow" not in {d.code for d in rescued.summary.diagnoses}


# --- 4. pure half precision, 5. finite means finite, 8. exact small things --------------------------


def test_pure_float16_statistics_are_of_the_float32_unscaled_gradient(train: Train, settings: Settings) -> None:
    # Every voxel's gradient is 1/2048**3 = 1.2e-10: at 2**20 backprop in float16 keeps it, but cast back
    # to float16 after unscaling, most weight gradients (about 1e-8) would read zero.
    unet = {"name": "conv3d_unet", "volume": 8, "filters": 4, "reference_edge": 2048}
    x = np.random.default_rng(7).standard_normal((2, 8, 8, 8, 1)).astype(np.float32)
    spec = npz_spec(settings, "scan", x, np.zeros((2, 1), np.float32), unet, precision_policy="float16",
                    loss_scale={"mode": "fixed", "scale": 2.0**20}, training={"batch_size": 2})
    reference = build_model(spec.model_copy(update={"precision_policy": PrecisionPolicy.FLOAT32}),
                            on_cpu_tf=True).model
    reference.set_weights([w.astype(np.float32) for w in initial_weights(spec)])
    with tf.GradientTape() as tape:
        value = tf.reduce_sum(reference(x, training=True)) / 2048.0**3
    expected = [g.numpy() for g in tape.gradient(value, reference.trainable_variables)]
    assert sum(int(np.sum((np.abs(g) < FLOAT16_ROUNDS_TO_ZERO) & (g != 0))) for g in expected) > 0.5 * sum(
        g.size for g in expected)

    result, reporter = train(spec)
    record = reporter.records[0]
    assert record.grads_finite
    assert record.zero_grad_fraction == pytest.approx(zero_share(expected), abs=0.01)
    assert record.excess_zero_fraction is not None and record.excess_zero_fraction < 0.01
    assert record.grad_norm == pytest.approx(global_norm(expected), rel=0.02)
    assert "gradient_underflow" not in {d.code for d in result.summary.diagnoses}


def test_finite_gradient_beyond_1e19_is_finite_with_its_norm(train: Train, settings: Settings) -> None:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False,
                                                                    kernel_initializer="ones")])
    model_json = str(model.to_json())
    x = np.array([[1e10, 2e9], [3e9, -1e10]], np.float32)
    y = np.zeros((2, 1), np.float32)
    spec = npz_spec(settings, "huge", x, y, {"keras_json": model_json, "loss": "mean_squared_error"},
                    training={"learning_rate": 1e-30})
    expected = reference_gradients(model_json, spec, x, y, keras.losses.MeanSquaredError())
    assert 1e19 < global_norm(expected) < 3e38

    result, reporter = train(spec)
    record = reporter.records[0]
    assert result.status == "succeeded"
    assert record.grads_finite and not record.skipped
    assert record.grad_norm == pytest.approx(global_norm(expected), rel=1e-6)


def test_every_gradient_zero_reads_exactly_one(train: Train, settings: Settings) -> None:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(
        16, activation="relu", bias_initializer=keras.initializers.Constant(-100.0))])
    spec = npz_spec(settings, "zeros", np.ones((4, 8), np.float32), np.zeros((4, 1), np.float32),
                    {"keras_json": str(model.to_json()), "loss": "output_mean"})
    _, reporter = train(spec)
    assert reporter.records[0].zero_grad_fraction == 1.0
    assert reporter.records[0].grad_norm == 0.0


def test_a_fixed_scale_reads_back_as_given(train: Train) -> None:
    spec = spec_of(precision_policy="mixed_float16", loss_scale={"mode": "fixed", "scale": 3.7},
                   training={"steps": 2}, dataset={"samples": 64})
    _, reporter = train(spec)
    assert [r.loss_scale for r in reporter.records] == [3.7, 3.7]
    spec = spec_of(precision_policy="mixed_float16", loss_scale={"mode": "dynamic", "initial_scale": 3.7,
                                                                 "growth_steps": 1}, training={"steps": 3},
                   dataset={"samples": 64})
    _, reporter = train(spec)
    assert [r.loss_scale for r in reporter.records] == [3.7, 7.4, 14.8]


# --- 6. the data loss, and penalties beside it ------------------------------------------------


def regularized_case(settings: Settings, policy: str = "float32") -> tuple[JobSpec, str, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(8)
    model = keras.Sequential([
        keras.Input((6,)),
        # Constant weights: TensorFlow and JAX draw different random ones from one seed, and the
        # backends' test compares their numbers on this model.
        keras.layers.Dense(5, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01),
                           kernel_initializer=keras.initializers.Constant(0.2),
                           bias_initializer=keras.initializers.Constant(0.1)),
        keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L1(0.002), bias_regularizer="l2",
                           kernel_initializer=keras.initializers.Constant(-0.3),
                           bias_initializer=keras.initializers.Constant(0.05)),
    ])
    model_json = str(model.to_json())
    x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32)
    spec = npz_spec(settings, "regularized", x, y, {"keras_json": model_json, "loss": "mse"},
                    precision_policy=policy, training={"steps": 2})
    return spec, model_json, x, y


def test_loss_is_the_data_loss_and_penalties_are_reported_beside_it(train: Train, settings: Settings) -> None:
    spec, model_json, x, y = regularized_case(settings)
    weights = [w.astype(np.float64) for w in initial_weights(spec)]
    kernel1, _, kernel2, bias2 = weights
    hidden = np.maximum(x.astype(np.float64) @ kernel1 + weights[1], 0.0)
    data_loss = np.mean(np.square(hidden @ kernel2 + bias2 - y))
    penalty = 0.01 * np.sum(kernel1**2) + 0.002 * np.sum(np.abs(kernel2)) + 0.01 * np.sum(bias2**2)
    assert penalty > 0.01 * data_loss  # large enough that adding it would show

    _, reporter = train(spec)
    record = reporter.records[0]
    assert record.loss == pytest.approx(data_loss, rel=1e-6)
    assert record.regularization_loss == pytest.approx(penalty, rel=1e-6)
    # The gradient is of the total: data loss plus penalties, as Keras trains.
    expected = reference_gradients(model_json, spec, x, y, keras.losses.MeanSquaredError())
    assert record.grad_norm == pytest.approx(global_norm(expected), rel=1e-6)


def test_a_model_without_penalties_reports_none(train: Train) -> None:
    _, reporter = train(spec_of(training={"steps": 1}, dataset={"samples": 64}))
    assert reporter.records[0].regularization_loss is None


def test_a_failing_check_is_reported_and_training_goes_on(tmp_path: Path, settings: Settings) -> None:
    spec = spec_of(precision_policy="mixed_float16", training={"steps": 3, "underflow_check_every": 1},
                   dataset={"samples": 128})
    reporter = ListReporter()
    training = Training(spec, reporter, tmp_path, never, settings, detect_device())
    assert training.check is not None

    def no_twin() -> keras.Model:
        raise RuntimeError("no twin today")

    training.check.build_twin = no_twin
    result = training.run()
    assert result.status == "succeeded" and [r.step for r in reporter.records] == [1, 2, 3]
    assert result.summary.float32_checks == 0
    assert all(r.excess_zero_fraction is None for r in reporter.records)
    assert result.summary.float32_check_error == (
        "The float32 check failed at step 1 and was turned off: RuntimeError: no twin today")

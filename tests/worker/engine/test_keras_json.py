"""keras_json models under every policy: pinned layers, nested models, regularizers, loss names.

Each expected value comes from plain Keras written for the policy, as Keras's
mixed-precision guide writes it, or from NumPy in float64.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import keras
import numpy as np
import pytest
from keras import layers

from app.core.config import Settings
from mpjobs.contract.spec import PrecisionPolicy
from scripts.stack import ROOT
from tests.worker.conftest import Train, initial_weights, spec_of
from worker.engine.data import synthetic
from worker.engine.models import build_model

POLICIES = [p.value for p in PrecisionPolicy]
HALF_POLICIES = [p for p in POLICIES if p != "float32"]
COMPUTE = {p.value: p.compute_dtype for p in PrecisionPolicy}
FEATURES, CLASSES, BATCH = 6, 3, 8
LOSS_REL_TOL = 1e-5
"""The engine's step and a compiled reference in the same policy agree to about 1e-7 here. An eager
reference does not on a CPU with native float16/bfloat16 kernels (AVX512-FP16, AMX): the compiled
step fuses ops and rounds differently, up to 1e-3 apart in bfloat16."""


def classifier(policy: str) -> keras.Model:
    """Dense, then a nested Sequential, then a float32 softmax head: built under `policy`."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        inputs = keras.Input((FEATURES,))
        x = layers.Dense(8, activation="relu", name="hidden")(inputs)
        inner = keras.Sequential(
            [layers.Dense(8, activation="tanh", name="inner_a"), layers.Dense(CLASSES, name="inner_b")], name="inner")
        outputs = layers.Activation("softmax", dtype="float32", name="probs")(inner(x))
        return keras.Model(inputs, outputs)
    finally:
        keras.config.set_dtype_policy(previous)


def plain_dtypes(text: str) -> str:
    """The same config with every serialized DTypePolicy written as its bare name."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get("class_name") == "DTypePolicy":
                return node["config"]["name"]
            return {key: strip(value) for key, value in node.items()}
        return [strip(value) for value in node] if isinstance(node, list) else node

    return json.dumps(strip(json.loads(text)))


def layer_policies(model: keras.Model) -> dict[str, str]:
    inner = model.get_layer("inner")
    return {layer.name: layer.dtype_policy.name for layer in [*model.layers[1:], *inner.layers] if layer is not inner}


def write_npz(settings: Settings) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = np.eye(CLASSES, dtype=np.float32)[rng.integers(0, CLASSES, BATCH)]
    settings.data_root.mkdir(parents=True, exist_ok=True)
    np.savez(settings.data_root / "batch.npz", x=x, y=y)
    return x, y


@pytest.mark.parametrize("policy", POLICIES)
def test_functional_model_with_a_nested_sequential_trains_under_every_policy(
    train: Train, settings: Settings, policy: str
) -> None:
    x, y = write_npz(settings)  # one batch: step 1's loss is the mean over exactly these samples
    spec = spec_of(model={"keras_json": classifier("mixed_float16").to_json(), "loss": "categorical_crossentropy"},
                   precision_policy=policy, training={"steps": 2, "batch_size": BATCH},
                   dataset={"kind": "npz", "path": "batch.npz"})
    result, reporter = train(spec)
    assert result.status == "succeeded" and result.model_path is not None
    assert "half_precision_output" not in {d.code for d in result.summary.diagnoses}  # the head stayed float32

    reference = classifier(policy)
    reference.set_weights(initial_weights(spec))
    probs = np.asarray(reference.predict_on_batch(x), dtype=np.float64)  # compiled, as the train step is
    expected = -np.mean(np.sum(y * np.log(probs), axis=1))
    assert reporter.records[0].loss == pytest.approx(expected, rel=LOSS_REL_TOL)

    saved = keras.models.load_model(result.model_path, compile=False)
    assert layer_policies(saved) == {"hidden": policy, "inner_a": policy, "inner_b": policy, "probs": "float32"}
    assert layer_policies(saved) == layer_policies(reference)


@pytest.mark.parametrize("policy", HALF_POLICIES)
@pytest.mark.parametrize("dtype_form", ["DTypePolicy", "name"])
def test_a_layer_pinned_to_float32_keeps_it(policy: str, dtype_form: str) -> None:
    text = classifier("mixed_float16").to_json()
    text = plain_dtypes(text) if dtype_form == "name" else text
    built = build_model(spec_of(model={"keras_json": text, "loss": "categorical_crossentropy"},
                                precision_policy=policy), on_cpu_tf=True)
    assert layer_policies(built.model) == {"hidden": policy, "inner_a": policy, "inner_b": policy, "probs": "float32"}
    assert built.output_dtype == "float32"
    out = keras.ops.convert_to_numpy(built.model(np.ones((2, FEATURES), np.float32)))
    assert str(out.dtype) == "float32"


@pytest.mark.parametrize("policy", HALF_POLICIES)
@pytest.mark.parametrize("dtype_form", ["DTypePolicy", "name"])
def test_a_model_of_one_dtype_takes_the_policy_in_every_layer(policy: str, dtype_form: str) -> None:
    text = classifier("float32").to_json()  # its float32 head cannot be told from the default
    text = plain_dtypes(text) if dtype_form == "name" else text
    built = build_model(spec_of(model={"keras_json": text, "loss": "categorical_crossentropy"},
                                precision_policy=policy), on_cpu_tf=True)
    assert layer_policies(built.model) == dict.fromkeys(["hidden", "inner_a", "inner_b", "probs"], policy)
    assert built.output_dtype == COMPUTE[policy]
    out = keras.ops.convert_to_numpy(built.model(np.ones((2, FEATURES), np.float32)))
    assert str(out.dtype) == COMPUTE[policy]


def test_built_in_models_keep_their_float32_head() -> None:
    built = build_model(spec_of(model={"name": "mlp", "input_dim": 4, "hidden_units": 8},
                                precision_policy="float16"), on_cpu_tf=True)
    assert built.model.get_layer("probs").dtype_policy.name == "float32"
    assert built.output_dtype == "float32"


def test_a_float32_job_does_not_round_a_nested_model_to_float16() -> None:
    """The nested Sequential's own input layer was made in float16 under mixed_float16."""
    built = build_model(spec_of(model={"keras_json": classifier("mixed_float16").to_json(),
                                       "loss": "categorical_crossentropy"}), on_cpu_tf=True)
    reference = classifier("float32")
    reference.set_weights(built.model.get_weights())
    x = np.random.default_rng(0).standard_normal((16, FEATURES)).astype(np.float32) * 3
    np.testing.assert_allclose(keras.ops.convert_to_numpy(built.model(x)),
                               keras.ops.convert_to_numpy(reference(x)), rtol=1e-6, atol=1e-7)


# --- regularizers under float16 and bfloat16 -----------------------------------

L2_RATE, L1_RATE, ACTIVITY_RATE = 0.01, 0.02, 0.001


def regularized() -> str:
    return str(keras.Sequential([
        keras.Input((FEATURES,)),
        layers.Dense(5, activation="tanh", kernel_regularizer=keras.regularizers.L2(L2_RATE),
                     bias_regularizer=keras.regularizers.L1(L1_RATE), bias_initializer="ones", name="weights"),
        layers.Dense(2, activity_regularizer=keras.regularizers.L2(ACTIVITY_RATE), name="activity"),
    ]).to_json())


@pytest.mark.parametrize("policy", ["float16", "bfloat16"])
def test_regularized_model_trains_and_saves_in_half_precision(train: Train, policy: str) -> None:
    spec = spec_of(model={"keras_json": regularized(), "loss": "mse"}, precision_policy=policy,
                   training={"steps": 3, "batch_size": BATCH}, dataset={"samples": 32})
    result, reporter = train(spec)
    assert result.status == "succeeded" and result.model_path is not None
    assert [r.step for r in reporter.records] == [1, 2, 3]
    assert all(r.loss is not None for r in reporter.records)
    saved = keras.models.load_model(result.model_path, compile=False)
    weights, activity = saved.get_layer("weights").get_config(), saved.get_layer("activity").get_config()
    assert (weights["kernel_regularizer"]["module"], weights["kernel_regularizer"]["class_name"]) == (
        "keras.regularizers", "L2")
    assert activity["activity_regularizer"]["class_name"] == "L2"
    assert activity["activity_regularizer"]["config"]["l2"] == pytest.approx(ACTIVITY_RATE)
    assert "mpjobs" not in json.dumps(saved.get_config())


@pytest.mark.parametrize("policy", ["float16", "bfloat16", "mixed_float16"])
def test_penalties_are_computed_in_float32(policy: str) -> None:
    built = build_model(spec_of(model={"keras_json": regularized(), "loss": "mse"}, precision_policy=policy),
                        on_cpu_tf=True)
    kernel, bias = built.model.get_layer("weights").kernel, built.model.get_layer("weights").bias
    # 30 weights of 60: their sum of squares, 108000, is beyond float16's largest value, 65504.
    kernel.assign(np.full((FEATURES, 5), 60.0))
    k64, b64 = (keras.ops.convert_to_numpy(v.value).astype(np.float64) for v in (kernel, bias))
    expected = [L2_RATE * np.sum(k64**2), L1_RATE * np.sum(np.abs(b64))]

    variables = built.model.trainable_variables
    assert [variables[i].path for i, _ in built.penalties] == [kernel.path, bias.path]
    for (index, penalty), want in zip(built.penalties, expected, strict=True):
        for value in (variables[index].value, keras.ops.convert_to_numpy(variables[index].value)):
            got = penalty(value)
            assert keras.backend.standardize_dtype(got.dtype) == "float32"
            assert float(got) == pytest.approx(want, rel=1e-6)

    x = np.random.default_rng(1).standard_normal((4, FEATURES)).astype(np.float32)
    out = keras.ops.convert_to_numpy(built.model(x)).astype(np.float64)
    keras_losses = built.model.losses  # what Keras adds to the float32 data loss
    assert {keras.backend.standardize_dtype(loss.dtype) for loss in keras_losses} == {"float32"}
    activity = ACTIVITY_RATE * np.sum(out**2) / len(x)
    assert sorted(float(loss) for loss in keras_losses) == pytest.approx(sorted([*expected, activity]), rel=1e-5)


JAX_SCRIPT = """
import json, sys, tempfile
import numpy as np, keras
from app.core.config import Settings
from mpjobs.contract.spec import JobSpec
from worker.engine.training import run_job
from worker.engine.models import build_model
from worker.telemetry.reporters import ListReporter

spec = JobSpec.model_validate({"model": {"keras_json": sys.argv[1], "loss": "mse"}, "precision_policy": "float16",
                               "training": {"steps": 2, "batch_size": 8}, "dataset": {"samples": 16}})
built = build_model(spec, on_cpu_tf=False)
variables = built.model.trainable_variables
penalties = [(str(penalty(variables[i].value).dtype), float(penalty(variables[i].value)),
              np.asarray(variables[i].value).astype(np.float64).tolist()) for i, penalty in built.penalties]
reporter = ListReporter()
result = run_job(spec, reporter=reporter, checkpoint_dir=tempfile.mkdtemp(), settings=Settings(speed_check_steps=0))
print(json.dumps({"penalties": penalties, "status": result.status, "losses": [r.loss for r in reporter.records]}))
"""


@pytest.mark.processes
def test_penalties_work_on_jax_arrays_and_train_under_jax() -> None:
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", JAX_SCRIPT, regularized()], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout.strip().splitlines()[-1])
    (k_dtype, k_value, kernel), (b_dtype, b_value, bias) = data["penalties"]
    assert (k_dtype, b_dtype) == ("float32", "float32")
    assert k_value == pytest.approx(L2_RATE * np.sum(np.square(kernel)), rel=1e-6)
    assert b_value == pytest.approx(L1_RATE * np.sum(np.abs(bias)), rel=1e-6)
    assert data["status"] == "succeeded" and None not in data["losses"]


# --- loss names ------------------------------------------------------------------


@pytest.mark.parametrize(("alias", "name"), [
    ("bce", "binary_crossentropy"), ("BinaryCrossentropy", "binary_crossentropy"), ("mse", "mean_squared_error"),
    ("MAE", "mean_absolute_error"),
])
def test_a_loss_alias_gets_the_labels_of_its_long_name(alias: str, name: str) -> None:
    spec = spec_of(model={"keras_json": regularized(), "loss": alias})
    assert spec.model.loss == name  # type: ignore[union-attr]
    x, y = synthetic((FEATURES,), (2,), spec.model.loss, 16, 0)  # type: ignore[union-attr]
    np.testing.assert_array_equal(y, synthetic((FEATURES,), (2,), name, 16, 0)[1])
    if name == "binary_crossentropy":
        assert set(np.unique(y)) <= {0.0, 1.0}


def test_a_job_with_a_loss_alias_trains(train: Train) -> None:
    spec = spec_of(model={"keras_json": regularized(), "loss": "mse"}, training={"steps": 2, "batch_size": BATCH},
                   dataset={"samples": 16})
    result, reporter = train(spec)
    assert result.status == "succeeded" and len(reporter.records) == 2

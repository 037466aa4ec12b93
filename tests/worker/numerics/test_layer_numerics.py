"""Per-layer numerics on nets where the answer is known by construction, each number checked against a
plain GradientTape on the same weights and batch (never the engine's own helpers)."""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from app.core.config import Settings
from mpjobs.contract.records import LayerCheck, LayerNumerics
from mpjobs.contract.spec import JobSpec
from tests.worker.conftest import Train, initial_weights
from tests.worker.numerics.test_numerics import npz_spec

TINY = 2.0**-20
"""Times the gradient flowing back through it (about 2^-6 here) is below half of float16's smallest
subnormal, so float16 flushes it to zero; the activations it makes stay representable."""


def rescaling_net(policy: str, scale: float, names: tuple[str, ...]) -> keras.Model:
    """Input -> Dense `d1` -> Dense `below` -> Rescaling(scale) -> Dense `above` -> Dense `head` -> softmax."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        inputs = keras.Input((16,))
        x = keras.layers.Dense(32, activation="relu", name=names[0])(inputs)
        x = keras.layers.Dense(32, activation="relu", name=names[1])(x)
        x = keras.layers.Rescaling(scale, name=names[2])(x)
        x = keras.layers.Dense(32, activation="relu", name=names[3])(x)
        x = keras.layers.Dense(10, name=names[4])(x)
        outputs = keras.layers.Activation("softmax", dtype="float32", name="probs")(x)
        return keras.Model(inputs, outputs)
    finally:
        keras.config.set_dtype_policy(previous)


def tape_numbers(model: keras.Model, x: np.ndarray, y: np.ndarray) -> dict[str, dict[str, Any]]:
    """Per layer, with a plain GradientTape: its weights' gradient and the gradient reaching its output."""
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    probe = keras.Model(model.inputs[0], [layer.output for layer in layers])
    with tf.GradientTape() as tape:
        outputs = probe(x, training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, outputs[-1]))
    weight_grads, signals = tape.gradient(loss, [[v for layer in layers for v in layer.trainable_variables],
                                                 list(outputs)])
    out, i = {}, 0
    for layer, output, signal in zip(layers, outputs, signals, strict=True):
        n = len(layer.trainable_variables)
        grads = [tf.cast(g, tf.float64).numpy().ravel() for g in weight_grads[i:i + n]]
        i += n
        out[layer.name] = {"grads": np.concatenate(grads) if grads else np.zeros(0),
                           "signal": np.zeros(output.shape) if signal is None else signal.numpy(),
                           "activation": output.numpy()}
    return out


def by_name(check: LayerCheck) -> dict[str, LayerNumerics]:
    return {layer.name: layer for layer in check.layers}


@pytest.fixture
def rescaling_job(settings: Settings) -> tuple[JobSpec, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)
    names = ("d1", "below", "tiny", "above", "head")
    model_json = rescaling_net("float32", TINY, names).to_json()
    spec = npz_spec(settings, "tiny", x, y, {"keras_json": model_json, "loss": "sparse_categorical_crossentropy"},
                    precision_policy="mixed_float16", loss_scale="none")
    return spec, x, y


def test_underflow_begins_at_the_layer_below_a_tiny_rescaling(train: Train, rescaling_job: Any) -> None:
    spec, x, y = rescaling_job
    weights = [w.astype(np.float32) for w in initial_weights(spec)]
    names = ("d1", "below", "tiny", "above", "head")
    expected = {}
    for policy in ("mixed_float16", "float32"):
        model = rescaling_net(policy, TINY, names)
        model.set_weights(weights)
        expected[policy] = tape_numbers(model, x, y)
    half, full = expected["mixed_float16"], expected["float32"]

    def signal_excess(name: str) -> float:
        p, r = half[name]["signal"], full[name]["signal"]
        return float(np.mean((p == 0) & (r != 0)))

    # By construction: the gradient reaching `below`'s output is the one reaching `tiny`'s times 2^-20.
    assert signal_excess("below") > 0.9 and signal_excess("d1") > 0.9
    assert signal_excess("tiny") == signal_excess("above") == signal_excess("head") == 0.0

    result, reporter = train(spec)
    (check,) = reporter.layer_checks
    assert check.step == 1 and check.underflow_layer == "below"
    got = by_name(check)
    assert [layer.name for layer in check.layers] == ["d1", "below", "tiny", "above", "head", "probs"]
    for name in ("d1", "below", "tiny", "above", "head"):
        layer, g_half, g_full = got[name], half[name]["grads"], full[name]["grads"]
        assert layer.signal_excess_zero_fraction == pytest.approx(signal_excess(name), abs=0.02), name
        if not g_half.size:
            assert layer.values == 0 and layer.grad_norm is None
            continue
        assert layer.values == g_half.size
        assert layer.zero_fraction == pytest.approx(np.mean(g_half == 0), abs=0.02), name
        assert layer.excess_zero_fraction == pytest.approx(np.mean((g_half == 0) & (g_full != 0)), abs=0.02), name
        assert layer.grad_norm == pytest.approx(float(np.linalg.norm(g_half)), rel=0.02, abs=1e-9), name
        nonzero = np.abs(g_half[g_half != 0])
        if nonzero.size:
            assert layer.grad_max_log2 == pytest.approx(math.log2(nonzero.max()), abs=0.1), name
            assert layer.grad_min_log2 == pytest.approx(math.log2(nonzero.min()), abs=0.5), name
        activation = np.abs(half[name]["activation"].astype(np.float64))
        assert layer.activation_dtype == "float16"
        assert layer.activation_max == pytest.approx(float(activation.max()), rel=1e-3), name
        assert layer.activation_subnormal_fraction == pytest.approx(
            float(np.mean((activation > 0) & (activation < 2.0**-14))), abs=0.02), name

    assert result.summary.underflow_layer == "below" and result.summary.underflow_step == 1
    named = {d.code: d for d in result.summary.diagnoses}
    diagnosis = named["layer_underflow"]
    assert diagnosis.layer == "below" and diagnosis.first_step == 1
    assert "begins at layer `below`" in diagnosis.message and "every layer below it inherits zeros" in diagnosis.message
    assert named["gradient_underflow"].layer == "below"


def test_overflow_headroom_is_reported_at_the_loud_layer(train: Train, settings: Settings) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)

    def net(policy: str, loud: float) -> keras.Model:
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            inputs = keras.Input((16,))
            h = keras.layers.Dense(16, name="dense_in")(inputs)
            h = keras.layers.Rescaling(loud, name="loud")(h)
            h = keras.layers.Rescaling(1.0 / loud, name="quiet")(h)
            h = keras.layers.Dense(10, name="head")(h)
            return keras.Model(inputs, keras.layers.Activation("softmax", dtype="float32", name="probs")(h))
        finally:
            keras.config.set_dtype_policy(previous)

    # Size `loud` so that its activations land at about 50,000, past a quarter of float16's 65,504.
    probe_spec = npz_spec(settings, "loud", x, y, {"keras_json": net("float32", 1.0).to_json(),
                                                   "loss": "sparse_categorical_crossentropy"},
                          precision_policy="mixed_float16")
    first = net("float32", 1.0)
    first.set_weights([w.astype(np.float32) for w in initial_weights(probe_spec)])
    loud = 50_000.0 / float(np.abs(first.get_layer("dense_in")(x)).max())
    spec = npz_spec(settings, "loud", x, y, {"keras_json": net("float32", loud).to_json(),
                                             "loss": "sparse_categorical_crossentropy"},
                    precision_policy="mixed_float16")
    half = net("mixed_float16", loud)
    half.set_weights([w.astype(np.float32) for w in initial_weights(spec)])
    expected = {name: float(np.abs(v.numpy().astype(np.float64)).max())
                for name, v in zip(("dense_in", "loud", "quiet"),
                                   keras.Model(half.inputs[0], [half.get_layer(n).output for n in
                                                             ("dense_in", "loud", "quiet")])(x), strict=True)}
    assert 65504 / 4 < expected["loud"] < 65504 and expected["dense_in"] < 100 and expected["quiet"] < 100

    result, reporter = train(spec)
    (check,) = reporter.layer_checks
    assert check.overflow_layer == "loud"
    got = by_name(check)
    for name, peak in expected.items():
        assert got[name].activation_max == pytest.approx(peak, rel=1e-3), name
        assert got[name].activation_headroom_log2 == pytest.approx(math.log2(65504 / peak), abs=0.01), name
    assert got["loud"].activation_headroom_log2 < 2 <= got["dense_in"].activation_headroom_log2
    diagnosis = {d.code: d for d in result.summary.diagnoses}["activation_overflow_risk"]
    assert diagnosis.layer == "loud" and result.summary.overflow_layer == "loud"
    assert f"reach {expected['loud']:,.5g}" in diagnosis.message and "one more doubling overflows" in diagnosis.message


def test_layer_checks_follow_their_interval_and_cost_nothing_when_off(train: Train) -> None:
    base = {"model": {"name": "mlp", "hidden_units": 8}, "dataset": {"samples": 64}}
    off, off_reporter = train(JobSpec.model_validate({**base, "precision_policy": "mixed_float16",
                                                      "training": {"steps": 4, "layer_check_every": 0}}))
    assert off_reporter.layer_checks == [] and off.summary.layer_checks == 0
    assert off.summary.float32_checks == 1  # the float32 check itself still runs
    on, on_reporter = train(JobSpec.model_validate({**base, "precision_policy": "mixed_float16",
                                                    "training": {"steps": 4, "layer_check_every": 2}}))
    assert [c.step for c in on_reporter.layer_checks] == [1, 2, 4] and on.summary.layer_checks == 3
    plain, plain_reporter = train(JobSpec.model_validate({**base, "training": {"steps": 3}}))
    assert plain_reporter.layer_checks == []  # float32 by default: no float32 check, no layer checks
    asked, asked_reporter = train(JobSpec.model_validate({**base, "training": {"steps": 3, "layer_check_every": 3}}))
    assert [c.step for c in asked_reporter.layer_checks] == [1, 3]
    assert all(layer.excess_zero_fraction is None and layer.activation_dtype == "float32"
               for layer in asked_reporter.layer_checks[0].layers)

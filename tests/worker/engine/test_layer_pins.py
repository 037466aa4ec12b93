"""Issue 32, item 2: per-layer policies (`layer_policies`) applied to built-in and keras_json models, nested
ones included, and their numbers checked against a plain GradientTape on a model pinned another way (`dtype=` at
construction), on the same weights and batch."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from app.core.config import Settings
from mpjobs.contract.layer_names import layer_names
from mpjobs.contract.spec import JobSpec
from tests.worker.conftest import Train, initial_weights
from tests.worker.numerics.test_layer_signals import built
from tests.worker.numerics.test_numerics import npz_spec
from worker.engine.models import all_layers, build_model

BUILT_IN = [{"name": "mlp", "input_dim": 8, "hidden_units": 8}, {"name": "cnn", "image_size": 8, "filters": 2},
            {"name": "conv3d_unet", "volume": 4, "filters": 1},
            {"name": "transformer", "seq_len": 4, "vocab_size": 16, "d_model": 8, "heads": 2, "layers": 2,
             "ffn_dim": 8}]


@pytest.mark.parametrize("model", BUILT_IN, ids=lambda m: m["name"])
def test_a_built_in_model_has_the_layer_names_the_api_lists(model: dict[str, Any]) -> None:
    """Built after another model in the same process: Keras's own names would have moved on (dense_2, ...)."""
    spec = JobSpec.model_validate({"model": model})
    build_model(spec, on_cpu_tf=True)
    model = build_model(spec, on_cpu_tf=True).model
    assert [layer.name for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)] == \
        layer_names(spec.model)


def nested(pins: dict[str, str] | None = None) -> keras.Model:
    """d1 -> a Sequential block (wide, then a Rescaling) -> TimeDistributed head over 2 steps -> softmax."""
    pins = pins or {}
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="d1", dtype=pins.get("d1"))(inputs)
    block = keras.Sequential([keras.layers.Dense(32, activation="relu", name="wide", dtype=pins.get("wide")),
                              keras.layers.Rescaling(2.0**-12, name="quiet", dtype=pins.get("quiet"))],
                             name="block")
    x = keras.layers.Reshape((2, 16), name="rows")(block(x))
    x = keras.layers.TimeDistributed(keras.layers.Dense(5, name="per_row", dtype=pins.get("per_row")),
                                     name="steps", dtype=pins.get("steps"))(x)
    x = keras.layers.Flatten(name="flat")(x)
    outputs = keras.layers.Activation("softmax", name="probs", dtype=pins.get("probs"))(x)
    return keras.Model(inputs, outputs, name="outer")


PINS = {"wide": "float32", "quiet": "float32", "per_row": "float32"}


def test_pins_reach_layers_at_every_depth_and_the_numbers_match_a_gradient_tape(
        train: Train, settings: Settings) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)
    spec = npz_spec(settings, "pinned", x, y, {"keras_json": nested().to_json(),
                                               "loss": "sparse_categorical_crossentropy"},
                    precision_policy="mixed_float16", loss_scale="none", layer_policies=PINS)
    model = build_model(spec, on_cpu_tf=True).model
    policies = {layer.name: layer.dtype_policy.name for layer in all_layers(model)}
    assert {name: policies[name] for name in PINS} == PINS
    assert policies["d1"] == policies["block"] == policies["steps"] == "mixed_float16"

    # The same model pinned at construction, on the job's initial weights: step 1's loss and gradient.
    reference = built(lambda: nested(PINS), "mixed_float16")
    reference.set_weights([w.astype(np.float32) for w in initial_weights(spec)])
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy()(y, reference(x, training=True))
    grads = [tf.cast(g, tf.float64).numpy() for g in tape.gradient(loss, reference.trainable_variables)]
    norm = float(np.sqrt(sum(np.sum(np.square(g)) for g in grads)))

    _, reporter = train(spec)
    (record,) = reporter.records
    assert record.loss == pytest.approx(float(loss), rel=1e-3)
    assert record.grad_norm == pytest.approx(norm, rel=1e-3)
    (check,) = reporter.layer_checks
    dtypes = {layer.name: layer.activation_dtype for layer in check.layers}
    assert dtypes["d1"] == "float16" and dtypes["block"] == "float32"  # the block ends in its pinned Rescaling
    assert dtypes["steps"] == "float16"  # the wrapper computes in the job's policy; only its inner Dense is pinned


def test_the_float32_check_still_compares_with_the_all_float32_model(train: Train, settings: Settings) -> None:
    """Pinning every layer to float32 under mixed_float16: the float32 check sees no difference at all."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 16)).astype(np.float32)
    y = rng.integers(0, 10, 16).astype(np.int32)
    everything = dict.fromkeys(["d1", "block", "wide", "quiet", "rows", "steps", "per_row", "flat", "probs"], "float32")
    spec = npz_spec(settings, "all32", x, y, {"keras_json": nested().to_json(),
                                              "loss": "sparse_categorical_crossentropy"},
                    precision_policy="mixed_float16", loss_scale="none", layer_policies=everything)
    _, reporter = train(spec)
    (check,) = reporter.layer_checks
    assert check.underflow_layer is None and check.overflow_layer is None
    for layer in check.layers:
        assert layer.grad_rel_error in (None, pytest.approx(0.0, abs=1e-6)), layer.name
        assert layer.excess_zero_fraction in (None, 0.0), layer.name

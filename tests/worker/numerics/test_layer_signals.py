"""The gradient reaching each layer's output (its signal), measured right on every kind of model: Sequential,
Functional, a model nested in another, a wrapper layer. Each kind is sent as `keras_json`, as users send it, and
each layer's signal zeros are checked against a plain GradientTape on the same weights and batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from app.core.config import Settings
from tests.worker.conftest import Train, initial_weights
from tests.worker.numerics.test_numerics import npz_spec

TINY = 2.0**-20
"""As in test_layer_numerics.py: the gradient flowing back through it falls under float16's smallest subnormal."""


def _head() -> list[keras.layers.Layer]:
    return [keras.layers.Dense(32, activation="relu", name="above"), keras.layers.Dense(10, name="head"),
            keras.layers.Activation("softmax", dtype="float32", name="probs")]


def sequential() -> keras.Model:
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="d1"),
                             keras.layers.Dense(32, activation="relu", name="below"),
                             keras.layers.Rescaling(TINY, name="tiny"), *_head()], name="seq")


def functional() -> keras.Model:
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="below")(x)
    x = keras.layers.Rescaling(TINY, name="tiny")(x)
    for layer in _head():
        x = layer(x)
    return keras.Model(inputs, x, name="fun")


def nested() -> keras.Model:
    """A Sequential block inside a Functional model: the block's output signal is the tiny layer's."""
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    block = keras.Sequential([keras.layers.Dense(32, activation="relu", name="below"),
                              keras.layers.Rescaling(TINY, name="tiny")], name="block")
    x = block(x)
    for layer in _head():
        x = layer(x)
    return keras.Model(inputs, x, name="outer")


def wrapped() -> keras.Model:
    """A TimeDistributed wrapper over 4 time steps, flattened into the same head."""
    return keras.Sequential([keras.Input((4, 16)),
                             keras.layers.TimeDistributed(keras.layers.Dense(8, activation="relu"), name="below"),
                             keras.layers.Rescaling(TINY, name="tiny"), keras.layers.Flatten(name="flat"),
                             *_head()], name="wrapped")


def relu_apart() -> keras.Model:
    """A healthy net whose float32 signals already hold zeros: a separate ReLU and a max-pooling."""
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="pre"),
                             keras.layers.Activation("relu", name="relu"), keras.layers.Reshape((8, 4), name="rows"),
                             keras.layers.MaxPooling1D(2, name="pool"), keras.layers.Flatten(name="flat"),
                             *_head()], name="relu_apart")


KINDS: dict[str, Callable[[], keras.Model]] = {"sequential": sequential, "functional": functional, "nested": nested,
                                               "wrapper": wrapped}


def built(make: Callable[[], keras.Model], policy: str) -> keras.Model:
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return make()
    finally:
        keras.config.set_dtype_policy(previous)


def tape_signals(model: keras.Model, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Each top-level layer called in turn under a plain GradientTape: the gradient of the loss at its output."""
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    with tf.GradientTape() as tape:
        h, outputs = tf.constant(x), []
        for layer in layers:
            h = layer(h, training=True)
            outputs.append(h)
        # Keras's cross-entropy on probabilities, written out: -log(p_y / sum(p)) of the clipped probabilities.
        p = tf.clip_by_value(tf.cast(h, tf.float32), 1e-7, 1 - 1e-7)
        loss = -tf.reduce_mean(tf.math.log(tf.gather(p, y, axis=1, batch_dims=1)) - tf.math.log(tf.reduce_sum(p, 1)))
    return {layer.name: np.asarray(g) for layer, g in zip(layers, tape.gradient(loss, outputs), strict=True)}


def job(settings: Settings, make: Callable[[], keras.Model], policy: str) -> tuple[Any, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    model = built(make, "float32")
    x = rng.standard_normal((32, *model.input_shape[1:])).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int32)
    spec = npz_spec(settings, make.__name__, x, y, {"keras_json": model.to_json(),
                                                   "loss": "sparse_categorical_crossentropy"},
                    precision_policy=policy, loss_scale="none")
    return spec, x, y


def expected(settings: Settings, make: Callable[[], keras.Model]) -> tuple[Any, dict[str, np.ndarray],
                                                                         dict[str, np.ndarray]]:
    """A mixed_float16 job of `make`'s model, and the tape's signals under mixed_float16 and float32 on its
    initial weights and batch."""
    spec, x, y = job(settings, make, "mixed_float16")
    weights = [w.astype(np.float32) for w in initial_weights(spec)]
    signals = []
    for policy in ("mixed_float16", "float32"):
        model = built(make, policy)
        model.set_weights(weights)
        signals.append(tape_signals(model, x, y))
    return spec, signals[0], signals[1]


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_measures_the_signal_a_gradient_tape_sees(train: Train, settings: Settings, kind: str) -> None:
    spec, half, full = expected(settings, KINDS[kind])

    _, reporter = train(spec)
    (check,) = reporter.layer_checks
    got = {layer.name: layer for layer in check.layers}
    assert list(got) == list(half), kind
    for name, signal in half.items():
        layer = got[name]
        assert layer.signal_values == signal.size, (kind, name)
        assert layer.signal_zero_fraction == pytest.approx(np.mean(signal == 0), abs=0.02), (kind, name)
        excess = float(np.mean((signal == 0) & (full[name] != 0)))
        if name == "probs" and layer.signal_excess_zero_fraction is None:
            continue  # float32's cross-entropy reads the softmax's logits: its loss has no path through `probs`
        assert layer.signal_excess_zero_fraction == pytest.approx(excess, abs=0.02), (kind, name)
        assert np.mean(full[name] == 0) < 0.5, (kind, name)  # float32 keeps it: a 1.0 would be a misreading
    # By construction the signal below the tiny layer is lost: underflow begins under it.
    assert np.mean(half["tiny" if kind != "nested" else "block"] == 0) < 0.5
    lost_below = [name for name in half if name not in ("tiny", "block", "flat", "above", "head", "probs")]
    assert all(got[name].signal_excess_zero_fraction > 0.9 for name in lost_below if name != "below" or
               kind != "nested"), {n: got[n].signal_excess_zero_fraction for n in got}
    if kind != "nested":  # a nested block's inner layers are not probed: its own weights lose, not its output
        assert check.underflow_layer == "below", {n: got[n].signal_excess_zero_fraction for n in got}


def test_zeros_float32_already_has_are_not_underflow(train: Train, settings: Settings) -> None:
    """A ReLU apart from its Dense, and a max-pooling, zero much of the signal in float32 too: none of it is
    excess under mixed_float16, and no layer is named."""
    spec, half, full = expected(settings, relu_apart)
    assert np.mean(full["pre"] == 0) > 0.3 and np.mean(full["rows"] == 0) > 0.3  # float32's own zeros

    _, reporter = train(spec)
    (check,) = reporter.layer_checks
    got = {layer.name: layer for layer in check.layers}
    for name, signal in half.items():
        assert got[name].signal_zero_fraction == pytest.approx(np.mean(signal == 0), abs=0.02), name
        if name != "probs":  # as above
            assert got[name].signal_excess_zero_fraction == pytest.approx(0.0, abs=0.02), name
    assert check.underflow_layer is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_float32_job_measures_each_kinds_signal_as_a_gradient_tape_does(train: Train, settings: Settings,
                                                                          kind: str) -> None:
    """Under float32 (layer checks asked for by `layer_check_every`), every layer's signal zeros are float32's."""
    make = KINDS[kind]
    spec, x, y = job(settings, make, "float32")
    spec = spec.model_copy(update={"training": spec.training.model_copy(update={"layer_check_every": 1})})
    model = built(make, "float32")
    model.set_weights([w.astype(np.float32) for w in initial_weights(spec)])
    full = tape_signals(model, x, y)
    _, reporter = train(spec)
    (check,) = reporter.layer_checks
    got = {layer.name: layer for layer in check.layers}
    for name, signal in full.items():
        if name == "probs" and got[name].signal_values == 0:
            continue  # the cross-entropy reads the softmax's logits: no gradient reaches `probs`, measured as none
        assert got[name].signal_values == signal.size, (kind, name)
        assert got[name].signal_zero_fraction == pytest.approx(np.mean(signal == 0), abs=1e-6), (kind, name)
        assert got[name].signal_excess_zero_fraction is None  # no float32 reference under float32

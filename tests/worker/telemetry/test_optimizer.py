"""TelemetryOptimizer: exact numbers, and the same dynamic rule as Keras's own."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from worker.telemetry.batch_loss import BatchLoss
from worker.telemetry.optimizer import TelemetryOptimizer
from worker.telemetry.step_vector import TELEMETRY_FIELDS


def telemetry(opt: TelemetryOptimizer) -> dict[str, float]:
    """The telemetry vector by name, its two-part zero count joined into `zero_count`."""
    t = dict(zip(TELEMETRY_FIELDS, ops.convert_to_numpy(opt.telemetry).tolist(), strict=True))
    t["zero_count"] = t.pop("zeros_high") * 2**24 + t.pop("zeros_low")
    return t


def make(
    mode: str, scale: float = 2.0, growth: int = 2000, size: int = 2
) -> tuple[TelemetryOptimizer, list[keras.Variable]]:
    variables = [keras.Variable(np.ones((size,), np.float32)), keras.Variable(np.ones((size,), np.float32))]
    opt = TelemetryOptimizer(keras.optimizers.SGD(learning_rate=0.5), mode=mode, initial_scale=scale,
                             growth_steps=growth)
    opt.build(variables)
    return opt, variables


def test_scale_loss() -> None:
    assert float(make("fixed", 8.0)[0].scale_loss(2.0)) == 16.0
    assert float(make("dynamic", 2.0**15)[0].scale_loss(1.0)) == 32768.0
    assert float(make("none", 8.0)[0].scale_loss(3.0)) == 3.0


def test_telemetry_of_one_step_is_exact() -> None:
    opt, variables = make("fixed", 2.0)
    opt.scale_loss(ops.convert_to_tensor(1.5))
    opt.apply([ops.convert_to_tensor([6.0, 8.0]), ops.convert_to_tensor([0.0, 0.0])], variables)
    assert telemetry(opt) == {"total_loss": 1.5, "loss_scale": 2.0, "grad_norm": 5.0, "grads_finite": 1.0,
                              "skipped": 0.0, "zero_count": 2, "regularization_loss": 0.0}
    # The unscaled gradient [3, 4] was applied with rate 0.5.
    np.testing.assert_array_equal(ops.convert_to_numpy(variables[0]), [-0.5, -1.0])


@pytest.mark.parametrize(("mode", "skipped"), [("fixed", 1.0), ("dynamic", 1.0), ("none", 0.0)])
def test_non_finite_step(mode: str, skipped: float) -> None:
    opt, variables = make(mode, 4.0)
    opt.apply([ops.convert_to_tensor([np.inf, 1.0]), ops.convert_to_tensor([1.0, 1.0])], variables)
    t = telemetry(opt)
    assert t["grads_finite"] == 0.0 and t["skipped"] == skipped
    applied = not np.array_equal(ops.convert_to_numpy(variables[1]), [1.0, 1.0])
    assert applied is (mode == "none")
    assert float(ops.convert_to_numpy(opt.loss_scale)) == {"fixed": 4.0, "dynamic": 2.0, "none": 1.0}[mode]


def test_both_zero_counts_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    # -0.0 is zero; 1e-30 and -1e-37 are tiny but not zero (float32 normals).
    grads = [ops.convert_to_tensor([6.0, 0.0, 1e-30, -0.0]), ops.convert_to_tensor([-1e-37, 8.0, 0.0, 0.0])]
    by_sign, variables = make("none", size=4)
    by_sign.apply(grads, variables)
    monkeypatch.setattr("worker.telemetry.optimizer.SIGN_COUNT_MAX_ELEMENTS", 0)  # every tensor counts `g == 0`
    by_comparison, variables = make("none", size=4)
    by_comparison.apply(grads, variables)
    assert telemetry(by_sign) == telemetry(by_comparison)
    assert telemetry(by_sign)["zero_count"] == 4 and telemetry(by_sign)["grad_norm"] == 10.0


def test_a_non_finite_step_still_counts_its_zeros() -> None:
    # sign(NaN) is NaN, so this step takes the comparison path: NaN and inf are not zero.
    opt, variables = make("dynamic", 4.0, size=4)
    opt.apply([ops.convert_to_tensor([np.nan, 0.0, 1.0, 0.0]), ops.convert_to_tensor([np.inf, 0.0, 2.0, 3.0])],
              variables)
    t = telemetry(opt)
    assert t["grads_finite"] == 0.0 and t["skipped"] == 1.0 and t["zero_count"] == 3


def test_dynamic_rule_matches_keras_loss_scale_optimizer() -> None:
    ours, our_vars = make("dynamic", 2.0**10, growth=3)
    keras_vars = [keras.Variable(np.ones((2,), np.float32)), keras.Variable(np.ones((2,), np.float32))]
    reference = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5),
                                                    initial_scale=2.0**10, dynamic_growth_steps=3)
    reference.build(keras_vars)
    finite = [1.0, 2.0]
    pattern = [finite, [np.nan, 1.0], finite, finite, finite, finite, [np.inf, 0.0], finite, finite, finite, finite]
    scales = []
    for grad in pattern:
        grads = [ops.convert_to_tensor(grad, "float32"), ops.convert_to_tensor([1.0, 1.0])]
        ours.apply(grads, our_vars)
        reference.apply(grads, keras_vars)
        assert float(ops.convert_to_numpy(ours.loss_scale)) == float(ops.convert_to_numpy(reference.dynamic_scale))
        for a, b in zip(our_vars, keras_vars, strict=True):
            np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
        scales.append(float(ops.convert_to_numpy(ours.loss_scale)))
    assert scales == [1024, 512, 512, 512, 1024, 1024, 512, 512, 512, 1024, 1024]


def test_unknown_mode_says_what_was_expected() -> None:
    with pytest.raises(ValueError, match=r"Expected mode to be one of \('none', 'fixed', 'dynamic'\). "
                                         r"Received: mode='static'"):
        TelemetryOptimizer(keras.optimizers.SGD(), mode="static")


def test_batch_loss_is_the_batch_not_the_running_mean() -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mean_squared_error",
                  metrics=[BatchLoss("mean_squared_error")])
    x = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]], np.float32)
    seen: list[dict[str, float]] = []
    keep = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(dict(logs)))
    model.fit(x, np.zeros((2, 1)), batch_size=1, shuffle=False, verbose=0, callbacks=[keep])
    predictions = ops.convert_to_numpy(model(x))[:, 0]  # the rate is 0: weights never move
    assert seen[0]["batch_loss"] == pytest.approx(predictions[0] ** 2, rel=1e-6)
    assert seen[1]["batch_loss"] == pytest.approx(predictions[1] ** 2, rel=1e-6)
    assert seen[1]["loss"] == pytest.approx((predictions[0] ** 2 + predictions[1] ** 2) / 2, rel=1e-6)


def test_sparse_gradient_counts_and_norms_its_dense_sum() -> None:
    import tensorflow as tf

    # Rows 1 and 3 repeat; 1's two parts cancel to exactly zero once summed, as the update sums them.
    values = np.array([[1.0, 2.0], [-1.0, -2.0], [3.0, 0.0], [4.0, 5.0], [0.5, 0.5]], np.float32)
    indices = np.array([1, 1, 3, 3, 0])
    sparse = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([5, 2]))
    dense = np.zeros((5, 2))
    np.add.at(dense, indices, values.astype(np.float64))
    for mode in ("none", "fixed"):
        opt = TelemetryOptimizer(keras.optimizers.SGD(learning_rate=0.5), mode=mode, initial_scale=4.0)
        variable = keras.Variable(np.zeros((5, 2), np.float32))
        opt.build([variable])
        opt.apply([sparse if mode == "none" else tf.IndexedSlices(sparse.values * 4.0, sparse.indices,
                                                                  sparse.dense_shape)], [variable])
        t = telemetry(opt)
        assert t["zero_count"] == np.sum(dense == 0) == 6
        assert t["grad_norm"] == pytest.approx(np.linalg.norm(dense), rel=1e-7)
        np.testing.assert_allclose(ops.convert_to_numpy(variable), -0.5 * dense, rtol=1e-7)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", [0, 1])
def test_finiteness_is_tested_in_every_tensor(bad: float, where: int) -> None:
    opt, variables = make("dynamic", 4.0, size=3)
    grads = [np.array([1.0, 2.0, 3.0], np.float32), np.array([1e-3, 0.0, 5.0], np.float32)]
    grads[where][1] = bad
    opt.apply([ops.convert_to_tensor(g) for g in grads], variables)
    assert telemetry(opt)["grads_finite"] == 0.0 and telemetry(opt)["skipped"] == 1.0


def test_a_finite_norm_beyond_float32_squares_is_finite_and_exact() -> None:
    # The sum of squares (2e40) overflows float32; the gradient and its norm (1.4e20) do not.
    opt, variables = make("none", size=2)
    grads = [np.array([1e20, -1e19], np.float32), np.array([3e19, 0.0], np.float32)]
    opt.apply([ops.convert_to_tensor(g) for g in grads], variables)
    t = telemetry(opt)
    expected = np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in grads))
    assert t["grads_finite"] == 1.0 and t["grad_norm"] == pytest.approx(expected, rel=1e-6)
    # Tiny gradients, whose squares underflow float32, keep their norm too.
    opt, variables = make("none", size=2)
    opt.apply([ops.convert_to_tensor([3e-30, 4e-30]), ops.convert_to_tensor([0.0, 0.0])], variables)
    assert telemetry(opt)["grad_norm"] == pytest.approx(5e-30, rel=1e-6)


def test_every_value_zero_counts_every_value() -> None:
    opt, variables = make("none", size=4)
    opt.apply([ops.zeros((4,)), ops.zeros((4,))], variables)
    assert telemetry(opt)["zero_count"] == 8 == opt.gradient_elements


def test_pure_float16_statistics_precede_the_cast_back() -> None:
    # At scale 2**20, a float16 gradient of 2**-5 means 2**-25 unscaled: float16 flushes it, float32 keeps it.
    variable = keras.Variable(np.ones((2,), np.float16), dtype="float16")
    opt = TelemetryOptimizer(keras.optimizers.SGD(learning_rate=1.0), mode="fixed", initial_scale=2.0**20)
    opt.build([variable])
    opt.apply([ops.convert_to_tensor(np.array([2.0**-5, 2.0**-5], np.float16))], [variable])
    t = telemetry(opt)
    assert t["zero_count"] == 0 and t["grad_norm"] == pytest.approx(2.0**-25 * np.sqrt(2), rel=1e-7)


def test_penalties_are_reported_at_the_step_s_weights() -> None:
    opt, variables = make("none", size=2)
    opt.penalties = [(1, keras.regularizers.L2(0.5))]
    opt.apply([ops.convert_to_tensor([1.0, 1.0]), ops.convert_to_tensor([1.0, 1.0])], variables)
    assert telemetry(opt)["regularization_loss"] == 0.5 * 2  # at the weights before the update: ones

"""Steps 1 and 2's reported numbers on the layer kinds users bring, each against a plain float32 GradientTape.

Every model is a small `keras_json` (a few hundred weights at most) trained two steps of plain SGD on one
`.npz` batch of 16 (`batch_size` is the sample count, so each step's batch is the whole file, in another
order). Step 2 is taken at the weights the reference's own step 1 gives (w - LR * g, in NumPy): so a
gradient applied still scaled, a frozen layer moved, or an Embedding's repeated rows applied once show at
step 2. LR moves every case's loss by 0.3% to 86% in one step, far past float32's tolerance (asserted): an
update 10% off fails 36 of the 49 cases, every float32 one among them. The job's JSON is
built as Keras's mixed-precision guide has users build it: under `mixed_float16`, a softmax head pinned
to float32 (a float16 softmax's gradient, -1/(16 p), passes 65504 at the dynamic scale 32768 and skips
the step). The reference builds the same layers under float32, takes the job's initial weights, and
differentiates the mean loss with Keras's own `Loss` class, so a mask (an `Embedding(mask_zero=True)`
under an LSTM) weighs the loss as the compiled loss does, plus `model.losses` (the shared layer's L2
penalty, reported once as `regularization_loss` though the layer is called twice). No engine statistic
is used.

Tolerances, by what the policy computes in (docs/numerics.md: every statistic is of the unscaled
gradient in float32, so only the forward and backward passes round):

- float32: the same arithmetic, up to the order of sums (XLA, oneDNN): 1e-5 relative, zeros exact.
- float16 compute: 11 significant bits, a rounding of 2**-11 = 4.9e-4 per op; a few layers deep the
  loss and the norm moved up to 7e-4 in the scan that wrote this file. 1e-2.
- bfloat16 compute: 8 significant bits, 2**-8 = 3.9e-3 per op; up to 4.3e-3 seen. 3e-2.

Step 2's tolerance is `rel x (1 + move)`, `move` being the loss's relative change over step 1: under a
16-bit policy step 1's gradient is off by up to `rel`, so its update is, and step 2's loss moves by that
share of `move` beyond its own rounding (pure bfloat16 `conv1d`, whose loss falls 86% in one step, is 4%
off at step 2).

A gradient value that is zero in exact arithmetic (a bias under a BatchNormalization, which subtracts
the batch mean; a MultiHeadAttention key bias, which softmax cannot see) is rounding noise, exactly zero
or not depending on the order of sums, even in float32. The layers under a normalization have no bias
(as is usual); the attention's key bias remains, so under a 16-bit compute dtype the zero count may
differ from float32's by `HALF_ZERO_SLACK` values, and so may the attention's under float32 once step 1
has moved its weights (one value, in the scan that wrote this file).
Every tolerance is far below what a wrong number shows: a gradient left scaled (x32768), a frozen or
shared layer counted twice or not at all, a mask ignored (47% off the norm on `masked_lstm`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

from app.core.config import Settings
from mpjobs.contract.spec import JobSpec
from tests.worker.conftest import Train, spec_of
from worker.engine.models import build_model

pytestmark = pytest.mark.slow
"""49 cases, two steps each, against a GradientTape: about 40 s here."""

B = 16
HALF_ZERO_SLACK = 2
"""Gradient values whose zero-ness half-precision rounding may flip (module docstring)."""
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 3e-2}
"""Relative tolerance of the loss and the gradient norm, by compute dtype (module docstring)."""
LR = 0.1
"""SGD's learning rate: one step moves each case's loss by more than a 16-bit tolerance (asserted), while the
16-bit gradient's rounding moves step 2's weights by LR x 1e-2 x |g| at most."""

Case = tuple[keras.Model, str, np.ndarray, np.ndarray]


def _regression(inputs: tuple[int, ...], outputs: int, *stack: keras.layers.Layer) -> Case:
    rng = np.random.default_rng(0)
    model = keras.Sequential([keras.Input(inputs), *stack])
    assert model.output_shape == (None, outputs)
    return (model, "mean_squared_error", rng.standard_normal((B, *inputs)).astype(np.float32),
            rng.standard_normal((B, outputs)).astype(np.float32))


def _classes(inputs: tuple[int, ...], *stack: keras.layers.Layer, scale: float = 1.0) -> Case:
    rng = np.random.default_rng(1)
    model = keras.Sequential([keras.Input(inputs), *stack, layers.Dense(3),
                              layers.Activation("softmax", dtype="float32")])
    x = (rng.standard_normal((B, *inputs)) * scale + 1.0).astype(np.float32)
    return model, "sparse_categorical_crossentropy", x, rng.integers(0, 3, B).astype(np.int32)


def _functional(build: Callable[[keras.KerasTensor], keras.KerasTensor]) -> Case:
    rng = np.random.default_rng(2)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, build(inputs))
    return (model, "mean_squared_error", rng.standard_normal((B, 6)).astype(np.float32),
            rng.standard_normal((B, 2)).astype(np.float32))


def _shared(inputs: keras.KerasTensor) -> keras.KerasTensor:
    # Its kernel's gradient sums both uses; its penalty counts once.
    twice = layers.Dense(6, activation="tanh", name="twice", kernel_regularizer=keras.regularizers.L2(0.05))
    return layers.Dense(2)(twice(twice(inputs)))


def _nested(inputs: keras.KerasTensor) -> keras.KerasTensor:
    inner = keras.Sequential([keras.Input((6,)), layers.Dense(5, activation="tanh"), layers.Dense(4)], name="inner")
    return layers.Dense(2)(inner(inputs))


def _attention() -> Case:
    rng = np.random.default_rng(3)
    inputs = keras.Input((4, 8))
    x = layers.MultiHeadAttention(2, 4)(inputs, inputs)
    model = keras.Model(inputs, layers.Dense(1)(layers.GlobalAveragePooling1D()(x)))
    return (model, "mean_squared_error", rng.standard_normal((B, 4, 8)).astype(np.float32),
            rng.standard_normal((B, 1)).astype(np.float32))


def _masked_lstm() -> Case:
    """Padded token sequences: the loss of the padded time steps is masked out of the mean."""
    rng = np.random.default_rng(4)
    model = keras.Sequential([keras.Input((6,), dtype="int32"), layers.Embedding(10, 4, mask_zero=True),
                              layers.LSTM(5, return_sequences=True), layers.TimeDistributed(layers.Dense(3)),
                              layers.Activation("softmax", dtype="float32")])
    x = rng.integers(1, 10, (B, 6)).astype(np.int32)
    x[:, 4:], x[::2, 2:] = 0, 0
    return model, "sparse_categorical_crossentropy", x, rng.integers(0, 3, (B, 6)).astype(np.int32)


def _nested_embedding() -> Case:
    """Token ids into an Embedding inside a nested Sequential: a sparse gradient, rows repeated, most unused."""
    rng = np.random.default_rng(5)
    encoder = keras.Sequential([keras.Input((6,), dtype="int32"), layers.Embedding(40, 4),
                                layers.GlobalAveragePooling1D()], name="encoder")
    inputs = keras.Input((6,), dtype="int32")
    model = keras.Model(inputs, layers.Dense(2)(encoder(inputs)))
    return (model, "mean_squared_error", rng.integers(0, 8, (B, 6)).astype(np.int32),
            rng.standard_normal((B, 2)).astype(np.float32))


ARCHITECTURES: dict[str, Callable[[], Case]] = {
    "lstm": lambda: _regression((5, 3), 2, layers.LSTM(6), layers.Dense(2)),
    "gru": lambda: _regression((5, 3), 2, layers.GRU(6), layers.Dense(2)),
    "simple_rnn": lambda: _regression((5, 3), 2, layers.SimpleRNN(6), layers.Dense(2)),
    "bidirectional_lstm": lambda: _regression((5, 3), 2, layers.Bidirectional(layers.LSTM(4)), layers.Dense(2)),
    "masked_lstm": _masked_lstm,
    # Moving statistics are non-trainable: updated by the step, never counted as gradients.
    "batch_normalization": lambda: _classes((6,), layers.Dense(8, use_bias=False), layers.BatchNormalization(),
                                            layers.Activation("relu"), scale=3.0),
    "layer_normalization": lambda: _regression((6,), 2, layers.Dense(8, use_bias=False), layers.LayerNormalization(),
                                               layers.Dense(2)),
    "group_normalization": lambda: _regression((8,), 2, layers.Dense(8, use_bias=False),
                                               layers.GroupNormalization(groups=2), layers.Dense(2)),
    "unit_normalization": lambda: _regression((6,), 2, layers.Dense(8), layers.UnitNormalization(), layers.Dense(2)),
    "multi_head_attention": _attention,
    "conv1d": lambda: _regression((10, 2), 2, layers.Conv1D(4, 3, activation="relu"), layers.GlobalMaxPooling1D(),
                                  layers.Dense(2)),
    "conv2d_batch_normalization": lambda: _classes((6, 6, 2), layers.Conv2D(4, 3, use_bias=False),
                                                   layers.BatchNormalization(), layers.Activation("relu"),
                                                   layers.Flatten()),
    "time_distributed": lambda: _regression((4, 3), 2, layers.TimeDistributed(layers.Dense(5)), layers.Flatten(),
                                            layers.Dense(2)),
    "shared_layer": lambda: _functional(_shared),
    "nested_sequential": lambda: _functional(_nested),
    "nested_embedding": _nested_embedding,
    # A frozen layer's weights are neither trained nor counted; its bias kills most ReLUs, so the next
    # kernel has zero rows and the zero fraction depends on what is counted.
    "frozen_layer": lambda: _regression((6,), 2, layers.Dense(8, activation="relu", trainable=False,
                                                              bias_initializer=keras.initializers.Constant(-1.5)),
                                        layers.Dense(2)),
}
PURE = {
    # Pure 16-bit variables: LSTM, GRU and SimpleRNN cannot be built in bfloat16 (their Orthogonal
    # initializer has no bfloat16 kernel: unsupported_precision_on_device), so the cheap others.
    "float16": ("conv2d_batch_normalization", "shared_layer", "nested_sequential", "lstm"),
    "bfloat16": ("batch_normalization", "conv1d", "multi_head_attention"),
}
MIXED_BFLOAT16 = ("lstm", "masked_lstm", "batch_normalization", "multi_head_attention", "conv2d_batch_normalization",
                  "shared_layer", "nested_sequential", "frozen_layer")
"""bfloat16 rounds like float16, only coarser, through the same code: half the kinds, to keep the file cheap."""
FIXED = ("masked_lstm", "batch_normalization", "shared_layer", "nested_embedding", "frozen_layer")
"""Fixed scaling (1024) unscales in the inner optimizer, not in LossScaleOptimizer: step 2 shows it unscaled."""
POLICIES = ([(name, policy, scale) for name in ARCHITECTURES
             for policy, scale in (("float32", "none"), ("mixed_float16", "dynamic"))]
            + [(name, "mixed_bfloat16", "none") for name in MIXED_BFLOAT16]
            + [(name, "mixed_float16", "fixed") for name in FIXED] + [("nested_sequential", "float16", "fixed")]
            + [(name, "float16", "dynamic") for name in PURE["float16"]]
            + [(name, "bfloat16", "none") for name in PURE["bfloat16"]])


def built_under(policy: str, name: str) -> Case:
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return ARCHITECTURES[name]()
    finally:
        keras.config.set_dtype_policy(previous)


def job(settings: Settings, name: str, policy: str, loss_scale: str) -> tuple[JobSpec, Case]:
    """The job (its JSON built under mixed_float16), and the same layers built under float32 for the reference.

    The float32 and layer checks are off: they are not what is reported here (tests/worker/numerics/test_numerics.py and
    test_layer_numerics.py check them), and they would double the file's time.
    """
    model, loss, x, y = built_under("mixed_float16", name)
    settings.data_root.mkdir(parents=True, exist_ok=True)
    np.savez(Path(settings.data_root) / f"{name}.npz", x=x, y=y)
    spec = spec_of(model={"keras_json": str(model.to_json()), "loss": loss},
                   dataset={"kind": "npz", "path": f"{name}.npz"},
                   training={"steps": 2, "batch_size": B, "optimizer": "sgd", "learning_rate": LR,
                             "underflow_check_every": 0},
                   precision_policy=policy, loss_scale=loss_scale)
    return spec, (built_under("float32", name)[0], loss, x, y)


Step = tuple[float, float | None, list[np.ndarray]]
"""A step's float32 data loss, weight penalties (None without) and the gradient of their sum (float64 arrays)."""


def reference(spec: JobSpec, case: Case) -> tuple[Step, Step]:
    """Steps 1 and 2: at the job's initial weights, then after one plain SGD step (w - LR * g)."""
    keras.utils.set_random_seed(spec.training.seed)
    initial = build_model(spec, on_cpu_tf=True).model.get_weights()  # get_weights: an RNN's seed state is no weight
    model, loss_name, x, y = case
    model.set_weights([w.astype(np.float32) for w in initial])
    loss = {"mean_squared_error": keras.losses.MeanSquaredError(),
            "sparse_categorical_crossentropy": keras.losses.SparseCategoricalCrossentropy()}[loss_name]

    def step() -> Step:
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
            penalty = sum(model.losses, tf.constant(0.0))
            total = value + penalty
        grads = [tf.convert_to_tensor(g).numpy().astype(np.float64)
                 for g in tape.gradient(total, model.trainable_variables)]
        return float(value), float(penalty) if model.losses else None, grads

    first = step()
    for variable, grad in zip(model.trainable_variables, first[2], strict=True):
        variable.assign((variable.numpy().astype(np.float64) - LR * grad).astype(np.float32))
    return first, step()


@pytest.mark.parametrize(("name", "policy", "loss_scale"), POLICIES)
def test_steps_one_and_two_match_a_float32_gradient_tape(train: Train, settings: Settings, name: str, policy: str,
                                                  loss_scale: str) -> None:
    spec, case = job(settings, name, policy, loss_scale)
    steps = reference(spec, case)
    (first_loss, _, first_grads), (second_loss, _, _) = steps
    zeros_at_one = sum(int(np.sum(g == 0)) for g in first_grads)
    if name == "frozen_layer":
        assert zeros_at_one >= 8, "the case is what it says: dead units leave zero rows in the trainable kernel"
    if name == "nested_embedding":
        assert zeros_at_one == (40 - 8) * 4, "the case is what it says: 32 of the 40 rows unused"
    rel, move = TOLERANCE[spec.precision_policy.compute_dtype], abs(second_loss - first_loss) / first_loss
    assert move > 100 * TOLERANCE["float32"], "the case is what it says: under float32, step 1's update shows"

    _, reporter = train(spec)
    assert [r.step for r in reporter.records] == [1, 2]
    for record, (expected_loss, penalty, grads), tolerance in zip(reporter.records, steps, (rel, rel * (1 + move)),
                                                                  strict=True):
        values = sum(g.size for g in grads)
        zeros = sum(int(np.sum(g == 0)) for g in grads)
        norm = float(np.sqrt(sum(np.sum(np.square(g)) for g in grads)))
        at = f"step {record.step}"
        assert record.grads_finite and not record.skipped, at
        assert record.loss_scale == {"none": 1.0, "fixed": 1024.0, "dynamic": 32768.0}[loss_scale], at  # unchanged
        assert record.loss == pytest.approx(expected_loss, rel=tolerance), at
        assert record.regularization_loss == (None if penalty is None else pytest.approx(penalty, rel=tolerance)), at
        assert record.grad_norm == pytest.approx(norm, rel=tolerance), at
        slack = 0 if policy == "float32" and name != "multi_head_attention" else HALF_ZERO_SLACK
        assert abs(record.zero_grad_fraction * values - zeros) <= slack + 1e-9, (at, record.zero_grad_fraction, zeros)

"""Issue 32, items 3 and 4 (the engine's part): precision plans on models where the right plan is known by
construction, each as a Sequential and as a Functional `keras_json`. The proposed plan must pin exactly the
layers the construction says, and the planned run must lose no gradient values that float32 keeps and overflow
nowhere: checked with a plain GradientTape on the model pinned with `dtype=`, against float32's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from app.core.config import Settings
from mpjobs.contract.plan import keras_lines, spec_fragment
from mpjobs.contract.spec import JobSpec
from tests.worker.conftest import Train, initial_weights
from tests.worker.numerics.test_numerics import npz_spec


def dense(units: int, activation: str | None = None) -> Callable[[str, str | None], keras.layers.Layer]:
    return lambda name, dtype: keras.layers.Dense(units, activation=activation, name=name, dtype=dtype)


def rescale(factor: float) -> Callable[[str, str | None], keras.layers.Layer]:
    return lambda name, dtype: keras.layers.Rescaling(factor, name=name, dtype=dtype)


CASES: dict[str, dict[str, Any]] = {
    # 2^17 times activations of about 1 pass 65,504 in float16; the next layer brings them back. Pinning the loud
    # layer alone hands its float32 output to a float16 consumer, which overflows: both must be in float32.
    "overflow": {"layers": [("pre", dense(16, "relu")), ("loud", rescale(2.0**17)), ("quiet", rescale(2.0**-17)),
                            ("head", dense(5)), ("probs", lambda n, d: keras.layers.Activation("softmax", name=n,
                                                                                               dtype="float32"))],
                 "loss": "sparse_categorical_crossentropy", "scale": "dynamic", "pins": ["loud", "quiet"]},
    # A tiny Rescaling: 2^-28 times activations of about 1 is zero in float16, and the layer above scales back.
    "tiny": {"layers": [("pre", dense(16, "relu")), ("tiny", rescale(2.0**-28)), ("back", rescale(2.0**28)),
                        ("after", dense(16, "relu")), ("head", dense(5)),
                        ("probs", lambda n, d: keras.layers.Activation("softmax", name=n, dtype="float32"))],
             "loss": "sparse_categorical_crossentropy", "scale": "dynamic", "pins": ["tiny", "back"]},
    # The mean of 32 x 4096 outputs scaled by 2^-10: every output's gradient is 2^-27, under float16's smallest
    # subnormal (2^-24), while every activation is a normal float16. A loss scale alone brings them back.
    "scale only": {"layers": [("d1", dense(32, "relu")), ("wide", dense(4096)), ("out", rescale(2.0**-10))],
                   "loss": "output_mean", "scale": "none", "pins": []},
}


def build(case: dict[str, Any], kind: str, pins: dict[str, str] | None = None) -> keras.Model:
    pins = pins or {}
    layers = [make(name, pins.get(name)) for name, make in case["layers"]]
    if kind == "sequential":
        return keras.Sequential([keras.Input((8,)), *layers], name="seq")
    inputs = keras.Input((8,))
    x = inputs
    for layer in layers:
        x = layer(x)
    return keras.Model(inputs, x, name="fun")


def gradients(model: keras.Model, x: np.ndarray, y: np.ndarray, loss: str, scale: float) -> list[np.ndarray]:
    with tf.GradientTape() as tape:
        out = tf.cast(model(x, training=True), tf.float32)
        value = tf.reduce_mean(out) if loss == "output_mean" else \
            keras.losses.SparseCategoricalCrossentropy()(y, out)
        scaled = value * scale
    return [tf.cast(g, tf.float64).numpy() / scale for g in tape.gradient(scaled, model.trainable_variables)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sequential", "functional"])
@pytest.mark.parametrize("name", CASES)
def test_the_plan_is_the_one_the_construction_says_and_the_planned_step_matches_float32(
        train: Train, settings: Settings, name: str, kind: str) -> None:
    case = CASES[name]
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.5, (32, 8)).astype(np.float32)
    y = rng.integers(0, 5, 32).astype(np.int32)
    model_json = build(case, kind).to_json()
    spec = npz_spec(settings, f"plan-{kind}", x, y, {"keras_json": model_json, "loss": case["loss"]},
                    precision_policy="mixed_float16", loss_scale=case["scale"])
    _, reporter = train(spec)
    first = reporter.layer_checks[0]
    assert first.underflow_layer or first.overflow_layer, "the case is what it says: the check flags it"
    plan = first.plan
    assert plan is not None and plan.holds, plan
    assert list(plan.layer_policies) == case["pins"], plan.moves
    assert all(v == "float32" for v in plan.layer_policies.values())
    if not case["pins"]:
        assert plan.proposed_scale is not None and plan.message.startswith("A loss scale alone suffices")
    assert plan.moves[0].flagged and not plan.moves[-1].flagged  # the search's record: from flagged to none

    # The planned step, computed apart from the engine: the model pinned with dtype=, at the plan's scale.
    scale = plan.proposed_scale or plan.loss_scale
    weights = [w.astype(np.float32) for w in initial_weights(spec)]
    previous = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy("mixed_float16")
        planned, unplanned = build(case, kind, plan.layer_policies), build(case, kind)
        keras.config.set_dtype_policy("float32")
        reference = build(case, kind)
    finally:
        keras.config.set_dtype_policy(previous)
    for m in (planned, unplanned, reference):
        m.set_weights(weights)
    full = gradients(reference, x, y, case["loss"], 1.0)
    ref = np.concatenate([g.ravel() for g in full])

    def lost(grads: list[np.ndarray]) -> float:
        flat = np.concatenate([g.ravel() for g in grads])
        return float(np.mean(~np.isfinite(flat) | ((flat == 0) & (ref != 0))))

    assert lost(gradients(unplanned, x, y, case["loss"], plan.loss_scale)) > 0.05  # without the plan: lost
    grads = gradients(planned, x, y, case["loss"], scale)
    got = np.concatenate([g.ravel() for g in grads])
    assert np.isfinite(got).all()
    # Per layer, the layer_underflow thresholds restated (docs/numerics.md): under 5% or under 16 values lost.
    at = 0
    for layer in planned.layers:
        n = len(layer.trainable_variables)
        mine = [(g.ravel(), r.ravel()) for g, r in zip(grads[at:at + n], full[at:at + n], strict=True)]
        at += n
        values = sum(g.size for g, _ in mine)
        gone = sum(int(np.sum((g == 0) & (r != 0))) for g, r in mine)
        assert gone < 16 or gone / values < 0.05, (layer.name, gone, values)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= plan.max_grad_rel_error
    activations = planned(x, training=True)
    assert np.isfinite(np.asarray(tf.cast(activations, tf.float32))).all()

    # The plan as a spec fragment: the engine's own run of it flags nothing at the same step.
    fragment = spec_fragment(plan, spec.loss_scale.mode if spec.loss_scale else "none")
    _, again = train(JobSpec.model_validate({**spec.model_dump(mode="json"), **fragment}))
    check = again.layer_checks[0]
    assert check.underflow_layer is None and check.overflow_layer is None, check
    assert ("model.get_layer(name).dtype_policy" in keras_lines(plan)) == bool(case["pins"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["overflow", "scale only"])
def test_a_plan_auto_job_trains_with_the_plan_of_its_own_step_one(train: Train, settings: Settings, name: str) -> None:
    """Item 4's engine: `plan: "auto"` finds the plan the policy's own job finds at step 1, and trains with it."""
    case = CASES[name]
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.5, (32, 8)).astype(np.float32)
    y = rng.integers(0, 5, 32).astype(np.int32)
    spec = npz_spec(settings, "auto", x, y, {"keras_json": build(case, "functional").to_json(), "loss": case["loss"]},
                    precision_policy="mixed_float16", loss_scale=case["scale"], training={"steps": 2})
    _, policy = train(spec)
    result, planned = train(spec.model_copy(update={"plan": "auto"}))
    plan = result.summary.plan
    assert plan is not None and plan == policy.layer_checks[0].plan.model_copy(update={"evaluated": plan.evaluated})
    assert list(plan.layer_policies) == case["pins"]
    first = planned.layer_checks[0]  # the planned model's own check of the same step
    assert first.underflow_layer is None and first.overflow_layer is None, first
    assert result.summary.underflow_layer is None and result.summary.overflow_layer is None
    assert planned.records[0].loss_scale == (plan.proposed_scale or plan.loss_scale)
    dtypes = {layer.name: layer.activation_dtype for layer in first.layers}
    assert all(dtypes[n] == "float32" for n in case["pins"])


def test_a_clean_step_gets_the_plan_that_says_nothing_is_needed(train: Train, settings: Settings) -> None:
    """`plan: "auto"` on a model float16 handles as it is: no pins, no scale, and the plan says so."""
    spec = JobSpec.model_validate({"model": {"name": "mlp", "input_dim": 8, "hidden_units": 8},
                                   "precision_policy": "mixed_float16", "loss_scale": "dynamic", "plan": "auto",
                                   "training": {"steps": 1}})
    result, reporter = train(spec)
    plan = result.summary.plan
    assert plan is not None and plan.holds and plan.layer_policies == {} and plan.proposed_scale is None
    assert plan.message == "Nothing needs pinning at step 1: the step matches float32 as it is."
    assert [m.flagged for m in plan.moves] == [[]] and reporter.layer_checks[0].underflow_layer is None


def test_the_search_runs_on_a_model_whose_copies_name_their_sublayers_anew(
        train: Train, caplog: pytest.LogCaptureFixture) -> None:
    """The transformer's PositionEmbedding names its inner Embedding itself: a pinned copy built in the same
    session holds `embedding_2` where the job's model holds `embedding`. The search maps the weights by
    position, so it runs (by path, it failed on a KeyError and the job had no plan)."""
    spec = JobSpec.model_validate({"model": {"name": "transformer", "seq_len": 16, "vocab_size": 50, "d_model": 16,
                                             "heads": 2, "layers": 1, "ffn_dim": 16},
                                   "precision_policy": "mixed_float16", "plan": "auto", "dataset": {"samples": 64},
                                   "training": {"steps": 2}})
    result, reporter = train(spec)
    plan = result.summary.plan
    assert plan is not None and plan.moves, "the search ran"
    assert not [r for r in caplog.records if "plan" in r.getMessage().lower() and r.levelname in ("WARNING", "ERROR")]
    assert reporter.records[-1].step == 2

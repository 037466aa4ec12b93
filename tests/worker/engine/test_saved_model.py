"""model.keras loads with plain `keras.models.load_model`, compiled, in an interpreter that has no mpjobs code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from app.core.notes import spec_notes
from tests.processes.plain_keras import expected_loss, load_plainly, same_bytes, try_loads
from tests.worker.conftest import Train, spec_of, trained_weights
from worker.engine import checkpoint

pytestmark = pytest.mark.processes

def keras_json_model() -> str:
    """A user's own model, of Keras's classes only: float16 inside, its output pinned to float32 as Keras advises."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((6,))
        x = keras.layers.Dense(8, activation="relu")(inputs)
        outputs = keras.layers.Dense(2, dtype="float32")(x)
        return str(keras.Model(inputs, outputs).to_json())
    finally:
        keras.mixed_precision.set_global_policy("float32")


MLP = {"name": "mlp", "input_dim": 12, "hidden_units": 8, "classes": 3}
CASES = {
    "mlp-mixed_float16-dynamic": dict(model=MLP, precision_policy="mixed_float16",
                                      loss_scale={"mode": "dynamic", "initial_scale": 256, "growth_steps": 2}),
    "mlp-mixed_float16-fixed": dict(model=MLP, precision_policy="mixed_float16",
                                    loss_scale={"mode": "fixed", "scale": 64}, training={"optimizer": "sgd"}),
    "mlp-float32-none": dict(model=MLP, precision_policy="float32", loss_scale="none",
                             training={"optimizer": "rmsprop"}),
    "cnn-float32-none": dict(model={"name": "cnn", "image_size": 8, "filters": 2, "classes": 2},
                             precision_policy="float32", loss_scale="none", training={"optimizer": "adamw"}),
}
OPTIMIZER_CLASSES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop"}


@pytest.mark.parametrize("case", [*CASES, "keras_json-mixed_float16-dynamic"])
def test_model_keras_loads_compiled_with_plain_keras(train: Train, tmp_path: Path, case: str) -> None:
    if case.startswith("keras_json"):
        fields: dict[str, Any] = dict(model={"keras_json": keras_json_model(),
                                             "loss": "mean_squared_error"},
                                      precision_policy="mixed_float16", loss_scale={"mode": "dynamic",
                                                                                    "initial_scale": 512})
    else:
        fields = dict(CASES[case])
    training = {"steps": 5, "batch_size": 4, "learning_rate": 0.01, **fields.pop("training", {})}
    spec = spec_of(**fields, training=training, dataset={"samples": 32})
    result, reporter = train(spec)
    assert result.status == "succeeded" and result.model_path is not None

    report, loaded = load_plainly(result.model_path, tmp_path / "fresh")

    assert report["mpjobs_importable"] is False
    assert report["compiled"] is True
    loss = spec.model.loss if case.startswith("keras_json") else "sparse_categorical_crossentropy"  # type: ignore[union-attr]
    assert report["loss"] == loss
    inner_class = OPTIMIZER_CLASSES[spec.training.optimizer]
    assert report["inner"] == inner_class
    assert report["learning_rate"] == np.float32(spec.training.learning_rate)
    assert report["iterations"] == spec.training.steps
    last = reporter.records[-1]
    mode = spec.loss_scale.mode if spec.loss_scale is not None else "none"
    if mode == "dynamic":
        assert report["optimizer"] == "LossScaleOptimizer"
        assert report["initial_scale"] == report["dynamic_scale"] == last.loss_scale
        assert report["growth_steps"] == spec.loss_scale.growth_steps  # type: ignore[union-attr]
        assert report["loss_scale_factor"] is None
    else:
        assert report["optimizer"] == inner_class
        assert report["loss_scale_factor"] == (last.loss_scale if mode == "fixed" else None)

    # The job's final weights, byte for byte, and the inner optimizer's trained state (moments, iterations).
    saved = checkpoint.load(result.checkpoint_path.parent)
    assert saved is not None and saved.step == spec.training.steps
    weights = [loaded[f"weight_{i}"] for i in range(sum(k.startswith("weight_") for k in loaded))]
    assert same_bytes(weights, trained_weights(result))
    inner = [loaded[f"inner_{i}"] for i in range(sum(k.startswith("inner_") for k in loaded))]
    assert inner and same_bytes(inner, saved.optimizer_values[-len(inner):])

    assert report["evaluate"] == pytest.approx(expected_loss(loss, loaded["pred"], loaded["y"]), rel=1e-4)
    assert np.isfinite(report["fit_loss"]) and report["iterations_after_fit"] == 1


def test_a_dynamic_scale_that_grew_is_the_one_saved(train: Train, tmp_path: Path) -> None:
    """Five steps at growth_steps 2 double the scale twice: the saved scale is the grown one, not the initial."""
    spec = spec_of(**CASES["mlp-mixed_float16-dynamic"], training={"steps": 5, "batch_size": 4},
                   dataset={"samples": 32})
    result, reporter = train(spec)
    assert [r.loss_scale for r in reporter.records] == [256.0, 256.0, 512.0, 512.0, 1024.0]
    assert result.model_path is not None
    report, _ = load_plainly(result.model_path, tmp_path / "fresh")
    assert report["dynamic_scale"] == report["initial_scale"] == 1024.0


@pytest.mark.parametrize(("model", "missing", "uncompiled"), [
    ({"name": "transformer", "seq_len": 4, "vocab_size": 8, "d_model": 8, "heads": 1, "layers": 1, "ffn_dim": 8,
      "classes": 2}, "PositionEmbedding", False),
    ({"name": "conv3d_unet", "volume": 8, "filters": 2, "reference_edge": 8}, "ScanVoxelSum", True),
])
def test_a_model_of_mpjobs_classes_loads_only_as_its_note_says(train: Train, tmp_path: Path, model: dict[str, Any],
                                                                missing: str, uncompiled: bool) -> None:
    spec = spec_of(model=model, precision_policy="float32", training={"steps": 1, "batch_size": 2},
                   dataset={"samples": 4})
    [note] = spec_notes(spec)
    assert missing in note
    result, _ = train(spec)
    assert result.model_path is not None
    answers = try_loads(result.model_path, tmp_path / "fresh")
    assert f"Could not locate class '{missing}'" in answers["True"]
    assert (answers["False"] == "loaded") is uncompiled, answers["False"]
    assert ("not even with compile=False" in note) is not uncompiled

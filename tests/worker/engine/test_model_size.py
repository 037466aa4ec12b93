"""The API's size estimate of each built-in model (app/core/model_size.py) against the model Keras builds."""

from __future__ import annotations

import math
from typing import Any

import pytest

from app.core.model_size import builtin_size, training_memory
from mpjobs.contract.spec import JobSpec
from tests.worker.conftest import spec_of
from worker.engine.memory import activation_elements
from worker.engine.models import build_model

CONFIGS: list[dict[str, Any]] = [
    {"name": "mlp"},
    {"name": "mlp", "input_dim": 3, "hidden_units": 1, "classes": 2},
    {"name": "mlp", "input_dim": 1000, "hidden_units": 777, "classes": 13},
    {"name": "cnn"},
    {"name": "cnn", "image_size": 9, "filters": 1, "classes": 2},
    {"name": "cnn", "image_size": 30, "filters": 5, "classes": 7},
    {"name": "conv3d_unet"},
    {"name": "conv3d_unet", "volume": 4, "filters": 1},
    {"name": "conv3d_unet", "volume": 10, "filters": 3},
    {"name": "transformer"},
    {"name": "transformer", "seq_len": 2, "vocab_size": 2, "d_model": 8, "heads": 1, "layers": 1, "ffn_dim": 8,
     "classes": 2},
    {"name": "transformer", "seq_len": 12, "vocab_size": 97, "d_model": 24, "heads": 3, "layers": 3, "ffn_dim": 40,
     "dropout": 0.1, "classes": 5},
]


def built(model: dict[str, Any], policy: str = "float32") -> Any:
    return build_model(spec_of(model=model, precision_policy=policy), on_cpu_tf=True).model


def config_id(model: dict[str, Any]) -> str:
    return "-".join(str(v) for v in model.values())


@pytest.mark.parametrize("model", CONFIGS, ids=config_id)
def test_parameters_and_activations_are_those_of_the_built_model(model: dict[str, Any]) -> None:
    size = builtin_size(spec_of(model=model).model)
    keras_model = built(model)
    assert size.parameters == keras_model.count_params()
    assert size.trainable == sum(math.prod(v.shape) for v in keras_model.trainable_variables)
    assert size.activations == activation_elements(keras_model)


def test_the_activations_count_every_layer_output() -> None:
    """An mlp counted by hand: input 5, Dense 4, Dense 3, softmax 3."""
    assert activation_elements(built({"name": "mlp", "input_dim": 5, "hidden_units": 4, "classes": 3})) == 15


def test_the_float16_cpu_fallback_builds_the_same_model() -> None:
    """Under float16 on a CPU, MaxPooling3D is rebuilt in float32: same weights, same count."""
    model = {"name": "conv3d_unet", "volume": 6, "filters": 2}
    assert builtin_size(spec_of(model=model).model).parameters == built(model, "float16").count_params()


def test_memory_adds_weights_gradients_slots_twin_and_activations() -> None:
    """mlp 10-20-2: 262 parameters; 10 + 20 + 2 + 2 = 34 activations per sample."""
    spec = JobSpec.model_validate({"model": {"name": "mlp", "input_dim": 10, "hidden_units": 20, "classes": 2},
                                   "precision_policy": "mixed_float16", "training": {"batch_size": 8}})
    memory = training_memory(spec)
    assert memory is not None
    assert (memory.weights, memory.gradients, memory.optimizer_slots) == (262 * 4, 262 * 4, 262 * 2 * 4)
    assert memory.float32_twin == 4 * (262 + 3 * 262) + 8 * 34 * 4 * 2
    assert memory.activations == 8 * 34 * 2 * 2  # float16 activations, kept and their gradients
    pure = JobSpec.model_validate({**spec.model_dump(mode="json"), "precision_policy": "float16",
                                   "training": {"batch_size": 8, "optimizer": "rmsprop", "underflow_check_every": 0}})
    memory = training_memory(pure)
    assert memory is not None
    assert (memory.weights, memory.optimizer_slots, memory.float32_twin) == (262 * 2, 262 * 2, 0)

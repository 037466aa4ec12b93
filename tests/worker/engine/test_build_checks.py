"""What `build_model` refuses, through `run_job`: ops with no kernel for the dtype, and models
the engine cannot train on generated data."""

from __future__ import annotations

from pathlib import Path

import keras
import pytest
import tensorflow as tf
from keras import layers

from app.core.errors import JobFailed
from mpjobs.contract.jobs import FailureReason
from tests.worker.conftest import Train, spec_of
from worker.engine.failures import missing_kernel
from worker.engine.models import build_model


def failure_of(train: Train, tmp_path: Path, text: str, policy: str = "float32", loss: str = "mse") -> JobFailed:
    spec = spec_of(model={"keras_json": text, "loss": loss}, precision_policy=policy,
                   training={"steps": 2, "batch_size": 4}, dataset={"samples": 8})
    with pytest.raises(JobFailed) as raised:
        train(spec, out=tmp_path / "out")
    return raised.value


def lstm() -> str:
    return str(keras.Sequential([keras.Input((5, 4)), layers.LSTM(3), layers.Dense(2)]).to_json())


# --- no kernel for the dtype -----------------------------------------------------


def test_lstm_under_bfloat16_fails_while_building_as_unsupported_precision(train: Train, tmp_path: Path) -> None:
    # Its Orthogonal recurrent initializer runs a QR, and TensorFlow's Qr has no bfloat16 at all.
    failure = failure_of(train, tmp_path, lstm(), "bfloat16")
    assert failure.reason is FailureReason.UNSUPPORTED_PRECISION_ON_DEVICE
    assert "no bfloat16 kernel for op Qr on any device" in failure.message
    assert "Fix: use float32" in failure.message and "mixed policy" in failure.message


def test_lstm_builds_under_the_mixed_policy_the_fix_names() -> None:
    built = build_model(spec_of(model={"keras_json": lstm(), "loss": "mse"}, precision_policy="mixed_bfloat16"),
                        on_cpu_tf=True)
    assert built.model.get_layer(index=0).dtype_policy.name == "mixed_bfloat16"


def test_an_op_refused_while_training_names_the_op(train: Train, tmp_path: Path) -> None:
    # sparsemax builds a float16 Range, which TensorFlow's Range does not accept.
    text = keras.Sequential([keras.Input((6,)), layers.Dense(4, activation="sparsemax"), layers.Dense(2)]).to_json()
    failure = failure_of(train, tmp_path, str(text), "float16")
    assert failure.reason is FailureReason.UNSUPPORTED_PRECISION_ON_DEVICE
    assert "op Range" in failure.message and "Fix:" in failure.message


def raised_by(run: object) -> Exception:
    with pytest.raises(Exception) as raised:
        run()  # type: ignore[operator]
    return raised.value


@pytest.mark.parametrize(("make_error", "names"), [
    (lambda: raised_by(lambda: tf.linalg.qr(tf.zeros((2, 2), tf.bfloat16))), "op Qr on any device"),
    (lambda: raised_by(lambda: tf.function(tf.linalg.qr)(tf.zeros((2, 2), tf.bfloat16))),
     "the op that takes parameter 'input' on any device"),
    (lambda: raised_by(lambda: tf.nn.max_pool3d(tf.zeros((1, 2, 2, 2, 1), tf.float16), 2, 2, "VALID")),
     "op MaxPool3D on this cpu"),
])
def test_every_wording_of_a_missing_kernel_is_recognised(make_error: object, names: str) -> None:
    failure = missing_kernel(make_error(), "bfloat16", "tensorflow", "cpu")  # type: ignore[operator]
    assert failure is not None and failure.reason is FailureReason.UNSUPPORTED_PRECISION_ON_DEVICE
    assert names in failure.message


@pytest.mark.parametrize("text", [
    "Value passed to parameter 'x' has DataType int32 not in list of allowed values: float32",
    "Incompatible shapes: [4,3] vs. [4,2]",
])
def test_other_errors_are_not_taken_for_a_missing_kernel(text: str) -> None:
    assert missing_kernel(ValueError(text), "float16", "tensorflow", "cpu") is None


# --- models the engine cannot train ----------------------------------------------


def test_an_open_input_dimension_is_an_invalid_model(train: Train, tmp_path: Path) -> None:
    text = keras.Sequential([keras.Input((None, 8)), layers.Dense(3), layers.GlobalAveragePooling1D()]).to_json()
    failure = failure_of(train, tmp_path, str(text))
    assert failure.reason is FailureReason.INVALID_MODEL
    assert failure.message.startswith("model.keras_json input has shape (None, None, 8): every dimension but the "
                                      "batch must be fixed, because mpjobs generates synthetic data of that shape.")
    assert "Received: input" in failure.message
    assert not (tmp_path / "out").exists()


def test_a_model_with_no_trainable_weights_is_an_invalid_model(train: Train, tmp_path: Path) -> None:
    text = keras.Sequential([keras.Input((4,)), layers.Dense(3, trainable=False), layers.Activation("relu")]).to_json()
    failure = failure_of(train, tmp_path, str(text))
    assert failure.reason is FailureReason.INVALID_MODEL
    assert "must have trainable weights" in failure.message
    assert "Received: 2 weights, none trainable" in failure.message


def test_a_sequential_without_an_input_shape_is_an_invalid_model(train: Train, tmp_path: Path) -> None:
    failure = failure_of(train, tmp_path, str(keras.Sequential([layers.Dense(3)]).to_json()))
    assert failure.reason is FailureReason.INVALID_MODEL
    assert "must declare its input shape" in failure.message

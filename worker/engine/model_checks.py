"""What the engine can train: one fixed-shape numeric input and output, classes for a class loss, weights."""

from __future__ import annotations

import keras

from app.core.errors import InvalidModel
from mpjobs.contract.keras_io import not_one_input_and_output

_NUMERIC_KINDS = ("float", "bfloat", "int", "uint", "bool")


_CLASS_LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy")


def check_trainable(model: keras.Model, source: str, loss_name: str) -> None:
    """Refuse what the engine cannot train on generated data: open or empty shapes, several inputs or outputs,
    non-numeric inputs, a class loss without classes, nothing to train."""
    if not model.built:
        raise InvalidModel(f"{source} must declare its input shape: start it with keras.Input(shape). "
                           f"Received: a {type(model).__name__} that was never built.")
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        outputs = getattr(model, "output_names", None) or [t.name for t in model.outputs]  # a Functional's layers
        raise InvalidModel(not_one_input_and_output(source, [t.name for t in model.inputs], list(outputs)))
    for kind, tensors in (("input", model.inputs), ("output", model.outputs)):
        for tensor in tensors:
            dtype = keras.backend.standardize_dtype(tensor.dtype)
            if not dtype.startswith(_NUMERIC_KINDS):
                raise InvalidModel(
                    f"{source} {kind} {tensor.name!r} has dtype {dtype!r}: mpjobs trains on numbers (synthetic data "
                    f"or .npz arrays), so every {kind} must be a float or an integer (token ids, with an Embedding). "
                    f"Received: dtype={dtype!r}")
            shape = tuple(tensor.shape)
            if None in shape[1:]:
                raise InvalidModel(
                    f"{source} {kind} has shape {shape}: every dimension but the batch must be fixed, because "
                    f"mpjobs generates synthetic data of that shape. Received: {kind} {tensor.name!r}, shape={shape}"
                )
            if 0 in shape[1:]:
                raise InvalidModel(f"{source} {kind} has shape {shape}: a dimension of size 0 holds no values, so "
                                   f"its mean loss is NaN. Received: {kind} {tensor.name!r}, shape={shape}")
    out_shape = tuple(model.outputs[0].shape)
    if loss_name in _CLASS_LOSSES and (len(out_shape) < 2 or out_shape[-1] < 2):
        raise InvalidModel(
            f"{source} output has shape {out_shape}: loss {loss_name!r} needs a last axis of at least 2 classes "
            f"(one score per class); one class makes the loss 0 for every input. For one yes/no output use "
            f"'binary_crossentropy'. Received: output shape={out_shape}")
    if not model.trainable_weights:
        names = ", ".join(layer.name for layer in model.layers)
        raise InvalidModel(
            f"{source} must have trainable weights: training updates them and reports their gradients. "
            f"Received: {len(model.weights)} weights, none trainable, in layers: {names}"
        )

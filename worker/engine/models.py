"""Build the job's Keras model under its precision policy, and its loss.

Built-in models are plain Keras layers; `keras_json` models come from
worker/engine/keras_json.py, checked and given the job's policy.

Regularizers compute their penalty in float32: Keras adds it to the float32 loss
as it is, and a float16 sum of squares overflows at 65504.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
from keras import layers, ops

from app.core.errors import InvalidModel, JobFailed
from mpjobs.contract.keras_io import not_one_input_and_output
from mpjobs.contract.model_specs import (
    CnnModel,
    Conv3dUnetModel,
    KerasJsonModel,
    MlpModel,
    TransformerModel,
)
from mpjobs.contract.spec import JobSpec
from worker.engine.devices import detect_device
from worker.engine.failures import missing_kernel, out_of_memory
from worker.engine.keras_json import keras_cause, load_keras_json

FLOAT16_MISSING_ON_CPU = ("MaxPooling3D", "AveragePooling3D")
"""Layers whose TensorFlow CPU kernels exist only for float32 and bfloat16."""

Penalty = Callable[[Any], Any]


@dataclass(frozen=True)
class BuiltModel:
    model: keras.Model
    loss: str | Callable[..., Any]
    loss_name: str
    output_dtype: str
    """The dtype of the model's output tensor as built, e.g. "float16" under mixed_float16 without a float32 head."""
    float32_layers: tuple[str, ...] = ()
    """Layers run in float32 because the device has no kernel for the policy."""
    penalties: tuple[tuple[int, Penalty], ...] = ()
    """(index in `model.trainable_variables`, penalty) for each regularized weight. The penalty
    takes the weight's value (a variable, tensor or array) and returns a float32 scalar."""


@keras.saving.register_keras_serializable(package="mpjobs")
class PositionEmbedding(layers.Layer):
    """Adds a learned embedding of each token's position."""

    def __init__(self, seq_len: int, width: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seq_len, self.width = seq_len, width
        self.positions = layers.Embedding(seq_len, width, dtype=self.dtype_policy)

    def build(self, input_shape: Any) -> None:
        self.positions.build((self.seq_len,))

    def call(self, inputs: Any) -> Any:
        return inputs + self.positions(ops.arange(ops.shape(inputs)[1]))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "seq_len": self.seq_len, "width": self.width}


@keras.saving.register_keras_serializable(package="mpjobs")
def output_mean(y_true: Any, y_pred: Any) -> Any:
    """Mean of the model's output: the loss of the zero-gradient report."""
    return ops.mean(ops.cast(y_pred, "float32"))


@keras.saving.register_keras_serializable(package="mpjobs")
class ScanVoxelSum(keras.losses.Loss):
    """Σ outputs / reference_edge³: every voxel's gradient is 1 / reference_edge³."""

    def __init__(self, reference_edge: int = 384, name: str = "scan_voxel_sum", **kw: Any):
        super().__init__(name=name, reduction="sum", **kw)
        self.reference_edge = reference_edge

    def call(self, y_true: Any, y_pred: Any) -> Any:
        per_sample = ops.sum(ops.reshape(ops.cast(y_pred, "float32"), (ops.shape(y_pred)[0], -1)), axis=1)
        return per_sample / float(self.reference_edge) ** 3

    def get_config(self) -> dict[str, Any]:  # no "reduction": always "sum", which from_config would pass twice
        config = {**super().get_config(), "reference_edge": self.reference_edge}
        return {k: v for k, v in config.items() if k != "reduction"}


def _softmax_head(x: Any, classes: int) -> Any:
    # Keras's mixed-precision guide: keep the final softmax in float32.
    return layers.Activation("softmax", dtype="float32", name="probs")(layers.Dense(classes)(x))


def _mlp(m: MlpModel) -> keras.Model:
    inputs = keras.Input((m.input_dim,))
    x = layers.Dense(m.hidden_units, activation="relu")(inputs)
    return keras.Model(inputs, _softmax_head(x, m.classes), name="mlp")


def _cnn(m: CnnModel) -> keras.Model:
    inputs = keras.Input((m.image_size, m.image_size, 3))
    x = layers.Conv2D(m.filters, 3, padding="same", activation="relu")(inputs)
    x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(m.filters * 2, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D()(x)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, _softmax_head(x, m.classes), name="cnn")


def _conv3d_unet(m: Conv3dUnetModel) -> keras.Model:
    inputs = keras.Input((m.volume, m.volume, m.volume, 1))
    skip = layers.Conv3D(m.filters, 3, padding="same")(inputs)
    skip = layers.Activation("relu")(layers.BatchNormalization()(skip))
    x = layers.MaxPooling3D(2)(skip)
    x = layers.Conv3D(m.filters * 2, 3, padding="same")(x)
    x = layers.Activation("relu")(layers.BatchNormalization()(x))
    x = layers.UpSampling3D(2)(x)
    x = layers.Concatenate()([x, skip])
    x = layers.Conv3D(m.filters, 3, padding="same", activation="relu")(x)
    # The output stays in the compute dtype, as in the report.
    outputs = layers.Conv3D(1, 1, name="voxels")(x)
    return keras.Model(inputs, outputs, name="conv3d_unet")


def _transformer(m: TransformerModel) -> keras.Model:
    inputs = keras.Input((m.seq_len,), dtype="int32")
    x = layers.Embedding(m.vocab_size, m.d_model)(inputs)
    x = PositionEmbedding(m.seq_len, m.d_model)(x)
    for _ in range(m.layers):
        attn = layers.MultiHeadAttention(m.heads, m.d_model // m.heads, dropout=m.dropout)(x, x)
        x = layers.LayerNormalization()(x + attn)
        ffn = layers.Dense(m.ffn_dim, activation="gelu")(x)
        ffn = layers.Dropout(m.dropout)(layers.Dense(m.d_model)(ffn))
        x = layers.LayerNormalization()(x + ffn)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, _softmax_head(x, m.classes), name="transformer")


_BUILDERS: dict[type, Callable[[Any], keras.Model]] = {
    MlpModel: _mlp,
    CnnModel: _cnn,
    Conv3dUnetModel: _conv3d_unet,
    TransformerModel: _transformer,
}


def all_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer, breadth first: the model's own, then those inside nested models and wrappers
    (TimeDistributed, Bidirectional), by Keras's public attributes."""
    found = list(model.layers)
    for layer in found:
        found.extend(getattr(layer, "layers", None) or [])
        found.extend(inner for inner in (getattr(layer, "layer", None),) if isinstance(inner, keras.layers.Layer))
    return found


def _in_float32(config: Any, names: tuple[str, ...]) -> None:
    """Set the dtype of the layer configs named `names`, at any depth (nested models), to float32."""
    if isinstance(config, dict):
        inner = config.get("config")
        if (isinstance(inner, dict) and inner.get("name") in names
                and config.get("class_name") in FLOAT16_MISSING_ON_CPU):
            inner["dtype"] = "float32"
        for value in config.values():
            _in_float32(value, names)
    elif isinstance(config, list):
        for value in config:
            _in_float32(value, names)


def _float32_fallback(model: keras.Model, compute_dtype: str, on_cpu_tf: bool) -> tuple[keras.Model, tuple[str, ...]]:
    """Run layers with no float16 CPU kernel in float32, nested ones too (max pooling is exact either way)."""
    if compute_dtype != "float16" or not on_cpu_tf:
        return model, ()
    names = tuple(layer.name for layer in all_layers(model) if type(layer).__name__ in FLOAT16_MISSING_ON_CPU)
    if not names:
        return model, ()
    config = model.get_config()
    _in_float32(config, names)
    rebuilt = model.__class__.from_config(config)
    rebuilt.set_weights(model.get_weights())  # Same initial weights as every other policy.
    return rebuilt, names


_NUMERIC_KINDS = ("float", "bfloat", "int", "uint", "bool")


_CLASS_LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy")


def _check_trainable(model: keras.Model, source: str, loss_name: str) -> None:
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


class _Float32Penalty(keras.regularizers.Regularizer):
    """Calls `regularizer` on a float32 copy of its input, so the penalty is float32."""

    def __init__(self, regularizer: Penalty) -> None:
        self.regularizer = regularizer

    def __call__(self, x: Any) -> Any:
        return self.regularizer(ops.cast(x, "float32"))

    def get_config(self) -> dict[str, Any]:
        return dict(self.regularizer.get_config())  # type: ignore[attr-defined]

    # A layer saves its activity regularizer by class: this one saves as the one it wraps,
    # so model.keras names only Keras's own classes.
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self.regularizer)


def _float32_penalties(model: keras.Model) -> tuple[tuple[int, Penalty], ...]:
    """Make every regularizer compute in float32; return the weights' penalties by variable index."""
    penalties = []
    for index, variable in enumerate(model.trainable_variables):
        if variable.regularizer is not None:
            variable.regularizer = _Float32Penalty(variable.regularizer)
            penalties.append((index, variable.regularizer))
    for layer in model._flatten_layers(include_self=False):  # the layers Keras collects losses from
        if isinstance(getattr(layer, "activity_regularizer", None), keras.regularizers.Regularizer):
            layer.activity_regularizer = _Float32Penalty(layer.activity_regularizer)
    return tuple(penalties)


def build_model(spec: JobSpec, *, on_cpu_tf: bool) -> BuiltModel:
    """Build the spec's model under its policy. Call `keras.utils.set_random_seed` first.

    Raises:
        InvalidModel: a `keras_json` that does not load, or a model this engine cannot train.
        UnsupportedPrecision: an op, even one run while building, has no kernel for the policy's dtype.
    """
    policy, m = spec.precision_policy, spec.model
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy.value)
    try:
        if isinstance(m, KerasJsonModel):
            model = load_keras_json(m, policy)
            loss: str | Callable[..., Any] = output_mean if m.loss == "output_mean" else m.loss
            loss_name: str = m.loss
        else:
            model = _BUILDERS[type(m)](m)
            if isinstance(m, Conv3dUnetModel):
                loss, loss_name = ScanVoxelSum(m.reference_edge), "scan_voxel_sum"
            else:
                loss = loss_name = "sparse_categorical_crossentropy"
        model, float32_layers = _float32_fallback(model, policy.compute_dtype, on_cpu_tf)
    except JobFailed:
        raise
    except Exception as exc:
        # Building runs ops too: LSTM's Orthogonal initializer has no bfloat16 kernel.
        unsupported = missing_kernel(exc, policy.compute_dtype, keras.backend.backend(), detect_device().kind)
        if unsupported is not None:
            raise unsupported from exc
        memory = out_of_memory(exc)
        if memory is not None:
            raise memory from exc
        if isinstance(m, KerasJsonModel):  # Keras raises many types for a bad config.
            raise InvalidModel(f"model.keras_json could not be loaded: {keras_cause(exc)}") from None
        raise
    finally:
        keras.config.set_dtype_policy(previous)
    _check_trainable(model, "model.keras_json" if isinstance(m, KerasJsonModel) else "model", loss_name)
    return BuiltModel(
        model, loss, loss_name, output_dtype=keras.backend.standardize_dtype(model.outputs[0].dtype),
        float32_layers=float32_layers, penalties=_float32_penalties(model),
    )

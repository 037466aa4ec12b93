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
from mpjobs.contract.fp8 import Fp8Layers
from mpjobs.contract.layer_names import BuiltinNames
from mpjobs.contract.model_specs import (
    CnnModel,
    Conv3dUnetModel,
    KerasJsonModel,
    MlpModel,
    TransformerModel,
)
from mpjobs.contract.spec import JobSpec, PrecisionPolicy
from worker.engine.devices import detect_device
from worker.engine.failures import missing_kernel, out_of_memory
from worker.engine.fp8 import apply_fp8
from worker.engine.keras_json import keras_cause, load_keras_json
from worker.engine.model_checks import check_trainable

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
    fp8: Fp8Layers | None = None
    """With `spec.fp8`: the layers that train in FP8 (worker/engine/fp8.py) and those that kept their policy."""


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


def _softmax_head(x: Any, classes: int, n: Callable[[str], str]) -> Any:
    # Keras's mixed-precision guide: keep the final softmax in float32.
    return layers.Activation("softmax", dtype="float32", name=n("probs"))(layers.Dense(classes, name=n("dense"))(x))


# Every layer is named as mpjobs.contract.layer_names.builtin_names lists it, in this order: a name in a
# spec's layer_policies means the same layer in every process, however many models it built before.

def _mlp(m: MlpModel, n: Callable[[str], str]) -> keras.Model:
    inputs = keras.Input((m.input_dim,))
    x = layers.Dense(m.hidden_units, activation="relu", name=n("dense"))(inputs)
    return keras.Model(inputs, _softmax_head(x, m.classes, n), name="mlp")


def _cnn(m: CnnModel, n: Callable[[str], str]) -> keras.Model:
    inputs = keras.Input((m.image_size, m.image_size, 3))
    x = layers.Conv2D(m.filters, 3, padding="same", activation="relu", name=n("conv2d"))(inputs)
    x = layers.MaxPooling2D(name=n("max_pooling2d"))(x)
    x = layers.Conv2D(m.filters * 2, 3, padding="same", activation="relu", name=n("conv2d"))(x)
    x = layers.MaxPooling2D(name=n("max_pooling2d"))(x)
    x = layers.GlobalAveragePooling2D(name=n("global_average_pooling2d"))(x)
    return keras.Model(inputs, _softmax_head(x, m.classes, n), name="cnn")


def _conv_block(x: Any, filters: int, n: Callable[[str], str]) -> Any:
    x = layers.Conv3D(filters, 3, padding="same", name=n("conv3d"))(x)
    return layers.Activation("relu", name=n("activation"))(layers.BatchNormalization(name=n("batch_normalization"))(x))


def _conv3d_unet(m: Conv3dUnetModel, n: Callable[[str], str]) -> keras.Model:
    inputs = keras.Input((m.volume, m.volume, m.volume, 1))
    skip = _conv_block(inputs, m.filters, n)
    x = _conv_block(layers.MaxPooling3D(2, name=n("max_pooling3d"))(skip), m.filters * 2, n)
    x = layers.UpSampling3D(2, name=n("up_sampling3d"))(x)
    x = layers.Concatenate(name=n("concatenate"))([x, skip])
    x = layers.Conv3D(m.filters, 3, padding="same", activation="relu", name=n("conv3d"))(x)
    # The output stays in the compute dtype, as in the report.
    outputs = layers.Conv3D(1, 1, name=n("voxels"))(x)
    return keras.Model(inputs, outputs, name="conv3d_unet")


def _transformer(m: TransformerModel, n: Callable[[str], str]) -> keras.Model:
    inputs = keras.Input((m.seq_len,), dtype="int32")
    x = layers.Embedding(m.vocab_size, m.d_model, name=n("embedding"))(inputs)
    x = PositionEmbedding(m.seq_len, m.d_model, name=n("position_embedding"))(x)
    for _ in range(m.layers):
        attn = layers.MultiHeadAttention(m.heads, m.d_model // m.heads, dropout=m.dropout,
                                         name=n("multi_head_attention"))(x, x)
        x = layers.LayerNormalization(name=n("layer_normalization"))(x + attn)
        ffn = layers.Dense(m.ffn_dim, activation="gelu", name=n("dense"))(x)
        ffn = layers.Dropout(m.dropout, name=n("dropout"))(layers.Dense(m.d_model, name=n("dense"))(ffn))
        x = layers.LayerNormalization(name=n("layer_normalization"))(x + ffn)
    x = layers.GlobalAveragePooling1D(name=n("global_average_pooling1d"))(x)
    return keras.Model(inputs, _softmax_head(x, m.classes, n), name="transformer")


_BUILDERS: dict[type, Callable[[Any, Callable[[str], str]], keras.Model]] = {
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


def _set_dtypes(config: Any, dtypes: dict[str, str]) -> None:
    """Set the dtype of each layer config named in `dtypes`, at any depth (nested models, wrapped layers)."""
    if isinstance(config, dict):
        inner = config.get("config")
        if (isinstance(inner, dict) and inner.get("name") in dtypes
                and not str(config.get("class_name", "")).startswith("DTypePolicy")):
            inner["dtype"] = dtypes[inner["name"]]
        for value in config.values():
            _set_dtypes(value, dtypes)
    elif isinstance(config, list):
        for value in config:
            _set_dtypes(value, dtypes)


def _with_dtypes(model: keras.Model, policy: PrecisionPolicy, pins: dict[str, PrecisionPolicy],
                 on_cpu_tf: bool) -> tuple[keras.Model, tuple[str, ...]]:
    """The model with the spec's per-layer policies (`layer_policies`), and with the layers that have no float16
    CPU kernel in float32 (max pooling is exact either way): rebuilt from its config, with the same weights.
    Returns the model and the layers run in float32 for want of a kernel."""
    fallback = tuple(
        layer.name for layer in all_layers(model) if on_cpu_tf and type(layer).__name__ in FLOAT16_MISSING_ON_CPU
        and pins.get(layer.name, policy).compute_dtype == "float16")
    dtypes = {**{name: pinned.value for name, pinned in pins.items()}, **dict.fromkeys(fallback, "float32")}
    if not dtypes:
        return model, ()
    config = model.get_config()
    _set_dtypes(config, dtypes)
    rebuilt = model.__class__.from_config(config)
    rebuilt.set_weights(model.get_weights())  # Same initial weights as every other policy.
    return rebuilt, fallback


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
            model = _BUILDERS[type(m)](m, BuiltinNames())
            if isinstance(m, Conv3dUnetModel):
                loss, loss_name = ScanVoxelSum(m.reference_edge), "scan_voxel_sum"
            else:
                loss = loss_name = "sparse_categorical_crossentropy"
        model, float32_layers = _with_dtypes(model, policy, spec.layer_policies, on_cpu_tf)
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
    check_trainable(model, "model.keras_json" if isinstance(m, KerasJsonModel) else "model", loss_name)
    fp8 = None if spec.fp8 is None else apply_fp8(model, spec.fp8, policy.value, spec.layer_policies)
    return BuiltModel(
        model, loss, loss_name, output_dtype=keras.backend.standardize_dtype(model.outputs[0].dtype),
        float32_layers=float32_layers, penalties=_float32_penalties(model), fp8=fp8,
    )


def token_ids(model: keras.Model, spec: JobSpec) -> range | None:
    """Synthetic token ids: below every Embedding's input_dim (nested ones' too), so each can take them, and
    from 1 where one masks 0 (padding, which real ids have only at the ends); an .npz has its own."""
    if spec.dataset.kind == "npz" or "int" not in str(model.inputs[0].dtype):
        return None
    embeddings = [layer for layer in all_layers(model) if isinstance(layer, keras.layers.Embedding)]
    if embeddings:
        stop = min(int(layer.input_dim) for layer in embeddings)
        return range(1 if stop > 1 and any(layer.mask_zero for layer in embeddings) else 0, stop)
    raise InvalidModel("model has integer inputs but no Embedding layer to size the synthetic token ids: add one, "
                       "or train on your own ids (dataset.kind 'npz').")

"""The model a job trains: a built-in architecture by name, or a Keras model config checked before Keras sees it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from mpjobs.contract.keras_io import check_one_input_and_output
from mpjobs.contract.strict import Integer, Number, Strict, Text

MAX_KERAS_JSON_CHARS = 1_000_000
"""A model config larger than this is refused before it is parsed."""
MAX_KERAS_JSON_DEPTH = 64
"""Deeper nesting than any real model config; refused before Keras sees it."""
MAX_KERAS_LAYERS = 1000
"""Most layer configs a keras_json may hold: the entries of `config.layers` of the model and of every
model nested in it. Keras loads a Functional model in time that grows with its layers (measured with
keras.saving.deserialize_keras_object(config, safe_mode=True) on one CPU: chains of 100/200/400/800
Dense(4), 0.6/1.0/2.2/4.8 s; ResNet50's 177 layers, 1.4 s; EfficientNetB7's 816, 4.7 s). EfficientNetB7
fits, as an 850 KB body; EfficientNetV2L (1,031) and NASNetLarge (1,041) are over the 1 MiB body anyway."""
MAX_SEQUENTIAL_LAYERS = 200
"""Most layer configs one Sequential may hold. Keras rebuilds a Sequential's graph for every layer it
adds, so its load time grows with the square of its layers (measured as above: 100/200/400 Dense(4),
3.2/17.2/54.1 s; in issue 17's run, 800 took 149 s and 1,500 held a worker 258 s, then failed on
Python's recursion limit)."""
KERAS_MODELS = frozenset({"Sequential", "Functional", "Model"})
KERAS_MODULES = frozenset({
    "keras", "keras.layers", "keras.initializers", "keras.regularizers", "keras.constraints",
    "keras.src.models.functional",  # a Functional nested in a model
    "keras.dtype_policies", "keras.quantizers",  # a model after Model.quantize()
    "keras.optimizers", "keras.optimizers.schedules", "keras.losses", "keras.metrics",  # a compiled model's
    "keras.src.ops.core", "keras.src.ops.einops", "keras.src.ops.image", "keras.src.ops.linalg",  # x + y, keras.ops
    "keras.src.ops.math", "keras.src.ops.nn", "keras.src.ops.numpy",  # on a Functional's tensors
    "keras.src.applications.convnext", "keras.src.applications.inception_resnet_v2",  # their own layers
})
"""Every `module` Keras 3.15 writes in model.to_json(), found by serializing its layers, initializers,
regularizers, constraints, activations, dtype policies, optimizers, losses, metrics, ops and applications
(tests/mpjobs/contract/test_schemas.py::test_every_module_keras_writes_is_allowed_and_each_allowed_one_is_written).
The API never imports Keras, so the list is kept here. A config naming another module is refused."""


# --- model -----------------------------------------------------------------


class MlpModel(Strict):
    name: Literal["mlp"]
    input_dim: Integer = Field(784, ge=1, le=65_536)
    hidden_units: Integer = Field(128, ge=1, le=16_384)
    classes: Integer = Field(10, ge=2, le=10_000)


class CnnModel(Strict):
    name: Literal["cnn"]
    image_size: Integer = Field(32, ge=8, le=512)
    filters: Integer = Field(32, ge=1, le=1024)
    classes: Integer = Field(10, ge=2, le=10_000)


class Conv3dUnetModel(Strict):
    """Conv3D + BatchNorm + MaxPool3D + UpSampling3D, the reported zero-gradient net.

    Its loss is the voxel mean over a full `reference_edge`³ scan of which each
    sample is a `volume`³ crop, so every output voxel gets the gradient
    1 / reference_edge³: at 384³ that is 1.8e-8, below float16's smallest
    subnormal (6e-8), exactly as in the full-size report.
    """

    name: Literal["conv3d_unet"]
    volume: Integer = Field(16, ge=4, le=256, multiple_of=2)
    filters: Integer = Field(8, ge=1, le=256)
    reference_edge: Integer = Field(384, ge=1, le=4096)


class TransformerModel(Strict):
    name: Literal["transformer"]
    seq_len: Integer = Field(64, ge=2, le=8192)
    vocab_size: Integer = Field(1000, ge=2, le=262_144)
    d_model: Integer = Field(64, ge=8, le=8192)
    heads: Integer = Field(4, ge=1, le=128)
    layers: Integer = Field(2, ge=1, le=64)
    ffn_dim: Integer = Field(256, ge=8, le=65_536)
    dropout: Number = Field(0.0, ge=0.0, lt=1.0)
    classes: Integer = Field(10, ge=2, le=10_000)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TransformerModel:
        if self.d_model % self.heads:
            raise ValueError(
                f"model.d_model must be a multiple of model.heads. "
                f"Received: d_model={self.d_model}, heads={self.heads}"
            )
        return self


KerasLoss = Literal[
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
    "mean_squared_error",
    "mean_absolute_error",
    "mean_absolute_percentage_error",
    "mean_squared_logarithmic_error",
    "huber",
    "log_cosh",
    "kl_divergence",
    "hinge",
    "squared_hinge",
    "output_mean",
]
"""Keras's loss functions by name, for which the synthetic data makes fitting labels, and `output_mean`.

Class indices for sparse_categorical_crossentropy, one-hot rows for
categorical_crossentropy, 0/1 for binary_crossentropy, -1/1 for the hinge losses, a
distribution over the last axis for kl_divergence, real values for the rest.
Losses that need other labels (poisson's counts, the focal and ctc losses) are left out.
"""
KERAS_LOSSES: tuple[str, ...] = get_args(KerasLoss)

LOSS_ALIASES: dict[str, str] = {
    "mse": "mean_squared_error",
    "MSE": "mean_squared_error",
    "mae": "mean_absolute_error",
    "MAE": "mean_absolute_error",
    "mape": "mean_absolute_percentage_error",
    "MAPE": "mean_absolute_percentage_error",
    "msle": "mean_squared_logarithmic_error",
    "MSLE": "mean_squared_logarithmic_error",
    "bce": "binary_crossentropy",
    "BCE": "binary_crossentropy",
    "kld": "kl_divergence",
    "KLD": "kl_divergence",
    "SparseCategoricalCrossentropy": "sparse_categorical_crossentropy",
    "CategoricalCrossentropy": "categorical_crossentropy",
    "BinaryCrossentropy": "binary_crossentropy",
    "MeanSquaredError": "mean_squared_error",
    "MeanAbsoluteError": "mean_absolute_error",
    "MeanAbsolutePercentageError": "mean_absolute_percentage_error",
    "MeanSquaredLogarithmicError": "mean_squared_logarithmic_error",
    "Huber": "huber",
    "LogCosh": "log_cosh",
    "KLDivergence": "kl_divergence",
    "Hinge": "hinge",
    "SquaredHinge": "squared_hinge",
}
"""The other names `keras.losses.get` resolves to one of `KerasLoss`: its short names and loss classes.

The API process never imports Keras, so the list is kept here (tests check it against Keras).
"""


class KerasJsonModel(Strict):
    """Bring your own architecture as `model.to_json()`: no code, no Lambda layers.

    `output_mean` is the mean of the model's output, the loss of the
    zero-gradient report; the others are Keras losses by name. A short name or
    class name (`"mse"`, `"MeanSquaredError"`) becomes the long one (`"mean_squared_error"`).
    """

    keras_json: Text = Field(min_length=2, max_length=MAX_KERAS_JSON_CHARS)
    loss: KerasLoss = Field(json_schema_extra={"enum": [*KERAS_LOSSES, *LOSS_ALIASES]})

    @field_validator("keras_json")
    @classmethod
    def _no_code(cls, value: str) -> str:
        check_keras_json(value)
        return value

    @field_validator("loss", mode="before")
    @classmethod
    def _long_loss_name(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        name = LOSS_ALIASES.get(value, value)
        if name not in KERAS_LOSSES:
            shorts = ", ".join(repr(alias) for alias in LOSS_ALIASES if alias.islower())
            raise ValueError(
                f"model.loss must be one of {', '.join(map(repr, KERAS_LOSSES))}, "
                f"or a short name ({shorts}, in either case) or class name ('MeanSquaredError', ...) "
                f"of one of them. Received: loss={value!r}"
            )
        return name


def walk_config(node: Any) -> Iterator[dict[str, Any]]:
    """Every dict in a Keras config, depth first; refuses absurd nesting."""
    return (found for _, found in walk_config_paths(node))


def walk_config_paths(node: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every dict in a Keras config with its path in it (`config.layers[1].config`), depth first."""
    if depth > MAX_KERAS_JSON_DEPTH:
        raise ValueError(f"model.keras_json is nested deeper than {MAX_KERAS_JSON_DEPTH} levels.")
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk_config_paths(value, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from walk_config_paths(value, f"{path}[{index}]", depth + 1)


def check_keras_json(text: str) -> dict[str, Any]:
    """Refuse configs that could run code (Lambda, custom or non-Keras classes), or that Keras would take
    minutes to load (over MAX_KERAS_LAYERS layers, a Sequential over MAX_SEQUENTIAL_LAYERS), before Keras
    parses a single layer."""
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"model.keras_json is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or not _is_model(config):
        raise ValueError(
            "model.keras_json must be a Sequential or Functional model from model.to_json(). "
            f"Received: class_name={config.get('class_name') if isinstance(config, dict) else None!r}"
        )
    for path, node in walk_config_paths(config):
        name = node.get("class_name")
        if name is None:
            continue
        if name == "Lambda":
            raise ValueError(
                "model.keras_json contains a Lambda layer, which runs code; only built-in layers are allowed."
            )
        module = node.get("module", "keras")
        if not isinstance(module, str) or module not in KERAS_MODULES:
            field = f"{path}.module" if path else "module"
            raise ValueError(f"model.keras_json's {field} is {module!r} (for {name!r}); it must be one of Keras's "
                             f"own modules: {', '.join(map(repr, sorted(KERAS_MODULES)))}.")
        registered = node.get("registered_name")
        if registered is not None and registered != name:
            raise ValueError(
                f"model.keras_json uses the custom object {registered!r}; only Keras's own classes are allowed."
            )
    check_one_input_and_output(config)
    count = layer_count(config)
    if count > MAX_KERAS_LAYERS:
        raise ValueError(f"model.keras_json has {count} layer configs (nested models' included); at most "
                         f"{MAX_KERAS_LAYERS} are allowed.")
    return config


def _is_model(node: dict[str, Any]) -> bool:
    name = node.get("class_name")
    return isinstance(name, str) and name in KERAS_MODELS  # a list or dict would not hash


def _layers_of(node: dict[str, Any]) -> list[Any] | None:
    """A model's own layer configs, or None for a layer that is not a model."""
    config = node.get("config")
    layers = config.get("layers") if _is_model(node) and isinstance(config, dict) else None
    return layers if isinstance(layers, list) else None


def layer_count(config: dict[str, Any]) -> int:
    """The layer configs of a model config and of the models nested in it; refuses a Sequential of more than
    MAX_SEQUENTIAL_LAYERS.

    >>> dense = {"class_name": "Dense", "config": {"units": 4}}
    >>> layer_count({"class_name": "Functional", "config": {"layers": [
    ...     dense, {"class_name": "Sequential", "config": {"layers": [dense, dense]}}]}})
    4
    """
    count = 0
    for node in walk_config(config):
        layers = _layers_of(node)
        if layers is None:
            continue
        if node.get("class_name") == "Sequential" and len(layers) > MAX_SEQUENTIAL_LAYERS:
            raise ValueError(f"model.keras_json has a Sequential of {len(layers)} layers; at most "
                             f"{MAX_SEQUENTIAL_LAYERS} are allowed (Keras loads a Sequential in time that grows "
                             "with the square of its layers).")
        count += len(layers)
    return count


def model_tag(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        return "keras_json" if isinstance(value, KerasJsonModel) else value.name  # type: ignore[attr-defined]
    if isinstance(value, dict):
        return "keras_json" if "keras_json" in value else value.get("name")
    return None


ModelSpec = Annotated[
    Annotated[MlpModel, Tag("mlp")]
    | Annotated[CnnModel, Tag("cnn")]
    | Annotated[Conv3dUnetModel, Tag("conv3d_unet")]
    | Annotated[TransformerModel, Tag("transformer")]
    | Annotated[KerasJsonModel, Tag("keras_json")],
    Discriminator(
        model_tag,
        custom_error_type="invalid_model",
        custom_error_message=(
            "model must be {'name': one of 'mlp', 'cnn', 'conv3d_unet', "
            "'transformer'} or {'keras_json': ..., 'loss': ...}"
        ),
    ),
]

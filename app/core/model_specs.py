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

from app.core.strict import Strict

MAX_KERAS_JSON_CHARS = 1_000_000
"""A model config larger than this is refused before it is parsed."""
MAX_KERAS_JSON_DEPTH = 64
"""Deeper nesting than any real model config; refused before Keras sees it."""


# --- model -----------------------------------------------------------------


class MlpModel(Strict):
    name: Literal["mlp"]
    input_dim: int = Field(784, ge=1, le=65_536)
    hidden_units: int = Field(128, ge=1, le=16_384)
    classes: int = Field(10, ge=2, le=10_000)


class CnnModel(Strict):
    name: Literal["cnn"]
    image_size: int = Field(32, ge=8, le=512)
    filters: int = Field(32, ge=1, le=1024)
    classes: int = Field(10, ge=2, le=10_000)


class Conv3dUnetModel(Strict):
    """Conv3D + BatchNorm + MaxPool3D + UpSampling3D, the reported zero-gradient net.

    Its loss is the voxel mean over a full `reference_edge`³ scan of which each
    sample is a `volume`³ crop, so every output voxel gets the gradient
    1 / reference_edge³: at 384³ that is 1.8e-8, below float16's smallest
    subnormal (6e-8), exactly as in the full-size report.
    """

    name: Literal["conv3d_unet"]
    volume: int = Field(16, ge=4, le=256, multiple_of=2)
    filters: int = Field(8, ge=1, le=256)
    reference_edge: int = Field(384, ge=1, le=4096)


class TransformerModel(Strict):
    name: Literal["transformer"]
    seq_len: int = Field(64, ge=2, le=8192)
    vocab_size: int = Field(1000, ge=2, le=262_144)
    d_model: int = Field(64, ge=8, le=8192)
    heads: int = Field(4, ge=1, le=128)
    layers: int = Field(2, ge=1, le=64)
    ffn_dim: int = Field(256, ge=8, le=65_536)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    classes: int = Field(10, ge=2, le=10_000)

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
categorical_crossentropy, 0/1 for binary_crossentropy, real values for the rest.
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

    keras_json: str = Field(min_length=2, max_length=MAX_KERAS_JSON_CHARS)
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


def walk_config(node: Any, depth: int = 0) -> Iterator[dict[str, Any]]:
    """Every dict in a Keras config, depth first; refuses absurd nesting."""
    if depth > MAX_KERAS_JSON_DEPTH:
        raise ValueError(f"model.keras_json is nested deeper than {MAX_KERAS_JSON_DEPTH} levels.")
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk_config(value, depth + 1)
    elif isinstance(node, list):
        for value in node:
            yield from walk_config(value, depth + 1)


def check_keras_json(text: str) -> dict[str, Any]:
    """Refuse configs that could run code (Lambda, custom or non-Keras classes),
    before Keras parses a single layer."""
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"model.keras_json is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("class_name") not in {"Sequential", "Functional", "Model"}:
        raise ValueError(
            "model.keras_json must be a Sequential or Functional model from model.to_json(). "
            f"Received: class_name={config.get('class_name') if isinstance(config, dict) else None!r}"
        )
    for node in walk_config(config):
        name = node.get("class_name")
        if name is None:
            continue
        if name == "Lambda":
            raise ValueError(
                "model.keras_json contains a Lambda layer, which runs code; only built-in layers are allowed."
            )
        module = node.get("module")
        if module is not None and not str(module).startswith("keras"):
            raise ValueError(
                f"model.keras_json uses {name!r} from module {module!r}; only Keras's own classes are allowed."
            )
        registered = node.get("registered_name")
        if registered is not None and registered != name:
            raise ValueError(
                f"model.keras_json uses the custom object {registered!r}; only Keras's own classes are allowed."
            )
    return config




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

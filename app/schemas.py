"""The job spec and the telemetry records: shared by the API and the worker.

Every field is bounded, unknown fields are rejected and so are NaN and
Infinity, so a spec that validates here can be trusted by the engine.

>>> spec = JobSpec.model_validate({"model": {"name": "mlp"},
...                                "precision_policy": "mixed_float16"})
>>> spec.loss_scale
DynamicLossScale(mode='dynamic', initial_scale=32768.0, growth_steps=2000)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

MAX_KERAS_JSON_CHARS = 1_000_000
"""A model config larger than this is refused before it is parsed."""
MAX_KERAS_JSON_DEPTH = 64
"""Deeper nesting than any real model config; refused before Keras sees it."""


class PrecisionPolicy(StrEnum):
    FLOAT32 = "float32"
    MIXED_FLOAT16 = "mixed_float16"
    MIXED_BFLOAT16 = "mixed_bfloat16"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @property
    def compute_dtype(self) -> str:
        return self.value.removeprefix("mixed_")

    @property
    def variable_dtype(self) -> str:
        return "float32" if self.value.startswith("mixed_") else self.value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


# --- model -----------------------------------------------------------------


class MlpModel(_Strict):
    name: Literal["mlp"]
    input_dim: int = Field(784, ge=1, le=65_536)
    hidden_units: int = Field(128, ge=1, le=16_384)
    classes: int = Field(10, ge=2, le=10_000)


class CnnModel(_Strict):
    name: Literal["cnn"]
    image_size: int = Field(32, ge=8, le=512)
    filters: int = Field(32, ge=1, le=1024)
    classes: int = Field(10, ge=2, le=10_000)


class Conv3dUnetModel(_Strict):
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


class TransformerModel(_Strict):
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


class KerasJsonModel(_Strict):
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




def _model_tag(value: Any) -> str | None:
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
        _model_tag,
        custom_error_type="invalid_model",
        custom_error_message=(
            "model must be {'name': one of 'mlp', 'cnn', 'conv3d_unet', "
            "'transformer'} or {'keras_json': ..., 'loss': ...}"
        ),
    ),
]


# --- loss scale -------------------------------------------------------------


class LossScaleMode(StrEnum):
    NONE = "none"
    FIXED = "fixed"
    DYNAMIC = "dynamic"


class NoLossScale(_Strict):
    mode: Literal["none"] = "none"


class FixedLossScale(_Strict):
    mode: Literal["fixed"] = "fixed"
    scale: float = Field(1024.0, ge=1.0, le=2.0**64)


class DynamicLossScale(_Strict):
    mode: Literal["dynamic"] = "dynamic"
    initial_scale: float = Field(32768.0, ge=1.0, le=2.0**64)
    growth_steps: int = Field(2000, ge=1, le=1_000_000)


LossScale = Annotated[
    NoLossScale | FixedLossScale | DynamicLossScale, Field(discriminator="mode")
]


# --- training, data, spec ---------------------------------------------------


UNDERFLOW_CHECK_EVERY = 100
"""The float32 check's default interval: two extra gradient computations per 100 steps."""


class TrainingSpec(_Strict):
    steps: int = Field(200, ge=1, le=10_000_000)
    batch_size: int = Field(32, ge=1, le=65_536)
    optimizer: Literal["adam", "adamw", "sgd", "rmsprop"] = "adam"
    learning_rate: float = Field(0.001, gt=0.0, le=10.0)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    checkpoint_every: int = Field(50, ge=1, le=10_000_000)
    max_seconds: int | None = Field(None, ge=1, le=30 * 24 * 3600)
    """Fail with reason `timeout` once an attempt has trained this long. None: no limit."""
    underflow_check_every: int = Field(UNDERFLOW_CHECK_EVERY, ge=0, le=10_000_000)
    """Under a float16/bfloat16 compute policy, compare the step's gradient with float32's at
    step 1 and every multiple of this step (worker/float32_check.py). 0 turns the check off."""


class SyntheticDataset(_Strict):
    """Inputs drawn from N(0, 1); labels from a fixed random teacher network."""

    kind: Literal["synthetic"] = "synthetic"
    samples: int = Field(4096, ge=1, le=10_000_000)
    seed: int = Field(0, ge=0, le=2**31 - 1)


class NpzDataset(_Strict):
    """Arrays `x` and `y` in a `.npz` file under the configured data root."""

    kind: Literal["npz"] = "npz"
    path: str = Field(min_length=1, max_length=1024)

    @field_validator("path")
    @classmethod
    def _relative_inside_root(cls, value: str) -> str:
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts or "\\" in value or "\0" in value:
            raise ValueError(
                "dataset.path must be relative to the data root, without '..'. "
                f"Received: path={value!r}"
            )
        return value


def _dataset_tag(value: Any) -> str | None:
    kind = value.get("kind", "synthetic") if isinstance(value, dict) else getattr(value, "kind", None)
    return None if kind is None else str(kind)


DatasetSpec = Annotated[
    Annotated[SyntheticDataset, Tag("synthetic")] | Annotated[NpzDataset, Tag("npz")],
    Discriminator(
        _dataset_tag,
        custom_error_type="invalid_dataset",
        custom_error_message="dataset.kind must be one of 'synthetic', 'npz'",
    ),
]


def loss_scale_from_mode(value: Any) -> Any:
    """Accept a bare mode string ("dynamic") for a loss scale with default parameters."""
    if isinstance(value, str):
        if value not in {m.value for m in LossScaleMode}:
            raise ValueError(
                "loss_scale must be one of 'none', 'fixed', 'dynamic'. "
                f"Received: loss_scale={value!r}"
            )
        return {"mode": value}
    return value


MAX_VARIANTS = 8


class Variant(_Strict):
    """One arm of a comparison: the spec's precision policy and loss scaling replaced by these."""

    precision_policy: PrecisionPolicy
    loss_scale: LossScale | None = None
    """None means the default for the policy, as in a job spec."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _bare_mode(cls, value: Any) -> Any:
        return loss_scale_from_mode(value)

    def resolved(self) -> Variant:
        """With the policy's default loss scaling filled in, as the job will run."""
        probe = JobSpec.model_validate({"model": {"name": "mlp"}, "precision_policy": self.precision_policy,
                                        "loss_scale": self.loss_scale})
        return Variant(precision_policy=self.precision_policy, loss_scale=probe.loss_scale)

    @property
    def label(self) -> str:
        """"float32", "mixed_float16 + dynamic", "mixed_float16 + fixed 1024"."""
        scale = self.loss_scale
        if scale is None or (scale.mode == "none" and self.precision_policy.compute_dtype != "float16"):
            return self.precision_policy.value
        if isinstance(scale, FixedLossScale):
            return f"{self.precision_policy.value} + fixed {scale.scale:g}"
        return f"{self.precision_policy.value} + {scale.mode}"


class JobSpec(_Strict):
    name: str | None = Field(None, max_length=200)
    model: ModelSpec
    precision_policy: PrecisionPolicy = PrecisionPolicy.FLOAT32
    loss_scale: LossScale | None = None
    """None means the default: dynamic when the policy computes in float16."""
    training: TrainingSpec = TrainingSpec()
    dataset: DatasetSpec = SyntheticDataset()
    device: Literal["any", "cpu", "gpu"] = "any"
    speed_check: list[Variant] | None = Field(None, max_length=MAX_VARIANTS)
    """What the job times against float32 after it trains, on its own device (worker/speed.py).
    None: its own policy, on a CPU, when that computes in float16/bfloat16. A list: each of these
    variants, on any device; a comparison's float32 baseline times them all in one measurement,
    and its other variants get []: nothing."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _bare_mode(cls, value: Any) -> Any:
        return loss_scale_from_mode(value)

    @field_validator("speed_check", mode="after")
    @classmethod
    def _resolved_variants(cls, value: list[Variant] | None) -> list[Variant] | None:
        return None if value is None else [v.resolved() for v in value]

    @model_validator(mode="after")
    def _default_loss_scale(self) -> JobSpec:
        if self.loss_scale is None:
            default: NoLossScale | DynamicLossScale = (
                DynamicLossScale()
                if self.precision_policy.compute_dtype == "float16"
                else NoLossScale()
            )
            object.__setattr__(self, "loss_scale", default)
        return self


# --- precision comparisons ----------------------------------------------------

DEFAULT_MATCH_TOLERANCE = 0.02
"""A variant "matches" float32 when its final loss is within this fraction of float32's."""


DEFAULT_VARIANTS = (
    Variant(precision_policy=PrecisionPolicy.FLOAT32),
    Variant(precision_policy=PrecisionPolicy.MIXED_FLOAT16, loss_scale=DynamicLossScale()),
    Variant(precision_policy=PrecisionPolicy.MIXED_FLOAT16, loss_scale=NoLossScale()),
    Variant(precision_policy=PrecisionPolicy.MIXED_BFLOAT16),
)


class ComparisonSpec(_Strict):
    """Run `spec` once per variant, same seed and data; float32 is the baseline.

    The spec's own `precision_policy` and `loss_scale` are replaced by each variant's.
    """

    name: str | None = Field(None, max_length=200)
    spec: JobSpec
    variants: list[Variant] | None = Field(None, min_length=2, max_length=MAX_VARIANTS, validate_default=True)
    """None means float32, mixed_float16 + dynamic, mixed_float16 + none and mixed_bfloat16."""
    tolerance: float = Field(DEFAULT_MATCH_TOLERANCE, gt=0.0, le=1.0)
    """Largest relative gap to float32's final loss that still counts as a match."""

    @field_validator("variants", mode="after")
    @classmethod
    def _baseline_and_distinct(cls, value: list[Variant] | None) -> list[Variant]:
        variants = [v.resolved() for v in (value or DEFAULT_VARIANTS)]
        if not any(v.precision_policy is PrecisionPolicy.FLOAT32 for v in variants):
            raise ValueError("variants must include a 'float32' variant: it is the baseline every other "
                             "variant is compared with.")
        seen: dict[str, int] = {}
        for index, variant in enumerate(variants):
            if variant.label in seen:
                raise ValueError(f"variants[{index}] repeats variants[{seen[variant.label]}] "
                                 f"({variant.label!r}); each variant must differ.")
            seen[variant.label] = index
        return variants

    def job_specs(self) -> list[JobSpec]:
        """One job spec per variant, named "NAME · VARIANT": the comparison's name, else the model's.

        The spec's own name is not used: it names one job, often after the policy it was written
        for ("mlp mixed_float16"), and would name a float32 job after a policy it does not run.
        A name too long for the 200 characters of a job's is cut; the variant's label never is.

        >>> spec = ComparisonSpec.model_validate({"spec": {"name": "mlp mixed_float16", "model": {"name": "mlp"}}})
        >>> [s.name for s in spec.job_specs()][:2]
        ['mlp · float32', 'mlp · mixed_float16 + dynamic']
        """
        base = self.spec.model_dump(mode="json")
        variants = self.variants or []
        baseline = next(v for v in variants if v.precision_policy is PrecisionPolicy.FLOAT32)
        specs = []
        for variant in variants:
            label = f" · {variant.label}"  # kept whole: a long name is cut instead
            name = f"{(self.name or _model_tag(self.spec.model) or 'model')[:200 - len(label)]}{label}"
            # One speed measurement for all: the baseline times every other variant in turns.
            timed = [v.model_dump(mode="json") for v in variants if v is not baseline] if variant is baseline else []
            specs.append(JobSpec.model_validate({
                **base, "name": name, "precision_policy": variant.precision_policy.value,
                "loss_scale": None if variant.loss_scale is None else variant.loss_scale.model_dump(mode="json"),
                "speed_check": timed,
            }))
        return specs

    @property
    def baseline_index(self) -> int:
        """The float32 variant's place: its job times the others and is the verdict's reference."""
        return next(i for i, v in enumerate(self.variants or ()) if v.precision_policy is PrecisionPolicy.FLOAT32)


# --- telemetry --------------------------------------------------------------


class StepRecord(_Strict):
    """One optimizer step. Non-finite values are null (JSON has no NaN)."""

    step: int
    loss: float | None
    """That batch's unscaled loss, not Keras's running mean."""
    loss_scale: float
    grad_norm: float | None
    """Global L2 norm of the unscaled gradients."""
    grads_finite: bool
    skipped: bool
    """True when the update was not applied."""
    zero_grad_fraction: float
    """Share of gradient elements that are exactly zero, in float32 before any cast back
    to the variables' dtype. Zeros that float32 has too are not underflow: see below."""
    regularization_loss: float | None = None
    """The model's weight penalties at this step (None: the model has none). Not in `loss`."""
    excess_zero_fraction: float | None = None
    """On checked steps only: share of gradient values zero under the policy but not in float32."""
    grad_rel_error: float | None = None
    """On checked steps only: ||g_policy - g_float32|| / ||g_float32||, both unscaled."""
    learning_rate: float
    examples_per_sec: float
    step_time_ms: float
    time: float
    """Unix time at the end of the step."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class Diagnosis(_Strict):
    code: Literal[
        "gradient_underflow",
        "overflow_skips",
        "diverged",
        "slow_precision_on_device",
        "float32_fallback",
        "half_precision_output",
    ]
    message: str
    first_step: int | None


SpeedDifference = Literal["slower", "faster", "none"]
"""What a speed check can tell: measurably slower or faster than float32, or no measurable difference."""


class PrecisionSpeed(_Strict):
    """A policy's training speed against float32 on one device, measured in turns (worker/speed.py).

    Fresh copies of the model, built, compiled and warmed the same way, take turns
    training a few steps each on the same batches, round after round, in rotated
    order: the policy, float32, and a second float32 copy (the A/A pair that shows
    how much two identical sides differ on this machine now). Each round gives one
    ratio per side, its step time over float32's in that round; the figures are the
    median and quartiles of those ratios, so drift that hits all sides alike cancels.
    """

    policy_ms: float
    """Median step time under the policy."""
    float32_ms: float
    slowdown: float
    """Median over rounds of policy / float32 step time: above 1 the policy is slower here."""
    steps: int
    """Timed steps on each side."""
    low: float | None = None
    """First quartile of the per-round ratios (None on a record from before the interval existed)."""
    high: float | None = None
    """Third quartile of the per-round ratios."""
    noise_low: float | None = None
    """First quartile of float32 against float32 (the A/A noise of this measurement)."""
    noise_high: float | None = None
    rounds: int = 0
    difference: SpeedDifference = "none"
    """"slower" only when the whole interval lies above both 1 and the A/A noise, "faster" only when
    it lies below both; otherwise no measurable difference. See `speed_difference`."""

    @property
    def interval(self) -> tuple[float, float]:
        return (self.slowdown if self.low is None else self.low, self.slowdown if self.high is None else self.high)


def speed_difference(low: float, high: float, noise_low: float, noise_high: float) -> SpeedDifference:
    """Whether a slowdown interval [low, high] is beyond the A/A noise [noise_low, noise_high] and 1.

    >>> speed_difference(1.3, 1.5, 0.96, 1.05), speed_difference(0.97, 1.08, 0.96, 1.05)
    ('slower', 'none')
    >>> speed_difference(0.6, 0.7, 0.96, 1.05), speed_difference(1.03, 1.04, 0.99, 1.05)
    ('faster', 'none')
    """
    if low > max(1.0, noise_high):
        return "slower"
    if high < min(1.0, noise_low):
        return "faster"
    return "none"


class VariantSpeed(_Strict):
    """One comparison variant timed by the float32 baseline job against float32 (worker/speed.py)."""

    label: str
    speed: PrecisionSpeed | None
    error: str | None = None
    """Why this variant could not be timed (it could not be built or trained here)."""
    slow_precision: str | None = None
    """The `slow_precision_on_device` message the measurement earned, if any."""


class Summary(_Strict):
    steps_done: int
    final_loss: float | None
    """Mean batch loss over the last steps (up to 10), so one batch cannot decide it."""
    skipped_steps: int
    loss_scale_min: float | None
    loss_scale_max: float | None
    loss_scale_final: float | None
    peak_zero_grad_fraction: float | None
    mean_examples_per_sec: float | None
    float32_checks: int = 0
    """Steps whose gradient was compared with float32's."""
    peak_excess_zero_fraction: float | None = None
    """Largest `excess_zero_fraction` over the checked steps."""
    peak_grad_rel_error: float | None = None
    """Largest `grad_rel_error` over the checked steps."""
    float32_check_error: str | None = None
    """Why the float32 check stopped, if it failed (the job trained on without it)."""
    precision_speed: PrecisionSpeed | None = None
    """On a CPU, for a float16/bfloat16 policy that succeeded: its speed against float32 there."""
    variant_speeds: list[VariantSpeed] = []
    """A comparison's float32 baseline only: every other variant's speed against float32, timed in turns."""
    diagnoses: list[Diagnosis] = []

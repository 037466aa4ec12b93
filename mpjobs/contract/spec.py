"""What a job or a comparison asks for: policy, loss scaling, training, data; every field bounded.

Every field is bounded, unknown fields are rejected and so are NaN and
Infinity, so a spec that validates here can be trusted by the engine.

>>> spec = JobSpec.model_validate({"model": {"name": "mlp"},
...                                "precision_policy": "mixed_float16"})
>>> spec.loss_scale
DynamicLossScale(mode='dynamic', initial_scale=32768.0, growth_steps=2000)
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from mpjobs.contract.data_specs import NpzDataset, UploadedDataset
from mpjobs.contract.fp8 import Fp8Spec, check_fp8, fp8_label
from mpjobs.contract.layer_names import layer_names, unknown_layers_message
from mpjobs.contract.loss_scale import DynamicLossScale as DynamicLossScale  # the contract's names, re-exported
from mpjobs.contract.loss_scale import FixedLossScale as FixedLossScale
from mpjobs.contract.loss_scale import LossScale as LossScale
from mpjobs.contract.loss_scale import LossScaleMode as LossScaleMode
from mpjobs.contract.loss_scale import NoLossScale as NoLossScale
from mpjobs.contract.loss_scale import loss_scale_from_mode
from mpjobs.contract.model_specs import MAX_KERAS_LAYERS, ModelSpec, model_tag
from mpjobs.contract.strict import Integer, Number, Strict, Text
from mpjobs.contract.training_spec import TrainingSpec


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


# --- training, data, spec ---------------------------------------------------


class SyntheticDataset(Strict):
    """Inputs drawn from N(0, 1); labels from a fixed random teacher network."""

    kind: Literal["synthetic"] = "synthetic"
    samples: Integer = Field(4096, ge=1, le=10_000_000)
    seed: Integer = Field(0, ge=0, le=2**31 - 1)


def _dataset_tag(value: Any) -> str | None:
    kind = value.get("kind", "synthetic") if isinstance(value, dict) else getattr(value, "kind", None)
    return None if kind is None else str(kind)


DatasetSpec = Annotated[
    Annotated[SyntheticDataset, Tag("synthetic")] | Annotated[NpzDataset, Tag("npz")]
    | Annotated[UploadedDataset, Tag("uploaded")],
    Discriminator(
        _dataset_tag,
        custom_error_type="invalid_dataset",
        custom_error_message="dataset.kind must be one of 'synthetic', 'npz', 'uploaded'",
    ),
]


MAX_VARIANTS = 8


class Variant(Strict):
    """One arm of a comparison: the spec's precision policy and loss scaling replaced by these."""

    precision_policy: PrecisionPolicy
    loss_scale: LossScale | None = None
    """None means the default for the policy, as in a job spec."""
    layer_policies: dict[Annotated[Text, Field(min_length=1, max_length=200)], PrecisionPolicy] | None = None
    """Per-layer policies for this variant, as `JobSpec.layer_policies`. None: the spec's (float32: none)."""
    fp8: Fp8Spec | None = None
    """Train the Dense and EinsumDense layers in FP8, as `JobSpec.fp8`. None: not in FP8."""

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _bare_mode(cls, value: Any) -> Any:
        return loss_scale_from_mode(value)

    def resolved(self) -> Variant:
        """With the policy's default loss scaling filled in, as the job will run."""
        probe = JobSpec.model_validate({"model": {"name": "mlp"}, "precision_policy": self.precision_policy,
                                        "loss_scale": self.loss_scale})
        return Variant(precision_policy=self.precision_policy, loss_scale=probe.loss_scale,
                       layer_policies=self.layer_policies, fp8=self.fp8)

    @property
    def is_float32(self) -> bool:
        """All float32: the baseline's policy, no FP8 layer."""
        return self.precision_policy is PrecisionPolicy.FLOAT32 and self.fp8 is None

    @property
    def label(self) -> str:
        """"float32", "mixed_float16 + dynamic", "mixed_float16 + fixed 1024"."""
        scale, pins = self.loss_scale, fp8_label(self.fp8)
        for policy in dict.fromkeys((self.layer_policies or {}).values()):  # " + float32: dense_1, probs"
            pins += f" + {policy.value}: {', '.join(n for n, p in (self.layer_policies or {}).items() if p is policy)}"
        if scale is None or (scale.mode == "none" and self.precision_policy.compute_dtype != "float16"):
            return self.precision_policy.value + pins
        if isinstance(scale, FixedLossScale):
            return f"{self.precision_policy.value} + fixed {scale.scale:g}{pins}"
        return f"{self.precision_policy.value} + {scale.mode}{pins}"


from mpjobs.contract.evaluation import ValidationSpec, check_metrics, loss_name_of  # noqa: E402  (reads DatasetSpec)


class JobSpec(Strict):
    name: Text | None = Field(None, max_length=200)
    model: ModelSpec
    precision_policy: PrecisionPolicy = PrecisionPolicy.FLOAT32
    loss_scale: LossScale | None = None
    """None means the default: dynamic when the policy computes in float16."""
    training: TrainingSpec = TrainingSpec()
    dataset: DatasetSpec = SyntheticDataset()
    device: Literal["any", "cpu", "gpu"] = "any"
    speed_check: list[Variant] | None = Field(None, max_length=MAX_VARIANTS)
    """What the job times against float32 after it trains, on its own device (worker/numerics/speed.py).
    None: its own policy, on a CPU, when that computes in float16/bfloat16. A list: each of these
    variants, on any device; a comparison's float32 baseline times them all in one measurement,
    and its other variants get []: nothing."""
    validation: ValidationSpec | None = None
    """Held-out evaluation, its metrics and interval (mpjobs/contract/evaluation.py). None: none."""
    layer_policies: dict[Annotated[Text, Field(min_length=1, max_length=200)], PrecisionPolicy] = Field(
        default_factory=dict, max_length=MAX_KERAS_LAYERS)
    """Layers that compute in another policy than `precision_policy`, by name (`mpjobs.contract.layer_names`),
    nested models' and wrapped layers' included: {"dense_1": "float32"} keeps that layer in float32 under
    mixed_float16. The float32 check and the layer checks still compare with the all-float32 model."""
    fp8: Fp8Spec | None = None
    """Train the model's Dense and EinsumDense layers in FP8 (Keras's `float8_from_<precision_policy>`), the
    other layers in `precision_policy`, which must be float32, mixed_bfloat16 or mixed_float16. A layer named
    in `layer_policies` keeps its policy. None: no FP8 (docs/numerics.md, "FP8")."""
    plan: Literal["auto"] | None = None
    """"auto": before training, find the precision plan of this job's own step 1 (docs/numerics.md, "Precision
    plan") and train with it: its layers in float32, its loss scale. A comparison's plan variant sets it."""

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
            half = self.precision_policy.compute_dtype == "float16"
            object.__setattr__(self, "loss_scale", DynamicLossScale() if half else NoLossScale())
        if self.validation is not None:
            check_metrics(self.validation.metrics, loss_name_of(self.model))
        if self.layer_policies:
            known = layer_names(self.model)
            if unknown := [name for name in self.layer_policies if name not in known]:
                raise ValueError(unknown_layers_message("layer_policies", unknown, known))
        if self.fp8 is not None:
            check_fp8(self.precision_policy.value, self.model, self.training.devices)
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


class ComparisonSpec(Strict):
    """Run `spec` once per variant, same seed and data; float32 is the baseline.

    The spec's own `precision_policy` and `loss_scale` are replaced by each variant's.
    """

    name: Text | None = Field(None, max_length=200)
    spec: JobSpec
    variants: list[Variant] | None = Field(None, min_length=2, max_length=MAX_VARIANTS, validate_default=True)
    """None means float32, mixed_float16 + dynamic, mixed_float16 + none and mixed_bfloat16."""
    tolerance: Number = Field(DEFAULT_MATCH_TOLERANCE, gt=0.0, le=1.0)
    """Largest relative gap to float32's final loss that still counts as a match."""
    plan: Literal["auto"] | None = None
    """"auto": one more variant, the first half-precision variant's job with `plan: "auto"`: it trains with the
    precision plan of that variant's step 1, and the verdict says whether the plan removed what that variant lost."""
    float32_seeds: Integer = Field(1, ge=1, le=2)
    """2: also train float32 with the next training seed (the seed control), so the verdict can say whether
    mixed precision's held-out difference is larger than two float32 runs'. Needs `spec.validation`."""

    @field_validator("float32_seeds", mode="after")
    @classmethod
    def _seeds_need_validation(cls, value: int, info: ValidationInfo) -> int:
        spec = info.data.get("spec")
        if value > 1 and spec is not None and spec.validation is None:
            raise ValueError(f"float32_seeds={value} compares two float32 runs on held-out data: give the spec a "
                             "'validation', or leave float32_seeds at 1. Received: spec.validation=None")
        return value

    @field_validator("variants", mode="after")
    @classmethod
    def _baseline_and_distinct(cls, value: list[Variant] | None, info: ValidationInfo) -> list[Variant]:
        variants = [v.resolved() for v in (value or DEFAULT_VARIANTS)]
        spec = info.data.get("spec")
        for index, variant in enumerate(variants):
            if spec is not None and variant.layer_policies:
                known = layer_names(spec.model)
                if unknown := [name for name in variant.layer_policies if name not in known]:
                    raise ValueError(unknown_layers_message(f"variants[{index}].layer_policies", unknown, known))
            if spec is not None and variant.fp8 is not None:
                check_fp8(variant.precision_policy.value, spec.model, spec.training.devices, f"variants[{index}].")
        if not any(v.is_float32 for v in variants):
            raise ValueError("variants must include a 'float32' variant: it is the baseline every other "
                             "variant is compared with.")
        seen: dict[str, int] = {}
        for index, variant in enumerate(variants):
            if variant.label in seen:
                raise ValueError(f"variants[{index}] repeats variants[{seen[variant.label]}] "
                                 f"({variant.label!r}); each variant must differ.")
            seen[variant.label] = index
        return variants

    @model_validator(mode="after")
    def _something_to_plan(self) -> ComparisonSpec:
        if self.plan is not None and all(v.precision_policy.compute_dtype == "float32" and v.fp8 is None
                                         for v in self.variants or ()):
            raise ValueError("plan 'auto' plans a float16 or bfloat16 variant: add one to variants, or leave plan out.")
        return self

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
        baseline = next(v for v in variants if v.is_float32)
        specs = []
        for variant in variants:
            label = f" · {variant.label}"  # kept whole: a long name is cut instead
            name = f"{(self.name or model_tag(self.spec.model) or 'model')[:200 - len(label)]}{label}"
            # One speed measurement for all: the baseline times every other variant in turns.
            timed = [{**v.model_dump(mode="json"), "layer_policies": self.pins_of(v)} for v in variants
                     if v is not baseline] if variant is baseline else []
            specs.append(JobSpec.model_validate({
                **base, "name": name, "precision_policy": variant.precision_policy.value,
                "loss_scale": None if variant.loss_scale is None else variant.loss_scale.model_dump(mode="json"),
                "speed_check": timed, "layer_policies": self.pins_of(variant),
                "fp8": None if variant.fp8 is None else variant.fp8.model_dump(mode="json"),
            }))
        if self.plan is not None:  # the plan variant, after the variants: the planned one's spec, planned
            planned = specs[self.planned_index]
            specs.append(planned.model_copy(update={"plan": "auto", "speed_check": None,
                                                    "name": f"{planned.name} + plan"[:200]}))
        if self.float32_seeds > 1:  # the seed control, last: float32 with the next training seed (0 after the last)
            label, tag = self.seed_control_label, self.name or model_tag(self.spec.model) or "model"
            specs.append(JobSpec.model_validate({**base, "name": f"{tag[:197 - len(label)]} · {label}",
                "precision_policy": "float32", "loss_scale": None, "speed_check": [], "layer_policies": {},
                "training": {**base["training"], "seed": (self.spec.training.seed + 1) % 2**31}}))
        return specs

    def pins_of(self, variant: Variant) -> dict[str, str]:
        """The per-layer policies `variant`'s job trains with: its own, else the spec's; none for float32."""
        if variant.is_float32 and variant.layer_policies is None:
            return {}
        pins = self.spec.layer_policies if variant.layer_policies is None else variant.layer_policies
        return {name: policy.value for name, policy in pins.items()}

    @property
    def planned_index(self) -> int:
        """The variant the plan variant plans: the first that does not compute in float32."""
        return next(i for i, v in enumerate(self.variants or ())
                    if v.precision_policy.compute_dtype != "float32" or v.fp8 is not None)

    @property
    def seed_control_label(self) -> str:
        return f"float32 seed {(self.spec.training.seed + 1) % 2**31}"

    @property
    def baseline_index(self) -> int:
        """The float32 variant's place: its job times the others and is the verdict's reference."""
        return next(i for i, v in enumerate(self.variants or ()) if v.is_float32)

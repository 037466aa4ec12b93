"""FP8 training (Keras's `float8` policies): what a spec asks for, and the scaling state each step reports.

Keras 3 trains `Dense` and `EinsumDense` layers in FP8 with delayed scaling: each layer keeps, for its
inputs, its kernel and its output gradient, a scale and a history of the largest |x| of recent steps.
A tensor is divided by its scale, clipped to the format's largest value and cast: float8_e4m3fn
(largest 448) for inputs and kernel, float8_e5m2 (largest 57,344) for output gradients. The next
scale is the history's largest value over the format's largest (margin 0), so it follows the data
two steps late, and a single outlier sets it for as many steps as the history is long.

>>> Fp8Spec().amax_history_length
1024
>>> FORMATS["outputs_grad"].max, FORMATS["inputs"].smallest
(57344.0, 0.001953125)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from mpjobs.contract.model_specs import KerasJsonModel, walk_config
from mpjobs.contract.strict import Integer, Strict

FP8_SOURCES = ("float32", "mixed_bfloat16", "mixed_float16")
"""The precision policies FP8 layers may compute in around their FP8 matmuls (Keras's `float8_from_<source>`)."""
FP8_KINDS = ("Dense", "EinsumDense")
"""The layer classes Keras 3.15 trains in FP8 (their subclasses excluded, as `quantize` excludes them)."""
FP8_CONTAINERS = ("MultiHeadAttention",)
"""Keras layers built of EinsumDense layers, which FP8 then applies to."""
TENSORS = ("inputs", "kernel", "outputs_grad")
Tensor = Literal["inputs", "kernel", "outputs_grad"]


@dataclass(frozen=True)
class Format:
    name: str
    max: float
    """The largest finite value: a tensor divided by its scale is clipped here."""
    smallest: float
    """The smallest positive (subnormal) value: below half of it, a value rounds to zero."""
    smallest_normal: float


E4M3 = Format("float8_e4m3fn", 448.0, 2.0**-9, 2.0**-6)
E5M2 = Format("float8_e5m2", 57344.0, 2.0**-16, 2.0**-14)
FORMATS = {"inputs": E4M3, "kernel": E4M3, "outputs_grad": E5M2}


class Fp8Spec(Strict):
    """Train the model's Dense and EinsumDense layers in FP8 (the job's `precision_policy` is their source)."""

    amax_history_length: Integer = Field(1024, ge=1, le=4096)
    """Steps of largest values each scale is taken from (Keras's default 1024). A shorter history forgets
    an outlier sooner; a longer one keeps the scale steadier."""


class Fp8Tensor(Strict):
    """One FP8 layer's tensor at one step: its delayed-scaling state, and how it fit the format.

    `scale` is the one in force at the step: the tensor was divided by it before the cast, so values past
    format max × scale saturated and those below half the format's smallest × scale became zero.
    """

    layer: str
    """The layer's path: its name, or for a layer inside another, `multi_head_attention/query`."""
    tensor: Tensor
    scale: float | None
    amax: float | None
    """This step's largest |x| (of the loss-scaled gradient for `outputs_grad`). Null: not finite."""
    range_use: float | None
    """amax / (format max × scale): above 1 the step saturated (its largest values were clipped); far below 1
    its small values fall under the format's smallest. Null: not finite (a zero scale)."""
    history_max: float | None
    """The largest amax in the history after this step: what the scale two steps on is taken from."""
    peak_age: int
    """Steps since the history's largest amax came in (0: this step's). It sets the scale until it leaves."""
    saturated_fraction: float | None = None
    """On checked steps only: the share of the tensor's values past format max × scale, counted exactly."""
    underflow_fraction: float | None = None
    """On checked steps only: the share of its non-zero values that became zero in the format, counted exactly."""

    @property
    def underflowing(self) -> bool:
        """Even this step's largest |x| lands below the format's smallest normal at the scale in force: its values
        have lost their precision, and those under half the smallest subnormal became zero."""
        fmt = FORMATS[self.tensor]
        return self.range_use is not None and self.range_use * fmt.max < fmt.smallest_normal and (self.amax or 0) > 0

    @property
    def lag(self) -> float | None:
        """history_max / amax: how far this step's largest value sits below the one the scale follows."""
        if self.amax is None or self.history_max is None or self.amax <= 0:
            return None
        return self.history_max / self.amax


class Fp8Layers(Strict):
    """Which layers a job trained in FP8, and which kept their policy (in the job's summary)."""

    amax_history_length: int
    layers: list[str]
    """The FP8 layers (Dense and EinsumDense), in the model's order."""
    kept: list[str]
    """Layers with weights that kept the job's (or their pinned) policy: FP8 does not apply to them."""


def fp8_label(fp8: Fp8Spec | None) -> str:
    """What FP8 adds to a variant's label: " + fp8", or " + fp8 (history 16)" for another history than 1024."""
    if fp8 is None:
        return ""
    length = fp8.amax_history_length
    return " + fp8" if length == Fp8Spec().amax_history_length else f" + fp8 (history {length})"


def fp8_capable(model: Any) -> bool:
    """Whether a model spec has a layer FP8 applies to (a Dense, an EinsumDense or a MultiHeadAttention).

    >>> from mpjobs.contract.model_specs import Conv3dUnetModel, MlpModel
    >>> fp8_capable(MlpModel(name="mlp")), fp8_capable(Conv3dUnetModel(name="conv3d_unet"))
    (True, False)
    """
    if isinstance(model, KerasJsonModel):
        kinds = FP8_KINDS + FP8_CONTAINERS
        return any(node.get("class_name") in kinds for node in walk_config(json.loads(model.keras_json)))
    return getattr(model, "name", None) != "conv3d_unet"


def check_fp8(policy: str, model: Any, devices: int, where: str = "") -> None:
    """FP8's policy is one FP8 computes in, its model has a layer FP8 applies to, on one device; `where` prefixes
    the fields named (`variants[1].` for a comparison's variant)."""
    if policy not in FP8_SOURCES:
        raise ValueError(f"{where}fp8 trains Dense and EinsumDense layers in FP8 around a precision_policy of "
                         f"{', '.join(map(repr, FP8_SOURCES))}. Received: {where}precision_policy={policy!r}")
    if not fp8_capable(model):
        raise ValueError(f"{where}fp8 applies to Dense and EinsumDense layers (and those inside MultiHeadAttention), "
                         "and this model has none: Keras trains no other layer in FP8 (Conv layers, Embedding and "
                         f"the rest keep their policy). Leave {where}fp8 out for this model.")
    if devices > 1:
        raise ValueError(f"{where}fp8 trains on one device: each replica's FP8 scaling state would be summed across "
                         f"replicas. Received: training.devices={devices}")

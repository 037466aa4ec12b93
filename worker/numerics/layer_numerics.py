"""Per-layer numerics: each layer's gradient and output activation at a check, and the layer where they go wrong.

A layer check runs inside the float32 check (worker/numerics/float32_check.py), on the
same step, weights and batch: the gradient under the policy (unscaled, float32)
and float32's are already there, so per layer (the model's top-level layers,
each with its own trainable variables) it adds:

- the zero share of its gradient, and its excess zeros (zero under the policy,
  not in float32);
- its gradient's norm, largest |g| and smallest non-zero |g| (as log2), and the
  smallest float32 |g| the policy lost;
- from the same forward pass, its output activation in the dtype it computes
  in: the largest |a|, the doublings left before the dtype's largest value, and
  the share of values that are not zero but below the dtype's smallest normal.

Then it names two layers. Backpropagation runs from the output to the input, so
gradient underflow *begins* at the flagged layer nearest the output: every
layer below it (nearer the input) gets its gradient through it. Overflow begins
at the first layer, from the input, whose activations come within
`HEADROOM_DOUBLINGS` doublings of the dtype's largest value, or pass it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
from keras import ops

from mpjobs.contract.records import LayerCheck, LayerNumerics
from worker.telemetry.fp8_state import weight_indices

SMALLEST = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149}
"""The smallest positive value (subnormal) of each dtype."""
SMALLEST_NORMAL = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126}
LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}
UNDERFLOW_EXCESS_ONE_TENSOR = 0.05
"""A weight tensor, or a layer, is flagged when this share of its gradient values is zero only under the policy,"""
UNDERFLOW_MIN_VALUES_ONE_TENSOR = 16
"""... when that is at least this many values: one bias value of 16 that float16 rounds to exactly
zero where float32 keeps a remainder is rounding, not a layer that stopped learning."""
HEADROOM_DOUBLINGS = 2.0
"""Activations this many doublings from the dtype's largest (65,504/4 for float16) are named: no scale helps."""


def flagged_share(lost: int, values: int) -> bool:
    """Whether `lost` excess zeros out of `values` gradient values mark a weight tensor as underflowing."""
    return values > 0 and lost / values >= UNDERFLOW_EXCESS_ONE_TENSOR and lost >= UNDERFLOW_MIN_VALUES_ONE_TENSOR


def layer_lost(lost: int, values: int) -> bool:
    """Whether a layer loses its gradients: as a tensor is flagged, or when it loses every one of at least two
    (a 1x1 convolution's 5 values, all zero, is a layer that stopped learning, not rounding).

    >>> layer_lost(16, 320), layer_lost(1, 16), layer_lost(5, 5), layer_lost(3, 5), layer_lost(1, 1)
    (True, False, True, False, False)
    """
    return flagged_share(lost, values) or (values >= 2 and lost == values)


def floor_percent(share: float) -> str:
    """A share as a percentage, never rounded up to 100% (nor down to 0% when not zero).

    >>> floor_percent(0.99999), floor_percent(0.00001), floor_percent(0.25)
    ('99.99%', '<0.01%', '25%')
    """
    if 0 < share < 0.0001:
        return "<0.01%"
    return f"{math.floor(share * 10000) / 100:g}%"


def scale_text(value: float) -> str:
    """A loss scale as people write it: 1024, or 2^40 when long."""
    exponent = math.log2(value)
    return f"2^{exponent:g}" if exponent.is_integer() and value >= 2**20 else f"{value:g}"


@dataclass(frozen=True)
class LayerGroup:
    name: str
    kind: str
    variables: tuple[int, ...]
    """Indices of its weights among the model's (its trainable variables less FP8 state, as gradient_fn returns)."""
    probed: int | None
    """Its output's position among the probe's extra outputs; None when its output cannot be read."""
    dtype: str | None
    """Its output's dtype."""


class LayerProbe:
    """The model's top-level layers, their variables, and a model that also returns each layer's output."""

    def __init__(self, model: keras.Model) -> None:
        full = {id(v): i for i, v in enumerate(model.trainable_variables)}
        index = {id(model.trainable_variables[i]): k for k, i in enumerate(weight_indices(model.trainable_variables))}
        owned: set[int] = set()
        groups: list[LayerGroup] = []
        outputs: list[Any] = []
        in_graph = _graph_nodes(model)
        for layer in model.layers:
            if isinstance(layer, keras.layers.InputLayer):
                continue
            mine = tuple(index[id(v)] for v in layer.trainable_variables if id(v) in index and id(v) not in owned)
            owned.update(id(v) for v in layer.trainable_variables)
            output = _single_output(layer, in_graph)
            probed = None if output is None else len(outputs)
            if output is not None:
                outputs.append(output)
            dtype = None if output is None else keras.backend.standardize_dtype(output.dtype)
            groups.append(LayerGroup(layer.name, type(layer).__name__, tuple(sorted(mine)), probed, dtype))
        rest = tuple(i for v, i in index.items() if v not in owned)
        if rest:  # weights of the model itself, outside any layer
            groups.append(LayerGroup(model.name, type(model).__name__, rest, None, None))
        self.groups = groups
        inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs  # called with one tensor, not a list
        self.model = keras.Model(inputs, [model.outputs[0], *outputs], name=f"{model.name}_probe")
        self._trainable = [full[id(v)] for v in self.model.trainable_variables]
        non_trainable = {id(v): i for i, v in enumerate(model.non_trainable_variables)}
        self._non_trainable = [non_trainable[id(v)] for v in self.model.non_trainable_variables]
        self._dtypes = [keras.backend.standardize_dtype(o.dtype) for o in outputs]

    def reorder_trainable(self, values: Sequence[Any]) -> list[Any]:
        """The model's trainable values in the probe's order (the same variables, perhaps listed otherwise)."""
        return [values[i] for i in self._trainable]

    def reorder_non_trainable(self, values: Sequence[Any]) -> list[Any]:
        return [values[i] for i in self._non_trainable]

    def statistics(self, outputs: Sequence[Any]) -> tuple[Any, Any, Any, Any, Any]:
        """In the graph, per probed output: (largest finite |a|, all finite?, subnormal count, zero count, size)."""
        peaks, finite, subnormal, zeros, sizes = [], [], [], [], []
        for a, dtype in zip(outputs, self._dtypes, strict=True):
            magnitude = ops.abs(ops.cast(a, "float32"))
            ok = ops.isfinite(magnitude)
            peaks.append(ops.max(ops.where(ok, magnitude, 0.0)))
            finite.append(ops.all(ok))
            below = ops.logical_and(magnitude > 0.0, magnitude < SMALLEST_NORMAL.get(dtype, 0.0))
            subnormal.append(ops.sum(ops.cast(below, "int32")))
            zeros.append(ops.sum(ops.cast(ops.equal(magnitude, 0.0), "int32")))
            sizes.append(ops.size(magnitude))
        if not outputs:
            empty = ops.zeros((0,), "float32")
            return empty, ops.zeros((0,), "bool"), ops.zeros((0,), "int32"), ops.zeros((0,), "int32"), \
                ops.zeros((0,), "int32")
        return ops.stack(peaks), ops.stack(finite), ops.stack(subnormal), ops.stack(zeros), ops.stack(sizes)


def _graph_nodes(model: keras.Model) -> set[int] | None:
    """The ids of the nodes of the graph the model runs (a Sequential's inner Functional), or None (subclassed)."""
    graph = getattr(model, "_functional", None) or model
    by_depth = getattr(graph, "_nodes_by_depth", None)
    return None if by_depth is None else {id(node) for nodes in by_depth.values() for node in nodes}


def _single_output(layer: keras.layers.Layer, in_graph: set[int] | None) -> Any:
    """The layer's one output tensor in the model's graph, or None (called more than once there, or with several
    outputs). A layer keeps a node per call: a Sequential rebuilt from JSON has one per build, and only the last
    is in the graph it runs. An output from another node is not on the loss's path: its gradient would be none."""
    nodes = [n for n in layer._inbound_nodes if in_graph is None or id(n) in in_graph]
    if len(nodes) != 1 or len(nodes[0].output_tensors) != 1:
        return None
    output = nodes[0].output_tensors[0]
    return output if isinstance(output, keras.KerasTensor) else None


def _log2(value: float) -> float | None:
    return math.log2(value) if value > 0 and math.isfinite(value) else None


def sum_of_squares(values: np.ndarray) -> float:
    """Σ v² without BLAS: after NumPy's `dot`, OpenBLAS's threads spin ~0.1 s on the cores training needs."""
    return float(np.square(values).sum())


def _gradient_fields(policy: Sequence[np.ndarray], reference: Sequence[np.ndarray] | None) -> dict[str, Any]:
    values = sum(g.size for g in policy)
    if not values:
        return {"values": 0}
    flat = np.concatenate([np.ravel(g) for g in policy]).astype(np.float64)
    finite = bool(np.isfinite(flat).all())
    magnitude = np.abs(flat)
    nonzero = magnitude[magnitude > 0]
    fields: dict[str, Any] = {
        "values": int(values),
        "zero_fraction": float(np.count_nonzero(flat == 0) / values),
        "grads_finite": finite,
        "grad_norm": math.sqrt(sum_of_squares(flat)) if finite else None,
        "grad_max_log2": _log2(float(magnitude.max())) if finite else None,
        "grad_min_log2": _log2(float(nonzero.min())) if finite and nonzero.size else None,
    }
    if reference is not None:
        ref = np.concatenate([np.ravel(r) for r in reference]).astype(np.float64)
        lost = (flat == 0) & (ref != 0)
        fields["excess_zero_fraction"] = float(np.count_nonzero(lost) / values)
        ref_norm = math.sqrt(sum_of_squares(ref))
        if finite and ref_norm > 0:
            fields["grad_rel_error"] = math.sqrt(sum_of_squares(flat - ref)) / ref_norm
        fields["lost_min_log2"] = _log2(float(np.abs(ref[lost]).min())) if lost.any() else None
    return fields


def _activation_fields(dtype: str, peak: float, finite: bool, subnormal: int, zeros: int,
                       size: int) -> dict[str, Any]:
    fields: dict[str, Any] = {"activation_dtype": dtype, "activation_finite": finite}
    if size:
        fields["activation_subnormal_fraction"] = subnormal / size
        fields["activation_zero_fraction"] = zeros / size
    if finite:
        fields["activation_max"] = peak
        if peak > 0 and dtype in LARGEST:
            fields["activation_headroom_log2"] = math.log2(LARGEST[dtype] / peak)
    return fields


def _signal_fields(policy: np.ndarray, reference: np.ndarray | None) -> dict[str, Any]:
    """The signal's zeros; nothing (null fractions) where no gradient reached the output (an empty array)."""
    fields: dict[str, Any] = {"signal_values": int(policy.size)}
    if policy.size:
        zero = policy == 0
        fields["signal_zero_fraction"] = float(np.count_nonzero(zero) / policy.size)
        if reference is not None and reference.shape == policy.shape:
            fields["signal_excess_zero_fraction"] = float(np.count_nonzero(zero & (reference != 0)) / policy.size)
    return fields


@dataclass(frozen=True)
class StepArrays:
    """One step's arrays for `measure`, as NumPy: what `worker.numerics.gradients.gradient_fn` returns."""

    policy: Sequence[np.ndarray]
    """The unscaled gradient under the policy, one array per trainable variable."""
    reference: Sequence[np.ndarray] | None = None
    """float32's, or None (a float32 policy has no reference)."""
    stats: Sequence[Any] = ()
    """The probe's activation statistics (`LayerProbe.statistics`)."""
    signals: Sequence[np.ndarray] = ()
    """The gradient reaching each probed output under the policy (empty: not measured)."""
    reference_signals: Sequence[np.ndarray] = ()


def measure(groups: Sequence[LayerGroup], step: StepArrays) -> list[LayerNumerics]:
    """Every layer's numbers at one step."""
    stats = step.stats
    peaks, finite, subnormal, zeros, sizes = [np.asarray(s) for s in stats] if len(stats) else [np.zeros(0)] * 5
    reference = step.reference
    out = []
    for g in groups:
        fields = _gradient_fields([step.policy[i] for i in g.variables],
                                  None if reference is None else [reference[i] for i in g.variables])
        if g.probed is not None and g.dtype is not None and len(stats):
            k = g.probed
            fields.update(_activation_fields(g.dtype, float(peaks[k]), bool(finite[k]), int(subnormal[k]),
                                             int(zeros[k]), int(sizes[k])))
        if g.probed is not None and len(step.signals):
            fields.update(_signal_fields(np.asarray(step.signals[g.probed]), np.asarray(
                step.reference_signals[g.probed]) if len(step.reference_signals) else None))
        out.append(LayerNumerics(name=g.name, kind=g.kind, **fields))
    return out


def _lost(share: float | None, values: int) -> bool:
    return share is not None and layer_lost(round(share * values), values)


def signal_lost(layer: LayerNumerics) -> bool:
    """Whether the gradient reaching the layer's output loses values to zero that float32 keeps."""
    return _lost(layer.signal_excess_zero_fraction, layer.signal_values)


def weights_lost(layer: LayerNumerics) -> bool:
    """Whether the layer's weights' gradient loses values to zero that float32 keeps."""
    return _lost(layer.excess_zero_fraction, layer.values)


def underflow_layer(layers: Sequence[LayerNumerics]) -> str | None:
    """Where gradient underflow begins, going from the output towards the input as backpropagation does.

    The gradient reaching a layer's output is what it passes on: where that first loses values that
    float32 keeps, underflow begins, and every layer nearer the input inherits the zeros. Weights can
    also lose gradient values on their own, to tiny inputs under an intact signal (the layers above a
    tiny rescaling): when no signal is lost, the layer nearest the output whose weights lose is named.
    """
    for lost in (signal_lost, weights_lost):
        found = next((layer.name for layer in reversed(layers) if lost(layer)), None)
        if found is not None:
            return found
    return None


def near_overflow(layer: LayerNumerics) -> bool:
    """Whether the layer's activations passed its dtype's largest value or came within HEADROOM_DOUBLINGS of it."""
    if layer.activation_dtype is None:
        return False
    if not layer.activation_finite:
        return True
    return layer.activation_headroom_log2 is not None and layer.activation_headroom_log2 < HEADROOM_DOUBLINGS


def overflow_layer(layers: Sequence[LayerNumerics]) -> str | None:
    """Where overflow begins: the first layer, from the input, near or past its dtype's largest value."""
    return next((layer.name for layer in layers if near_overflow(layer)), None)


def layer_check(step: int, compute_dtype: str, scale: float, time: float, layers: list[LayerNumerics]) -> LayerCheck:
    return LayerCheck(step=step, compute_dtype=compute_dtype, loss_scale=scale, layers=layers, time=time,
                      underflow_layer=underflow_layer(layers), overflow_layer=overflow_layer(layers))

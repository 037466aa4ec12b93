"""FP8 layers' scaling state, read in every compiled step: four numbers per tensor, rows on the host.

Keras keeps six float32 variables per FP8 layer (a scale and an amax history for its inputs, its kernel
and its output gradient). They are trainable, and the step "updates" them through a custom gradient
that is the new value (`overwrite_with_gradient`): the optimizer assigns it. So they are not weights.
The engine leaves them out of every gradient statistic, never unscales them, and gives the float32
twin none (`weight_indices`); and it reads them in the compiled step (`step_state`), which the host
turns into `Fp8Tensor` rows (`rows`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keras import ops

from mpjobs.contract.fp8 import FORMATS, TENSORS, Fp8Tensor

FIELDS_PER_TENSOR = 4
"""(scale in force, this step's amax, the history's largest amax, that amax's age in steps)."""


def is_state(variable: Any) -> bool:
    """An FP8 scale or amax history: set to its "gradient", never trained."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def weight_indices(variables: Sequence[Any]) -> list[int]:
    """The positions of the real weights among `variables` (a model's trainable variables): no FP8 state."""
    return [i for i, v in enumerate(variables) if not is_state(v)]


@dataclass(frozen=True)
class Slot:
    """One FP8 tensor of one layer: where its scale and amax history are among the trainable variables."""

    layer: str
    """The layer's path (`dense_1`, `multi_head_attention/query`): unique where names of nested layers are not."""
    tensor: str
    scale: int
    history: int


def slots(variables: Sequence[Any]) -> list[Slot]:
    """Every FP8 tensor of `variables` (a model's trainable variables), in their order."""
    index = {v.path: i for i, v in enumerate(variables) if is_state(v)}
    found = []
    for path in index:
        layer, _, name = path.rpartition("/")
        for tensor in TENSORS:
            if name == f"{tensor}_scale" and f"{layer}/{tensor}_amax_history" in index:
                found.append(Slot(layer, tensor, index[path], index[f"{layer}/{tensor}_amax_history"]))
    return found


def step_state(found: Sequence[Slot], current: Sequence[Any], new: Sequence[Any], applied: Any) -> list[Any]:
    """In the compiled step, FIELDS_PER_TENSOR float32 numbers per slot: the scale the step used (`current`, the
    values before the update), the amax it saw (the new history's first entry, written whether or not the step
    is applied) and, of the history kept (the new one when `applied`, else the old), its largest amax and the
    steps since that amax came in.

    Keras's history: after step t, entry 0 holds t's amax and entry i >= 1 that of step t - n + i (it rolls
    by one and overwrites entry 0). The newest occurrence of the largest value is the one that leaves last.
    """
    out = []
    for s in found:
        fresh = ops.cast(new[s.history], "float32")
        kept = ops.where(applied, fresh, ops.cast(current[s.history], "float32"))
        n = int(kept.shape[0])
        positions = ops.arange(n, dtype="int32")
        ages = ops.where(positions == 0, 0, n - positions)
        peak = ops.max(kept)
        age = ops.min(ops.where(kept == peak, ages, n))
        out += [ops.cast(current[s.scale], "float32"), fresh[0], peak, ops.cast(age, "float32")]
    return out


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def rows(found: Sequence[Slot], values: Sequence[float],
         counts: Mapping[tuple[str, str], tuple[float, float]] | None = None) -> list[Fp8Tensor]:
    """The host's `Fp8Tensor` rows of one step, from `step_state`'s numbers; on a checked step, with `counts`:
    (layer, tensor) -> the exact (saturated, underflow) shares (worker/numerics/fp8_counts.py)."""
    out = []
    for k, s in enumerate(found):
        scale, amax, peak, age = values[k * FIELDS_PER_TENSOR:(k + 1) * FIELDS_PER_TENSOR]
        bound = FORMATS[s.tensor].max * scale
        use = amax / bound if bound > 0 and math.isfinite(bound) and math.isfinite(amax) else math.nan
        out.append(Fp8Tensor(layer=s.layer, tensor=s.tensor,
                             scale=_finite(scale), amax=_finite(amax), range_use=_finite(use),
                             history_max=_finite(peak), peak_age=int(age),
                             **dict(zip(("saturated_fraction", "underflow_fraction"),
                                        (counts or {}).get((s.layer, s.tensor), ()), strict=False))))
    return out

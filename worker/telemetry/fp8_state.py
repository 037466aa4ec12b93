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


def step_state(found: Sequence[Slot], variables: Sequence[Any], new: Sequence[Any], applied: Any) -> Any:
    """In the compiled step, one float32 vector of FIELDS_PER_TENSOR numbers per slot, slot after slot: the scale
    the step used (`variables`' values before the update), the amax it saw (the new history's first entry, written
    whether or not the step is applied) and, of the history kept (the new one when `applied`, else the old), its
    largest amax and the steps since that amax came in. All slots at once: a few ops per step, not per tensor.

    Keras's history: after step t, entry 0 holds t's amax and entry i >= 1 that of step t - n + i (it rolls
    by one and overwrites entry 0). The newest occurrence of the largest value is the one that leaves last.
    """
    groups: dict[int, list[int]] = {}  # slots by history length (one length per job; pinned layers are not FP8)
    for k, s in enumerate(found):
        groups.setdefault(int(new[s.history].shape[0]), []).append(k)
    parts, order = [], []
    for n, members in groups.items():
        fresh = ops.stack([ops.cast(new[found[k].history], "float32") for k in members])
        old = ops.stack([ops.cast(ops.convert_to_tensor(variables[found[k].history]), "float32") for k in members])
        kept = ops.where(applied, fresh, old)
        positions = ops.arange(n, dtype="int32")
        ages = ops.cast(ops.where(positions == 0, 0, n - positions), "float32")
        peak = ops.max(kept, axis=1)
        age = ops.min(ops.where(kept == ops.expand_dims(peak, 1), ops.expand_dims(ages, 0), float(n)), axis=1)
        scales = ops.stack([ops.cast(ops.convert_to_tensor(variables[found[k].scale]), "float32") for k in members])
        parts.append(ops.stack([scales, fresh[:, 0], peak, age], axis=1))
        order += members
    table = parts[0] if len(parts) == 1 else ops.take(ops.concatenate(parts, axis=0),
                                                      [order.index(k) for k in range(len(found))], axis=0)
    return ops.reshape(table, (-1,))


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

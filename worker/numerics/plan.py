"""The precision plan's search (mpjobs/contract/plan.py), on the step of the first flagged layer check.

Each candidate is the job's model rebuilt with some layers in float32 (`layer_policies`), given
the step's weights, differentiated as the layer checks differentiate (worker/numerics/gradients.py)
at a loss scale, and measured layer by layer against the float32 twin's gradient and signals of
the same step (worker/numerics/layer_numerics.py). A candidate holds when no layer loses gradient
values float32 keeps (the `layer_underflow` thresholds), no gradient or activation is non-finite
or within two doublings of the compute dtype's largest value, and the whole gradient is within
PLAN_REL_ERROR of float32's.

The search, greedy:

1. the step as it is: if it holds, nothing is needed;
2. a loss scale alone, doubling up to where float32's largest gradient would no longer fit the
   dtype: the first that holds is the plan; else the one that leaves the least badness is kept;
3. pins, one move at a time: a flagged layer, or it with the layer before or after it in the
   model's order (a layer kept in float32 hands a float32 tensor to a consumer that casts it back,
   so a tiny or huge tensor needs its producer and its consumer pinned together). The move that
   leaves the least badness is taken, the fewest layers first on a tie. Badness counts the layers
   flagged, plus each layer's excess zeros above NOISE_FLOOR and the error beyond the bound:
   summing raw errors chases float16's rounding noise (about 5e-4) and pins the wrong layer.
   The search stops when a candidate holds, when no move lowers the badness, or after
   MAX_CANDIDATES candidates or MAX_SECONDS.

It sees one step: activations that overflow only on other data, or layers whose gradients
underflow only later in training, are not in it (docs/numerics.md, "Precision plan").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
from keras import ops

from mpjobs.contract.plan import PLAN_REL_ERROR, PlanMove, PrecisionPlan
from mpjobs.contract.records import LayerCheck, LayerNumerics
from mpjobs.contract.spec import JobSpec, PrecisionPolicy
from worker.engine.models import build_model
from worker.numerics.gradients import gradient_fn
from worker.numerics.layer_numerics import (
    LayerProbe,
    StepArrays,
    measure,
    near_overflow,
    scale_text,
    signal_lost,
    sum_of_squares,
    weights_lost,
)
from worker.numerics.scale_search import doublings
from worker.telemetry.fp8_state import is_state

MAX_CANDIDATES = 32
"""Candidate plans tried on one step, at most: each rebuilds and differentiates the model once."""
MAX_SECONDS = 60.0
"""The search's time on one step, at most: a large model takes seconds per candidate, and the job waits."""
NOISE_FLOOR = 0.01
"""A layer's excess zeros below this share count for nothing in the badness: float16 rounding, not loss."""


def pinned_builder(spec: JobSpec, on_cpu_tf: bool) -> Callable[[dict[str, str]], keras.Model]:
    """Builds the job's model with `pins` (layer -> policy) on top of the spec's own `layer_policies`."""
    def build(pins: dict[str, str]) -> keras.Model:
        ours = {name: PrecisionPolicy(policy) for name, policy in pins.items()}
        pinned = spec.model_copy(update={"layer_policies": {**spec.layer_policies, **ours}})
        return build_model(pinned, on_cpu_tf=on_cpu_tf).model
    return build


@dataclass(frozen=True)
class Candidate:
    pins: frozenset[str]
    scale: float
    layers: list[LayerNumerics]
    excess: float
    """The whole gradient's excess zeros against float32."""
    rel_error: float | None
    """The whole gradient's relative L2 error against float32's; None when not finite."""
    probed: frozenset[str] = frozenset()
    """The layers a move may pin."""

    @property
    def flagged(self) -> list[str]:
        return [layer.name for layer in self.layers if not layer.grads_finite or signal_lost(layer)
                or weights_lost(layer) or near_overflow(layer)]

    @property
    def off(self) -> list[str]:
        """With no layer flagged, the layers whose gradients are furthest from float32's, beyond the bound: where
        pins may bring the whole gradient within it (up to four, the furthest first)."""
        far = [layer for layer in self.layers if layer.grad_rel_error is not None
               and layer.grad_rel_error > PLAN_REL_ERROR and layer.name in self.probed]
        return [layer.name for layer in sorted(far, key=lambda layer: -(layer.grad_rel_error or 0.0))][:4]

    @property
    def holds(self) -> bool:
        return not self.flagged and self.rel_error is not None and self.rel_error <= PLAN_REL_ERROR

    @property
    def badness(self) -> float:
        excess = sum(max(0.0, (layer.excess_zero_fraction or 0.0) - NOISE_FLOOR) for layer in self.layers)
        beyond = 1.0 if self.rel_error is None else max(0.0, self.rel_error - PLAN_REL_ERROR)
        return len(self.flagged) + excess + beyond


def _values_for(variables: Sequence[Any], values: Sequence[Any], source: Sequence[Any] = ()) -> list[Any]:
    """The job's weight values for a pinned copy's variables, in its dtypes; refused unless the shapes match.
    With `source` (the job's variables, trainable): an FP8 layer's state by its path, where the copy's layer is
    FP8 too (a pinned layer is not), weights by position."""
    state = {v.path: value for v, value in zip(source, values, strict=True) if is_state(v)}
    values = [value for v, value in zip(source, values, strict=True) if not is_state(v)] if source else values
    weights = [v for v in variables if not is_state(v)]
    shapes = [tuple(v.shape) for v in weights]
    if shapes != [tuple(np.shape(value)) for value in values]:
        raise ValueError(f"Expected the pinned copy's variables to match the model's. Received shapes {shapes}.")
    given = iter(values)
    return [ops.cast(state.get(v.path, v.value), v.dtype) if is_state(v) else ops.cast(next(given), v.dtype)
            for v in variables]


class Candidates:
    """Pinned copies of the job's model differentiated on one step, each built once."""

    def __init__(self, build: Callable[[dict[str, str]], keras.Model], loss: Any, model: keras.Model,
                 values: tuple[Sequence[Any], Sequence[Any]], x: np.ndarray, y: np.ndarray,
                 reference: Sequence[np.ndarray], reference_signals: Sequence[Any]) -> None:
        self.build, self.loss, self.x, self.y = build, loss, x, y
        self.reference, self.reference_signals = reference, reference_signals
        # By position, not by path: a copy built in the same session names the sublayers Keras names itself
        # anew (a transformer's `position_embedding/embedding_2`), while its variables come in the same order.
        self.trainable, self.non_trainable = list(values[0]), list(values[1])
        self.source = list(model.trainable_variables)
        self.evaluated, self.deadline = 0, time.monotonic() + MAX_SECONDS
        self._built: dict[frozenset[str], tuple[keras.Model, LayerProbe, Any]] = {}

    @property
    def exhausted(self) -> bool:
        """MAX_CANDIDATES tried, or MAX_SECONDS spent."""
        return self.evaluated >= MAX_CANDIDATES or time.monotonic() > self.deadline

    def __call__(self, pins: frozenset[str], scale: float) -> Candidate:
        self.evaluated += 1
        if pins in self._built:  # only the unpinned model is tried again (at each scale): the others once each
            model, probe, fn = self._built[pins]
        else:
            model = self.build(dict.fromkeys(sorted(pins), "float32"))
            probe = LayerProbe(model)
            fn = gradient_fn(model, self.loss, probe)
            if not pins:  # kept; a pinned copy is not, so a large model's 32 candidates are never held at once
                self._built[pins] = (model, probe, fn)
        trainable = _values_for(model.trainable_variables, self.trainable, self.source)
        non_trainable = _values_for(model.non_trainable_variables, self.non_trainable)
        grads, stats, signals = fn(trainable, non_trainable, self.x, self.y, ops.convert_to_tensor(scale, "float32"))
        policy = [np.asarray(ops.convert_to_numpy(g), dtype=np.float32) for g in grads]
        arrays = StepArrays(policy, self.reference, [ops.convert_to_numpy(s) for s in stats],
                            [ops.convert_to_numpy(s) for s in signals], self.reference_signals)
        flat = np.concatenate([p.ravel() for p in policy]).astype(np.float64)
        ref = np.concatenate([r.ravel() for r in self.reference]).astype(np.float64)
        excess = float(np.count_nonzero((flat == 0) & (ref != 0)) / max(1, flat.size))
        norm = math.sqrt(sum_of_squares(ref))
        rel = (math.sqrt(sum_of_squares(flat - ref)) / norm
               if np.isfinite(flat).all() and norm > 0 else None)
        names = frozenset(g.name for g in probe.groups if g.name != model.name)
        return Candidate(pins, scale, measure(probe.groups, arrays), excess, rel, names)


def _move(before: Candidate, after: Candidate, pinned: frozenset[str] = frozenset(),
          scale: float | None = None, order: Sequence[str] = ()) -> PlanMove:
    fixed = [n for n in before.flagged if n not in after.flagged]
    return PlanMove(pinned=sorted(pinned, key=lambda n: (order.index(n) if n in order else len(order), n)),
                    loss_scale=scale, fixed=fixed, flagged=after.flagged,
                    excess_zero_fraction=after.excess, grad_rel_error=after.rel_error)


def _moves(flagged: Sequence[str], names: Sequence[str], pinned: frozenset[str]) -> list[frozenset[str]]:
    """Each flagged layer alone, with the layer before it and with the layer after it, less what is pinned."""
    out: list[frozenset[str]] = []
    for name in flagged:
        i = names.index(name)
        for group in ([name], names[max(0, i - 1):i + 1], names[i:i + 2]):
            move = frozenset(group) - pinned
            if move and move not in out:
                out.append(move)
    return sorted(out, key=lambda m: (len(m), sorted(m)))


def search(check: LayerCheck, policy: str, names: Sequence[str], evaluate: Candidates, cap: float) -> PrecisionPlan:
    """The plan for `check`'s step: `names` the layers in the model's order, `cap` the largest scale to try."""
    start = evaluate(frozenset(), check.loss_scale)
    moves = [_move(start, start)]
    best = start
    if not start.holds:  # 2. a loss scale alone
        for scale in doublings(check.loss_scale, cap):
            if evaluate.exhausted:
                break
            tried = evaluate(frozenset(), scale)
            if tried.badness < best.badness:
                best = tried
            if tried.holds:
                break
        if best is not start:
            moves.append(_move(start, best, scale=best.scale))
    current = best
    while not current.holds and not evaluate.exhausted:  # 3. pins, greedily
        options = []
        for move in _moves(current.flagged or current.off, names, current.pins):
            if evaluate.exhausted:
                break
            options.append(evaluate(current.pins | move, current.scale))
        better = min(options, key=lambda c: (c.badness, len(c.pins)), default=None)
        if better is None or better.badness >= current.badness:
            break
        moves.append(_move(current, better, pinned=better.pins - current.pins, order=names))
        current = better
    return PrecisionPlan(
        step=check.step, policy=policy, compute_dtype=check.compute_dtype, loss_scale=check.loss_scale,
        proposed_scale=None if current.scale == check.loss_scale else current.scale,
        layer_policies=dict.fromkeys(sorted(current.pins, key=names.index), "float32"), holds=current.holds,
        moves=moves, evaluated=evaluate.evaluated, message=_words(check, current, start, names))


def _words(check: LayerCheck, plan: Candidate, start: Candidate, names: Sequence[str]) -> str:
    pins = ", ".join(f"`{n}`" for n in names if n in plan.pins)
    scale = f"a loss scale of at least {scale_text(plan.scale)}" if plan.scale != check.loss_scale else ""
    at = f"at step {check.step}"
    if start.holds:
        return f"Nothing needs pinning {at}: the step matches float32 as it is."
    if plan.holds and not plan.pins:
        return f"A loss scale alone suffices {at}: {scale} keeps every layer's gradients, with no layer in float32."
    what = " and ".join(p for p in (f"keeping {pins} in float32" if pins else "", scale) if p)
    if plan.holds:
        return (f"With {what}, {at} no layer loses gradient values that float32 keeps, no activation nears "
                f"overflow, and the gradient is within {plan.rel_error:.2%} of float32's.")
    error = "not finite" if plan.rel_error is None else f"{plan.rel_error:.2%} from float32's"
    left = (f"still flags {', '.join(f'`{n}`' for n in plan.flagged)} (gradient {error})" if plan.flagged else
            f"flags no layer, but the gradient is {error} (the bound is {PLAN_REL_ERROR:.0%})")
    return f"No plan found that holds {at}: the best, {what or 'the step as it is'}, {left}."

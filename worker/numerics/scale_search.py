"""Trying a step again at doubling loss scales: how far to go, what recovers a layer, and how to ask for a scale.

The smallest float32 magnitude lost against the dtype's smallest positive value says about
how far a gradient fell short, but the gradients flowing between layers can be smaller than
any weight's, so scales are tried on the step itself: from twice the scale in force up to where
the largest float32 gradient would no longer fit the dtype (worker/numerics/float32_check.py for the
whole model, `layer_recovery` for the layer where underflow begins).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from mpjobs.contract.records import LayerCheck
from worker.numerics.layer_numerics import LARGEST, LayerGroup, StepArrays, measure, scale_text, underflow_layer

MAX_TRIED_SCALE = 2.0**40
"""No recovery scale above this is tried: larger than any scale used in practice."""
RECOVERED_REL_ERROR = 0.1
"""A layer's gradients count as recovered when none is lost and they are within this of float32's (relative
L2): a gradient that survives as float16's smallest subnormal is not zero, but it is off by up to half."""


def power_of_two(value: float, up: bool) -> float:
    return 2.0 ** (math.ceil(math.log2(value)) if up else math.floor(math.log2(value)))


def largest_scale(reference: Sequence[np.ndarray], dtype: str) -> float:
    """The largest scale tried: where the largest float32 gradient would no longer fit the dtype."""
    peak = max((float(np.abs(r).max()) for r in reference if r.size), default=0.0)
    return min(MAX_TRIED_SCALE, power_of_two(LARGEST[dtype] / peak, up=False) if peak > 0 else MAX_TRIED_SCALE)


def doublings(scale: float, cap: float) -> Iterator[float]:
    """2·scale, 4·scale, ... up to `cap`."""
    while scale * 2 <= cap:
        scale *= 2
        yield scale


def layer_recovery(check: LayerCheck, group: LayerGroup, arrays: StepArrays, dtype: str,
                   policy_at: Callable[[float], tuple[list[np.ndarray], Any, list[Any]]]) -> LayerCheck:
    """`check` with its `recovery`: from which doubled scale does the underflow layer keep its gradients?"""
    assert arrays.reference is not None
    tried, found = check.loss_scale, None
    for tried in doublings(check.loss_scale, largest_scale(arrays.reference, dtype)):
        policy, _, signals = policy_at(tried)
        if not all(bool(np.isfinite(p).all()) for p in policy):
            return check.model_copy(update={"recovery": "overflows_first", "recovery_scale": tried})
        (found,) = measure([group], replace(arrays, policy=policy, stats=(), signals=signals))
        error = found.grad_rel_error
        if underflow_layer([found]) is None and (error is None or error <= RECOVERED_REL_ERROR):
            return check.model_copy(update={"recovery": "recovered", "recovery_scale": tried,
                                            "recovery_excess_zero_fraction": found.excess_zero_fraction,
                                            "recovery_grad_rel_error": error})
    return check.model_copy(update={
        "recovery": "not_by_scaling", "recovery_scale": tried,
        "recovery_excess_zero_fraction": None if found is None else found.excess_zero_fraction,
        "recovery_grad_rel_error": None if found is None else found.grad_rel_error})


def how_to_scale(mode: str, scale: float) -> str:
    """How a job in loss-scale `mode` gets a scale of at least `scale`."""
    dynamic = ("'dynamic' (it starts at 32768 and halves only on overflow)" if scale <= 32768
               else f"'dynamic' with initial_scale {scale_text(scale)}")
    if mode == "none":
        return f"Turn on loss scaling: loss_scale {dynamic}, or 'fixed' with a scale of at least {scale_text(scale)}."
    if mode == "fixed":
        return f"Raise the fixed scale to at least {scale_text(scale)}, or use loss_scale {dynamic}."
    return (f"The dynamic scale was lower than that at this step: start it at initial_scale {scale_text(scale)} "
            "or more; if overflow keeps pulling it down, the gradients span more than float16's range, so keep "
            "the most affected layer in float32 or use mixed_bfloat16.")

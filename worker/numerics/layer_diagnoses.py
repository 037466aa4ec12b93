"""The layer checks' findings in plain words, with their numbers: where underflow begins, where overflow looms.

>>> from mpjobs.contract.records import LayerCheck, LayerNumerics
>>> check = LayerCheck(step=1, compute_dtype="float16", loss_scale=1.0, time=0.0, layers=[
...     LayerNumerics(name="dense", kind="Dense", values=40, excess_zero_fraction=1.0, lost_min_log2=-30.2),
...     LayerNumerics(name="dense_1", kind="Dense", values=40, excess_zero_fraction=0.0,
...                   activation_dtype="float16", activation_max=61000.0, activation_headroom_log2=0.1)],
...     underflow_layer="dense", overflow_layer="dense_1", recovery="recovered", recovery_scale=1024.0,
...     recovery_excess_zero_fraction=0.0, recovery_grad_rel_error=0.0012)
>>> import textwrap
>>> print(textwrap.fill(underflow_words(check, "mixed_float16"), 100))
Gradient underflow begins at layer `dense` (step 1): 100% of its gradient values are zero under
mixed_float16 but not in float32; it is the first layer with weights. A loss scale of 1024 would
bring its smallest gradients above float16's floor (2^-24): the same step tried at 1024 lost none of
this layer's values, and its gradient was within 0.2% of float32's.
>>> print(textwrap.fill(overflow_words(check), 100))
Activations of `dense_1` reach 61,000, 93.12% of float16's maximum (65,504), at step 1: one more
doubling overflows. Keep this layer in float32 or normalise its input.
"""

from __future__ import annotations

import math

from mpjobs.contract.records import LayerCheck, LayerNumerics
from worker.numerics.layer_numerics import LARGEST, SMALLEST, floor_percent, scale_text, signal_lost, weights_lost


def _layer(check: LayerCheck, name: str) -> tuple[int, LayerNumerics]:
    return next((i, layer) for i, layer in enumerate(check.layers) if layer.name == name)


def _lost(layer: LayerNumerics) -> bool:
    return weights_lost(layer) or signal_lost(layer)


def _percent_up(share: float) -> str:
    """A relative error as a percentage, never rounded down to 0%."""
    return f"{math.ceil(share * 1000) / 10:g}%"


def underflow_words(check: LayerCheck, policy: str) -> str:
    """Where gradient underflow begins at `check`, what the layers below it inherit, and the scale that helps."""
    assert check.underflow_layer is not None
    index, layer = _layer(check, check.underflow_layer)
    dtype = check.compute_dtype
    below = [b for b in check.layers[:index] if b.values]
    lost_below = sum(_lost(b) for b in below)
    if not below:
        inherit = "it is the first layer with weights"
    elif lost_below == len(below):
        inherit = f"every layer below it inherits zeros ({len(below)} with weights, all losing gradients)"
    elif lost_below:
        inherit = f"{lost_below} of the {len(below)} layers with weights below it lose gradients too"
    else:
        inherit = f"the {len(below)} layers with weights below it keep theirs"
    weights = (f"{floor_percent(layer.excess_zero_fraction or 0.0)} of its gradient values" if layer.values
               else "it has no weights")
    if signal_lost(layer):
        what = (f"{floor_percent(layer.signal_excess_zero_fraction or 0.0)} of the gradient reaching its output is "
                f"zero under {policy} but not in float32 ({weights}" + (" too)" if layer.values else ")"))
    else:
        what = f"{weights} are zero under {policy} but not in float32"
    text = f"Gradient underflow begins at layer `{layer.name}` (step {check.step}): {what}; {inherit}."
    floor = f"{dtype}'s floor (2^{math.log2(SMALLEST[dtype]):g})"
    keep = "keep this layer in float32" + (", or use mixed_bfloat16, whose range is float32's." if dtype == "float16"
                                           else ".")
    at, scale = check.recovery_scale, scale_text(check.recovery_scale or 1.0)
    if check.recovery == "recovered":
        left, error = check.recovery_excess_zero_fraction or 0.0, check.recovery_grad_rel_error
        kept = f"lost only {floor_percent(left)} of this layer's values" if left else "lost none of this layer's values"
        close = "" if error is None else f", and its gradient was within {_percent_up(error)} of float32's"
        return (f"{text} A loss scale of {scale} would bring its smallest gradients above {floor}: the same step "
                f"tried at {scale} {kept}{close}.")
    if check.recovery == "overflows_first":
        return (f"{text} No loss scale fits: the same step tried at doubling scales overflows {dtype} at {scale} "
                f"before this layer's gradients come back, so {keep}")
    if check.recovery == "not_by_scaling" and at is not None:
        error = check.recovery_grad_rel_error
        off = "" if error is None else f", its gradient {_percent_up(error)} off float32's"
        return (f"{text} A larger loss scale does not help: tried on the same step up to {scale} (the largest at "
                f"which its gradients fit in {dtype}), this layer still lost "
                f"{floor_percent(check.recovery_excess_zero_fraction or 0.0)} of its values{off}. They are lost "
                f"to {dtype}'s precision in the forward pass, not to underflow: {keep}")
    if layer.lost_min_log2 is not None:
        needed = 2.0 ** math.ceil(math.log2(SMALLEST[dtype]) - layer.lost_min_log2)
        if needed > check.loss_scale:
            text += (f" Its smallest lost gradients (2^{layer.lost_min_log2:.1f}) need a loss scale of at least "
                     f"{scale_text(needed)} to clear {floor}.")
    return text


def overflow_words(check: LayerCheck) -> str:
    """The layer whose activations near (or pass) their dtype's largest value at `check`, with the numbers."""
    assert check.overflow_layer is not None
    _, layer = _layer(check, check.overflow_layer)
    dtype = layer.activation_dtype or check.compute_dtype
    limit = LARGEST[dtype]
    advice = "Keep this layer in float32 or normalise its input."
    if not layer.activation_finite or layer.activation_max is None:
        return (f"Activations of `{layer.name}` overflow {dtype} at step {check.step}: they hold inf or NaN, past "
                f"{dtype}'s maximum ({limit:,.6g}). {advice}")
    headroom = layer.activation_headroom_log2 or 0.0
    doublings = math.floor(headroom) + 1
    more = "one more doubling overflows" if doublings == 1 else f"{doublings} more doublings overflow"
    return (f"Activations of `{layer.name}` reach {layer.activation_max:,.5g}, "
            f"{floor_percent(layer.activation_max / limit)} of {dtype}'s maximum ({limit:,.6g}), at step "
            f"{check.step}: {more}. {advice}")

"""A precision plan: which layers to keep in float32, and what loss scale, so that a job's step matches float32.

Proposed by the worker on the first layer check that finds underflow or overflow
(worker/numerics/plan.py), on that step's own weights and batch, and carried by that check
(`LayerCheck.plan`; `GET /jobs/{id}/plan`). It is given as the spec fragment that applies it
(`layer_policies`, `loss_scale`) and as the lines of Keras that apply it to the user's own model.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from mpjobs.contract.strict import Strict

PLAN_REL_ERROR = 0.05
"""The plan's bound on the whole gradient's error against float32's (relative L2) at the planned step."""


class PlanMove(Strict):
    """One step of the search: what it changed, and what the step's gradient looked like after it."""

    pinned: list[str] = []
    """Layers this move put in float32 (a producer and its consumer move together)."""
    loss_scale: float | None = None
    """The loss scale this move set; null: unchanged."""
    fixed: list[str] = []
    """Layers flagged before this move and not after it."""
    flagged: list[str] = []
    """Layers still flagged after it: losing gradient values float32 keeps, or near overflow."""
    excess_zero_fraction: float | None = None
    """The whole gradient's share of values zero under the plan so far, not in float32."""
    grad_rel_error: float | None = None
    """The whole gradient's error against float32's (relative L2); null when not finite."""


class PrecisionPlan(Strict):
    """The smallest set of layers to keep in float32, found greedily, and the loss scale; and whether it holds."""

    step: int
    policy: str
    compute_dtype: str
    loss_scale: float
    """The scale in force at the step."""
    proposed_scale: float | None = None
    """A loss scale the plan needs (at least this); null: the job's own scaling suffices."""
    layer_policies: dict[str, str] = {}
    """The layers to keep in float32, as `JobSpec.layer_policies` takes them."""
    holds: bool
    """Whether, with the plan, no layer loses gradient values float32 keeps (the `layer_underflow` thresholds),
    the gradient is within `max_grad_rel_error` of float32's, and no activation is within two doublings of the
    compute dtype's largest value, at this step."""
    max_grad_rel_error: float = PLAN_REL_ERROR
    moves: list[PlanMove] = []
    """The search, in order; the first records the step as it was."""
    evaluated: int = Field(0, ge=0)
    """Candidate plans tried on the step."""
    message: str


def spec_fragment(plan: PrecisionPlan, mode: str) -> dict[str, object]:
    """The fields of a job spec that apply `plan` (`mode`: the job's loss-scale mode).

    >>> p = PrecisionPlan(step=1, policy="mixed_float16", compute_dtype="float16", loss_scale=1.0,
    ...                   proposed_scale=1024.0, layer_policies={"dense_1": "float32"}, holds=True, message="")
    >>> spec_fragment(p, "none")
    {'layer_policies': {'dense_1': 'float32'}, 'loss_scale': {'mode': 'fixed', 'scale': 1024.0}}
    """
    fragment: dict[str, object] = {"layer_policies": dict(plan.layer_policies)}
    if plan.proposed_scale is not None:
        fragment["loss_scale"] = ({"mode": "dynamic", "initial_scale": plan.proposed_scale} if mode == "dynamic"
                                  else {"mode": "fixed", "scale": plan.proposed_scale})
    return fragment


def keras_lines(plan: PrecisionPlan) -> str:
    """Lines of Keras that apply the plan to the user's own model (`model`, built under the job's policy).

    >>> p = PrecisionPlan(step=1, policy="mixed_float16", compute_dtype="float16", loss_scale=1.0,
    ...                   proposed_scale=None, layer_policies={"dense_1": "float32"}, holds=True, message="")
    >>> print(keras_lines(p))
    # Keep these layers in float32 (mpjobs precision plan, step 1), then compile:
    for name in ["dense_1"]:
        model.get_layer(name).dtype_policy = "float32"
    """
    lines = [f"# Keep these layers in float32 (mpjobs precision plan, step {plan.step}), then compile:"]
    if plan.layer_policies:
        lines += [f"for name in {sorted(plan.layer_policies)!r}:".replace("'", '"'),
                  '    model.get_layer(name).dtype_policy = "float32"']
    else:
        lines[0] = f"# No layer needs float32 (mpjobs precision plan, step {plan.step})."
    if plan.proposed_scale is not None:
        lines.append(f"optimizer = keras.optimizers.LossScaleOptimizer(optimizer, "
                     f"initial_scale={plan.proposed_scale:g})")
    return "\n".join(lines)


class PlanView(Strict):
    """`GET /jobs/{id}/plan`: the job's precision plan, as a spec fragment and as lines of Keras."""

    job_id: str
    plan: PrecisionPlan
    spec_fragment: dict[str, Any]
    """The fields of a job spec that apply the plan on top of the job's own (`layer_policies` merged with the
    spec's, and `loss_scale` when the plan needs one)."""
    keras: str
    """Lines of Keras that apply it to the user's own model (`keras_lines`)."""

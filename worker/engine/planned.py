"""`plan: "auto"`: find the precision plan of the job's own step 1 before training, then train with it.

A comparison's plan variant (`ComparisonSpec.plan`) is the planned variant's job with this set. The
same seed and data give it the same initial weights and first batch as that variant's own job, so
its step-1 layer check, and the plan it proposes, are the ones that job finds at its step 1
(worker/numerics/plan.py). The plan is a function of the spec alone: every attempt derives it again
and trains the same planned model, so a resumed attempt matches its checkpoint.
"""

from __future__ import annotations

import keras

from app.core.config import Settings
from mpjobs.contract.plan import PrecisionPlan
from mpjobs.contract.spec import DynamicLossScale, FixedLossScale, JobSpec, PrecisionPolicy
from worker.engine.data import hold_out, load_dataset
from worker.engine.models import build_model, token_ids
from worker.engine.optimizers import make_optimizer
from worker.numerics.float32_check import Float32Check
from worker.numerics.plan import pinned_builder
from worker.telemetry.batch_loss import compiled_loss


def applied(spec: JobSpec, plan: PrecisionPlan) -> JobSpec:
    """`spec` with `plan`'s layers in float32 (on top of its own) and its loss scale, if it needs one."""
    pins = {**spec.layer_policies, **{name: PrecisionPolicy(p) for name, p in plan.layer_policies.items()}}
    update: dict[str, object] = {"layer_policies": pins}
    if plan.proposed_scale is not None:
        dynamic = spec.loss_scale is not None and spec.loss_scale.mode == "dynamic"
        update["loss_scale"] = (DynamicLossScale(initial_scale=plan.proposed_scale) if dynamic
                                else FixedLossScale(scale=plan.proposed_scale))
    return spec.model_copy(update=update)


def planned_spec(spec: JobSpec, on_cpu_tf: bool, settings: Settings) -> tuple[JobSpec, PrecisionPlan | None]:
    """The spec to train, and the plan it applies: `spec` itself and None unless it asks for `plan: "auto"`
    under a float16/bfloat16 policy. A step 1 that flags nothing gets the plan that says so."""
    policy = spec.precision_policy
    if spec.plan != "auto" or (policy.compute_dtype == "float32" and spec.fp8 is None):
        return spec, None
    keras.utils.set_random_seed(spec.training.seed)
    built = build_model(spec, on_cpu_tf=on_cpu_tf)
    model, optimizer = built.model, make_optimizer(spec)
    model.compile(optimizer=optimizer, loss=built.loss, auto_scale_loss=False)
    optimizer.build(model.trainable_variables)
    dataset = load_dataset(spec, tuple(model.input_shape[1:]), tuple(model.output_shape[1:]), built.loss_name,
                           settings.data_root, token_ids(model, spec), settings.datasets_dir())
    dataset, _ = hold_out(spec, dataset, tuple(model.input_shape[1:]), settings.data_root, settings.datasets_dir())
    x, y = next(iter(dataset.batches(0, 1)))
    twin = spec.model_copy(update={"precision_policy": PrecisionPolicy.FLOAT32, "layer_policies": {}, "fp8": None})
    check = Float32Check(
        build_twin=lambda: build_model(twin, on_cpu_tf=on_cpu_tf).model, loss=compiled_loss(built.loss), every=1,
        layer_every=1, start_step=0, batch_size=spec.training.batch_size, compute_dtype=policy.compute_dtype,
        mode=optimizer.mode, need_advice=lambda: False, build_pinned=pinned_builder(spec, on_cpu_tf),
        always_plan=True, fp8=spec.fp8 is not None)
    check.set_model(model)
    check.check(1, x[:spec.training.batch_size], y[:spec.training.batch_size])
    plan = check.layer_results[1].plan
    keras.backend.clear_session(free_memory=False)
    return (spec, None) if plan is None else (applied(spec, plan), plan)

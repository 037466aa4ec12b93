"""The float32 and layer checks a job runs (worker/numerics/float32_check.py), set up from its spec."""

from __future__ import annotations

from mpjobs.contract.spec import JobSpec, PrecisionPolicy
from worker.engine.models import BuiltModel, build_model
from worker.numerics.float32_check import Float32Check
from worker.numerics.plan import pinned_builder
from worker.numerics.summary import SummaryBuilder
from worker.telemetry.batch_loss import compiled_loss


def make_check(spec: JobSpec, built: BuiltModel, mode: str, start: int, replicated: bool, on_cpu_tf: bool,
               builder: SummaryBuilder) -> Float32Check | None:
    """The job's checks, or None when none is due: a float32 policy without FP8 layers and without layer checks.

    The checks differentiate outside the compiled step, on one device: off on several (docs/numerics.md).
    An FP8 job compares with float32 whatever its policy: FP8 is not float32 even around float32 layers.
    """
    t, policy = spec.training, spec.precision_policy
    half = (policy.compute_dtype != "float32" or spec.fp8 is not None) and not replicated
    every = t.underflow_check_every if half else 0
    layer_every = 0 if replicated else t.layer_check_every if t.layer_check_every is not None else every
    if every <= 0 and layer_every <= 0:
        return None
    twin_spec = spec.model_copy(update={"precision_policy": PrecisionPolicy.FLOAT32, "layer_policies": {},
                                        "fp8": None})
    return Float32Check(
        build_twin=lambda: build_model(twin_spec, on_cpu_tf=on_cpu_tf).model, loss=compiled_loss(built.loss),
        every=every, layer_every=layer_every, start_step=start, batch_size=t.batch_size,
        compute_dtype=policy.compute_dtype, mode=mode, build_pinned=pinned_builder(spec, on_cpu_tf),
        need_advice=lambda: builder.underflow_advice is None, on_error=builder.set_check_error,
        fp8=spec.fp8 is not None)

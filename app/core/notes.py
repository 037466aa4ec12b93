"""What a valid spec asks for that will not do what it seems to: said when the job is submitted.

>>> from mpjobs.contract.spec import JobSpec
>>> spec_notes(JobSpec.model_validate({"model": {"name": "mlp"}, "loss_scale": "dynamic"}))[0][:58]
'Loss scaling has no effect under float32: float32 holds th'
"""

from __future__ import annotations

from mpjobs.contract.spec import JobSpec


def spec_notes(spec: JobSpec) -> list[str]:
    """Today one: loss scaling under a policy that does not compute in float16."""
    scale, compute = spec.loss_scale, spec.precision_policy.compute_dtype
    if scale is None or scale.mode == "none" or compute == "float16":
        return []
    if compute == "float32":
        why = ("float32 holds the gradients that float16 would flush to zero, so there is nothing for the "
               "scale to lift")
    else:
        why = (f"{compute} keeps float32's exponent range, so gradients do not underflow as they do in "
               "float16; what bfloat16 loses is precision, which no scale restores")
    effect = ("it multiplies and divides every gradient by a power of two, which changes nothing, and a "
              "dynamic scale may still skip a step that overflows at its high initial value")
    return [f"Loss scaling has no effect under {spec.precision_policy.value}: {why}; {effect}. "
            "Use loss_scale 'none', or a float16 policy to see what scaling does."]

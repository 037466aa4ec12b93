"""What a valid spec asks for that will not do what it seems to: said when the job is submitted.

>>> from mpjobs.contract.spec import JobSpec
>>> spec_notes(JobSpec.model_validate({"model": {"name": "mlp"}, "loss_scale": "dynamic"}))[0][:58]
'Loss scaling has no effect under float32: float32 holds th'
"""

from __future__ import annotations

from mpjobs.contract.model_specs import Conv3dUnetModel, KerasJsonModel, TransformerModel
from mpjobs.contract.spec import JobSpec


def spec_notes(spec: JobSpec) -> list[str]:
    """Loss scaling under a policy that does not compute in float16; a model.keras that needs mpjobs's classes."""
    return _scaling_notes(spec) + _takeaway_notes(spec) + _fp8_notes(spec)


def _fp8_notes(spec: JobSpec) -> list[str]:
    """FP8 is fast only on GPUs with FP8 units; elsewhere Keras simulates it."""
    if spec.fp8 is None:
        return []
    compute = spec.precision_policy.compute_dtype
    return [f"fp8: the Dense and EinsumDense layers train in FP8 around {compute}. Without FP8 units (any CPU, "
            "and GPUs before Hopper or Ada) Keras simulates FP8: it rounds inputs and kernel to float8_e4m3fn "
            f"and output gradients to float8_e5m2, then multiplies in {compute}. The numbers are FP8's; the "
            "speed is not, and such a job is slower than without fp8. Its scaling state is in each step's "
            "`fp8` (docs/numerics.md, \"FP8\")."]


def _takeaway_notes(spec: JobSpec) -> list[str]:
    """The built-in classes a trained model.keras holds that plain Keras does not have (worker/engine/takeaway.py)."""
    m = spec.model
    if isinstance(m, TransformerModel):
        needs, elsewhere = "the transformer's PositionEmbedding layer", "not even with compile=False"
    elif isinstance(m, Conv3dUnetModel):
        needs, elsewhere = "conv3d_unet's loss ScanVoxelSum", "only uncompiled, with compile=False"
    elif isinstance(m, KerasJsonModel) and m.loss == "output_mean":
        needs, elsewhere = "the loss 'output_mean'", "only uncompiled, with compile=False"
    else:
        return []
    return [f"The trained model.keras uses {needs}, a class of the mpjobs worker that Keras does not have: "
            "keras.models.load_model loads it only where worker/engine/models.py is imported, elsewhere "
            f"{elsewhere}. Models of Keras's own classes (mlp, cnn, keras_json) load with plain Keras."]


def _scaling_notes(spec: JobSpec) -> list[str]:
    """Loss scaling under a policy that does not compute in float16."""
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

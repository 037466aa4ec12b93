"""Worked OpenAPI examples: one per precision policy and per loss-scale mode."""

from __future__ import annotations

from typing import Any

_TRAINING = {"steps": 200, "batch_size": 32, "optimizer": "adam", "learning_rate": 0.001, "seed": 0}


def _example(summary: str, **fields: Any) -> dict[str, Any]:
    value = {"model": {"name": "mlp"}, "training": _TRAINING, **fields}
    return {"summary": summary, "value": value}


SPEC_EXAMPLES: dict[str, dict[str, Any]] = {
    "float32": _example("float32 baseline", precision_policy="float32"),
    "mixed_float16_dynamic": _example(
        "mixed_float16 + dynamic loss scaling (the usual choice on GPUs)",
        precision_policy="mixed_float16",
        loss_scale={"mode": "dynamic", "initial_scale": 32768, "growth_steps": 2000},
    ),
    "mixed_float16_fixed": _example(
        "mixed_float16 + a fixed loss scale", precision_policy="mixed_float16",
        loss_scale={"mode": "fixed", "scale": 1024},
    ),
    "mixed_float16_none": _example(
        "the zero-gradient report: mixed_float16 without loss scaling",
        model={"name": "conv3d_unet", "volume": 16, "filters": 8, "reference_edge": 384},
        precision_policy="mixed_float16", loss_scale="none",
        training={"steps": 20, "batch_size": 2, "optimizer": "sgd", "learning_rate": 0.1},
        dataset={"kind": "synthetic", "samples": 32},
    ),
    "mixed_bfloat16": _example("mixed_bfloat16 (no loss scaling needed)", precision_policy="mixed_bfloat16"),
    "float16": _example("pure float16, variables too, with dynamic scaling", precision_policy="float16",
                        loss_scale="dynamic"),
    "bfloat16": _example("pure bfloat16, variables too", precision_policy="bfloat16"),
}

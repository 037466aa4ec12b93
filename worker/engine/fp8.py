"""FP8 layers: Keras's float8 policy put on a built model's Dense and EinsumDense layers (`spec.fp8`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras

from mpjobs.contract.fp8 import Fp8Layers, Fp8Spec


def fp8_classes() -> tuple[type, ...]:
    return (keras.layers.Dense, keras.layers.EinsumDense)


def apply_fp8(model: keras.Model, fp8: Fp8Spec, source: str, pins: Mapping[str, Any]) -> Fp8Layers:
    """Turn the model's Dense and EinsumDense layers that compute in `source` into FP8 (not those `pins` names,
    nor subclasses, which Keras cannot quantize). Returns the FP8 layers and the layers with weights of their own
    that kept their policy, both by path (`multi_head_attention/query` for a layer inside another)."""
    from keras.dtype_policies import QuantizedFloat8DTypePolicy

    chosen: list[str] = []
    for layer in model._flatten_layers(include_self=False):
        if type(layer) in fp8_classes() and layer.name not in pins and layer.dtype_policy.name == source:
            layer.dtype_policy = QuantizedFloat8DTypePolicy("float8", source,
                                                            amax_history_length=fp8.amax_history_length)
            chosen.append(layer.path)
    kept = [layer.path for layer in model._flatten_layers(include_self=False)
            if layer.path not in chosen and any(v.trainable for v in layer._trainable_variables)]
    return Fp8Layers(amax_history_length=fp8.amax_history_length, layers=chosen, kept=kept)

"""The names of a model's layers, known without Keras: what a spec's `layer_policies` may name.

A built-in model names every layer itself, with the names Keras gives them in a fresh process
(`dense`, `dense_1`, ...), so that a name means the same layer in every worker however many
models it built before: `worker/engine/models.py` takes them from `BuiltinNames`, in build order.
A `keras_json` model's names are in its JSON: every layer of the model, of the models nested in
it, and the layer inside a wrapper (TimeDistributed, Bidirectional), input layers left out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from mpjobs.contract.model_specs import (
    CnnModel,
    Conv3dUnetModel,
    KerasJsonModel,
    MlpModel,
    TransformerModel,
    walk_config,
)

WRAPPED = ("layer", "forward_layer", "backward_layer")
"""The config keys under which Keras's wrappers keep the layers they wrap."""


class BuiltinNames:
    """Keras's own naming, per kind: the first Dense is `dense`, the next `dense_1`.

    >>> names = BuiltinNames()
    >>> names("dense"), names("dense"), names("probs"), names("dense")
    ('dense', 'dense_1', 'probs', 'dense_2')
    """

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.names: list[str] = []

    def __call__(self, kind: str) -> str:
        count = self.seen.get(kind, 0)
        self.seen[kind] = count + 1
        name = kind if count == 0 else f"{kind}_{count}"
        self.names.append(name)
        return name


def builtin_names(model: MlpModel | CnnModel | Conv3dUnetModel | TransformerModel) -> BuiltinNames:
    """The names `worker/engine/models.py` gives the built-in `model`'s layers, in the order it builds them."""
    n = BuiltinNames()
    if isinstance(model, MlpModel):
        n("dense")
    elif isinstance(model, CnnModel):
        for kind in ("conv2d", "max_pooling2d", "conv2d", "max_pooling2d", "global_average_pooling2d"):
            n(kind)
    elif isinstance(model, Conv3dUnetModel):
        for kind in ("conv3d", "batch_normalization", "activation", "max_pooling3d", "conv3d",
                     "batch_normalization", "activation", "up_sampling3d", "concatenate", "conv3d", "voxels"):
            n(kind)
        return n
    else:
        n("embedding")
        n("position_embedding")
        for _ in range(model.layers):
            for kind in ("multi_head_attention", "layer_normalization", "dense", "dense", "dropout",
                         "layer_normalization"):
                n(kind)
        n("global_average_pooling1d")
    n("dense")  # the softmax head: its logits, then the float32 softmax
    n("probs")
    return n


def _named(node: Any) -> str | None:
    config = node.get("config") if isinstance(node, dict) else None
    name = config.get("name") if isinstance(config, dict) else None
    return name if isinstance(name, str) and node.get("class_name") != "InputLayer" else None


def _json_layers(node: dict[str, Any]) -> Iterator[str]:
    for found in walk_config(node):
        config = found.get("config")
        if not isinstance(config, dict):
            continue
        inner = config.get("layers") if found.get("class_name") in ("Sequential", "Functional", "Model") else None
        for child in (inner if isinstance(inner, list) else []) + [config.get(key) for key in WRAPPED]:
            if (name := _named(child)) is not None:
                yield name


def layer_names(model: Any) -> list[str]:
    """Every layer name of `model` (a model spec), each once, in config order (the model's own first)."""
    if isinstance(model, KerasJsonModel):
        names = _json_layers(json.loads(model.keras_json))
    else:
        names = iter(builtin_names(model).names)
    return list(dict.fromkeys(names))


def unknown_layers_message(field: str, unknown: list[str], known: list[str]) -> str:
    """Names the first unknown layer and lists the model's layers (all of them when there are few).

    >>> unknown_layers_message("layer_policies", ["mid"], ["dense", "dense_1", "probs"])
    "layer_policies names layer 'mid', which this model does not have. Its layers: dense, dense_1, probs."
    """
    shown = known if len(known) <= 60 else [*known[:60], f"... ({len(known) - 60} more)"]
    others = f" (and {len(unknown) - 1} more unknown: {', '.join(map(repr, unknown[1:4]))})" if len(unknown) > 1 else ""
    return (f"{field} names layer {unknown[0]!r}{others}, which this model does not have. "
            f"Its layers: {', '.join(shown)}.")


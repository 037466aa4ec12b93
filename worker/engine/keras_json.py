"""A user's Keras model config: checked for anything that could run code, given the job's policy, loaded safely.

`keras_json` models are checked for anything that could run code (Lambda layers,
custom or non-Keras classes) before Keras parses a single layer, then loaded in
safe mode.

A `keras_json` model's layers with the dtype policy most of them share, and its
models, take the job's policy. A layer with another policy was pinned and keeps
it, like the float32 softmax head of a model built under mixed_float16 as in
Keras's mixed-precision guide (on a tie, float32 is the pinned one). A config
cannot tell a pinned float32 from a default one: when all layers share one
policy, all take the job's. Input layers keep their dtype, except one in the
half-precision compute dtype the model was built under (a Sequential makes its
own so): it takes the job's, or a float32 job would round activations to float16.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import keras

from app.core.errors import InvalidModel
from mpjobs.contract.model_specs import KerasJsonModel, check_keras_json, walk_config
from mpjobs.contract.spec import PrecisionPolicy

_FLOAT_POLICIES = frozenset({"float16", "bfloat16", "float32", "float64", "mixed_float16", "mixed_bfloat16"})
_HALF_DTYPES = frozenset({"float16", "bfloat16"})


def _policy_of(config: dict[str, Any]) -> str | None:
    """A config's float dtype policy, written as a name or as a serialized DTypePolicy; else None."""
    dtype = config.get("dtype")
    if isinstance(dtype, dict) and dtype.get("class_name") in {"DTypePolicy", "FloatDTypePolicy"}:
        inner = dtype.get("config")
        dtype = inner.get("name") if isinstance(inner, dict) else None
    return dtype if isinstance(dtype, str) and dtype in _FLOAT_POLICIES else None


def _set_policy(config: dict[str, Any], name: str) -> None:
    if isinstance(config["dtype"], dict):
        config["dtype"]["config"]["name"] = name
    else:
        config["dtype"] = name


def _with_policy(config: dict[str, Any], policy: PrecisionPolicy) -> dict[str, Any]:
    """Give the job's policy to every layer built under the shared policy (see the module docstring)."""
    inputs: list[dict[str, Any]] = []
    models: list[dict[str, Any]] = []
    layer_configs: list[dict[str, Any]] = []
    for node in walk_config(config):
        cfg = node.get("config")
        if not isinstance(cfg, dict) or node.get("class_name") == "__keras_tensor__" or _policy_of(cfg) is None:
            continue
        if node.get("class_name") == "InputLayer":
            inputs.append(cfg)
        else:
            (models if isinstance(cfg.get("layers"), list) else layer_configs).append(cfg)
    counts = Counter(_policy_of(cfg) for cfg in layer_configs)
    shared = max(counts, key=lambda name: (counts[name], name != "float32"), default=None)
    for cfg in models + [cfg for cfg in layer_configs if _policy_of(cfg) == shared]:
        _set_policy(cfg, policy.value)
    built_compute = shared.removeprefix("mixed_") if shared else None
    for cfg in inputs:
        if built_compute in _HALF_DTYPES and _policy_of(cfg) == built_compute:
            _set_policy(cfg, policy.compute_dtype)
    return config


_NESTED_CAUSE = "\n\nException encountered: "
"""How Keras chains a deserialization error: each level's message, its whole config, then this and the next."""
_LAYER_OF_CAUSE = re.compile(r"Error when deserializing class '(?P<cls>\w+)' using config=\{'name': '(?P<name>[^']*)'")


def keras_cause(exc: BaseException) -> str:
    """Keras's deserialization error, cause first and on one line: the innermost message, after the
    layer it came from; without the configs Keras prints at each level (kilobytes of them).

    >>> keras_cause(TypeError("<class 'Sequential'> could not be deserialized. config={'layers': [...]}."
    ...     "\\n\\nException encountered: Error when deserializing class 'Dense' using config={'name': 'hidden'}."
    ...     "\\n\\nException encountered: Received an invalid value for `units`. Received: units=many"))
    "layer 'hidden' (Dense): Received an invalid value for `units`. Received: units=many"
    """
    text = str(exc)
    cause = " ".join(text.split(_NESTED_CAUSE)[-1].split())
    for marker in (" config=", " Config: ", " Full object config:"):
        cause = cause.split(marker)[0]
    layers = list(_LAYER_OF_CAUSE.finditer(text))
    where = f"layer {layers[-1]['name']!r} ({layers[-1]['cls']}): " if layers else ""
    return f"{where}{cause[:400]}"


def load_keras_json(m: KerasJsonModel, policy: PrecisionPolicy) -> keras.Model:
    try:
        config = _with_policy(check_keras_json(m.keras_json), policy)
    except ValueError as exc:
        raise InvalidModel(str(exc)) from None
    model = keras.saving.deserialize_keras_object(config, safe_mode=True)
    if not isinstance(model, keras.Model):
        raise InvalidModel("model.keras_json must describe a Keras model.")
    return model

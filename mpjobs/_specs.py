"""What `submit` and `compare` send: a JobSpec, a dict or a Keras model, with keyword overrides on top.

A Keras model is sent as its `to_json()` config (`model.keras_json`), its loss taken from
`model.loss` once compiled. Nothing here imports Keras or TensorFlow: a model is told apart by
its class's module and its `to_json`, and only its own methods are called.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from mpjobs.contract.evaluation import METRICS
from mpjobs.contract.spec import LossScaleMode, Variant

KERAS_MODULES = ("keras", "tf_keras", "tensorflow")
"""Where a Keras model's class comes from: Keras 3, the tf_keras package, or tf.keras."""


def is_keras_model(obj: Any) -> bool:
    module = type(obj).__module__ or ""
    return callable(getattr(obj, "to_json", None)) and module.split(".")[0] in KERAS_MODULES


def loss_name(loss: Any) -> str | None:
    """A compiled model's loss by name: as given ("mse"), a loss function's name, or a Loss object's class
    name ("MeanSquaredError"); the API takes all three and names it in full."""
    if loss is None or isinstance(loss, str):
        return loss
    if callable(loss) and hasattr(loss, "__name__"):  # a function: keras.losses.mean_squared_error
        return str(loss.__name__)
    return type(loss).__name__  # a Loss object: keras.losses.MeanSquaredError()


def keras_model_spec(model: Any, loss: str | None) -> dict[str, Any]:
    """`{"keras_json": ..., "loss": ...}` for a Keras model; `loss` wins over the compiled one."""
    name = loss or loss_name(getattr(model, "loss", None))
    if name is None:
        raise ValueError("Expected a compiled model (model.compile(loss=...)) or loss=... to say what it trains on. "
                         f"Received: an uncompiled {type(model).__name__} and loss=None")
    return {"keras_json": model.to_json(), "loss": name}


def as_dict(spec: Any) -> dict[str, Any]:
    """A JobSpec (only the fields it was given: defaults stay the server's), a dict (copied) or a Keras model."""
    if isinstance(spec, BaseModel):
        return spec.model_dump(mode="json", exclude_unset=True)
    if isinstance(spec, dict):
        return copy.deepcopy(spec)
    if is_keras_model(spec):
        return {"model": keras_model_spec(spec, None)}
    raise TypeError(f"Expected a JobSpec, a dict or a keras.Model. Received: {type(spec).__name__}")


def job_spec(spec: Any, *, policy: str | None = None, loss_scale: Any = None, steps: int | None = None,
             batch_size: int | None = None, learning_rate: float | None = None, loss: str | None = None,
             name: str | None = None, device: str | None = None,
             layer_policies: dict[str, str] | None = None) -> dict[str, Any]:
    """The body of `POST /jobs`: `spec` with each keyword given set on top. The server validates it.

    >>> job_spec({"model": {"name": "mlp"}}, policy="mixed_float16", loss_scale="dynamic", steps=50)
    {'model': {'name': 'mlp'}, 'precision_policy': 'mixed_float16', 'loss_scale': 'dynamic', 'training': {'steps': 50}}
    >>> job_spec({"model": {"name": "mlp"}}, layer_policies={"dense_1": "float32"})["layer_policies"]
    {'dense_1': 'float32'}
    """
    body = as_dict(spec)
    if loss is not None:
        if is_keras_model(spec):
            body["model"] = keras_model_spec(spec, loss)
        else:
            body["model"] = {**(body.get("model") or {}), "loss": loss}
    if isinstance(loss_scale, BaseModel):
        loss_scale = loss_scale.model_dump(mode="json")
    for key, value in (("precision_policy", policy), ("loss_scale", loss_scale), ("name", name), ("device", device),
                       ("layer_policies", layer_policies)):
        if value is not None:
            body[key] = value
    training = {k: v for k, v in (("steps", steps), ("batch_size", batch_size), ("learning_rate", learning_rate))
                if v is not None}
    if training:
        body["training"] = {**(body.get("training") or {}), **training}
    return body


def variant(value: Any) -> dict[str, Any]:
    """A comparison variant: a Variant, a dict, or "POLICY" / "POLICY:MODE" ("mixed_float16:dynamic").

    >>> variant("mixed_float16:none"), variant("float32")
    ({'precision_policy': 'mixed_float16', 'loss_scale': 'none'}, {'precision_policy': 'float32'})
    """
    if isinstance(value, Variant):
        return value.model_dump(mode="json", exclude_unset=True)
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str):
        policy, _, mode = value.partition(":")
        if mode and mode not in {m.value for m in LossScaleMode}:
            raise ValueError(f"Expected a loss scale mode of {[m.value for m in LossScaleMode]} after ':'. "
                             f"Received: {value!r}")
        return {"precision_policy": policy, **({"loss_scale": mode} if mode else {})}
    raise TypeError(f"Expected a Variant, a dict or 'POLICY[:MODE]'. Received: {type(value).__name__}")


def compiled_metrics(model: Any) -> list[str]:
    """A compiled Keras model's metric names that `validation.metrics` takes (others are left out): from
    `model.get_compile_config()["metrics"]`, each a name, a serialized metric (its config's name) or a function."""
    config = model.get_compile_config() if callable(getattr(model, "get_compile_config", None)) else None
    names: list[str] = []
    for metric in (config or {}).get("metrics") or []:
        if isinstance(metric, dict):
            metric = (metric.get("config") or {}).get("name")
        elif callable(metric) and hasattr(metric, "__name__"):
            metric = metric.__name__
        if isinstance(metric, str) and metric in METRICS and metric not in names:
            names.append(metric)
    return names


def validation_spec(validation: Any, model: Any, dataset_id: str | None) -> dict[str, Any]:
    """The spec's `validation` from `validation=`: a share (a split, seed 0), `(x, y)` uploaded as `dataset_id`,
    or a dict as the spec takes it. A Keras model's compiled metrics go to `metrics` unless the dict names some."""
    if isinstance(validation, dict):
        body = copy.deepcopy(validation)
    elif isinstance(validation, float):
        body = {"split": validation, "seed": 0}
    elif dataset_id is not None:
        body = {"dataset": {"kind": "uploaded", "id": dataset_id}}
    else:
        raise TypeError("Expected validation= to be a share of the rows (0.2), arrays (x_val, y_val) or a dict. "
                        f"Received: {type(validation).__name__}")
    if "metrics" not in body and is_keras_model(model):
        metrics = compiled_metrics(model)
        if metrics:
            body["metrics"] = metrics
    return body

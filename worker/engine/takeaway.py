"""The model a user takes away: the trained model with Keras's own optimizer, so plain `load_model` compiles it.

The engine trains with a `TelemetryOptimizer` (worker/telemetry/optimizer.py) and
its own metrics, which no one else's Keras can load. `model.keras` holds a copy
of the trained model instead, compiled with Keras's own classes only:

- the inner optimizer (Adam, AdamW, SGD or RMSprop), with its trained state
  (iterations, moments) and learning rate;
- loss scaling where Keras can load it: dynamic is a `LossScaleOptimizer`
  starting at the scale in force at the end (its count of good steps too),
  with the spec's growth steps; fixed is the inner optimizer's
  `loss_scale_factor`; none is the inner optimizer alone;
- the job's loss, and no metrics (the engine's are its own).

The weights are the trained ones, value for value. The copy is made in host
memory and dropped once written: a GPU that trained the model has no room to
spare for a second one. `PositionEmbedding` (the
built-in transformer), `ScanVoxelSum` (conv3d_unet) and `output_mean` are
mpjobs's own classes: a model that uses them loads only where
`worker/engine/models.py` is imported (`app.core.notes.spec_notes` says so when
the job is submitted).
"""

from __future__ import annotations

from typing import Any

import keras

from app.core.errors import JobFailed
from worker.telemetry.optimizer import TelemetryOptimizer


def portable_copy(model: keras.Model, optimizer: TelemetryOptimizer) -> keras.Model:
    """A copy of `model` with its weights, compiled with Keras's own optimizer holding `optimizer`'s state.

    Raises:
        JobFailed: the copy's variables do not line up with the trained ones (a bug, said plainly).
    """
    # In host memory: a GPU that held the job has no room for a second model and optimizer.
    with keras.device("cpu:0"):
        return _copy(model, optimizer)


def _copy(model: keras.Model, optimizer: TelemetryOptimizer) -> keras.Model:
    # From its config, as load_model builds it (clone_model would also compile it as the engine did).
    copy = model.__class__.from_config(model.get_config())
    _assign(*_aligned(copy, model), "model variables")
    inner = optimizer.inner_optimizer
    fresh = type(inner).from_config(inner.get_config())
    plain: keras.optimizers.Optimizer = fresh
    if optimizer.mode == "fixed":
        fresh.loss_scale_factor = float(optimizer.initial_scale)
    elif optimizer.mode == "dynamic":
        scale = float(keras.ops.convert_to_numpy(optimizer.loss_scale.value))
        plain = keras.optimizers.LossScaleOptimizer(fresh, initial_scale=scale,
                                                    dynamic_growth_steps=optimizer.growth_steps)
    # auto_scale_loss=False: a mixed_float16 model must not gain a second, dynamic, scale when it loads.
    copy.compile(optimizer=plain, loss=model.loss, auto_scale_loss=False)
    plain.build(copy.trainable_variables)
    _assign(fresh.variables, [v.value for v in inner.variables], "optimizer state")
    if isinstance(plain, keras.optimizers.LossScaleOptimizer):
        plain.step_counter.assign(optimizer.good_steps.value)
        plain.dynamic_scale.assign(optimizer.loss_scale.value)
    return copy


def _aligned(copy: keras.Model, model: keras.Model) -> tuple[list[Any], list[Any]]:
    """The copy's variables and the model's values, paired. By position, unless the copy builds a layer's
    variables in another order (an FP8 layer rebuilt from its config makes its scales before its kernel):
    then by the owning layer's place in the model and the variable's name."""
    values = [v.value for v in model.variables]
    if [tuple(v.shape) for v in copy.variables] == [tuple(v.shape) for v in values]:
        return list(copy.variables), values

    def keyed(m: keras.Model) -> dict[tuple[int, str], Any]:
        place = {layer.path: i for i, layer in enumerate(m._flatten_layers(include_self=False))}
        return {(place.get(v.path.rpartition("/")[0], -1), v.name): v for v in m.variables}
    source = keyed(model)
    return list(copy.variables), [source[key].value if key in source else None for key in keyed(copy)]


def _assign(targets: list[Any], values: list[Any], what: str) -> None:
    if len(targets) != len(values):
        raise JobFailed(f"the saved model's {what} has {len(targets)} variables, expected {len(values)} "
                        "as in training.")
    for target, value in zip(targets, values, strict=True):
        if value is None or tuple(target.shape) != tuple(value.shape):
            raise JobFailed(f"the saved model's {what} variable {target.path!r} has shape {tuple(target.shape)}, "
                            f"expected {'none' if value is None else tuple(value.shape)} as in training.")
        target.assign(value)

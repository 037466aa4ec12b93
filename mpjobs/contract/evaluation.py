"""Held-out evaluation: what a job's `validation` asks for, which metrics fit its loss, and the rows held out.

`validation` is either `{"split": 0.2, "seed": 0}` (a share of the training data held out by a fixed
seed, never trained on) or `{"dataset": {...}}` (a dataset of its own), each with `metrics` (Keras
metric names) and `eval_every` (steps). `metrics` and `eval_every` live inside `validation`, so they
cannot be given without held-out data: alone they would measure nothing.
The held-out rows of a split are chosen in worker/engine/data.py (`split_rows`), a rule docs/client.md states.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, field_validator

from mpjobs.contract.spec import (
    DatasetSpec,  # spec.py imports this module after defining it (mpjobs/contract/__init__.py)
)
from mpjobs.contract.strict import Integer, Number, Strict

METRICS = ("accuracy", "sparse_categorical_accuracy", "categorical_accuracy", "binary_accuracy", "mae", "mse", "auc")
"""The Keras metric names `validation.metrics` takes."""
EVAL_EVERY = 100
"""The default interval: the model is evaluated on the whole held-out set every 100 steps, and at the end."""
MAX_EVAL_EVERY = 10_000_000

_SPARSE, _CATEGORICAL, _BINARY = "sparse_categorical_crossentropy", "categorical_crossentropy", "binary_crossentropy"
_NOT_SAME_SHAPE = {_SPARSE, "output_mean", "scan_voxel_sum"}
"""Losses whose labels do not have the output's shape: `mae` and `mse` would compare unlike things."""
FITTING_LOSSES: dict[str, set[str] | None] = {
    "accuracy": {_SPARSE, _CATEGORICAL, _BINARY, "kl_divergence"},
    "sparse_categorical_accuracy": {_SPARSE},
    "categorical_accuracy": {_CATEGORICAL, "kl_divergence"},
    "binary_accuracy": {_BINARY},
    "auc": {_BINARY},
    "mae": None,
    "mse": None,
}
"""Each metric's losses (None: any whose labels have the output's shape)."""


class _Evaluation(Strict):
    metrics: list[str] = Field([], max_length=len(METRICS))
    """Keras metric names, computed on the whole held-out set with its loss at each evaluation."""
    eval_every: Integer = Field(EVAL_EVERY, ge=0, le=MAX_EVAL_EVERY)
    """Evaluate at every multiple of this step, and at the last step. 0: at the last step only."""

    @field_validator("metrics")
    @classmethod
    def _known_and_distinct(cls, value: list[str]) -> list[str]:
        unknown = [name for name in value if name not in METRICS]
        if unknown:
            raise ValueError(f"validation.metrics must name metrics among {', '.join(map(repr, METRICS))}. "
                             f"Received: metrics={value!r} ({', '.join(map(repr, unknown))} unknown)")
        if len(set(value)) != len(value):
            raise ValueError(f"validation.metrics must name each metric once. Received: metrics={value!r}")
        return value


class ValidationSplit(_Evaluation):
    """Hold out `split` of the training rows, chosen by `seed` (see `held_out_rows`); they are never trained on."""

    split: Number = Field(gt=0.0, lt=1.0)
    seed: Integer = Field(0, ge=0, le=2**31 - 1)


class ValidationData(_Evaluation):
    """Evaluate on a dataset of its own (an .npz under the data root: arrays `x` and `y`)."""

    dataset: DatasetSpec

    @field_validator("dataset")
    @classmethod
    def _not_synthetic(cls, value: Any) -> Any:
        if getattr(value, "kind", None) == "synthetic":
            raise ValueError("validation.dataset cannot be 'synthetic': a synthetic set of another seed is "
                             "labelled by another teacher. Use validation.split to hold out synthetic rows.")
        return value


def _validation_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return "dataset" if "dataset" in value and "split" not in value else "split"
    return "dataset" if isinstance(value, ValidationData) else "split"


ValidationSpec = Annotated[
    Annotated[ValidationSplit, Tag("split")] | Annotated[ValidationData, Tag("dataset")],
    Discriminator(_validation_tag),
]


def loss_name_of(model: Any) -> str:
    """The loss a job's model trains with, as worker/engine/models.py picks it, from its spec alone."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, str):
        return loss
    return "scan_voxel_sum" if getattr(model, "name", None) == "conv3d_unet" else _SPARSE


def check_metrics(metrics: list[str], loss_name: str) -> None:
    """Raise ValueError naming `validation.metrics` when one cannot measure a model trained with `loss_name`."""
    for name in metrics:
        fits = FITTING_LOSSES[name]
        if (loss_name not in fits) if fits is not None else loss_name in _NOT_SAME_SHAPE:
            allowed = [m for m, f in FITTING_LOSSES.items() if (loss_name in f if f is not None
                                                                 else loss_name not in _NOT_SAME_SHAPE)]
            raise ValueError(f"validation.metrics: {name!r} cannot measure a model trained with loss {loss_name!r}. "
                             f"Expected metrics among {allowed!r} for that loss. Received: metrics={metrics!r}")

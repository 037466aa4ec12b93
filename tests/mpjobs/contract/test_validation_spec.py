"""`validation` in a job spec: a split or a dataset, known metrics that fit the loss, a bounded interval; else a 422."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from mpjobs.contract.evaluation import METRICS, ValidationData, ValidationSplit
from mpjobs.contract.spec import JobSpec


def spec(validation: Any, model: Any = None) -> JobSpec:
    return JobSpec.model_validate({"model": model or {"name": "mlp"}, "validation": validation})


def refused(validation: Any, model: Any = None) -> str:
    with pytest.raises(ValidationError) as caught:
        spec(validation, model)
    return str(caught.value)


def test_a_split_and_a_dataset_of_its_own_are_both_taken() -> None:
    split = spec({"split": 0.2, "seed": 7, "metrics": ["accuracy"], "eval_every": 5}).validation
    assert isinstance(split, ValidationSplit)
    assert (split.split, split.seed, split.metrics, split.eval_every) == (0.2, 7, ["accuracy"], 5)
    data = spec({"dataset": {"kind": "npz", "path": "held.npz"}}).validation
    assert isinstance(data, ValidationData) and data.eval_every == 100 and data.metrics == []
    assert spec(None).validation is None
    again = JobSpec.model_validate(spec({"split": 0.5}).model_dump(mode="json"))
    assert again.validation == ValidationSplit(split=0.5)


def test_an_unknown_metric_is_refused_naming_the_field_and_every_allowed_one() -> None:
    message = refused({"split": 0.2, "metrics": ["accuracy", "f1"]})
    assert "validation.metrics" in message and "'f1' unknown" in message
    assert all(repr(name) in message for name in METRICS)


@pytest.mark.parametrize(("metric", "loss"), [("mse", "sparse_categorical_crossentropy"),
                                              ("binary_accuracy", "categorical_crossentropy"),
                                              ("auc", "mean_squared_error"),
                                              ("accuracy", "mean_squared_error")])
def test_a_metric_that_cannot_measure_the_loss_is_refused(metric: str, loss: str) -> None:
    dense = {"module": "keras.layers", "class_name": "Dense", "config": {"units": 3}}
    model = {"keras_json": json.dumps({"module": "keras", "class_name": "Sequential",
                                       "config": {"name": "s", "layers": [dense]}}), "loss": loss}
    message = refused({"split": 0.2, "metrics": [metric]}, model)
    assert f"validation.metrics: {metric!r} cannot measure a model trained with loss {loss!r}" in message


def test_metrics_that_fit_the_loss_are_taken() -> None:
    assert spec({"split": 0.2, "metrics": ["accuracy", "sparse_categorical_accuracy"]}).validation is not None


@pytest.mark.parametrize(("validation", "words"), [
    ({"split": 0.0}, "greater than 0"),
    ({"split": 1.0}, "less than 1"),
    ({"split": 0.2, "eval_every": -1}, "greater than or equal to 0"),
    ({"split": 0.2, "eval_every": 10_000_001}, "less than or equal to 10000000"),
    ({"split": 0.2, "metrics": ["mae", "mae"]}, "each metric once"),
    ({"metrics": ["accuracy"]}, "split\n  Field required"),
    ({"split": 0.2, "dataset": {"kind": "npz", "path": "a.npz"}}, "Extra inputs are not permitted"),
    ({"dataset": {"kind": "synthetic"}}, "validation.dataset cannot be 'synthetic'"),
    ({"dataset": {"kind": "npz", "path": "../a.npz"}}, "relative to the data root"),
])
def test_a_bad_validation_is_refused_saying_why(validation: Any, words: str) -> None:
    assert words in refused(validation)


def test_metrics_and_eval_every_exist_only_inside_validation() -> None:
    with pytest.raises(ValidationError, match="metrics\n  Extra inputs are not permitted"):
        JobSpec.model_validate({"model": {"name": "mlp"}, "metrics": ["accuracy"]})

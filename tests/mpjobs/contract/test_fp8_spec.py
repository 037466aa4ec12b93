"""`fp8` in job specs and comparison variants: labels, the float32 baseline, and what each variant's job asks for."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mpjobs.contract.fp8 import fp8_capable
from mpjobs.contract.model_specs import KerasJsonModel
from mpjobs.contract.spec import ComparisonSpec, JobSpec

MLP = {"name": "mlp", "input_dim": 8, "hidden_units": 8}


def test_float32_with_fp8_is_a_variant_not_the_baseline() -> None:
    spec = ComparisonSpec.model_validate({"spec": {"model": MLP}, "variants": [
        {"precision_policy": "float32", "fp8": {}}, {"precision_policy": "float32"},
        {"precision_policy": "mixed_bfloat16", "fp8": {"amax_history_length": 16}},
        {"precision_policy": "mixed_float16", "fp8": {}}]})
    assert [v.label for v in spec.variants or []] == [
        "float32 + fp8", "float32", "mixed_bfloat16 + fp8 (history 16)", "mixed_float16 + dynamic + fp8"]
    assert spec.baseline_index == 1 and spec.planned_index == 0
    jobs = spec.job_specs()
    assert [None if s.fp8 is None else s.fp8.amax_history_length for s in jobs] == [1024, None, 16, 1024]
    assert [v.fp8 is not None for v in jobs[1].speed_check or []] == [True, True, True]  # timed by the baseline


def test_a_comparison_of_float32_with_and_without_fp8_may_plan() -> None:
    spec = ComparisonSpec.model_validate({"spec": {"model": MLP}, "plan": "auto", "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "float32", "fp8": {}}]})
    assert spec.job_specs()[-1].plan == "auto" and spec.job_specs()[-1].fp8 is not None


def test_variants_that_differ_only_in_fp8_history_are_distinct_and_the_same_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"variants\[2\] repeats variants\[1\]"):
        ComparisonSpec.model_validate({"spec": {"model": MLP}, "variants": [
            {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16", "fp8": {}},
            {"precision_policy": "mixed_bfloat16", "fp8": {"amax_history_length": 1024}}]})


@pytest.mark.parametrize(("layers", "capable"), [
    ('{"class_name": "Conv2D", "config": {}}', False), ('{"class_name": "EinsumDense", "config": {}}', True),
    ('{"class_name": "MultiHeadAttention", "config": {}}', True), ('{"class_name": "Dense", "config": {}}', True)])
def test_a_keras_json_model_is_capable_when_it_holds_a_layer_fp8_applies_to(layers: str, capable: bool) -> None:
    text = f'{{"class_name": "Sequential", "config": {{"layers": [{layers}]}}}}'
    model = KerasJsonModel.model_construct(keras_json=text, loss="mean_squared_error")
    assert fp8_capable(model) is capable


def test_fp8_defaults_to_keras_history_length() -> None:
    spec = JobSpec.model_validate({"model": MLP, "precision_policy": "mixed_float16", "fp8": {}})
    assert spec.fp8 is not None and spec.fp8.amax_history_length == 1024
    assert spec.loss_scale is not None and spec.loss_scale.mode == "dynamic"  # float16 around FP8 still scales

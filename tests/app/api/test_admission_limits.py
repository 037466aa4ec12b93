"""Admission's limits are inclusive: a spec exactly at MAX_MODEL_BYTES or MAX_JOB_SECONDS is admitted."""

from __future__ import annotations

import pytest

from app.api.admission import admit
from app.core.config import Settings
from app.core.errors import SpecRefused
from mpjobs.contract.spec import JobSpec

# mlp 10-20-2, float32, Adam, batch 8: 262 parameters x 4 bytes x (weights, gradients, 2 slots) = 4,192;
# activations 10 + 20 + 2 + 2 = 34 per sample x 8 rows x 4 bytes x 2 (outputs and their gradients) = 2,176.
SMALL = JobSpec.model_validate({"model": {"name": "mlp", "input_dim": 10, "hidden_units": 20, "classes": 2},
                                "training": {"batch_size": 8, "max_seconds": 600}, "dataset": {"samples": 64}})
SMALL_BYTES = 4_192 + 2_176


def test_a_model_exactly_at_max_model_bytes_is_admitted_and_one_byte_less_refuses_it() -> None:
    admit(SMALL, Settings(max_model_bytes=SMALL_BYTES))
    with pytest.raises(SpecRefused) as refused:
        admit(SMALL, Settings(max_model_bytes=SMALL_BYTES - 1))
    assert refused.value.loc == ("model",)
    assert "262 parameters" in refused.value.message


def test_max_seconds_exactly_at_max_job_seconds_is_admitted() -> None:
    admit(SMALL, Settings(max_job_seconds=600))
    with pytest.raises(SpecRefused) as refused:
        admit(SMALL, Settings(max_job_seconds=599))
    assert refused.value.loc == ("training", "max_seconds")


def test_keras_json_models_are_left_to_the_worker() -> None:
    spec = JobSpec.model_validate({"model": {"keras_json": '{"class_name": "Sequential", "config": {}}',
                                             "loss": "mse"}})
    admit(spec, Settings(max_model_bytes=1))


def test_a_synthetic_dataset_larger_than_max_model_bytes_is_refused_naming_its_samples() -> None:
    # The worker draws every sample at the start: 64 samples x 10 float32 inputs = 2,560 bytes.
    admit(SMALL, Settings(max_model_bytes=SMALL_BYTES))
    big = SMALL.model_copy(update={"dataset": SMALL.dataset.model_copy(update={"samples": 1_000})})
    with pytest.raises(SpecRefused) as refused:
        admit(big, Settings(max_model_bytes=39_999))  # 1,000 x 40 bytes: one byte over
    assert refused.value.loc == ("dataset", "samples")
    assert "samples=1,000 of 40 bytes each" in refused.value.message
    admit(big, Settings(max_model_bytes=40_000))

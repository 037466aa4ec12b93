"""Named failures: divergence keeps the last good checkpoint; a time limit fails with `timeout`."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

from app.core.errors import FailureReason, JobFailed
from tests.worker.conftest import Train, spec_of
from worker import checkpoint


def test_divergence_fails_within_bounded_steps_and_keeps_the_last_good_weights(train: Train, tmp_path: Path) -> None:
    spec = spec_of(training={"steps": 200, "optimizer": "sgd", "learning_rate": 10.0, "checkpoint_every": 5},
                   dataset={"samples": 512})
    out = tmp_path / "diverging"
    with pytest.raises(JobFailed) as raised:
        train(spec, out=out)
    assert raised.value.reason is FailureReason.DIVERGED
    assert "last good checkpoint" in raised.value.message
    saved = checkpoint.load(out)
    assert saved is not None and saved.step < 200
    assert all(np.isfinite(v).all() for v in saved.model_values)
    model = keras.models.load_model(out / "model.keras", compile=False)
    assert all(np.isfinite(keras.ops.convert_to_numpy(w)).all() for w in model.weights)


def test_dynamic_scaling_that_cannot_absorb_a_non_finite_loss_diverges(train: Train) -> None:
    spec = spec_of(precision_policy="mixed_float16", loss_scale="dynamic",
                   training={"steps": 200, "optimizer": "sgd", "learning_rate": 10.0, "checkpoint_every": 5},
                   dataset={"samples": 512})
    with pytest.raises(JobFailed) as raised:
        train(spec)
    assert raised.value.reason is FailureReason.DIVERGED
    assert "10 steps in a row" in raised.value.message


def test_max_seconds_fails_with_timeout_and_keeps_a_checkpoint(train: Train, tmp_path: Path) -> None:
    spec = spec_of(precision_policy="mixed_float16", training={"steps": 100_000, "max_seconds": 2})
    out = tmp_path / "slow"
    with pytest.raises(JobFailed) as raised:
        train(spec, out=out)
    assert raised.value.reason is FailureReason.TIMEOUT
    saved = checkpoint.load(out)
    assert saved is not None and 0 < saved.step < 100_000
    assert f"step {saved.step}" in raised.value.message


def test_xla_precision_refusal_is_a_named_unsupported_precision() -> None:
    """JAX's CPU backend refuses float16 attention with float32 accumulation (seen with a
    transformer under mixed_float16): a named failure with its fix, not `internal`."""
    from worker.devices import detect_device
    from worker.failures import named_failure

    device = detect_device()

    error = RuntimeError("INVALID_ARGUMENT: The precision 'F16_F16_F32' is not supported by dot_general on CPU.")
    failure = named_failure(error, "float16", device.backend, device.kind)
    assert failure.reason is FailureReason.UNSUPPORTED_PRECISION_ON_DEVICE
    assert "float16 kernel for op dot_general" in failure.message and "mixed_bfloat16 or float32" in failure.message

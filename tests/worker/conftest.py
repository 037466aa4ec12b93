from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from app.core.config import Settings
from mpjobs.contract.spec import JobSpec
from worker.engine import checkpoint  # noqa: E402
from worker.engine.models import build_model  # noqa: E402
from worker.engine.training import RunResult, run_job  # noqa: E402
from worker.telemetry.reporters import ListReporter  # noqa: E402

# Resume must reproduce an uninterrupted run bit for bit.
tf.config.experimental.enable_op_determinism()


def spec_of(**fields: Any) -> JobSpec:
    fields.setdefault("model", {"name": "mlp"})
    return JobSpec.model_validate(fields)


Train = Callable[..., tuple[RunResult, ListReporter]]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    # The speed check (worker.numerics.speed) adds two model builds to every half-precision job; its own
    # tests ask for it, the rest test numerics and leave it off.
    return Settings(data_root=tmp_path / "data", artifacts_dir=tmp_path / "artifacts", speed_check_steps=0)


@pytest.fixture
def train(tmp_path: Path, settings: Settings) -> Train:
    """Run a spec through the real engine; returns (result, reporter)."""
    counter = iter(range(1_000_000))

    def run(spec: JobSpec, out: Path | None = None, **kwargs: Any) -> tuple[RunResult, ListReporter]:
        reporter = ListReporter()
        out = out or tmp_path / f"run{next(counter)}"
        kwargs.setdefault("settings", settings)
        result = run_job(spec, reporter=reporter, checkpoint_dir=out, **kwargs)
        return result, reporter

    return run


def initial_weights(spec: JobSpec) -> list[np.ndarray]:
    keras.utils.set_random_seed(spec.training.seed)
    model = build_model(spec, on_cpu_tf=True).model
    return [keras.ops.convert_to_numpy(v.value) for v in model.variables]


def trained_weights(result: RunResult) -> list[np.ndarray]:
    saved = checkpoint.load(result.checkpoint_path.parent)
    assert saved is not None
    return saved.model_values

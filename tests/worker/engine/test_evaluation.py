"""Held-out evaluation on real data (scikit-learn's iris): steps, rows and numbers recomputed in NumPy."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
from sklearn.datasets import load_iris

from app.core.config import Settings
from app.core.errors import InvalidDataset
from mpjobs.contract.records import EvalRecord
from tests.worker.conftest import spec_of
from worker.engine.devices import detect_device
from worker.engine.training import Training, never, run_job
from worker.telemetry.reporters import ListReporter

pytestmark = pytest.mark.slow
"""Each case trains a job and recomputes its evaluations in NumPy: about 15 s in all, left to `make test`."""

SPLIT, SPLIT_SEED, BATCH = 0.2, 3, 16


class WeightsAtEvaluation(ListReporter):
    """Keeps the model's weights as they are when each evaluation is reported."""

    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None
        self.weights: dict[int, list[np.ndarray]] = {}

    def evaluations(self, records: Any) -> None:
        super().evaluations(records)
        for record in records:
            self.weights[record.step] = [np.array(keras.ops.convert_to_numpy(w)) for w in self.model.weights]


def iris(settings: Settings) -> tuple[np.ndarray, np.ndarray]:
    x, y = load_iris(return_X_y=True)
    x, y = x.astype(np.float32), y.astype(np.int32)
    settings.data_root.mkdir(parents=True, exist_ok=True)
    np.savez(settings.data_root / "iris.npz", x=x, y=y)
    return x, y


def mlp_json() -> str:
    return str(keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(3, activation="softmax")]).to_json())


def iris_spec(policy: str, steps: int, every: int, **training: Any) -> Any:
    return spec_of(model={"keras_json": mlp_json(), "loss": "sparse_categorical_crossentropy"},
                   precision_policy=policy, dataset={"kind": "npz", "path": "iris.npz"},
                   training={"steps": steps, "batch_size": BATCH, "seed": 1, "learning_rate": 0.01, **training},
                   validation={"split": SPLIT, "seed": SPLIT_SEED, "metrics": ["accuracy"], "eval_every": every})


def held_out(rows: int) -> np.ndarray:
    """The documented rule, written again: the first floor(split*n + 0.5) rows of the seed's permutation."""
    return np.sort(np.random.default_rng(SPLIT_SEED).permutation(rows)[: math.floor(SPLIT * rows + 0.5)])


def numpy_loss_and_hits(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w1, b1, w2, b2 = (w.astype(np.float64) for w in weights)
    logits = np.maximum(x @ w1 + b1, 0.0) @ w2 + b2
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.log(np.clip(p[np.arange(len(y)), y], 1e-7, 1 - 1e-7))
    return loss, p.argmax(axis=1) == y


def run(spec: Any, settings: Settings, out: Path, should_stop: Any = never) -> tuple[Any, WeightsAtEvaluation]:
    reporter = WeightsAtEvaluation()
    training = Training(spec, reporter, out, should_stop, settings, detect_device(settings.cpu_logical_devices))
    reporter.model = training.model
    return training.run(), reporter


@pytest.mark.parametrize(("policy", "tolerance"), [("float32", 1e-6), ("mixed_float16", 1e-2)])
def test_each_evaluation_is_numpy_on_the_held_out_rows(settings: Settings, tmp_path: Path, policy: str,
                                                       tolerance: float) -> None:
    x, y = iris(settings)
    result, reporter = run(iris_spec(policy, steps=7, every=3), settings, tmp_path / "job")
    rows = held_out(len(x))
    assert [r.step for r in reporter.evaluation_records] == [3, 6, 7]
    for record in reporter.evaluation_records:
        loss, hits = numpy_loss_and_hits(reporter.weights[record.step], x[rows], y[rows])
        assert record.examples == len(rows) == 30
        assert record.loss == pytest.approx(loss.mean(), rel=tolerance, abs=tolerance)
        accuracy = record.metrics["accuracy"]
        assert accuracy is not None
        # float32: the same decisions; mixed_float16: at most one row on a float16 rounding's edge.
        assert abs(accuracy - hits.mean()) <= (1e-6 if policy == "float32" else 1 / len(rows) + 1e-6)
        assert record.seconds > 0
    assert result.summary.validation == reporter.evaluation_records[-1]
    final = np.load(tmp_path / "job" / "evaluation" / "final.npz")
    loss, hits = numpy_loss_and_hits(reporter.weights[7], x[rows], y[rows])
    assert final["rows"].tolist() == rows.tolist() and int(final["step"]) == 7
    np.testing.assert_allclose(final["loss"], loss, rtol=tolerance, atol=tolerance)
    if policy == "float32":
        assert final["correct"].tolist() == hits.astype(np.float32).tolist()
    use = result.summary.data
    assert use is not None
    assert (use.rows, use.held_out_rows, use.steps_per_epoch, use.dropped_per_epoch) == (120, 30, 7, 120 % BATCH)
    assert use.epochs == 1.0


def test_held_out_rows_are_never_trained_on(settings: Settings, tmp_path: Path) -> None:
    """Training's batches come from the other 120 rows only: the held-out rows' labels are scrambled, and
    the run's weights are still those of a run without them."""
    x, y = iris(settings)
    rows = held_out(len(x))
    first, _ = run(iris_spec("float32", steps=7, every=0), settings, tmp_path / "a")
    scrambled = y.copy()
    scrambled[rows] = (scrambled[rows] + 1) % 3
    np.savez(settings.data_root / "iris.npz", x=x, y=scrambled)
    _, reporter = run(iris_spec("float32", steps=7, every=0), settings, tmp_path / "b")
    assert [r.step for r in reporter.evaluation_records] == [7]
    loss_first = first.summary.final_loss
    assert reporter.records[-1].loss is not None and loss_first is not None
    assert reporter.summaries[-1].final_loss == loss_first


def test_a_resumed_run_records_each_evaluation_once(settings: Settings, tmp_path: Path) -> None:
    iris(settings)
    out, calls = tmp_path / "job", iter(range(1, 100))

    def stop_after_four() -> bool:  # asked once after each step
        return next(calls) >= 4

    reporter = WeightsAtEvaluation()
    spec = iris_spec("float32", steps=7, every=3, checkpoint_every=2)
    training = Training(spec, reporter, out, stop_after_four, settings, detect_device(settings.cpu_logical_devices))
    reporter.model = training.model
    stopped = training.run()
    first: list[EvalRecord] = reporter.evaluation_records
    resumed = ListReporter()
    result = run_job(spec, reporter=resumed, checkpoint_dir=out, settings=settings)
    steps = [r.step for r in first + resumed.evaluation_records]
    assert stopped.status == "stopped" and result.status == "succeeded"
    assert steps == [3, 4, 6, 7]  # 4: the stopped attempt's final evaluation
    assert result.summary.validation is not None and result.summary.validation.step == 7


def test_a_validation_dataset_of_its_own_is_evaluated_whole_and_a_misshapen_one_is_refused(
        settings: Settings, tmp_path: Path) -> None:
    x, y = iris(settings)
    np.savez(settings.data_root / "held.npz", x=x[:40], y=y[:40])
    split = iris_spec("float32", steps=3, every=0).model_dump(mode="json")
    spec = spec_of(**{**split, "validation": {
        "dataset": {"kind": "npz", "path": "held.npz"}, "metrics": ["sparse_categorical_accuracy"], "eval_every": 0}})
    result, reporter = run(spec, settings, tmp_path / "job")
    [final] = reporter.evaluation_records
    loss, hits = numpy_loss_and_hits(reporter.weights[3], x[:40], y[:40])
    assert (final.step, final.examples) == (3, 40) and final.loss == pytest.approx(loss.mean(), rel=1e-6)
    assert final.metrics == {"sparse_categorical_accuracy": pytest.approx(hits.mean(), abs=1e-6)}
    assert np.load(tmp_path / "job" / "evaluation" / "final.npz")["rows"].tolist() == list(range(40))
    assert result.summary.data is not None and result.summary.data.rows == 150
    np.savez(settings.data_root / "held.npz", x=x[:40, :3], y=y[:40])
    with pytest.raises(InvalidDataset, match=r"validation.dataset 'held.npz' holds x of shape \(3,\)"):
        run(spec, settings, tmp_path / "other")


@pytest.mark.parametrize("model", [
    {"name": "conv3d_unet", "volume": 8, "filters": 2, "reference_edge": 16},
    {"keras_json": "dense", "loss": "output_mean"},
])
def test_losses_of_their_own_are_evaluated_per_row(settings: Settings, tmp_path: Path, model: dict[str, Any]) -> None:
    """The unet's voxel sum and output_mean (which reduces the batch itself) give one loss per held-out row,
    whose mean is the record's loss."""
    if model.get("keras_json") == "dense":
        model = {**model, "keras_json": str(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]).to_json())}
    spec = spec_of(model=model, dataset={"samples": 10}, training={"steps": 2, "batch_size": 2},
                   validation={"split": 0.3, "eval_every": 0})
    result, reporter = run(spec, settings, tmp_path / "job")
    [record] = reporter.evaluation_records
    final = np.load(tmp_path / "job" / "evaluation" / "final.npz")
    assert record.examples == len(final["loss"]) == 3 and "correct" not in final
    assert record.loss == pytest.approx(float(final["loss"].mean()), rel=1e-6)
    assert result.summary.validation == record

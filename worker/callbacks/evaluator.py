"""The evaluation callback: the trained model on the whole held-out set, every `eval_every` steps and at the end.

The model itself is evaluated, under the job's precision policy: its predictions come from
`model.predict_on_batch` over batches of training.batch_size (the bound on the memory an evaluation takes);
the loss (the training loss's function, unreduced, in float32 as Keras computes it) and each metric
are computed on all held-out rows at once. Each evaluation's wall time is its record's `seconds`.
The final evaluation's per-example numbers go to `<job dir>/evaluation/final.npz` (docs/client.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np

from mpjobs.contract.records import EvalRecord
from worker.engine.data import HeldOut
from worker.engine.stepper import crossed
from worker.numerics.summary import SummaryBuilder
from worker.telemetry.batch_loss import compiled_loss
from worker.telemetry.reporters import Reporter
from worker.telemetry.step_vector import CALL_STEPS_KEY

FINAL_FILE = Path("evaluation") / "final.npz"
"""Under the job's folder: the final evaluation's `rows`, per-example `loss` and (for a class loss) `correct`."""

_ACCURACY = {"sparse_categorical_crossentropy": "sparse_categorical_accuracy",
             "binary_crossentropy": "binary_accuracy"}
"""What "accuracy" means for a loss, as Keras resolves it; categorical_accuracy for the others that allow it."""
_METRICS: dict[str, Callable[[], keras.metrics.Metric]] = {
    "sparse_categorical_accuracy": keras.metrics.SparseCategoricalAccuracy,
    "categorical_accuracy": keras.metrics.CategoricalAccuracy,
    "binary_accuracy": keras.metrics.BinaryAccuracy,
    "mae": keras.metrics.MeanAbsoluteError,
    "mse": keras.metrics.MeanSquaredError,
    "auc": keras.metrics.AUC,
}


def _finite(value: float) -> float | None:
    return value if np.isfinite(value) else None


def correct(loss_name: str, y: np.ndarray, pred: np.ndarray) -> np.ndarray | None:
    """Per example, the share of its decisions that are right (1.0 or 0.0 for one label); None for a non-class loss."""
    if loss_name == "sparse_categorical_crossentropy":
        hits = pred.argmax(axis=-1) == y.reshape(pred.shape[:-1])
    elif loss_name == "categorical_crossentropy":
        hits = pred.argmax(axis=-1) == y.argmax(axis=-1)
    elif loss_name == "binary_crossentropy":
        hits = (pred > 0.5) == (y > 0.5)
    else:
        return None
    return hits.reshape(len(hits), -1).mean(axis=1).astype(np.float32)


class Evaluator(keras.callbacks.Callback):
    """Evaluates at steps `every`, 2·`every`, ... after `start_step`, and once at the end (`final`)."""

    def __init__(self, *, held_out: HeldOut, loss: Any, loss_name: str, metrics: list[str], every: int,
                 start_step: int, batch_size: int, reporter: Reporter, builder: SummaryBuilder, out: Path,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.held_out, self.loss, self.loss_name, self.metrics = held_out, compiled_loss(loss), loss_name, metrics
        self.every, self.step, self.batch_size = every, start_step, batch_size
        self.reporter, self.builder, self.out, self.clock = reporter, builder, out, clock
        self.last: tuple[EvalRecord, np.ndarray, np.ndarray | None] | None = None
        """The latest evaluation of this attempt, with its per-example loss and correctness."""

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        ran = int((logs or {}).get(CALL_STEPS_KEY, 1))  # a call of several steps ends at its evaluation step
        self.step += ran
        if self.every and crossed(self.step, ran, self.every):
            self.evaluate(self.step)

    def evaluate(self, step: int) -> EvalRecord:
        """Evaluate the model as it is now, record it as step `step`'s evaluation and report it."""
        begin = time.perf_counter()
        sync = getattr(self.model, "jax_state_sync", None)
        if sync is not None:  # JAX keeps fit's live weights outside the variables
            sync()
        x, y = self.held_out.x, self.held_out.y
        # predict_on_batch reuses the model's compiled predict function; `predict` inside `fit` builds a data
        # adapter and an iterator on every call, most of an evaluation's time on small held-out sets.
        pred = np.concatenate([
            np.asarray(keras.ops.convert_to_numpy(self.model.predict_on_batch(x[i:i + self.batch_size])),
                       dtype=np.float32)
            for i in range(0, len(x), self.batch_size)])
        y32 = y.astype(np.float32)
        values = self._losses(y32, pred)
        if values.ndim == 0:  # a loss that reduces the batch itself (output_mean): each row on its own
            values = np.array([self._losses(y32[i:i + 1], pred[i:i + 1]) for i in range(len(pred))])
        per_example = values.reshape(len(values), -1).mean(axis=1)
        scores: dict[str, float | None] = {}
        for name in self.metrics:
            resolved = _ACCURACY.get(self.loss_name, "categorical_accuracy") if name == "accuracy" else name
            metric = _METRICS[resolved]()
            metric.update_state(y32, pred)
            scores[name] = _finite(float(keras.ops.convert_to_numpy(metric.result())))
        record = EvalRecord(step=step, loss=_finite(float(per_example.mean(dtype=np.float64))), metrics=scores,
                            examples=len(x), seconds=time.perf_counter() - begin, time=self.clock())
        self.last = (record, per_example, correct(self.loss_name, y, pred))
        self.builder.validation = record
        self.reporter.evaluations([record])
        return record

    def _losses(self, y: np.ndarray, pred: np.ndarray) -> np.ndarray:
        return np.asarray(keras.ops.convert_to_numpy(self.loss.call(y, pred)), dtype=np.float32)

    def final(self, step: int) -> EvalRecord:
        """The end of the run at `step`: evaluate unless this attempt just did, and write final.npz."""
        if self.last is None or self.last[0].step != step:
            self.evaluate(step)
        assert self.last is not None
        record, per_example, hits = self.last
        arrays: dict[str, np.ndarray] = {"rows": self.held_out.rows.astype(np.int64), "loss": per_example,
                                         "step": np.array(step, dtype=np.int64)}
        if hits is not None:
            arrays["correct"] = hits
        path = self.out / FINAL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial.npz")
        np.savez(partial, allow_pickle=False, **arrays)
        os.replace(partial, path)
        return record

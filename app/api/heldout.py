"""A variant's final held-out metric against float32's, paired example by example from the runs' final.npz.

Each job with validation writes `<ARTIFACTS_DIR>/<job id>/evaluation/final.npz` (worker/callbacks/evaluator.py):
`rows`, per-example `loss`, and `correct` for classification losses. The API shares that volume, so it pairs
the two files here with NumPy (an API dependency already; no TensorFlow), refusing when the rows differ. The
result depends only on the two files, so it is cached by their paths, sizes and modification times: a
comparison report is computed on every read, and a finished one costs a stat per file.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from app.api import paired
from mpjobs.contract.comparisons import HeldOut

FINAL_FILE = Path("evaluation") / "final.npz"
ACCURACY_METRICS = ("accuracy", "sparse_categorical_accuracy", "categorical_accuracy", "binary_accuracy")


class NotPaired(ValueError):
    """The two runs' final evaluations cannot be paired; the message says why."""


def final_file(artifacts_dir: Path, job_id: str) -> Path:
    return artifacts_dir / job_id / FINAL_FILE


def compare(artifacts_dir: Path, job_id: str, base_id: str, metrics: list[str], against: str = "float32") -> HeldOut:
    """The variant `job_id` against `base_id` on their final held-out evaluation.

    Raises:
        NotPaired: a file is missing or unreadable, or the runs held out different rows.
    """
    files = (final_file(artifacts_dir, job_id), final_file(artifacts_dir, base_id))
    try:
        stamps = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    except OSError as error:
        raise NotPaired(f"Expected each run's final held-out evaluation at <ARTIFACTS_DIR>/<job id>/{FINAL_FILE}. "
                        f"Received: {error.strerror} for {error.filename}") from None
    name = next((m for m in metrics if m in ACCURACY_METRICS), "accuracy")
    return _compare(stamps[0], stamps[1], name).model_copy(update={"against": against})


@functools.lru_cache(maxsize=256)
def _compare(variant: tuple[str, int, int], base: tuple[str, int, int], accuracy_name: str) -> HeldOut:
    mine, theirs = _load(Path(variant[0])), _load(Path(base[0]))
    if mine["rows"].shape != theirs["rows"].shape or not np.array_equal(mine["rows"], theirs["rows"]):
        raise NotPaired(f"Expected both runs to hold out the same rows (same spec, same seed) to pair them. "
                        f"Received: {len(mine['rows'])} and {len(theirs['rows'])} rows, not the same ones")
    n = len(mine["rows"])
    if "correct" in mine and "correct" in theirs:
        a, f = mine["correct"].astype(np.float64), theirs["correct"].astype(np.float64)
        value, base_value = float(a.mean()), float(f.mean())
        if np.isin(a, (0.0, 1.0)).all() and np.isin(f, (0.0, 1.0)).all():
            b, c = int(((a == 1) & (f == 0)).sum()), int(((a == 0) & (f == 1)).sum())
            difference, low, high = paired.accuracy_difference(b, c, n)
            return HeldOut(metric=accuracy_name, value=value, float32_value=base_value, difference=difference,
                           low=low, high=high, confidence=paired.CONFIDENCE, method="mcnemar_exact_conditional",
                           examples=n, p_value=paired.mcnemar_exact(b, c))
        difference, low, high = paired.bootstrap_interval(a - f)  # several decisions per example: shares
        return HeldOut(metric=accuracy_name, value=value, float32_value=base_value, difference=difference, low=low,
                       high=high, confidence=paired.CONFIDENCE, method="paired_bootstrap", examples=n, p_value=None)
    loss, base_loss = mine["loss"].astype(np.float64), theirs["loss"].astype(np.float64)
    difference, low, high = paired.bootstrap_interval(loss - base_loss)
    return HeldOut(metric="loss", value=float(loss.mean()), float32_value=float(base_loss.mean()),
                   difference=difference, low=low, high=high, confidence=paired.CONFIDENCE,
                   method="paired_bootstrap", examples=n, p_value=None)


def _load(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: np.asarray(data[name]) for name in data.files}
    except (OSError, ValueError) as error:
        raise NotPaired(f"Expected a readable .npz at {path}. Received: {error}") from None
    missing = [name for name in ("rows", "loss") if name not in arrays]
    if missing or len(arrays["loss"]) != len(arrays["rows"]):
        raise NotPaired(f"Expected arrays 'rows' and 'loss' of one length in {path}. "
                        f"Received: {sorted(arrays)}")
    return arrays

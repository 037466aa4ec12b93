"""Checkpoints and the trained model file: written atomically, restored, kept from before a divergence.

A checkpoint holds the weights, the optimizer state (loss scale and its counter
included), the step (the data position) and the summary, in one `.npz`.

Written to a temp file in the same folder, fsynced, then renamed over the old
one, so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np

from app.core.config import MODEL_ARTIFACT
from app.core.errors import JobFailed
from worker.engine.takeaway import portable_copy
from worker.telemetry.optimizer import TelemetryOptimizer

CHECKPOINT_NAME = "checkpoint.npz"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    fingerprint: str
    model_values: list[np.ndarray]
    optimizer_values: list[np.ndarray]
    summary_state: dict[str, Any]


def save(directory: Path, ckpt: Checkpoint) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"step": ckpt.step, "fingerprint": ckpt.fingerprint, "summary": ckpt.summary_state}
    arrays: dict[str, Any] = {"meta": np.array(json.dumps(meta))}
    arrays.update({f"model_{i}": v for i, v in enumerate(ckpt.model_values)})
    arrays.update({f"optimizer_{i}": v for i, v in enumerate(ckpt.optimizer_values)})
    target = directory / CHECKPOINT_NAME
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def saved_step(directory: Path) -> int:
    """The step of the checkpoint in `directory` (0 if none), reading only its metadata."""
    path = directory / CHECKPOINT_NAME
    if not path.exists():
        return 0
    with np.load(path, allow_pickle=False) as archive:
        return int(json.loads(str(archive["meta"]))["step"])


def load(directory: Path) -> Checkpoint | None:
    path = directory / CHECKPOINT_NAME
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as archive:
        meta = json.loads(str(archive["meta"]))
        model = [archive[f"model_{i}"] for i in range(_count(archive.files, "model_"))]
        opt = [archive[f"optimizer_{i}"] for i in range(_count(archive.files, "optimizer_"))]
    return Checkpoint(meta["step"], meta["fingerprint"], model, opt, meta["summary"])


class CheckpointWriter:
    """Writes checkpoints on one background thread, so a step waits only for the
    in-memory snapshot. At most one write is in flight; `close` waits for it and
    re-raises its error, if any."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, ckpt: Checkpoint) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(ckpt,), name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self, ckpt: Checkpoint) -> None:
        try:
            save(self.directory, ckpt)
        except BaseException as exc:  # Surfaced on the training thread by wait().
            self._error = exc

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    close = wait


def _count(names: list[str], prefix: str) -> int:
    return sum(1 for n in names if n.startswith(prefix))


def keep_last_good(model: keras.Model, optimizer: TelemetryOptimizer, out: Path) -> str:
    """After divergence: write model.keras from the last checkpoint, never from NaN weights."""
    saved = load(out)
    if saved is None:
        return " No checkpoint was reached before it diverged."
    restore(model.variables, saved.model_values)
    restore(optimizer.variables, saved.optimizer_values)
    save_model(model, optimizer, out)
    return f" The last good checkpoint (step {saved.step}) is kept, and model.keras holds its weights."


def restore(variables: list[keras.Variable], values: list[np.ndarray]) -> None:
    if len(variables) != len(values):
        raise JobFailed(f"checkpoint holds {len(values)} arrays but the model has {len(variables)} variables.")
    for var, value in zip(variables, values, strict=True):
        var.assign(value)


def save_model(model: keras.Model, optimizer: TelemetryOptimizer, out: Path) -> Path:
    """Write model.keras atomically: the trained model compiled with Keras's own classes (worker/engine/takeaway.py)."""
    portable = portable_copy(model, optimizer)
    target = out / MODEL_ARTIFACT
    fd, tmp = tempfile.mkstemp(prefix=".model-", suffix=".keras", dir=out)
    os.close(fd)
    try:
        portable.save(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target

"""Checkpoints and the trained model file: written atomically, restored, kept from before a divergence.

A checkpoint holds the weights, the optimizer state (loss scale and its counter
included), the step (the data position) and the summary, in one `.npz` per step
(`checkpoint-000000250.npz`).

Each is written to a temp file in the same folder, fsynced, then renamed, so a
crash mid-write leaves the earlier checkpoints intact. Several are kept: a
checkpoint may be ahead of the steps Redis holds (an outage held them in memory,
a crash lost them), and a resumed attempt starts from the newest one Redis has
every step of (`load(at_most=...)`), so no step is left out. `prune` keeps every
one after the last step Redis holds durably (acknowledged long enough ago for
its AOF to have it on disk) and the newest KEEP_DURABLE at or below it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np

from app.core.config import MODEL_ARTIFACT
from app.core.errors import JobFailed
from mpjobs.contract.spec import JobSpec
from worker.engine.takeaway import portable_copy
from worker.telemetry.optimizer import TelemetryOptimizer

LEGACY_NAME = "checkpoint.npz"
"""The single checkpoint of earlier versions: still read (and pruned) like the others."""
KEEP_DURABLE = 2
"""Checkpoints kept at or below the last step Redis holds durably: the newest, and one more."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    fingerprint: str
    model_values: list[np.ndarray]
    optimizer_values: list[np.ndarray]
    summary_state: dict[str, Any]


@dataclass(frozen=True)
class Resume:
    """Where a run may resume and what it may prune: `at_most`, the last step Redis holds without a gap (None:
    the newest checkpoint); `durable()`, the last step Redis holds durably so far (None: no Redis)."""

    at_most: int | None = None
    durable: Callable[[], int] | None = None


def save(directory: Path, ckpt: Checkpoint) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"step": ckpt.step, "fingerprint": ckpt.fingerprint, "summary": ckpt.summary_state}
    arrays: dict[str, Any] = {"meta": np.array(json.dumps(meta))}
    arrays.update({f"model_{i}": v for i, v in enumerate(ckpt.model_values)})
    arrays.update({f"optimizer_{i}": v for i, v in enumerate(ckpt.optimizer_values)})
    target = path_of(directory, ckpt.step)
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


def path_of(directory: Path, step: int) -> Path:
    """Where the checkpoint of `step` is written."""
    return directory / f"checkpoint-{step:09d}.npz"


def saved_steps(directory: Path) -> dict[int, Path]:
    """Every checkpoint in `directory` by step, oldest first (an earlier version's single one included)."""
    found: dict[int, Path] = {}
    legacy = directory / LEGACY_NAME
    if legacy.exists():
        with np.load(legacy, allow_pickle=False) as archive:
            found[int(json.loads(str(archive["meta"]))["step"])] = legacy
    for path in directory.glob("checkpoint-*.npz"):
        digits = path.name[len("checkpoint-"):-len(".npz")]
        if digits.isdigit():
            found[int(digits)] = path
    return dict(sorted(found.items()))


def saved_step(directory: Path, at_most: int | None = None) -> int:
    """The step of the newest checkpoint in `directory` (at or below `at_most`), 0 if none."""
    steps = [step for step in saved_steps(directory) if at_most is None or step <= at_most]
    return steps[-1] if steps else 0


def load(directory: Path, at_most: int | None = None) -> Checkpoint | None:
    """The newest checkpoint in `directory`, or the newest at or below step `at_most`; None if there is none."""
    found = [(step, path) for step, path in saved_steps(directory).items() if at_most is None or step <= at_most]
    if not found:
        return None
    with np.load(found[-1][1], allow_pickle=False) as archive:
        meta = json.loads(str(archive["meta"]))
        model = [archive[f"model_{i}"] for i in range(_count(archive.files, "model_"))]
        opt = [archive[f"optimizer_{i}"] for i in range(_count(archive.files, "optimizer_"))]
    return Checkpoint(meta["step"], meta["fingerprint"], model, opt, meta["summary"])


def discard_after(directory: Path, step: int) -> None:
    """Delete the checkpoints after `step`: a resumed attempt retrains those steps and checkpoints them again."""
    for saved, path in saved_steps(directory).items():
        if saved > step:
            path.unlink(missing_ok=True)


def prune(directory: Path, durable: int | None) -> None:
    """Keep every checkpoint after step `durable` (a crash of Redis may yet lose its steps) and the newest
    KEEP_DURABLE at or below it; None: every step is durable (no Redis behind the run)."""
    steps = saved_steps(directory)
    below = [step for step in steps if durable is None or step <= durable]
    for step in below[:-KEEP_DURABLE]:
        steps[step].unlink(missing_ok=True)


class CheckpointWriter:
    """Writes checkpoints on one background thread, so a step waits only for the
    in-memory snapshot. At most one write is in flight; `close` waits for it and
    re-raises its error, if any. `durable()`: the last step Redis holds durably (`prune`)."""

    def __init__(self, directory: Path, durable: Callable[[], int] | None = None) -> None:
        self.directory, self.durable = directory, durable
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, ckpt: Checkpoint) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(ckpt,), name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self, ckpt: Checkpoint) -> None:
        try:
            save(self.directory, ckpt)
            prune(self.directory, None if self.durable is None else self.durable())
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


def spec_fingerprint(spec: JobSpec) -> str:
    """What a checkpoint must match to be resumed (the step count may grow; steps per call change no number)."""
    data = spec.model_dump(mode="json", exclude={"name": True, "training": {"steps", "steps_per_execution"}})
    return hashlib.sha256(repr(sorted(data.items())).encode()).hexdigest()[:16]

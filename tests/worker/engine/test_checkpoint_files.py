"""Checkpoint files: one per step, the newest at or below what Redis holds restored, pruned by what Redis
holds durably; and the checkpoint callback's interval in steps or seconds, whichever comes first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from worker.callbacks.checkpointer import Checkpointer
from worker.engine import checkpoint


def ckpt(step: int) -> checkpoint.Checkpoint:
    return checkpoint.Checkpoint(step, "f" * 16, [np.full(3, float(step))], [np.array(step)], {"steps_done": step})


def write(directory: Path, *steps: int) -> None:
    for step in steps:
        checkpoint.save(directory, ckpt(step))


def test_each_step_has_its_file_and_load_takes_the_newest_at_or_below(tmp_path: Path) -> None:
    write(tmp_path, 50, 100, 150)
    assert list(checkpoint.saved_steps(tmp_path)) == [50, 100, 150]
    assert (tmp_path / "checkpoint-000000100.npz").exists()
    assert checkpoint.saved_step(tmp_path) == 150
    loaded = checkpoint.load(tmp_path, at_most=149)
    assert loaded is not None and loaded.step == 100
    assert loaded.model_values[0].tolist() == [100.0] * 3 and loaded.summary_state == {"steps_done": 100}
    assert checkpoint.saved_step(tmp_path, at_most=100) == 100
    assert checkpoint.load(tmp_path, at_most=49) is None and checkpoint.saved_step(tmp_path, at_most=49) == 0
    assert checkpoint.load(tmp_path / "none") is None


def test_an_earlier_versions_single_checkpoint_is_still_read(tmp_path: Path) -> None:
    """`checkpoint.npz` (one file, its step in its metadata) from before per-step files."""
    meta = {"step": 75, "fingerprint": "f" * 16, "summary": {}}
    np.savez(tmp_path / "checkpoint.npz", meta=np.array(json.dumps(meta)), model_0=np.zeros(2))
    write(tmp_path, 100)
    assert list(checkpoint.saved_steps(tmp_path)) == [75, 100]
    legacy = checkpoint.load(tmp_path, at_most=80)
    assert legacy is not None and legacy.step == 75 and legacy.optimizer_values == []


def test_prune_keeps_every_one_past_the_durable_step_and_the_newest_two_at_or_below(tmp_path: Path) -> None:
    write(tmp_path, 50, 100, 150, 200, 250, 300)
    checkpoint.prune(tmp_path, durable=240)
    assert list(checkpoint.saved_steps(tmp_path)) == [150, 200, 250, 300]
    checkpoint.prune(tmp_path, durable=None)  # no Redis behind the run: every step durable
    assert list(checkpoint.saved_steps(tmp_path)) == [250, 300]


def test_discard_after_drops_what_a_resumed_attempt_retrains(tmp_path: Path) -> None:
    write(tmp_path, 50, 100, 150)
    checkpoint.discard_after(tmp_path, 100)
    assert list(checkpoint.saved_steps(tmp_path)) == [50, 100]
    checkpoint.discard_after(tmp_path, 0)
    assert checkpoint.saved_steps(tmp_path) == {}


def test_the_writer_prunes_by_what_is_durable_when_it_writes(tmp_path: Path) -> None:
    durable = [0]
    writer = checkpoint.CheckpointWriter(tmp_path, lambda: durable[0])
    for step in (10, 20, 30, 40):
        writer.submit(ckpt(step))
        writer.wait()
    assert list(checkpoint.saved_steps(tmp_path)) == [10, 20, 30, 40], "nothing durable: all kept"
    durable[0] = 35
    writer.submit(ckpt(50))
    writer.close()
    assert list(checkpoint.saved_steps(tmp_path)) == [20, 30, 40, 50]


class Recorder:
    def __init__(self) -> None:
        self.step, self.published = 0, 0
        self.latest_steps: list[object] = []  # one step per call, as under `fit`

    def publish(self) -> None:
        self.published += 1


class Model:
    stop_training = False


def saves(steps: list[float], every: int, interval_s: float) -> list[int]:
    """The steps a Checkpointer saves at when step `i` ends at second `steps[i - 1]` of training."""
    saved: list[int] = []
    now = [0.0]
    recorder: Any = Recorder()
    callback = Checkpointer(recorder, every, saved.append, interval_s, clock=lambda: now[0])
    callback.set_model(Model())  # type: ignore[arg-type]
    for step, ends in enumerate(steps, start=1):
        recorder.step, now[0] = step, ends
        callback.on_train_batch_end(step - 1)
    assert recorder.published == len(saved)
    return saved


def test_a_checkpoint_every_so_many_steps_or_seconds_whichever_comes_first() -> None:
    assert saves([2.0 * s for s in range(1, 13)], every=50, interval_s=4.0) == [2, 4, 6, 8, 10, 12]
    assert saves([0.01 * s for s in range(1, 11)], every=5, interval_s=30.0) == [5, 10]
    # 3 s steps, interval 4 s: a save at 6 s (step 2), then 12 s (step 4); step 5 by count; its seconds restart.
    assert saves([3.0 * s for s in range(1, 9)], every=5, interval_s=4.0) == [2, 4, 5, 7]

"""TensorBoard event files: one scalar per step per tag, also across a resumed attempt."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.core.config import Settings
from mpjobs.contract.fp8 import Fp8Tensor
from mpjobs.contract.records import StepRecord
from tests.app.store.test_layer_checks import check
from tests.worker.conftest import spec_of
from worker.engine.training import run_job
from worker.telemetry.reporters import FanOut, ListReporter
from worker.telemetry.tensorboard import FP8_FIELDS, LAYER_FIELDS, TAGS, TensorBoardReporter


def record(step: int, loss: float | None) -> StepRecord:
    return StepRecord(step=step, loss=loss, loss_scale=2.0**15, grad_norm=None if loss is None else 1.0,
                      grads_finite=loss is not None, skipped=loss is None, zero_grad_fraction=0.0,
                      learning_rate=1e-3, examples_per_sec=100.0, step_time_ms=1.0, time=1_700_000_000.0 + step)


def read(logdir: Path) -> EventAccumulator:
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return events


def test_every_tag_once_per_step_and_non_finite_shown_as_nan(tmp_path: Path) -> None:
    board = TensorBoardReporter(tmp_path)
    board.steps([record(1, 2.0), record(2, None)])
    board.steps([record(3, 1.5)])
    board.close()
    events = read(tmp_path)
    assert set(events.Tags()["scalars"]) == set(TAGS)
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert loss[0].value == 2.0 and math.isnan(loss[1].value) and loss[2].value == 1.5
    assert [e.value for e in events.Scalars("skipped")] == [0.0, 1.0, 0.0]


def test_resumed_attempt_replaces_the_lost_attempts_steps(tmp_path: Path) -> None:
    first = TensorBoardReporter(tmp_path)
    first.steps([record(step, 10.0) for step in range(1, 16)])  # died at 15; checkpoint at 10
    first.close()
    second = TensorBoardReporter(tmp_path, resume_step=10)
    second.steps([record(step, 1.0) for step in range(11, 21)])
    second.close()
    loss = read(tmp_path).Scalars("loss")
    assert [e.step for e in loss] == list(range(1, 21))
    assert [e.value for e in loss] == [10.0] * 10 + [1.0] * 10


def test_the_float32_check_s_values_appear_on_the_steps_that_have_them(tmp_path: Path) -> None:
    board = TensorBoardReporter(tmp_path)
    checked = record(1, 2.0).model_copy(update={"excess_zero_fraction": 0.25, "grad_rel_error": 0.5})
    board.steps([checked, record(2, 1.0)])
    board.close()
    events = read(tmp_path)
    assert [(e.step, e.value) for e in events.Scalars("excess_zero_fraction")] == [(1, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("grad_rel_error")] == [(1, 0.5)]
    assert "regularization_loss" not in events.Tags()["scalars"]


def test_a_layer_check_is_one_scalar_per_layer_and_numeric_field_at_its_step(tmp_path: Path) -> None:
    board = TensorBoardReporter(tmp_path)
    board.layers([check(1)])
    board.steps([record(1, 2.0), record(2, 1.0)])
    board.close()
    events = read(tmp_path)
    layer_tags = {t for t in events.Tags()["scalars"] if t.startswith("layers/")}
    conv, pool = check(1).layers
    assert LAYER_FIELDS == ("values", "zero_fraction", "excess_zero_fraction", "grad_norm", "grad_max_log2",
                            "grad_min_log2", "lost_min_log2", "grad_rel_error", "signal_values", "signal_zero_fraction",
                            "signal_excess_zero_fraction", "activation_max", "activation_headroom_log2",
                            "activation_subnormal_fraction", "activation_zero_fraction")
    # The pooling layer trains nothing: its null gradient fields are left out, not written as NaN.
    assert layer_tags == {f"layers/conv3d_1/{f}" for f in LAYER_FIELDS} | {
        f"layers/max_pooling3d/{f}" for f in ("values", "signal_values", "activation_max", "activation_headroom_log2",
                                              "activation_subnormal_fraction", "activation_zero_fraction")}
    for layer in (conv, pool):
        for field in LAYER_FIELDS:
            if getattr(layer, field) is not None:
                scalars = events.Scalars(f"layers/{layer.name}/{field}")
                assert [(e.step, e.value) for e in scalars] == [(1, float(np.float32(getattr(layer, field))))]
    assert events.Scalars("layers/conv3d_1/grad_min_log2")[0].value == -24.0
    assert [e.step for e in events.Scalars("loss")] == [1, 2]


def fp8_rows(step: int) -> list[Fp8Tensor]:
    """An attention layer's query (a path with a slash) and a Dense layer whose scale went to zero."""
    query = [Fp8Tensor(layer="multi_head_attention/query", tensor=tensor, scale=scale * step, amax=amax,
                       range_use=amax / (fmt_max * scale * step), history_max=amax * 3, peak_age=step,
                       **({"saturated_fraction": 0.0078125, "underflow_fraction": 0.25} if step == 2 else {}))
             for tensor, scale, amax, fmt_max in (("inputs", 0.0074637276120483875, 3.453125, 448.0),
                                                  ("kernel", 0.0007847376982681453, 0.353515625, 448.0),
                                                  ("outputs_grad", 7.620879500791489e-07, 0.033203125, 57344.0))]
    return [*query, Fp8Tensor(layer="dense_1", tensor="kernel", scale=0.0, amax=0.0, range_use=None,
                              history_max=0.0, peak_age=0)]


def test_an_fp8_step_adds_each_layer_and_tensor_s_scaling_state_as_the_record_has_it(tmp_path: Path) -> None:
    board = TensorBoardReporter(tmp_path)
    records = [record(step, 2.0).model_copy(update={"fp8": fp8_rows(step)}) for step in (1, 2)]
    board.steps([*records, record(3, 1.0)])  # a step without FP8 rows adds no fp8 tag
    board.close()
    events = read(tmp_path)
    assert FP8_FIELDS == ("scale", "amax", "range_use", "history_max", "lag", "saturated_fraction",
                          "underflow_fraction")
    tags = {t for t in events.Tags()["scalars"] if t.startswith("fp8/")}
    query = {f"fp8/multi_head_attention/query/{tensor}/{field}" for tensor in ("inputs", "kernel", "outputs_grad")
             for field in FP8_FIELDS}
    # The zero scale: its range use and lag are null (not finite), left out; the rest are written.
    assert tags == query | {f"fp8/dense_1/kernel/{f}" for f in ("scale", "amax", "history_max")}
    for row_1, row_2 in zip(*(r.fp8 or [] for r in records), strict=True):
        for field in FP8_FIELDS:
            tag = f"fp8/{row_1.layer}/{row_1.tensor}/{field}"
            if tag not in tags:
                continue
            expected = [(r.step, float(np.float32(v))) for r, row in zip(records, (row_1, row_2), strict=True)
                        if (v := getattr(row, field)) is not None]
            assert [(e.step, e.value) for e in events.Scalars(tag)] == expected, tag
    assert [e.step for e in events.Scalars("fp8/multi_head_attention/query/inputs/underflow_fraction")] == [2]
    assert events.Scalars("fp8/multi_head_attention/query/kernel/lag")[0].value == 3.0  # history_max / amax
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert set(TAGS) < set(events.Tags()["scalars"])


FULL_DISK_STEPS = 40
"""More steps than tensorboard's writer queue (10 events) holds: some add_event must see its dead writer thread."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # tensorboard's writer thread dies
def test_a_full_disk_fails_no_step_and_is_logged(tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    board = TensorBoardReporter(tmp_path / "tensorboard", description="full disk")

    def full(data: Any) -> None:  # what TensorFlow's file raised when a tmpfs filled up under a run
        raise tf.errors.ResourceExhaustedError(None, None, "No space left on device")

    assert board._writer is not None
    monkeypatch.setattr(board._writer._general_file_writer, "write", full)  # the event file's own writes
    steps = ListReporter()  # where the Redis reporter stands in a worker: before the board
    with caplog.at_level(logging.ERROR, logger="mpjobs.worker"):
        result = run_job(spec_of(precision_policy="float32", training={"steps": FULL_DISK_STEPS}),
                         reporter=FanOut(steps, board), checkpoint_dir=tmp_path / "run", settings=settings)
        board.close()  # as worker/service/tasks.py does after every run: a dead writer must not raise here either
    assert result.status == "succeeded" and result.summary.steps_done == FULL_DISK_STEPS
    assert [r.step for r in steps.records] == list(range(1, FULL_DISK_STEPS + 1))
    failures = [r for r in caplog.records if r.name == "mpjobs.worker" and r.levelno == logging.ERROR]
    logdir = tmp_path / "tensorboard"
    # Logged once with its error, then counted, not a traceback per batch for the rest of the run.
    assert failures[0].getMessage() == f"writing TensorBoard events to {logdir} failed", caplog.text
    assert failures[0].exc_info is not None and isinstance(failures[0].exc_info[1], tf.errors.ResourceExhaustedError)
    assert board.failures >= 1
    rest = [f"writing TensorBoard events to {logdir} failed for {board.failures - 1} more batches; their steps are "
            "in Redis only"] if board.failures > 1 else []
    assert [r.getMessage() for r in failures[1:]] == rest, caplog.text


def test_a_folder_that_cannot_be_written_at_the_start_fails_no_step_and_is_logged(
        tmp_path: Path, settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.ERROR, logger="mpjobs.worker"):
        board = TensorBoardReporter(blocked / "tensorboard", description="blocked")
        steps = ListReporter()
        result = run_job(spec_of(precision_policy="float32", training={"steps": 5}),
                         reporter=FanOut(steps, board), checkpoint_dir=tmp_path / "run", settings=settings)
        board.close()
    assert result.status == "succeeded" and [r.step for r in steps.records] == [1, 2, 3, 4, 5]
    assert [r.getMessage() for r in caplog.records if r.name == "mpjobs.worker"] == [
        f"TensorBoard events cannot be written to {blocked / 'tensorboard'}; the job trains without them"]

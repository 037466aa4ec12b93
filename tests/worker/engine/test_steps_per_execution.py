"""Several steps per compiled call (worker/engine/stepper.py): the same records, calls that end at boundaries.

A call of k steps keeps each step's telemetry row on the device and hands them over once. Nothing a
record says may depend on k: these runs train the same seeded job at 1 and 8 steps per call and
compare every number (the timing fields aside), the layer checks and the final weights. The rules
at a call's edges are checked where they bite: a call ends before a check step and at a checkpoint,
and a cancel that arrives while a call runs lands when that call ends. Skips and divergence inside a
call are in tests/worker/engine/test_failures.py (parametrized `per_call`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from app.core.config import Settings
from mpjobs.contract.records import StepRecord
from tests.worker.conftest import spec_of
from worker.engine import checkpoint
from worker.engine.devices import detect_device
from worker.engine.stepper import AutoSize, call_sizes
from worker.engine.training import Training
from worker.telemetry.reporters import ListReporter

TIMING = {"time", "step_time_ms", "examples_per_sec"}
"""What a record may differ in between two runs: when each step ended and how long it took."""


def numbers(record: StepRecord) -> dict[str, Any]:
    return record.model_dump(exclude=TIMING)


def train(settings: Settings, out: Path, per_call: int | str, **training: Any) -> tuple[Training, ListReporter]:
    spec = spec_of(precision_policy="mixed_float16", loss_scale="dynamic", dataset={"samples": 256},
                   training={"seed": 3, **training, "steps_per_execution": per_call})
    reporter = ListReporter()
    job = Training(spec, reporter, out, lambda: False, settings, detect_device())
    job.run()
    return job, reporter


def test_call_sizes_end_early_at_every_boundary() -> None:
    # Boundaries after steps 10 and 20 (checkpoints): calls of at most 8 end there.
    assert list(call_sizes(0, 20, 8, lambda b: b % 10 == 0)) == [8, 2, 8, 2]
    # Resumed at step 7: the first call ends at the checkpoint of step 10.
    assert list(call_sizes(7, 13, 8, lambda b: b % 10 == 0)) == [3, 8, 2]
    assert list(call_sizes(0, 5, 1, lambda b: False)) == [1] * 5
    # The most per call is read before each call (the automatic size grows as calls are timed).
    most = iter([1, 1, 4, 4, 4])
    assert list(call_sizes(0, 10, lambda: next(most), lambda b: False)) == [1, 1, 4, 4]


def test_the_automatic_size_aims_at_20_ms_calls_and_never_counts_the_traced_call() -> None:
    auto = AutoSize()
    assert auto() == 1, "nothing timed yet"
    auto.timed(1, 2.0)  # the first call traces: not counted
    assert auto() == 1
    auto.timed(1, 0.001)
    assert auto() == 20
    auto.timed(20, 0.01)  # 0.5 ms a step
    assert auto() == 26, "the median of 1 ms and 0.5 ms a step, 0.75 ms: 26 steps in 20 ms"
    for _ in range(9):
        auto.timed(10, 1.0)  # 100 ms a step: one step per call
    assert auto() == 1
    for _ in range(9):
        auto.timed(100, 1e-5)
    assert auto() == 256, "at most MAX_STEPS_PER_CALL"


def test_records_checks_and_weights_are_identical_at_one_and_eight_steps_per_call(
        settings: Settings, tmp_path: Path) -> None:
    training = {"steps": 60, "checkpoint_every": 25, "underflow_check_every": 20}
    one, one_reporter = train(settings, tmp_path / "one", 1, **training)
    eight, eight_reporter = train(settings, tmp_path / "eight", 8, **training)

    assert one.calls is not None and eight.calls is not None
    assert one.calls.sizes == [1] * 60
    # Checks at steps 1, 20, 40 and 60 read the weights before their step: a call ends at 19, 39 and
    # 59; checkpoints end calls at 25 and 50. No call runs across one of those; the others run 8 steps
    # unless the segment of batches that `fit` would have been given ends first.
    sizes = eight.calls.sizes
    ends = list(np.cumsum(sizes))
    boundaries = {19, 25, 39, 50, 59, 60}
    assert ends[-1] == 60 and boundaries <= set(ends)
    assert not [(end - k, end) for k, end in zip(sizes, ends, strict=True)
                if any(end - k < b < end for b in boundaries)], "a call ran across a boundary"
    assert max(sizes) == 8 and sizes.count(8) >= 4
    assert one_reporter.summaries[-1].steps_per_call == 1 and eight_reporter.summaries[-1].steps_per_call == 8

    first, second = one_reporter.records, eight_reporter.records
    assert [r.step for r in second] == list(range(1, 61))
    assert [numbers(r) for r in second] == [numbers(r) for r in first]
    checked = [r.step for r in second if r.grad_rel_error is not None]
    assert checked == [1, 20, 40, 60], "the float32 check's steps are the same"
    assert ([c.model_dump(exclude={"time"}) for c in eight_reporter.layer_checks]
            == [c.model_dump(exclude={"time"}) for c in one_reporter.layer_checks])
    assert [c.step for c in eight_reporter.layer_checks] == [1, 20, 40, 60]
    a, b = checkpoint.load(tmp_path / "one"), checkpoint.load(tmp_path / "eight")
    assert a is not None and b is not None and a.step == b.step == 60
    for x, y in zip(a.model_values + a.optimizer_values, b.model_values + b.optimizer_values, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_cancel_that_arrives_during_a_call_lands_when_that_call_ends(settings: Settings, tmp_path: Path) -> None:
    spec = spec_of(dataset={"samples": 256}, training={"steps": 200, "steps_per_execution": 8, "checkpoint_every": 50})
    canceled = {"flag": False}
    reporter = ListReporter()
    job = Training(spec, reporter, tmp_path, lambda: canceled["flag"], settings, detect_device())
    assert job.calls is not None
    stepper, calls = job.calls.stepper, []

    def cancel_during_the_third_call(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        calls.append(len(x) // spec.training.batch_size)
        if len(calls) == 3:
            canceled["flag"] = True  # while the call is under way: its steps still run
        return stepper(x, y)

    job.calls.stepper = cancel_during_the_third_call  # type: ignore[assignment]
    result = job.run()
    end = sum(calls[:3])
    assert calls[2] > 1, "the cancel came inside a call of several steps"
    assert len(calls) == 3, "no call after it"
    assert result.status == "stopped"
    assert result.summary.steps_done == end, "the end of the call the cancel arrived in"
    assert [r.step for r in reporter.records] == list(range(1, end + 1))
    saved = checkpoint.load(tmp_path)
    assert saved is not None and saved.step == end, "stopped where it can resume"

"""Evaluations through every reporter: a list, a fan-out, JSON lines and TensorBoard's `validation/*` scalars."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from tests.app.store.test_evaluations_store import evaluation
from tests.worker.telemetry.test_tensorboard import read
from worker.telemetry.reporters import FanOut, JsonLinesReporter, ListReporter
from worker.telemetry.tensorboard import TensorBoardReporter


def test_tensorboard_shows_the_loss_and_each_metric_at_the_evaluations_step(tmp_path: Path) -> None:
    board = TensorBoardReporter(tmp_path)
    board.evaluations([evaluation(3), evaluation(6, loss=None)])
    board.close()
    events = read(tmp_path)
    assert set(events.Tags()["scalars"]) == {"validation/loss", "validation/accuracy", "validation/auc"}
    loss = events.Scalars("validation/loss")
    assert [e.step for e in loss] == [3, 6] and loss[0].value == 0.5 and math.isnan(loss[1].value)
    assert [e.value for e in events.Scalars("validation/accuracy")] == [0.75, 0.75]


def test_a_fan_out_hands_each_evaluation_to_every_reporter_and_json_lines_prints_one_line_each() -> None:
    kept, out = ListReporter(), io.StringIO()
    FanOut(kept, JsonLinesReporter(out)).evaluations([evaluation(3), evaluation(6)])
    assert kept.evaluation_records == [evaluation(3), evaluation(6)]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == [{"evaluation": evaluation(s).model_dump(mode="json")} for s in (3, 6)]

"""`mpjobs evaluations` and the summary's validation and data lines, for known values written out."""

from __future__ import annotations

import io
from typing import Any

from mpjobs.cli.commands import write_evaluations_csv
from mpjobs.cli.words import evaluations_table, summary_lines

RECORDS = [{"step": 100, "loss": 0.693147, "metrics": {"accuracy": 0.5, "auc": None}, "examples": 30,
            "seconds": 0.01234, "time": 1.0},
           {"step": 150, "loss": None, "metrics": {"accuracy": 0.9, "auc": 0.95}, "examples": 30, "seconds": 0.5,
            "time": 2.0}]
SUMMARY: dict[str, Any] = {
    "steps_done": 150, "final_loss": 0.25, "skipped_steps": 0, "loss_scale_min": 1.0, "loss_scale_max": 1.0,
    "loss_scale_final": 1.0, "peak_zero_grad_fraction": 0.0, "mean_examples_per_sec": 100.0, "diagnoses": [],
    "validation": RECORDS[0],
    "data": {"rows": 120, "held_out_rows": 30, "steps_per_epoch": 7, "epochs": 150 / 7, "dropped_per_epoch": 8,
             "shuffle": "..."}}


def test_the_evaluations_table_has_a_column_per_metric_and_says_non_finite() -> None:
    assert evaluations_table(RECORDS).splitlines() == [
        "step  loss        accuracy  auc         examples  seconds",
        "100   0.6931      0.5       non-finite  30        0.0123",
        "150   non-finite  0.9       0.95        30        0.5",
    ]


def test_the_summary_says_the_final_evaluation_and_what_training_did_with_the_data() -> None:
    job = {"id": "j1", "state": "succeeded", "progress": {"step": 150, "total_steps": 150}, "error": None,
           "summary": SUMMARY}
    lines = summary_lines(job)
    assert ("  validation       loss 0.6931, accuracy 0.5, auc non-finite on 30 held-out rows at step 100 "
            "(mpjobs evaluations j1)") in lines
    assert ("  data             120 rows trained on (30 held out), 21.4 epochs of 7 steps, each reshuffled; "
            "8 rows of each epoch dropped (the partial batch)") in lines
    without = summary_lines({**job, "summary": {**SUMMARY, "validation": None}})
    assert not any(line.startswith(("  validation", "  data")) for line in without)


def test_the_evaluations_csv_has_a_column_per_metric_and_an_empty_cell_for_non_finite() -> None:
    out = io.StringIO()
    write_evaluations_csv(RECORDS, out)
    assert out.getvalue().splitlines() == [
        "step,loss,accuracy,auc,examples,seconds,time",
        "100,0.693147,0.5,,30,0.01234,1.0",
        "150,,0.9,0.95,30,0.5,2.0",
    ]

"""An FP8 job in the CLI's words: the summary's FP8 line, and the latest FP8 rows as a table, for known values."""

from __future__ import annotations

from typing import Any

from mpjobs.cli.fp8_words import fp8_report, latest_fp8
from mpjobs.cli.words import summary_lines
from mpjobs.contract.records import StepRecord
from tests.mpjobs.test_cli_evaluation_words import SUMMARY

ROWS: list[dict[str, Any]] = [
    {"layer": "dense", "tensor": "inputs", "scale": 0.0074637276120483875, "amax": 3.453125,
     "range_use": 1.0327102895782176, "history_max": 3.453125, "peak_age": 0},
    {"layer": "dense", "tensor": "kernel", "scale": 1.0, "amax": 0.001, "range_use": 0.001 / 448,
     "history_max": 0.5, "peak_age": 3},
    {"layer": "multi_head_attention/query", "tensor": "outputs_grad", "scale": 7.620879500791489e-07,
     "amax": 0.033203125, "range_use": 0.7597765444087081, "history_max": 0.039306640625, "peak_age": 1},
    {"layer": "dense_1", "tensor": "kernel", "scale": 0.0, "amax": 0.0, "range_use": None, "history_max": 0.0,
     "peak_age": 0},
]
COUNTS = [{"saturated_fraction": 0.00390625, "underflow_fraction": 0.0},
          {"saturated_fraction": 0.0, "underflow_fraction": 0.5}, {}, {"saturated_fraction": 0.0}]


def step(number: int, rows: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A step record as the API serves it (validated: the rows are what a worker could report)."""
    return StepRecord(step=number, loss=1.0, loss_scale=1.0, grad_norm=1.0, grads_finite=True, skipped=False,
                      zero_grad_fraction=0.0, fp8=rows, learning_rate=0.1, examples_per_sec=10.0,
                      step_time_ms=1.0, time=1.0).model_dump(mode="json")


def test_the_summary_names_the_fp8_layers_those_kept_and_the_history_length() -> None:
    fp8 = {"amax_history_length": 4, "layers": ["dense", "multi_head_attention/query"], "kept": ["embedding"]}
    job = {"id": "j1", "state": "succeeded", "progress": {"step": 150, "total_steps": 150}, "error": None,
           "summary": {**SUMMARY, "fp8": fp8}}
    lines = summary_lines(job)
    assert ("  fp8              dense, multi_head_attention/query in FP8 (amax history of 4 steps); kept their "
            "policy: embedding") in lines
    assert lines.index("  diagnoses        none") > next(i for i, line in enumerate(lines) if "fp8" in line)
    assert not any("fp8" in line for line in summary_lines({**job, "summary": {**SUMMARY, "fp8": None}}))


def test_the_latest_fp8_rows_read_as_a_table_with_the_latest_checked_step_s_exact_shares() -> None:
    checked = step(20, [{**row, **counts} for row, counts in zip(ROWS, COUNTS, strict=True)])
    records = [step(19, ROWS), checked, step(21, None), step(30, ROWS)]
    latest, counted = latest_fp8(records)
    assert latest is records[-1] and counted is checked
    assert fp8_report("j1", latest, counted).splitlines() == [
        "job j1: FP8 scaling at step 30; SATURATED and LOST counted at step 20, the latest checked step",
        "LAYER                       TENSOR        SCALE     AMAX    RANGE USE   LAG    SATURATED  LOST",
        "dense                       inputs        0.007464  3.453   1.033       1      0.39%      0%    saturating",
        "dense                       kernel        1         0.001   2.232e-6    500    0%         50%   underflowing",
        "multi_head_attention/query  outputs_grad  7.621e-7  0.0332  0.7598      1.184  -          -",
        "dense_1                     kernel        0         0       non-finite  -      0%         -",
        "range use: amax / (format max × scale), above 1 saturated; lag: history max / amax",
    ]


def test_without_a_checked_step_the_table_has_no_share_columns() -> None:
    latest, counted = latest_fp8([step(1, ROWS[:1]), step(2, ROWS[:1])])
    assert latest is not None and counted is None
    assert fp8_report("j1", latest, counted).splitlines()[:3] == [
        "job j1: FP8 scaling at step 2",
        "LAYER  TENSOR  SCALE     AMAX   RANGE USE  LAG",
        "dense  inputs  0.007464  3.453  1.033      1    saturating",
    ]
    on_a_checked_step = fp8_report("j1", step(2, [{**ROWS[0], **COUNTS[0]}]), step(2, [{**ROWS[0], **COUNTS[0]}]))
    assert on_a_checked_step.splitlines()[0] == "job j1: FP8 scaling at step 2, a checked step"
    assert latest_fp8([step(1, None)]) == (None, None)

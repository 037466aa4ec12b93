"""Held-out evaluation's cost: one evaluation on every held-out row against one training step, same job, same run.

Each repeat trains the built-in mlp (mixed_float16, batch 32) on 4,096 synthetic rows with a validation split of
0.2 (819 held-out rows) and accuracy, evaluated every `EVERY` steps and at the end, through `run_job`, the engine
jobs run. The job's own records give both sides: each `EvalRecord.seconds` (predictions, loss and metrics over
every held-out row) and each `StepRecord.step_time_ms` (one optimizer step). A repeat's ratio is its median
evaluation over its median step; the row is the median over repeats. The second row is what one evaluation adds
to the `eval_every` steps it follows, at the default interval of 100 steps: the ratio / 100.

    python -m bench.evaluation_cost [--repeats N] [--quick]

Goal: one evaluation costs at most one training step per held-out batch (it is a forward pass over each batch, no
gradient and no update): here 26 batches of 32.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from app.core.config import Settings  # noqa: E402
from bench.report import Row, cli  # noqa: E402
from mpjobs.contract.spec import JobSpec  # noqa: E402
from worker.engine.training import run_job  # noqa: E402
from worker.telemetry.reporters import ListReporter  # noqa: E402

EVERY = 50
"""Steps between evaluations in the benchmark's job: several evaluations per repeat, each after warm steps."""
DEFAULT_EVERY = 100
"""`validation.eval_every`'s default: the interval the overhead row is stated at."""
REPEATS = 5
BATCH = 32


def spec(steps: int) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"name": "mlp"}, "precision_policy": "mixed_float16",
        "training": {"steps": steps, "batch_size": BATCH, "checkpoint_every": steps, "underflow_check_every": 0},
        "dataset": {"samples": 4096},
        "validation": {"split": 0.2, "seed": 0, "metrics": ["accuracy"], "eval_every": EVERY},
    })


def one_run(steps: int) -> tuple[float, float, int]:
    """(median evaluation s, median step s, held-out rows) of one job."""
    reporter = ListReporter()
    with tempfile.TemporaryDirectory() as out:
        run_job(spec(steps), reporter=reporter, checkpoint_dir=Path(out), settings=Settings(speed_check_steps=0))
    evaluations = reporter.evaluation_records
    assert len(evaluations) >= 2, f"{len(evaluations)} evaluations in {steps} steps"
    steps_s = [r.step_time_ms / 1e3 for r in reporter.records[1:] if r.step_time_ms is not None]
    return (statistics.median(e.seconds for e in evaluations[1:]), statistics.median(steps_s),
            evaluations[-1].examples)


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    steps, n = (2 * EVERY, 1) if quick else (4 * EVERY, REPEATS)
    n = repeats or n
    runs = [one_run(steps) for _ in range(n)]
    evaluation = statistics.median(r[0] for r in runs)
    step = statistics.median(r[1] for r in runs)
    ratio = statistics.median(r[0] / r[1] for r in runs)
    share = ratio / DEFAULT_EVERY
    rows = runs[0][2]
    batches = -(-rows // BATCH)
    return [
        Row("evaluation_cost", f"one evaluation, {rows} held-out rows (mlp, mixed_float16)", "one training step",
            step * 1e3, evaluation * 1e3, "ms", ratio, goal=f"<= {batches} steps (one per held-out batch)",
            met=ratio <= batches),
        Row("evaluation_cost", f"added to training at eval_every={DEFAULT_EVERY}", "training alone", 1.0,
            1.0 + share, "x", 1.0 + share),
    ]


if __name__ == "__main__":
    cli("held-out evaluation's cost", __doc__ or "", run)

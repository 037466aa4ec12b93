"""The same engine under KERAS_BACKEND=jax (how GPU hosts without TensorFlow run it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, tempfile
from pathlib import Path
from app.config import Settings
from app.schemas import JobSpec
from worker.engine import run_job
from worker.telemetry import ListReporter

def run(spec, out, should_stop=lambda: False):
    reporter = ListReporter()
    result = run_job(JobSpec.model_validate(spec), reporter=reporter, checkpoint_dir=out,
                     should_stop=should_stop, settings=Settings())
    return result, [r.model_dump() for r in reporter.records]

overflow = {"model": {"name": "mlp"}, "precision_policy": "mixed_float16",
            "loss_scale": {"mode": "dynamic", "initial_scale": 2.0**40}, "training": {"steps": 30},
            "dataset": {"samples": 256}}
result, records = run(overflow, Path(tempfile.mkdtemp()))
resumable = {"model": {"name": "mlp"}, "precision_policy": "mixed_float16",
             "loss_scale": {"mode": "dynamic", "initial_scale": 256, "growth_steps": 7},
             "training": {"steps": 24, "checkpoint_every": 10}, "dataset": {"samples": 256}}
_, whole = run(resumable, Path(tempfile.mkdtemp()))
out, calls = Path(tempfile.mkdtemp()), []
_, part1 = run(resumable, out, lambda: calls.append(1) or len(calls) >= 11)
_, part2 = run(resumable, out)
json.dump({"records": records, "skipped": result.summary.skipped_steps, "backend": result.device.backend,
           "whole": whole, "resumed": part1 + part2}, sys.stdout)
"""


def test_engine_runs_and_resumes_under_jax() -> None:
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout.strip().splitlines()[-1])
    assert data["backend"] == "jax"
    records = data["records"]
    first_applied = next(i for i, r in enumerate(records) if not r["skipped"])
    assert first_applied > 5
    assert [r["loss_scale"] for r in records[:first_applied]] == [2.0 ** (40 - i) for i in range(first_applied)]
    assert data["skipped"] == sum(r["skipped"] for r in records)
    assert all(r["loss"] is not None for r in records)
    resumed = data["resumed"]
    assert [r["step"] for r in resumed] == list(range(1, 25))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in data["whole"]]
    assert [r["loss_scale"] for r in resumed] == [r["loss_scale"] for r in data["whole"]]

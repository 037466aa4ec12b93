"""The same engine under KERAS_BACKEND=jax (how GPU hosts without TensorFlow run it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from app.core.config import Settings
from scripts.stack import ROOT
from tests.worker.conftest import Train
from tests.worker.numerics.test_numerics import partial_underflow_case, regularized_case

pytestmark = pytest.mark.processes
"""Each test runs the engine in another interpreter, under KERAS_BACKEND=jax."""

SCRIPT = """
import json, sys, tempfile
from pathlib import Path
from app.core.config import Settings
from mpjobs.contract.spec import JobSpec
from worker.engine.training import run_job
from worker.telemetry.reporters import ListReporter

def run(spec, out, should_stop=lambda: False, settings=Settings(speed_check_steps=0)):
    reporter = ListReporter()
    result = run_job(JobSpec.model_validate(spec), reporter=reporter, checkpoint_dir=out,
                     should_stop=should_stop, settings=settings)
    return result, [r.model_dump() for r in reporter.records]

overflow = {"model": {"name": "mlp"}, "precision_policy": "mixed_float16",
            "loss_scale": {"mode": "dynamic", "initial_scale": 2.0**40}, "training": {"steps": 30},
            "dataset": {"samples": 256}}
# The first run also times its policy against float32 after training, as a worker does (Settings()'s check);
# the runs that test resuming leave that out.
result, records = run(overflow, Path(tempfile.mkdtemp()), settings=Settings())
resumable = {"model": {"name": "mlp"}, "precision_policy": "mixed_float16",
             "loss_scale": {"mode": "dynamic", "initial_scale": 256, "growth_steps": 7},
             "training": {"steps": 24, "checkpoint_every": 10}, "dataset": {"samples": 256}}
_, whole = run(resumable, Path(tempfile.mkdtemp()))
out, calls = Path(tempfile.mkdtemp()), []
_, part1 = run(resumable, out, lambda: calls.append(1) or len(calls) >= 11)
_, part2 = run(resumable, out)
# The overflowing run at one and at eight steps per call (its skips and a check step inside the first calls).
per_call = {n: run({**overflow, "training": {"steps": 30, "steps_per_execution": n, "underflow_check_every": 10}},
                   Path(tempfile.mkdtemp()))[1] for n in (1, 8)}
json.dump({"records": records, "skipped": result.summary.skipped_steps, "backend": result.device.backend,
           "whole": whole, "resumed": part1 + part2, "per_call": per_call}, sys.stdout)
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
    # Several steps per call under JAX (a lax.scan): the same records as one step per call, timing aside.
    timing = {"time", "step_time_ms", "examples_per_sec"}
    one, eight = ([{k: v for k, v in r.items() if k not in timing} for r in data["per_call"][n]] for n in ("1", "8"))
    assert [r["step"] for r in eight] == list(range(1, 31)) and any(r["skipped"] for r in eight[1:7])
    # The checks at 1, 10 and 20 met overflowing steps (no gradient error to report); 30's is the float32 check's.
    assert [r["step"] for r in eight if r["grad_rel_error"] is not None] == [30]
    assert eight == one


AGREE_SCRIPT = """
import json, sys, tempfile
from pathlib import Path
from app.core.config import Settings
from mpjobs.contract.spec import JobSpec
from worker.engine.training import run_job
from worker.telemetry.reporters import ListReporter

given = json.loads(sys.stdin.read())
out = []
for spec in given["specs"]:
    reporter = ListReporter()
    result = run_job(JobSpec.model_validate(spec), reporter=reporter, checkpoint_dir=Path(tempfile.mkdtemp()),
                     settings=Settings(data_root=Path(given["data_root"]), speed_check_steps=0))
    out.append({"records": [r.model_dump() for r in reporter.records],
                "diagnoses": [d.code for d in result.summary.diagnoses]})
json.dump(out, sys.stdout)
"""


def test_tensorflow_and_jax_report_the_same_numbers(train: Train, settings: Settings) -> None:
    """The data loss, penalties, norm, zeros and the float32 check agree across backends."""
    specs = [regularized_case(settings)[0], partial_underflow_case(settings, "none")[0]]
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", AGREE_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300, input=json.dumps({"specs": [s.model_dump(mode="json") for s in specs],
                                                         "data_root": str(settings.data_root)}))
    assert done.returncode == 0, done.stderr[-3000:]
    under_jax = json.loads(done.stdout.strip().splitlines()[-1])
    for spec, jax_run in zip(specs, under_jax, strict=True):
        result, reporter = train(spec)
        ours = reporter.records[0].model_dump()
        theirs = jax_run["records"][0]
        # The two backends run different float16 kernels: the error float16 causes agrees to a few percent.
        for field, rel in (("loss", 1e-5), ("regularization_loss", 1e-5), ("grad_norm", 1e-4),
                           ("excess_zero_fraction", 1e-12), ("grad_rel_error", 0.05)):
            if ours[field] is None:
                assert theirs[field] is None, field
            else:
                assert theirs[field] == pytest.approx(ours[field], rel=rel), field
        assert theirs["zero_grad_fraction"] == ours["zero_grad_fraction"]
        assert jax_run["diagnoses"] == [d.code for d in result.summary.diagnoses]

"""Engine overhead: the instrumented engine against a bare `model.fit`.

Same model, policy, optimizer, batch size and batches on both sides. The
figure is the steady-state cost per step inside one run: the wall time from
the end of step 1 to the end of step N, over N - 1. It leaves out the one-off
costs (building, tracing, saving the model), which swing by seconds on a
shared machine, and keeps everything the engine does per step (telemetry,
reporting, new `fit` calls at segment boundaries). The ratio compares the
instrumented engine with checkpoints only at the end, since bare fit writes
none; the last column shows the engine again with a checkpoint every 50 steps,
the default, so their cost is visible too. Runs alternate bare/engine; the
table shows medians over the repeats and the median of the per-repeat ratios.
Goal: ratio <= 1.05.

    python -m bench.engine_overhead [--repeats 5] [--quick]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from app.config import Settings  # noqa: E402
from app.schemas import JobSpec  # noqa: E402
from bench.report import Row, cli  # noqa: E402
from worker.data import load_dataset  # noqa: E402
from worker.engine import run_job  # noqa: E402
from worker.models import build_model  # noqa: E402
from worker.telemetry import ListReporter  # noqa: E402

GOAL = 1.05


@dataclass(frozen=True)
class Case:
    model: dict[str, object]
    policy: str
    steps: int
    """Steps per run."""

    @property
    def label(self) -> str:
        scale = " + dynamic" if self.policy == "mixed_float16" else ""
        return f"{self.model['name']} {self.policy}{scale}"

    def spec(self, checkpoint_every: int) -> JobSpec:
        return JobSpec.model_validate({
            "model": self.model, "precision_policy": self.policy,
            "training": {"steps": self.steps, "batch_size": 32, "checkpoint_every": checkpoint_every},
            "dataset": {"samples": 4096},
        })


CASES = [
    Case({"name": "mlp"}, "float32", 600),
    Case({"name": "mlp"}, "mixed_float16", 120),
    Case({"name": "cnn"}, "float32", 300),
    Case({"name": "cnn"}, "mixed_float16", 20),
]


def bare_fit(spec: JobSpec) -> float:
    """Plain Keras: compile (mixed_float16 gets Keras's own LossScaleOptimizer) and fit."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(spec.training.seed)
    built = build_model(spec, on_cpu_tf=True)
    model = built.model
    data = load_dataset(spec, tuple(model.input_shape[1:]), tuple(model.output_shape[1:]), built.loss_name,
                        Path("."))
    x, y = (np.concatenate(a) for a in zip(*data.batches(0, spec.training.steps), strict=True))
    model.compile(optimizer=keras.optimizers.Adam(spec.training.learning_rate), loss=built.loss)
    ends: list[float] = []
    # TensorFlow's fit already brings logs to the host every step, so this adds no sync.
    clock = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: ends.append(time.perf_counter()))
    model.fit(x, y, batch_size=spec.training.batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def engine(spec: JobSpec) -> float:
    keras.backend.clear_session()
    reporter = ListReporter()
    with tempfile.TemporaryDirectory() as out:
        run_job(spec, reporter=reporter, checkpoint_dir=Path(out), settings=Settings())
    times = [r.time for r in reporter.records]
    return (times[-1] - times[0]) / (len(times) - 1)


def measure(case: Case, repeats: int) -> dict[str, float]:
    plain, checkpointed = case.spec(case.steps), case.spec(50)
    bare, eng, eng_ckpt, ratios = [], [], [], []
    for _ in range(repeats):
        bare.append(bare_fit(plain))
        eng.append(engine(plain))
        eng_ckpt.append(engine(checkpointed))
        ratios.append(eng[-1] / bare[-1])
    return {"bare_ms": statistics.median(bare) * 1e3, "engine_ms": statistics.median(eng) * 1e3,
            "ratio": statistics.median(ratios), "ckpt_ms": statistics.median(eng_ckpt) * 1e3}


def run(quick: bool = False, repeats: int = 5) -> list[Row]:
    """One row per case; `quick` runs the float32 cases with fewer steps and repeats."""
    cases = [Case(c.model, c.policy, c.steps // 3) for c in CASES if c.policy == "float32"] if quick else CASES
    rows = []
    for case in cases:
        r = measure(case, 2 if quick else repeats)
        rows.append(Row("engine overhead", f"{case.label}, {case.steps} steps", "bare model.fit", r["bare_ms"],
                        r["engine_ms"], "ms/step", r["ratio"], f"ratio <= {GOAL}", r["ratio"] <= GOAL))
        rows.append(Row("engine overhead", f"{case.label} + checkpoint every 50", "bare model.fit", r["bare_ms"],
                        r["ckpt_ms"], "ms/step", r["ckpt_ms"] / r["bare_ms"]))
    return rows


if __name__ == "__main__":
    cli(f"Engine overhead vs bare model.fit, keras {keras.__version__} ({keras.backend.backend()})", __doc__, run)

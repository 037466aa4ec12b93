"""Engine overhead: the instrumented engine against a bare `model.fit`.

Same model, policy, optimizer, batch size and batches on both sides. The
figure is the steady-state cost per step: the wall time between consecutive
step ends inside one `fit` call, summed and divided by the intervals counted.
It leaves out the one-off costs (building, tracing, saving the model), which
swing by seconds on a shared machine, and keeps everything the engine does
per step: gradient statistics, the telemetry vector, the record, reporting.

The machine's speed drifts by 10-30% over seconds, more than the effect
measured, so the sides are not run one after another. Each pair builds two
sides in one process: the engine (`worker.engine.training.Training`, the same object
`run_job` drives) and bare Keras. The run's steps are cut into `PIECES`
pieces and the two take turns piece by piece, alternating who goes first,
each training the same batches. Each repeat runs two pairs: the engine with
checkpoints only at the end (bare fit writes none; this is the goal's row),
and the engine with a checkpoint every 50 steps, the default, so their cost
is visible too. The table shows each side's median over the repeats; the
ratio is the median over all pieces of all repeats of the engine's piece
against the bare piece trained next to it (the same batches, within a
second), with the quartiles of those ratios beside it. Goal: ratio <= 1.05.

    python -m bench.engine_overhead [--repeats N] [--quick]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from app.core.config import Settings
from bench.report import Row, cli  # noqa: E402
from mpjobs.contract.spec import JobSpec
from worker.engine.data import SEGMENT_BYTES  # noqa: E402
from worker.engine.devices import detect_device  # noqa: E402
from worker.engine.models import build_model  # noqa: E402
from worker.engine.training import Training, never  # noqa: E402
from worker.telemetry.reporters import ListReporter  # noqa: E402

GOAL = 1.05
PIECES = 5
"""Turns per side and pair. Piece boundaries never fall on a checkpoint step but the last."""


@dataclass(frozen=True)
class Case:
    model: dict[str, object]
    policy: str
    steps: int
    """Steps per run."""
    repeats: int

    @property
    def label(self) -> str:
        scale = " + dynamic, float32 check and layer checks every 100" if self.policy == "mixed_float16" else ""
        return f"{self.model['name']} {self.policy}{scale}"

    def spec(self, checkpoint_every: int) -> JobSpec:
        return JobSpec.model_validate({
            "model": self.model, "precision_policy": self.policy,
            "training": {"steps": self.steps, "batch_size": 32, "checkpoint_every": checkpoint_every},
            "dataset": {"samples": 4096},
        })


CASES = [
    Case({"name": "mlp"}, "float32", 600, 9),
    Case({"name": "mlp"}, "mixed_float16", 300, 5),
    Case({"name": "cnn"}, "float32", 300, 5),
    Case({"name": "cnn"}, "mixed_float16", 20, 3),
]


def _per_step(pieces: Sequence[Sequence[float]]) -> float:
    """Seconds per step from each piece's step-end times: intervals inside a piece only."""
    return sum(p[-1] - p[0] for p in pieces) / sum(len(p) - 1 for p in pieces)


def _piece_ratios(pieces: Sequence[Sequence[float]], bare: Sequence[Sequence[float]]) -> list[float]:
    """Per piece: the engine's seconds per step over bare Keras's on the same batches, trained next to it."""
    return [_per_step([e]) / _per_step([b]) for e, b in zip(pieces, bare, strict=True)]


class Bare:
    """Plain Keras: compile (mixed_float16 gets Keras's own LossScaleOptimizer) and fit, with
    `callbacks` (none: bare; bench/peer_sides.py passes what users log with instead)."""

    def __init__(self, spec: JobSpec, callbacks: Sequence[keras.callbacks.Callback] = ()) -> None:
        keras.utils.set_random_seed(spec.training.seed)
        self.callbacks = list(callbacks)
        built = build_model(spec, on_cpu_tf=True)
        self.model, self.batch_size = built.model, spec.training.batch_size
        self.model.compile(optimizer=keras.optimizers.Adam(spec.training.learning_rate), loss=built.loss)
        self.pieces: list[list[float]] = []

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        ends: list[float] = []
        # TensorFlow's fit already brings logs to the host every step, so this adds no sync.
        clock = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: ends.append(time.time()))
        # The clock last: a step's end includes every other callback's work on it.
        self.model.fit(x, y, batch_size=self.batch_size, epochs=1, shuffle=False, verbose=0,
                       callbacks=[*self.callbacks, clock])
        self.pieces.append(ends)


class Engine:
    """The engine as `run_job` drives it, fed piece by piece; step ends come from its own records."""

    def __init__(self, spec: JobSpec, out: Path) -> None:
        self.reporter = ListReporter()
        self.training = Training(spec, self.reporter, out, never, Settings(speed_check_steps=0), detect_device())
        self.piece_steps: list[int] = []

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        if not self.training.fit(x, y):
            raise RuntimeError("the engine stopped early")
        self.piece_steps.append(len(x) // self.training.spec.training.batch_size)

    def finish(self) -> list[list[float]]:
        self.training.finish()
        times = [r.time for r in self.reporter.records]
        bounds = np.cumsum([0, *self.piece_steps])
        return [times[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def pair(case: Case, checkpoint_every: int, repeat: int) -> tuple[list[list[float]], list[list[float]]]:
    """Step-end times per piece of (bare Keras, the engine), the two taking turns on the same batches."""
    with tempfile.TemporaryDirectory() as out:
        # Training() starts from a clear Keras session, so it comes first; a model built before
        # another one's clear_session() trains measurably slower, so each engine has its own twin.
        engine = Engine(case.spec(checkpoint_every), Path(out))
        bare = Bare(case.spec(checkpoint_every))
        (x, y), = engine.training.segments(SEGMENT_BYTES)
        take_turns(bare, engine, x, y, repeat)
        return bare.pieces, engine.finish()


def take_turns(a: Bare | Engine, b: Bare | Engine, x: np.ndarray, y: np.ndarray, repeat: int) -> None:
    """`a` and `b` train the same `PIECES` pieces of (x, y) in turn, `a` first on even pieces of even repeats."""
    rows = len(x) // PIECES
    for piece in range(PIECES):
        part = slice(piece * rows, len(x) if piece == PIECES - 1 else (piece + 1) * rows)
        for side in (a, b) if (piece + repeat) % 2 == 0 else (b, a):
            side.fit(x[part], y[part])


def measure(case: Case, repeats: int) -> dict[str, float]:
    """Medians over repeats of each side's seconds per step; the ratio is the median over every
    piece of every repeat, since a piece and its bare twin ran within a second of each other."""
    bare, eng, eng_ckpt, ratios, ckpt_ratios = [], [], [], [], []
    for repeat in range(repeats):
        b, e = pair(case, case.steps, repeat)
        bare.append(_per_step(b))
        eng.append(_per_step(e))
        ratios += _piece_ratios(e, b)
        b, c = pair(case, 50, repeat)
        eng_ckpt.append(_per_step(c))
        ckpt_ratios += _piece_ratios(c, b)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"bare_ms": statistics.median(bare) * 1e3, "engine_ms": statistics.median(eng) * 1e3,
            "ratio": statistics.median(ratios), "ckpt_ms": statistics.median(eng_ckpt) * 1e3,
            "ckpt_ratio": statistics.median(ckpt_ratios), "q1": q1, "q3": q3, "pieces": len(ratios)}


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    """One row per case; `quick` runs the float32 cases with fewer steps and repeats.

    `repeats` replaces every case's own count.
    """
    cases = [Case(c.model, c.policy, c.steps // 3, 2) for c in CASES if c.policy == "float32"] if quick else CASES
    rows = []
    for case in cases:
        n = repeats or case.repeats
        r = measure(case, n)
        rows.append(Row("engine overhead",
                        f"{case.label}, {case.steps} steps, {n} repeats of {PIECES} pieces "
                        f"(quartiles of piece ratios {r['q1']:.2f}–{r['q3']:.2f})",
                        "bare model.fit", r["bare_ms"], r["engine_ms"], "ms/step", r["ratio"], f"ratio <= {GOAL}",
                        r["ratio"] <= GOAL))
        rows.append(Row("engine overhead", f"{case.label} + checkpoint every 50", "bare model.fit (its own pair)",
                        r["bare_ms"], r["ckpt_ms"], "ms/step", r["ckpt_ratio"]))
    return rows


if __name__ == "__main__":
    cli(f"Engine overhead vs bare model.fit, keras {keras.__version__} ({keras.backend.backend()})", __doc__, run)

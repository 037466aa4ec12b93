"""mpjobs against what users log per-step curves with instead, side by side in one run.

Training (bench/peer_sides.py): per case, one process builds the mpjobs engine (`worker.engine.training.Training`,
what `run_job` drives) without and with per-layer checks, bare `model.fit`, a second bare `fit` (an A/A
twin: the method's own noise), and bare `fit` with each peer's callback: TensorBoard at every step, a
hand-written loss-scale logger, MLflow's Keras callback at every step into SQLite. All of them train the
same batches, cut into pieces, taking turns piece by piece in a shuffled order (the paired method of
`bench.engine_overhead`). A side's figure is its steady-state seconds per step; its ratio is the median,
over every piece of every repeat, of its piece against the two bare pieces trained beside it (the geometric
mean of the two ratios); the A/A row, the second bare copy against the first, is the method's noise.

Goal, per case: the engine (without layer checks, and with them) is within 1.05x of bare `fit`, and
cheaper per step than every peer that records fewer series per step than its 8. A row that misses says
which part.

History (bench/peer_history.py): a 100,000-step loss series read back for a chart, from the mpjobs API
and from a local MLflow tracking server, p50 and p99 in one run.

    python -m bench.peers [--quick] [--repeats N]
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from bench import peer_history  # noqa: E402
from bench.engine_overhead import GOAL, PIECES, _per_step, _piece_ratios, automatic_steps_per_call  # noqa: E402
from bench.engine_overhead import Case as _Case  # noqa: E402
from bench.peer_sides import ENGINE_SERIES, mlflow_run, sides, take_turns  # noqa: E402
from bench.report import Row, cli  # noqa: E402
from mpjobs.contract.training_spec import UNDERFLOW_CHECK_EVERY  # noqa: E402
from worker.engine.data import SEGMENT_BYTES  # noqa: E402

BENCH = "peers"
BARE = "bare model.fit"
ENGINE = "mpjobs engine"
LAYER_EVERY = UNDERFLOW_CHECK_EVERY
ENGINE_LAYERS = f"mpjobs engine + layer checks every {LAYER_EVERY}"
AA = "bare model.fit again (A/A)"
PER_CALL = "steps per call"
"""Not a side: `measure` keeps the steps per call every side ran at under this name."""


@dataclass(frozen=True)
class Case(_Case):
    @property
    def label(self) -> str:
        return f"{self.model['name']} {self.policy}"


CASES = [
    Case({"name": "mlp"}, "mixed_float16", 300, 4),
    Case({"name": "mlp"}, "float32", 500, 4),
    Case({"name": "cnn"}, "float32", 200, 3),
]
"""Sized for at most 10 minutes in all on the project's 2-core VM, history included (7.4 min quiet, 10.8 min
under other sessions' load); each repeat builds 7 sides."""


@dataclass
class Side:
    per_step: list[float]
    """Seconds per step, one per repeat."""
    ratios: list[float]
    """Against the bare pieces of the same batches (both copies; the A/A twin against the first), every piece of
    every repeat."""
    series: int


def measure(case: Case, repeats: int, store: Path, mlflow: bool = True) -> dict[str, Side]:
    """Every side of `case`, by name, over `repeats` groups of sides taking turns."""
    found: dict[str, Side] = defaultdict(lambda: Side([], [], 0))
    per_call = automatic_steps_per_call(case)  # every side at the steps per call the engine chooses
    found[PER_CALL].per_step.append(per_call)
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory() as out, mlflow_run(store) if mlflow else contextlib.nullcontext():
            engines, peers = sides(case.spec(case.steps, per_call=per_call), Path(out), LAYER_EVERY, repeat, mlflow)
            (x, y), = engines[0].training.segments(SEGMENT_BYTES)
            take_turns([*engines, *peers], x, y, repeat)
            pieces = {ENGINE: (engines[0].finish(), ENGINE_SERIES), ENGINE_LAYERS: (engines[1].finish(), ENGINE_SERIES)}
            pieces |= {peer.name: (peer.pieces, peer.series()) for peer in peers}
        bare, twin = pieces[BARE][0], pieces[AA][0]
        for name, (times, series) in pieces.items():
            assert sum(map(len, times)) == case.steps, f"{name} trained {sum(map(len, times))} of {case.steps} steps"
            side = found[name]
            side.per_step.append(_per_step(times))
            # Against both bare copies (the geometric mean of the two ratios), which halves the baseline's own
            # noise; the A/A row is the twin against the first copy alone: that noise.
            side.ratios += _piece_ratios(times, bare) if name in (BARE, AA) else [
                math.sqrt(a * b) for a, b in zip(_piece_ratios(times, bare), _piece_ratios(times, twin), strict=True)]
            side.series = series
    return dict(found)


def verdict(name: str, measured: dict[str, Side]) -> tuple[bool, str]:
    """Whether engine side `name` meets the goal, and why not where it does not."""
    ours = statistics.median(measured[name].ratios)
    misses = [] if ours <= GOAL else [f"above {GOAL}"]
    for peer, side in measured.items():
        if peer in (BARE, AA, ENGINE, ENGINE_LAYERS, PER_CALL) or side.series >= ENGINE_SERIES:
            continue
        theirs = statistics.median(side.ratios)
        if ours >= theirs:
            misses.append(f"not cheaper than {peer} ({theirs:.3f}, {side.series} series)")
    return not misses, "; ".join(misses)


def rows_for(case: Case, repeats: int, measured: dict[str, Side]) -> list[Row]:
    bare_ms = statistics.median(measured[BARE].per_step) * 1e3
    per_call = int(measured[PER_CALL].per_step[0])
    rows = []
    for name, side in measured.items():
        if name in (BARE, PER_CALL):
            continue
        ratio = statistics.median(side.ratios)
        q1, _, q3 = statistics.quantiles(side.ratios, n=4)
        text = (f"{case.label}, {name}: {side.series} series/step, {case.steps} steps at {per_call} per call, "
                f"{repeats} repeats of {PIECES} pieces (quartiles {q1:.2f}–{q3:.2f})")
        goal, met = "", None
        if name in (ENGINE, ENGINE_LAYERS):
            goal = f"ratio <= {GOAL}, below every peer with fewer series"
            met, why = verdict(name, measured)
            text += f"; missed: {why}" if why else ""
        rows.append(Row(BENCH, text, BARE, bare_ms, statistics.median(side.per_step) * 1e3, "ms/step", ratio, goal,
                        met))
    return rows


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    """Quick: the float32 MLP alone, 100 steps, one repeat, and a 10,000-step history."""
    cases = [Case({"name": "mlp"}, "float32", 100, 1)] if quick else CASES
    rows = []
    with tempfile.TemporaryDirectory() as store:
        for case in cases:
            n, started = repeats or case.repeats, time.monotonic()
            rows += rows_for(case, n, measure(case, n, Path(store)))
            print(f"{case.label}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return rows + peer_history.run(quick)


def versions() -> str:
    import mlflow
    import tensorflow as tf

    return f"keras {keras.__version__}, TensorFlow {tf.__version__}, MLflow {mlflow.__version__}"


if __name__ == "__main__":
    cli(f"mpjobs against what users run instead — {versions()}", __doc__, run)

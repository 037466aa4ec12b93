"""Engine overhead: the instrumented engine against a bare `model.fit` at the same steps per call.

Same model, policy, optimizer, batch size and batches on every side. The figure is the steady-state
cost per step: the wall time from the first to the last step end inside one `fit`-sized piece, over
the steps between them. A call of several steps gives its steps ends spread evenly from the call's
start to its end, on every side. It leaves out the one-off costs (building, tracing, saving the
model), which swing by seconds on a shared machine, and keeps everything the engine does per step:
gradient statistics, the telemetry rows, the records, reporting.

The engine runs at its automatic steps per call (worker/engine/stepper.py: calls of about 20 ms).
Each repeat builds three sides in one process: the engine; the engine as it ran before, through
`model.fit` at one step per call ("one step per call (fit)"); and bare Keras compiled with
`steps_per_execution` at the steps per call the engine chose during a warm-up on the same first
batches. The machine's speed drifts by 10-30% over seconds, more than the effect measured, so the
sides take turns piece by piece (`PIECES`), in an order rotated each piece. The ratios are medians
over every piece of every repeat of a side's piece against the bare piece of the same batches,
trained within a second; the quartiles of the first are beside it. Goals: the engine <= 1.05 of bare
`fit` at the same steps per call; on the MLP, <= 0.6 of the engine at one step per call.

    python -m bench.engine_overhead [--repeats N] [--quick]
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
GOAL_AGAINST_ONE_PER_CALL = 0.6
"""The engine at its automatic steps per call against itself at one step per call, on the MLP."""
PIECES = 5
"""Turns per side. Piece boundaries never fall on a checkpoint step but the last."""
WARM_UP = 96
"""Steps every side trains first, uncounted: traces, and lets the engine settle its steps per call."""


@dataclass(frozen=True)
class Case:
    model: dict[str, object]
    policy: str
    steps: int
    """Steps per run."""
    repeats: int
    checks: bool = True
    """Under a half-precision policy: the float32 and layer checks at their default interval, or none."""

    @property
    def label(self) -> str:
        if self.policy != "mixed_float16":
            return f"{self.model['name']} {self.policy}"
        checks = "float32 check and layer checks every 100" if self.checks else "no float32 or layer checks"
        return f"{self.model['name']} {self.policy} + dynamic, {checks}"

    batch_size = 32

    def spec(self, checkpoint_every: int, steps: int | None = None, per_call: int | str = "auto") -> JobSpec:
        return JobSpec.model_validate({
            "model": self.model, "precision_policy": self.policy,
            "training": {"steps": steps or self.steps, "batch_size": self.batch_size,
                         "checkpoint_every": checkpoint_every, "steps_per_execution": per_call,
                         **({} if self.checks else {"underflow_check_every": 0})},
            "dataset": {"samples": 4096},
        })


CASES = [
    Case({"name": "mlp"}, "float32", 2000, 7),
    Case({"name": "mlp"}, "mixed_float16", 1500, 5),
    Case({"name": "mlp"}, "mixed_float16", 1500, 5, checks=False),
    Case({"name": "cnn"}, "float32", 400, 5),
]


@contextlib.contextmanager
def session_kept() -> Iterator[None]:
    """Build another engine without clearing the session: a model built before another's clear_session()
    trains measurably slower, and every side must train as built (bench.float32_check and bench.peers too)."""
    clear = keras.backend.clear_session
    keras.backend.clear_session = lambda *args, **kwargs: None
    try:
        yield
    finally:
        keras.backend.clear_session = clear


def _per_step(pieces: Sequence[Sequence[float]]) -> float:
    """Seconds per step from each piece's step-end times: intervals inside a piece only."""
    return sum(p[-1] - p[0] for p in pieces) / sum(len(p) - 1 for p in pieces)


def _piece_ratios(pieces: Sequence[Sequence[float]], bare: Sequence[Sequence[float]]) -> list[float]:
    """Per piece: the engine's seconds per step over bare Keras's on the same batches, trained next to it."""
    return [_per_step([e]) / _per_step([b]) for e, b in zip(pieces, bare, strict=True)]


def _spread(ends: Sequence[tuple[float, float, int]]) -> list[float]:
    """Step-end times from (call start, call end, steps in the call): a call's steps end evenly across it."""
    times = []
    for begin, end, steps in ends:
        share = (end - begin) / steps
        times += [end - (steps - 1 - i) * share for i in range(steps)]
    return times


class Bare:
    """Plain Keras: compile (mixed_float16 gets Keras's own LossScaleOptimizer) with `steps_per_execution`,
    and fit, with `callbacks` (none: bare; bench/peer_sides.py passes what users log with instead)."""

    def __init__(self, spec: JobSpec, callbacks: Sequence[keras.callbacks.Callback] = (),
                 steps_per_execution: int | None = None) -> None:
        """`steps_per_execution`: by default the spec's, 1 where that is "auto"."""
        keras.utils.set_random_seed(spec.training.seed)
        if steps_per_execution is None:
            given = spec.training.steps_per_execution
            steps_per_execution = given if isinstance(given, int) else 1
        self.callbacks = list(callbacks)
        built = build_model(spec, on_cpu_tf=True)
        self.model, self.batch_size = built.model, spec.training.batch_size
        self.model.compile(optimizer=keras.optimizers.Adam(spec.training.learning_rate), loss=built.loss,
                           steps_per_execution=steps_per_execution)
        self.pieces: list[list[float]] = []
        self.calls = 0
        """Calls made so far: what a callback that logs at each call's end logged."""

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        steps, begun = len(x) // self.batch_size, [0.0]
        calls: list[tuple[float, float, int]] = []

        def end(batch: int, logs: Any) -> None:  # `batch`: the call's last step, as if the call were whole
            calls.append((begun[0], time.time(), min(batch + 1, steps) - sum(c[2] for c in calls)))

        # TensorFlow's fit already brings logs to the host every call, so this adds no sync.
        clock = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: begun.__setitem__(
            0, time.time()), on_train_batch_end=end)
        # The clock last: a call's end includes every other callback's work on it.
        self.model.fit(x, y, batch_size=self.batch_size, epochs=1, shuffle=False, verbose=0,
                       callbacks=[*self.callbacks, clock])
        self.pieces.append(_spread(calls))
        self.calls += len(calls)


class Engine:
    """The engine as `run_job` drives it, fed piece by piece; step ends come from its own records.

    `one_per_call`: through `model.fit`, one step per call, as the engine ran before several steps per call."""

    def __init__(self, spec: JobSpec, out: Path, one_per_call: bool = False) -> None:
        self.reporter = ListReporter()
        self.training = Training(spec, self.reporter, out, never, Settings(speed_check_steps=0), detect_device())
        if one_per_call:
            self.training.calls = None
        self.piece_steps: list[int] = []

    def fit(self, x: np.ndarray, y: np.ndarray) -> None:
        if not self.training.fit(x, y):
            raise RuntimeError("the engine stopped early")
        self.piece_steps.append(len(x) // self.training.spec.training.batch_size)

    def steps_per_call(self) -> int:
        """The steps per call the engine runs at now (1 through `fit`)."""
        return 1 if self.training.calls is None else self.training.calls.most()

    def finish(self) -> list[list[float]]:
        self.training.finish()
        times = [r.time for r in self.reporter.records]
        bounds = np.cumsum([0, *self.piece_steps])
        return [times[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def automatic_steps_per_call(case: Case) -> int:
    """The steps per call the engine settles on for `case` after WARM_UP steps (in a throwaway engine)."""
    with tempfile.TemporaryDirectory() as out:
        engine = Engine(case.spec(WARM_UP, WARM_UP), Path(out))
        (x, y), = engine.training.segments(SEGMENT_BYTES)
        engine.fit(x, y)
        per_call = engine.steps_per_call()
        engine.finish()
        return per_call


def trio(case: Case, repeat: int) -> dict[str, list[list[float]]]:
    """Step-end times per piece of each side, the three taking turns on the same batches after a warm-up."""
    with tempfile.TemporaryDirectory() as out:
        # Training() starts from a clear Keras session, so it comes first; a model built before another
        # one's clear_session() trains measurably slower, so the others keep the session.
        total = case.steps + WARM_UP  # one checkpoint, at the end: bare fit writes none
        engine = Engine(case.spec(total, total), Path(out) / "engine")
        (x, y), = engine.training.segments(SEGMENT_BYTES)
        warm = WARM_UP * case.batch_size
        engine.fit(x[:warm], y[:warm])
        per_call = engine.steps_per_call()
        with session_kept():
            one = Engine(case.spec(total, total), Path(out) / "one", one_per_call=True)
        bare = Bare(case.spec(total, total), steps_per_execution=per_call)
        sides: dict[str, Engine | Bare] = {"bare": bare, "engine": engine, "one": one}
        for side in (one, bare):
            side.fit(x[:warm], y[:warm])
        take_turns_all(list(sides.values()), x[warm:], y[warm:], repeat)
        pieces = {"bare": bare.pieces[1:], "engine": engine.finish()[1:], "one": one.finish()[1:]}
        pieces["per_call"] = [[float(per_call)]]
        return pieces


def take_turns(a: Bare | Engine, b: Bare | Engine, x: np.ndarray, y: np.ndarray, repeat: int) -> None:
    """`a` and `b` train the same `PIECES` pieces of (x, y) in turn, `a` first on even pieces of even repeats."""
    take_turns_all([a, b], x, y, repeat)


def take_turns_all(sides: Sequence[Bare | Engine], x: np.ndarray, y: np.ndarray, repeat: int) -> None:
    """Every side trains the same `PIECES` pieces of (x, y) in turn, the order rotated each piece; a piece
    is whole batches of `Case.batch_size` rows (the last takes the rest)."""
    rows = len(x) // Case.batch_size // PIECES * Case.batch_size
    for piece in range(PIECES):
        part = slice(piece * rows, len(x) if piece == PIECES - 1 else (piece + 1) * rows)
        turn = (piece + repeat) % len(sides)
        for side in [*sides[turn:], *sides[:turn]]:
            side.fit(x[part], y[part])


def measure(case: Case, repeats: int) -> dict[str, Any]:
    """Medians over repeats of each side's seconds per step; the ratios are medians over every piece of every
    repeat, since each piece and its bare twin ran within a second of each other."""
    per_step: dict[str, list[float]] = {"bare": [], "engine": [], "one": []}
    ratios, against_one, per_call = [], [], []
    for repeat in range(repeats):
        pieces = trio(case, repeat)
        for side in per_step:
            per_step[side].append(_per_step(pieces[side]))
        ratios += _piece_ratios(pieces["engine"], pieces["bare"])
        against_one += _piece_ratios(pieces["engine"], pieces["one"])
        per_call.append(int(pieces["per_call"][0][0]))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    ms = {f"{side}_ms": statistics.median(values) * 1e3 for side, values in per_step.items()}
    return {**ms, "ratio": statistics.median(ratios),
            "against_one": statistics.median(against_one), "q1": q1, "q3": q3, "per_call": per_call}


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    """Two rows per case; `quick` runs the float32 cases with fewer steps and repeats.

    `repeats` replaces every case's own count.
    """
    cases = [Case(c.model, c.policy, c.steps // 3, 2) for c in CASES if c.policy == "float32"] if quick else CASES
    rows = []
    for case in cases:
        n = repeats or case.repeats
        r = measure(case, n)
        calls = f"{min(r['per_call'])}–{max(r['per_call'])}" if min(r["per_call"]) != max(r["per_call"]) else str(
            r["per_call"][0])
        rows.append(Row("engine overhead",
                        f"{case.label}, {case.steps} steps at {calls} steps per call (automatic), {n} repeats of "
                        f"{PIECES} pieces (quartiles of piece ratios {r['q1']:.2f}–{r['q3']:.2f})",
                        "bare model.fit, same steps per call", r["bare_ms"], r["engine_ms"], "ms/step", r["ratio"],
                        f"ratio <= {GOAL}", r["ratio"] <= GOAL))
        mlp = case.model["name"] == "mlp"
        rows.append(Row("engine overhead", f"{case.label}: automatic steps per call against one",
                        "the engine at one step per call (fit)", r["one_ms"], r["engine_ms"], "ms/step",
                        r["against_one"], f"ratio <= {GOAL_AGAINST_ONE_PER_CALL}" if mlp else "",
                        (r["against_one"] <= GOAL_AGAINST_ONE_PER_CALL) if mlp else None))
    return rows


if __name__ == "__main__":
    cli(f"Engine overhead vs bare model.fit, keras {keras.__version__} ({keras.backend.backend()})", __doc__, run)

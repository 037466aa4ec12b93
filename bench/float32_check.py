"""The float32 check's cost: the engine with the check at its default interval against the same
engine with the check off (`training.underflow_check_every=0`); and the layer checks' cost (per-layer
numerics, worker/numerics/layer_numerics.py, riding on the float32 check's steps by default): the engine with
both against the same engine with the layer checks off (`training.layer_check_every=0`).

Both sides are `worker.engine.training.Training`, the object `run_job` drives, on the same spec and batches;
they take turns piece by piece as in `bench.engine_overhead` (order alternating, the ratio the
median over pieces of the two sides' seconds per step). A check runs before the steps it is due
on, so the steady-state figure (the time between step ends) includes every check after step 1.
Step 1's check also builds the float32 twin and traces both gradient functions: that one-off cost
is timed on its own, beside a steady check and a training step.

    python -m bench.float32_check [--repeats N] [--quick]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from bench.engine_overhead import GOAL, PIECES, Engine, _per_step, _piece_ratios, session_kept, take_turns  # noqa: E402
from bench.report import Row, cli  # noqa: E402
from mpjobs.contract.spec import JobSpec
from mpjobs.contract.training_spec import UNDERFLOW_CHECK_EVERY
from worker.engine.data import SEGMENT_BYTES  # noqa: E402

MODEL = {"name": "mlp"}
POLICY = "mixed_float16"
STEPS = 600
REPEATS = 5


def spec(steps: int, every: int, layer_every: int | None = 0) -> JobSpec:
    """The benchmark's job: the float32 check every `every` steps, layer checks every `layer_every`
    (None: on the float32 check's steps, the default)."""
    return JobSpec.model_validate({
        "model": MODEL, "precision_policy": POLICY,
        "training": {"steps": steps, "batch_size": 32, "checkpoint_every": steps, "underflow_check_every": every,
                     "layer_check_every": layer_every},
        "dataset": {"samples": 4096},
    })


def sides(steps: int, out: Path, layers: bool) -> tuple[Engine, Engine]:
    """(off, on): the float32 check off and on (no layer checks), or with `layers`, the check on without and
    with the layer checks at their default interval."""
    on = Engine(spec(steps, UNDERFLOW_CHECK_EVERY, None if layers else 0), out / "on")
    with session_kept():
        off = Engine(spec(steps, UNDERFLOW_CHECK_EVERY if layers else 0), out / "off")
    return off, on


def pair(steps: int, repeat: int, layers: bool = False) -> tuple[list[list[float]], list[list[float]]]:
    """Step-end times per piece of `sides` (off, on), taking turns on the same batches."""
    with tempfile.TemporaryDirectory() as out:
        off, on = sides(steps, Path(out), layers)
        (x, y), = on.training.segments(SEGMENT_BYTES)
        take_turns(off, on, x, y, repeat)
        return off.finish(), on.finish()


def one_check(repeats: int, layers: bool = False) -> tuple[float, float, float]:
    """(first check, steady check, one training step) in ms, medians over repeats, on fresh engines."""
    first: list[float] = []
    steady: list[float] = []
    step: list[float] = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            engine = Engine(spec(2 * PIECES, UNDERFLOW_CHECK_EVERY, None if layers else 0), Path(out))
            check = engine.training.check
            assert check is not None
            check.set_model(engine.training.model)
            (x, y), = engine.training.segments(SEGMENT_BYTES)
            bs = engine.training.spec.training.batch_size
            for times in (first, steady):
                start = time.perf_counter()
                check.check(1, x[:bs], y[:bs])
                times.append(time.perf_counter() - start)
            engine.fit(x, y)
            step.append(_per_step(engine.finish()))
    return statistics.median(first) * 1e3, statistics.median(steady) * 1e3, statistics.median(step) * 1e3


TURNS = 15
"""Steady checks timed per side and repeat in `checks_in_turns`."""


def checks_in_turns(repeats: int, turns: int = TURNS) -> tuple[float, float, float]:
    """(check without layer checks, check with them, one training step) in ms: two engines in one session,
    their steady checks taking turns on the same batch, medians over every turn of every repeat."""
    plain: list[float] = []
    layered: list[float] = []
    step: list[float] = []
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            off, on = sides(2 * PIECES, Path(out), layers=True)
            (x, y), = on.training.segments(SEGMENT_BYTES)
            bs = on.training.spec.training.batch_size
            for engine in (off, on):
                assert engine.training.check is not None
                engine.training.check.set_model(engine.training.model)
                engine.training.check.check(1, x[:bs], y[:bs])  # the first: builds and traces
            for turn in range(turns):
                for engine, times in ((off, plain), (on, layered))[::1 if (turn + repeat) % 2 else -1]:
                    assert engine.training.check is not None
                    start = time.perf_counter()
                    engine.training.check.check(1, x[:bs], y[:bs])
                    times.append(time.perf_counter() - start)
            for engine in (off, on):
                engine.fit(x, y)
                step.append(_per_step(engine.finish()))
    return statistics.median(plain) * 1e3, statistics.median(layered) * 1e3, statistics.median(step) * 1e3


def _compare(steps: int, n: int, layers: bool) -> tuple[float, float, float, float, float]:
    """(off ms/step, on ms/step, median piece ratio, its quartiles)."""
    off, on, ratios = [], [], []
    for repeat in range(n):
        a, b = pair(steps, repeat, layers)
        off.append(_per_step(a))
        on.append(_per_step(b))
        ratios += _piece_ratios(b, a)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return statistics.median(off) * 1e3, statistics.median(on) * 1e3, statistics.median(ratios), q1, q3


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    steps, n = (UNDERFLOW_CHECK_EVERY, 2) if quick else (STEPS, REPEATS)
    turns = 3 if quick else TURNS
    n = repeats or n
    label = f"mlp {POLICY} + dynamic"
    rows = []
    for layers in (False, True):
        off, on, ratio, q1, q3 = _compare(steps, n, layers)
        first, steady, step = one_check(n, layers)
        if layers:
            name, what, baseline = "layer checks", "layer checks and the float32 check", "same engine, layer checks off"
            one = "one float32 check with its layer check (two gradients, every layer's numbers)"
        else:
            name, what, baseline = "float32 check", "check", "same engine, check off"
            one = "one check (two gradients and their comparison)"
        rows += [
            Row(name, f"{label}, {what} every {UNDERFLOW_CHECK_EVERY} steps (the default), {steps} steps, {n} "
                f"repeats of {PIECES} pieces (quartiles of piece ratios {q1:.2f}–{q3:.2f})", baseline,
                off, on, "ms/step", ratio, f"ratio <= {GOAL}", ratio <= GOAL),
            Row(name, f"{label}: {one}", "one training step", step, steady, "ms", steady / step),
            Row(name, f"{label}: the first check (twin build, traces)", "one training step", step,
                first, "ms", first / step),
        ]
    plain, layered, step = checks_in_turns(n, turns)
    added = (layered - plain) / UNDERFLOW_CHECK_EVERY
    rows.append(Row("layer checks", f"{label}: their added cost per step at the default interval, (check with layer "
                    f"checks {layered:.2f} ms − without {plain:.2f} ms) / {UNDERFLOW_CHECK_EVERY}, from {turns} "
                    f"checks a side taking turns in each of {n} repeats", "one training step", step, step + added,
                    "ms/step", (step + added) / step, f"ratio <= {GOAL}", (step + added) / step <= GOAL))
    return rows


if __name__ == "__main__":
    cli(f"The float32 check's cost, keras {keras.__version__} ({keras.backend.backend()})", __doc__, run)

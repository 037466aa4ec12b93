"""FP8 telemetry cost: the engine on an FP8 job against a bare `model.fit` of the same FP8 model, sides taking turns.

A job with `fp8` trains its Dense and EinsumDense layers in Keras's FP8 policy (worker/engine/fp8.py), and
the engine reads each FP8 tensor's scaling state in every compiled step into the record's `fp8` rows
(worker/telemetry/fp8_state.py). Six sides per repeat, built in one process from the same `build_model(spec)`,
train the same batches piece by piece in turns, as in `bench.engine_overhead` (its `Bare`, `Engine` and
`take_turns_all`, the order rotated each piece):

- **bare fp8**: `model.fit` of the FP8 model, Keras's own Adam, no telemetry, compiled with
  `steps_per_execution` at what the FP8 engine chose in its warm-up: the FP8 step with no telemetry;
- **engine fp8**: the engine on the FP8 job at its automatic steps per call, float32 and layer checks off
  (`underflow_check_every: 0`), so that only the per-step telemetry is timed;
- **engine fp8, checks**: the same with the float32 check and the layer checks at their default interval
  (every 100 steps; on an FP8 job the check also counts each FP8 tensor's exact saturation and underflow);
- **engine fp8, state unread**: the FP8 engine built with no FP8 slot (`worker.telemetry.optimizer.slots`
  patched to none while it is built): no scaling state in the step's telemetry vector, no `fp8` rows;
- **bare** and **engine**: the same two without `fp8`, the engine at its own automatic steps per call.

Rows per model, each ratio the median over every piece of every repeat of one side's seconds per step over
the other's on the same batches, trained within seconds; the quartiles beside the first:

- engine fp8 / bare fp8: the telemetry's cost on an FP8 step (goal <= 1.05, as `bench.engine_overhead`'s);
- engine fp8, checks / bare fp8: the same with the checks at their default interval (goal <= 1.05);
- engine / bare: the telemetry's cost without FP8 (goal <= 1.05);
- engine fp8 / engine fp8, state unread: what reading the FP8 state and making its rows costs;
- bare fp8 / bare: what FP8 itself costs. On a CPU Keras simulates FP8 (quantize-dequantize and a matmul
  in the compute dtype), so this is no speed figure for FP8 hardware, only the simulation's price here.

    python -m bench.fp8_overhead [--repeats N] [--quick]
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from bench.engine_overhead import (  # noqa: E402
    GOAL,
    PIECES,
    WARM_UP,
    Bare,
    Engine,
    _per_step,
    _piece_ratios,
    session_kept,
    take_turns_all,
)
from bench.report import Row, cli  # noqa: E402
from mpjobs.contract.spec import JobSpec  # noqa: E402
from worker.engine.data import SEGMENT_BYTES  # noqa: E402

POLICY = "mixed_bfloat16"
HISTORY = 1024
"""Keras's default amax history length (`fp8.amax_history_length`)."""
SMALL_TRANSFORMER = {"name": "transformer", "seq_len": 32, "vocab_size": 1000, "d_model": 64, "heads": 4,
                     "layers": 1, "ffn_dim": 128}
"""Small enough for its simulated FP8 step to take about 20 ms on the project's 2-core VM."""
SIDES = ("bare", "engine", "bare fp8", "engine fp8", "engine fp8, checks", "engine fp8, state unread")


@dataclass(frozen=True)
class Fp8Case:
    model: dict[str, Any]
    steps: int
    """Steps per run, after the warm-up."""
    repeats: int

    batch_size = 32  # take_turns_all cuts pieces in engine_overhead's Case.batch_size

    @property
    def name(self) -> str:
        return str(self.model["name"])

    def spec(self, fp8: bool, checks: bool = False, per_call: int | str = "auto") -> JobSpec:
        """The job of a side: `fp8` or not; `checks`: the float32 and layer checks at their default interval,
        else none. One checkpoint, at the end (bare fit writes none)."""
        total = self.steps + WARM_UP
        return JobSpec.model_validate({
            "model": self.model, "precision_policy": POLICY,
            "training": {"steps": total, "batch_size": self.batch_size, "checkpoint_every": total,
                         "steps_per_execution": per_call, **({} if checks else {"underflow_check_every": 0})},
            "dataset": {"samples": 4096},
            **({"fp8": {"amax_history_length": HISTORY}} if fp8 else {}),
        })


CASES = [
    Fp8Case({"name": "mlp"}, 1500, 5),
    Fp8Case(SMALL_TRANSFORMER, 300, 5),
]


@contextlib.contextmanager
def fp8_state_unread() -> Iterator[None]:
    """Build an engine whose optimizer finds no FP8 slot: its step reads no scaling state, its records have no
    `fp8` rows. The FP8 layers and their state variables are the same (still left out of the statistics)."""
    from worker.telemetry import optimizer

    with mock.patch.object(optimizer, "slots", lambda variables: []):
        yield


def engines(case: Fp8Case, out: Path) -> dict[str, Engine]:
    """The four engine sides, by name."""
    # Training() starts from a clear Keras session, so the first engine comes first; a model built before
    # another's clear_session() trains measurably slower, so every other side keeps the session.
    built = {"engine": Engine(case.spec(fp8=False), out / "engine")}
    with session_kept():
        built["engine fp8"] = Engine(case.spec(fp8=True), out / "fp8")
        built["engine fp8, checks"] = Engine(case.spec(fp8=True, checks=True), out / "checks")
        with fp8_state_unread():
            built["engine fp8, state unread"] = Engine(case.spec(fp8=True), out / "unread")
    unread = built["engine fp8, state unread"].training.optimizer.fp8_slots
    if not built["engine fp8"].training.optimizer.fp8_slots or unread:
        raise RuntimeError("the FP8 engine reads no FP8 state, or the unread one does")
    return built


def turns(case: Fp8Case, repeat: int) -> dict[str, Any]:
    """Step-end times per piece of each side after the warm-up, the six taking turns on the same batches;
    `per_call`: the steps per call the two bare sides were compiled with (the engines' after the warm-up)."""
    with tempfile.TemporaryDirectory() as out:
        found = engines(case, Path(out))
        (x, y), = found["engine"].training.segments(SEGMENT_BYTES)
        warm = WARM_UP * case.batch_size
        for engine in found.values():
            engine.fit(x[:warm], y[:warm])
        per_call = {"bare": found["engine"].steps_per_call(), "bare fp8": found["engine fp8"].steps_per_call()}
        sides: dict[str, Bare | Engine] = dict(found)
        sides["bare"] = Bare(case.spec(fp8=False), steps_per_execution=per_call["bare"])
        sides["bare fp8"] = Bare(case.spec(fp8=True), steps_per_execution=per_call["bare fp8"])
        for name in ("bare", "bare fp8"):
            sides[name].fit(x[:warm], y[:warm])
        ordered = [sides[name] for name in SIDES]
        take_turns_all(ordered, x[warm:], y[warm:], repeat)
        pieces = {name: side.pieces[1:] if isinstance(side, Bare) else side.finish()[1:]
                  for name, side in sides.items()}
        return {"pieces": pieces, "per_call": per_call}


PAIRS = {
    "fp8 telemetry": ("engine fp8", "bare fp8"),
    "fp8 checks": ("engine fp8, checks", "bare fp8"),
    "telemetry": ("engine", "bare"),
    "fp8 state": ("engine fp8", "engine fp8, state unread"),
    "fp8 simulation": ("bare fp8", "bare"),
}
"""Each row's (side, baseline side)."""


def measure(case: Fp8Case, repeats: int) -> dict[str, Any]:
    """Medians over repeats of each side's seconds per step; each pair's ratios over every piece of every repeat."""
    per_step: dict[str, list[float]] = {name: [] for name in SIDES}
    ratios: dict[str, list[float]] = {pair: [] for pair in PAIRS}
    per_call: dict[str, list[int]] = {"bare": [], "bare fp8": []}
    for repeat in range(repeats):
        done = turns(case, repeat)
        for name in SIDES:
            per_step[name].append(_per_step(done["pieces"][name]))
        for pair, (side, base) in PAIRS.items():
            ratios[pair] += _piece_ratios(done["pieces"][side], done["pieces"][base])
        for name in per_call:
            per_call[name].append(done["per_call"][name])
    return {"ms": {name: statistics.median(v) * 1e3 for name, v in per_step.items()},
            "ratio": {pair: statistics.median(v) for pair, v in ratios.items()},
            "quartiles": {pair: _quartiles(v) for pair, v in ratios.items()}, "per_call": per_call}


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, q3


def _calls(values: Sequence[int]) -> str:
    return str(values[0]) if min(values) == max(values) else f"{min(values)}–{max(values)}"


def rows(case: Fp8Case, repeats: int, r: dict[str, Any]) -> list[Row]:
    """The five rows of one model (`measure`'s result `r`)."""
    ms, ratio, quartiles = r["ms"], r["ratio"], r["quartiles"]

    def row(pair: str, case_text: str, baseline: str, goal: bool) -> Row:
        side, base = PAIRS[pair]
        q1, q3 = quartiles[pair]
        return Row("fp8 overhead", f"{case_text} (quartiles of piece ratios {q1:.2f}–{q3:.2f})", baseline, ms[base],
                   ms[side], "ms/step", ratio[pair], f"ratio <= {GOAL}" if goal else "",
                   (ratio[pair] <= GOAL) if goal else None)

    fp8, plain = f"{case.name} {POLICY} + fp8", f"{case.name} {POLICY}"
    how = f"{case.steps} steps, {repeats} repeats of {PIECES} pieces"
    at_fp8 = f"at {_calls(r['per_call']['bare fp8'])} steps per call"
    return [
        row("fp8 telemetry", f"{fp8}, no float32 or layer checks, {how}, bare {at_fp8}",
            "bare model.fit of the FP8 model, same steps per call", True),
        row("fp8 checks", f"{fp8}, float32 check and layer checks every 100, {how}, bare {at_fp8}",
            "bare model.fit of the FP8 model, same steps per call", True),
        row("telemetry", f"{plain} (no fp8), no float32 or layer checks, {how}, bare at "
            f"{_calls(r['per_call']['bare'])} steps per call", "bare model.fit, same steps per call", True),
        row("fp8 state", f"{fp8}: the FP8 state read in each step and its fp8 rows",
            "the same engine without FP8 state (no fp8 rows)", False),
        row("fp8 simulation", f"{case.name}: FP8 simulated on this CPU, bare {at_fp8} against bare without fp8",
            "bare model.fit without fp8", False),
    ]


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    """Five rows per model; `quick`: the MLP alone, 150 steps, 1 repeat. `repeats` replaces every case's own."""
    cases = [Fp8Case(CASES[0].model, 150, 1)] if quick else CASES
    found = []
    for case in cases:
        n = repeats or case.repeats
        found += rows(case, n, measure(case, n))
    return found


if __name__ == "__main__":
    cli(f"FP8 telemetry cost vs bare model.fit, keras {keras.__version__} ({keras.backend.backend()})", __doc__,
        run)

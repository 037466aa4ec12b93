"""The speed check itself (`worker.numerics.speed.measure_all`): does it make the same call each time?

For the MLP (default spec) and a small CNN (16x16 images, 8 filters): the comparison's
default variants other than float32 (`mpjobs.contract.spec.DEFAULT_VARIANTS`), plus a float32
variant, an A/A check: a third float32 copy timed as if it were a policy, whose only right
call is "none". Each repeat is one measurement as a comparison's float32 baseline makes it
after training: fresh copies, the job's first batches from `worker.engine.data.load_dataset`,
`SPEED_CHECK_STEPS` steps per side and round, `SPEED_CHECK_ROUNDS` rounds, on this CPU.

The repeats run first on a quiet machine, then beside a CPU hog (a busy loop in a
subprocess, one core's worth, killed afterwards). Per variant: its median slowdown (the
range across repeats), its 95% interval in each repeat, the calls (slower, faster,
none) and whether every repeat made the same one. Per model and load: the A/A noise band
(the second float32 copy against the reference) of each repeat. There is no separate
baseline run: every figure is against the float32 reference trained beside it in the same
measurement. `--quick` runs 2 repeats of 5 rounds: fewer rounds, so wider noise.

    python -m bench.speed_check [--repeats N] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from app.core.config import Settings
from bench.report import Row, machine, table  # noqa: E402
from mpjobs.contract.spec import DEFAULT_VARIANTS, JobSpec, PrecisionPolicy, Variant
from worker.engine.data import load_dataset  # noqa: E402
from worker.engine.models import build_model  # noqa: E402
from worker.engine.optimizers import make_optimizer  # noqa: E402
from worker.numerics.speed import float32_twin, measure_all, variant_spec  # noqa: E402

MODELS: tuple[dict[str, object], ...] = ({"name": "mlp"}, {"name": "cnn", "image_size": 16, "filters": 8})
"""The MLP as specified by default; the CNN smaller than its default (32x32, 32 filters), whose
float16 steps take 1.3-1.5 s on our Xeon (over 100x float32's), so that one measurement takes 3 minutes."""
REPEATS = 5
QUICK_ROUNDS = 5
AA = Variant(precision_policy=PrecisionPolicy.FLOAT32).resolved()
"""Timed as a policy: float32 against float32, whose only right call is "none"."""
VARIANTS = (*(v.resolved() for v in DEFAULT_VARIANTS if v.precision_policy is not PrecisionPolicy.FLOAT32), AA)
LOADS = ("quiet", "CPU hog")
HOG = "while True: pass"


@dataclass(frozen=True)
class Timing:
    """One variant in one repeat: `worker.numerics.speed`'s figures."""

    slowdown: float
    low: float
    high: float
    difference: str
    policy_ms: float
    float32_ms: float


@dataclass(frozen=True)
class Repeat:
    """One measurement: every variant against the same reference, and its A/A noise."""

    noise_low: float
    noise_high: float
    seconds: float
    timings: dict[str, Timing | str]
    """Per variant label: its figures, or why it could not be timed."""


@dataclass(frozen=True)
class Series:
    model: str
    load: str
    rounds: int
    steps: int
    """Steps per side and round."""
    repeats: list[Repeat]


def spec(model: dict[str, object]) -> JobSpec:
    return JobSpec.model_validate({"model": model, "dataset": {"samples": 512}})


def batches(job: JobSpec, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The job's first `steps` batches, as `worker.engine.training.Training._check_speed` takes them."""
    keras.utils.set_random_seed(job.training.seed)
    built = build_model(float32_twin(job), on_cpu_tf=True)
    model = built.model
    dataset = load_dataset(job, tuple(model.input_shape[1:]), tuple(model.output_shape[1:]), built.loss_name,
                           Path("."))  # synthetic data: no data root is read
    parts = list(dataset.batches(0, steps))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def measure(job: JobSpec, steps: int, rounds: int) -> Repeat:
    keras.backend.clear_session()  # as a job's Training starts
    x, y = batches(job, steps)
    start = time.monotonic()
    timed = measure_all([variant_spec(job, v) for v in VARIANTS], x, y, on_cpu_tf=True,
                        make_optimizer=make_optimizer, rounds=rounds)
    seconds = time.monotonic() - start
    assert timed is not None
    timings: dict[str, Timing | str] = {}
    noise = (1.0, 1.0)
    for variant, t in zip(VARIANTS, timed, strict=True):
        s = t.speed
        if s is None or s.low is None or s.high is None or s.noise_low is None or s.noise_high is None:
            timings[variant.label] = t.error or "no interval"
            continue
        timings[variant.label] = Timing(s.slowdown, s.low, s.high, s.difference, s.policy_ms, s.float32_ms)
        noise = (s.noise_low, s.noise_high)
    return Repeat(noise[0], noise[1], seconds, timings)


@contextlib.contextmanager
def load(name: str) -> Iterator[None]:
    """Nothing for "quiet"; a busy loop in a subprocess for the hog, killed on the way out."""
    if name == "quiet":
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        time.sleep(0.5)  # let it reach the loop
        yield
    finally:
        hog.kill()
        hog.wait()


def collect(quick: bool = False, repeats: int | None = None) -> list[Series]:
    n = repeats or (2 if quick else REPEATS)
    settings = Settings()
    steps, rounds = settings.speed_check_steps, QUICK_ROUNDS if quick else settings.speed_check_rounds
    if steps <= 0 or rounds <= 0:
        raise SystemExit(f"Expected SPEED_CHECK_STEPS and SPEED_CHECK_ROUNDS above 0. Received: {steps} and {rounds}.")
    series = []
    for model in MODELS:
        job = spec(model)
        for name in LOADS:
            with load(name):
                found = [measure(job, steps, rounds) for _ in range(n)]
            series.append(Series(str(model["name"]), name, rounds, steps, found))
    return series


def _span(values: Sequence[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}"


def _calls(timings: Sequence[Timing]) -> str:
    counts = {c: sum(t.difference == c for t in timings) for c in ("slower", "faster", "none")}
    return ", ".join(f"{k} {v}" for k, v in counts.items() if v)


def _timings(s: Series, label: str) -> tuple[list[Timing], list[str]]:
    found = [r.timings[label] for r in s.repeats]
    return [t for t in found if isinstance(t, Timing)], [t for t in found if isinstance(t, str)]


def rows(series: Sequence[Series]) -> list[Row]:
    """Per model and load: the A/A noise, then each variant's call and figures."""
    out = []
    for s in series:
        where = f"{s.model}, {s.load}, {len(s.repeats)} repeats of {s.rounds} rounds x {s.steps} steps"
        highs = [r.noise_high for r in s.repeats]
        out.append(Row("speed check", f"{where}: A/A noise band, second float32 copy against the reference "
                       f"(95% interval lows {_span([r.noise_low for r in s.repeats])}, highs {_span(highs)})",
                       "no difference", 1.0, statistics.median(highs), "x float32 (interval high)",
                       statistics.median(highs)))
        for v in VARIANTS:
            timings, errors = _timings(s, v.label)
            if not timings:
                out.append(Row("speed check", f"{where}: {v.label} not timed: {errors[0]}", "float32", None, 0.0,
                               "ms/step", None))
                continue
            calls = {t.difference for t in timings}
            right = calls == {"none"} if v is AA else len(calls) == 1
            intervals = "; ".join(f"{t.low:.2f}–{t.high:.2f}" for t in timings)
            untimed = f", {len(errors)} not timed" if errors else ""
            out.append(Row(
                "speed check", f"{where}: {v.label}{' (A/A)' if v is AA else ''}, calls {_calls(timings)}{untimed}; "
                f"median slowdown {_span([t.slowdown for t in timings])}, 95% intervals per repeat {intervals}",
                "float32, the same measurement's reference",
                statistics.median(t.float32_ms for t in timings), statistics.median(t.policy_ms for t in timings),
                "ms/step", statistics.median(t.slowdown for t in timings),
                "none in every repeat" if v is AA else "one call in every repeat", right and not errors))
    return out


def details(series: Sequence[Series]) -> str:
    """Two Markdown tables: the A/A noise per model and load, then each variant's calls across repeats."""
    lines = ["| model | load | repeats | rounds x steps | A/A noise band per repeat (95% interval) "
             "| s per measurement |",
             "|---|---|---:|---|---|---|"]
    for s in series:
        bands = "; ".join(f"{r.noise_low:.2f}–{r.noise_high:.2f}" for r in s.repeats)
        lines.append(f"| {s.model} | {s.load} | {len(s.repeats)} | {s.rounds} x {s.steps} | {bands} "
                     f"| {_span([r.seconds for r in s.repeats])} |")
    lines += ["", "| model | load | variant | median slowdown | interval per repeat (95%) | calls "
              "| same every repeat |", "|---|---|---|---:|---|---|---|"]
    for s in series:
        for v in VARIANTS:
            timings, errors = _timings(s, v.label)
            if not timings:
                lines.append(f"| {s.model} | {s.load} | {v.label} | — | not timed: {errors[0]} | — | — |")
                continue
            same = len({t.difference for t in timings}) == 1 and not errors
            untimed = f", {len(errors)} not timed" if errors else ""
            lines.append(
                f"| {s.model} | {s.load} | {v.label}{' (A/A)' if v is AA else ''} "
                f"| {_span([t.slowdown for t in timings])} "
                f"| {'; '.join(f'{t.low:.2f}–{t.high:.2f}' for t in timings)} "
                f"| {_calls(timings)}{untimed} | {'yes' if same else '**no**'} |")
    return "\n".join(lines)


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    return rows(collect(quick, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, help=f"measurements per model and load (default {REPEATS})")
    parser.add_argument("--quick", action="store_true",
                        help=f"2 repeats of {QUICK_ROUNDS} rounds, for a smoke check")
    parser.add_argument("--out", type=Path, help="also write speed_check.md and speed_check.json (raw figures) here")
    args = parser.parse_args()
    header = (f"# The speed check's calls, keras {keras.__version__} ({keras.backend.backend()}) — {machine()}"
              f"{' (quick)' if args.quick else ''}")
    print(header, flush=True)
    start = time.monotonic()
    series = collect(args.quick, args.repeats)
    found = rows(series)
    text = f"{header}\n\n{details(series)}\n\n{table(found)}\n\nTook {time.monotonic() - start:.0f} s.\n"
    print(text[len(header) + 1:], end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "speed_check.md").write_text(text)
        payload = {"header": header, "series": [asdict(s) for s in series],
                   "rows": [r.as_dict() for r in found]}
        (args.out / "speed_check.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()

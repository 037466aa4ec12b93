"""GPU speedup: mixed precision against float32, through the engine, under JAX.

Runs `worker.engine.training.run_job` (what a worker runs, telemetry and all) with
KERAS_BACKEND=jax, so a GPU host with JAX and no TensorFlow can run it: beside
JAX it needs only keras, pydantic and pydantic-settings, and this repo's
`app/`, `worker/` and `bench/` packages. Each model (transformer, cnn) trains
under float32, mixed_float16 + dynamic loss scaling, and mixed_bfloat16; the
transformer also with `fp8` (`--fp8`: mixed_bfloat16 + fp8 and mixed_float16 +
dynamic + fp8, Keras's FP8 policy on its Dense and EinsumDense layers).

- **steps per call**: every case runs at one step per call and at the engine's
  automatic steps per call (`--per-call 1,auto`, worker/engine/stepper.py: calls
  of about 20 ms, each step's telemetry kept on the device and read once per
  call). The per-call row of the table sets the automatic setting against one
  step per call for the same model and policy, round by round.
- **step time**: after the warm-up steps (the first call compiles), the time
  from a window's first step end to its last, over the steps between: a call's
  steps end evenly across it, so a window spans whole calls, the engine's host
  work per call included. The measured steps of a run are split into windows; a
  case's figure is the median of its windows.
- **examples/s**: batch size / step time.
- **speedup**: float32's step time / the policy's, within one round (a round
  runs a model's policies, FP8 ones included, back to back), then the median
  over rounds.
- **TFLOP/s**: analytic model FLOPs per step / step time, also as a share of
  the chip's dense bf16 peak (`--peak-tflops`, 790: an H200's measured rate).

Model FLOPs of one training step, 3 × the forward pass (backward costs two)::

    transformer (B batch, S seq_len, d d_model, f ffn_dim, L layers, C classes):
        6·L·(4d² + 2df)·B·S    q, k, v and output projections, the two FFN layers
      + 12·L·S²·d·B            attention: Q·Kᵀ and P·V, 2·S²·d each per layer
      + 6·d·C·B                classifier head
    cnn (B batch, H image size, F filters, C classes; 3×3 'same' convolutions):
        6·(H²·9·3·F + (H/2)²·9·F·2F + 2F·C)·B

Embedding look-ups, normalisation, softmax, activations and the optimizer
update are left out, so TFLOP/s is the useful work (as in MFU), a lower bound.
An FP8 case counts the same FLOPs, against the same bf16 peak (dense FP8's is
twice that on Hopper).

FP8 (`spec.fp8`, worker/engine/fp8.py): Keras quantizes each FP8 layer's inputs,
kernel and output gradient with delayed scaling and dequantizes them around a
matmul in the compute dtype. On Hopper and Blackwell GPUs XLA fuses that
quantize-dequantize into FP8 GEMMs, so there the FP8 rows measure FP8 speed. On
a CPU FP8 is only simulated (the extra quantize-dequantize work, no FP8 matmul):
the smoke run's FP8 figures say nothing about speed, only that the cases run.
The CNN trains no FP8 case: Keras has no FP8 convolution, so only its head
would be FP8. FP8 rows have no goal, and FP8 trains on one device
(`--devices N` > 1 leaves them out).

On Ampere and newer GPUs JAX runs float32 matmuls and convolutions in TF32
unless told otherwise; a float32 job gets that, so it is the baseline here.
`--float32-matmul highest` measures IEEE float32 instead. Goal: each mixed
policy trains the transformer at least 2.5× as fast as float32.

The budget, `--budget-s` (420 s), counts from start-up: a run whose estimate no
longer fits is skipped, and a run still going at the deadline is stopped after
its current step (a compile cannot be cut short: hence the margin to 8 minutes).
The report names both. Results are rewritten after every run. Rounds after the
first take their programs from JAX's compilation cache (a folder of its own for
each invocation), so repeats cost little more than their steps.

    python -m bench.gpu_speedup --out bench-out           # on the GPU host
    python -m bench.gpu_speedup --smoke --out /tmp/smoke  # tiny shapes, on a CPU
    python -m bench.gpu_speedup --devices 2 --out bench-out-2  # one job on two GPUs

`--devices N` (N > 1) trains each case as one job on N devices of this host
(`training.devices`, `tf.distribute.MirroredStrategy`), so it runs under
TensorFlow, not JAX; each device gets the batch one device gets alone (the
global batch is N times as large, and so are the FLOPs a step counts). On a
CPU, `--smoke --devices 2` splits the CPU into two logical devices.

The smoke run shares everything with the full one but its shapes and one
detail: its transformer has dropout, which takes Keras's einsum attention
(JAX's fused attention cannot compile float16 products on a CPU). The full run,
without dropout, takes the fused attention a GPU user gets, which no CPU test
can cover: its first run on a GPU host is its first test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

STARTED = time.monotonic()
"""The budget counts from here: before JAX, Keras and the device start up."""

_early = argparse.ArgumentParser(add_help=False)
_early.add_argument("--devices", type=int, default=1)
DEVICES = max(1, _early.parse_known_args()[0].devices)
"""One job on several devices runs under tf.distribute: the backend is chosen before Keras loads."""
BACKEND = "jax" if DEVICES == 1 else "tensorflow"
os.environ["KERAS_BACKEND"] = BACKEND  # Whatever the environment says: one device measures the JAX engine.
if __package__ in (None, ""):  # python bench/gpu_speedup.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402

if BACKEND == "jax":
    import jax

from app.core.config import Settings  # noqa: E402
from app.core.errors import DomainError, JobFailed  # noqa: E402
from bench.report import Row, median, table  # noqa: E402
from mpjobs.contract.model_specs import CnnModel, TransformerModel  # noqa: E402
from mpjobs.contract.spec import JobSpec  # noqa: E402
from worker.engine.devices import detect_device  # noqa: E402
from worker.engine.failures import named_failure  # noqa: E402
from worker.engine.training import Training, release_memory  # noqa: E402
from worker.telemetry.reporters import ListReporter  # noqa: E402

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
FP8_POLICIES = ("mixed_bfloat16", "mixed_float16")
"""The policies FP8 cases compute in around their FP8 matmuls (`--fp8`), on models with `fp8`."""
GOAL = 2.5
"""Least speedup over float32 each mixed policy should reach on the transformer."""
FLOAT32_MATMUL = {"default": "JAX's default (TF32 on Ampere and newer GPUs)", "highest": "IEEE float32"}
HEAVY_MODULES = ("tensorflow", "redis", "rq", "fastapi", "tensorboard")
"""What a GPU host without the service's stack lacks: none of it may be imported."""


@dataclass(frozen=True)
class Model:
    model: dict[str, Any]
    batch_size: int
    fp8: bool = False
    """Also trains under FP8: only where Dense and EinsumDense layers do the bulk of the work."""

    @property
    def name(self) -> str:
        return str(self.model["name"])

    def spec(self, policy: str, steps: int, devices: int = 1, per_call: int | str = 1, fp8: bool = False) -> JobSpec:
        batch = self.batch_size * devices  # each device gets the batch one device gets alone
        return JobSpec.model_validate({
            "model": self.model, "precision_policy": policy,
            "training": {"steps": steps, "batch_size": batch, "checkpoint_every": 10_000_000, "devices": devices,
                         "steps_per_execution": per_call},
            # Few samples: the data is built on the host, and a large set would only cost time.
            "dataset": {"samples": 2 * batch},
            # This benchmark times the steps itself; the service's after-run speed check (CPU only) is not its.
            "speed_check": [],
            **({"fp8": {}} if fp8 else {}),  # Keras's default amax history, 1024 steps
        })


FULL = (
    Model({"name": "transformer", "seq_len": 512, "vocab_size": 32_000, "d_model": 1024, "heads": 16,
           "layers": 8, "ffn_dim": 4096}, 64, fp8=True),
    Model({"name": "cnn", "image_size": 128, "filters": 256}, 128),
)
SMOKE = (
    # Dropout sends Keras's attention down its einsum path: JAX's fused one asks for
    # float16 x float16 -> float32 products, which its CPU backend cannot compile.
    Model({"name": "transformer", "seq_len": 16, "vocab_size": 64, "d_model": 32, "heads": 2, "layers": 1,
           "ffn_dim": 64, "dropout": 0.1}, 8, fp8=True),
    Model({"name": "cnn", "image_size": 16, "filters": 4}, 8),
)


def flops_per_step(spec: JobSpec) -> float:
    """Model FLOPs of one training step (the formulas in the module docstring)."""
    m, b = spec.model, spec.training.batch_size
    if isinstance(m, TransformerModel):
        s, d, f, layers = m.seq_len, m.d_model, m.ffn_dim, m.layers
        return float(6 * layers * (4 * d * d + 2 * d * f) * b * s + 12 * layers * s * s * d * b + 6 * d * m.classes * b)
    if isinstance(m, CnnModel):
        h, f = m.image_size, m.filters
        return float(6 * (h * h * 9 * 3 * f + (h // 2) ** 2 * 9 * f * 2 * f + 2 * f * m.classes) * b)
    raise ValueError(f"Expected a transformer or cnn model. Received: model={m!r}")


def label(policy: str, per_call: int | str = 1, fp8: bool = False) -> str:
    name = ("mixed_float16 + dynamic" if policy == "mixed_float16" else policy) + (" + fp8" if fp8 else "")
    return f"{name}, {per_call} per call" if per_call != 1 else name


@dataclass
class Case:
    model: Model
    policy: str
    per_call: int | str = 1
    fp8: bool = False
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return label(self.policy, self.per_call, self.fp8)

    def windows(self, round_: int | None = None) -> list[float]:
        return [w for r in self.runs if round_ in (None, r["round"]) for w in r["windows_ms"]]


def run_once(spec: JobSpec, warmup: int, steps: int, windows: int, deadline: float, round_: int) -> dict[str, Any]:
    """Train `spec` for warmup + steps steps; the window medians of its step intervals, in ms."""
    reporter, total, training = ListReporter(), warmup + steps, None

    def should_stop() -> bool:
        # Stopping after the last step also skips saving model.keras, which costs
        # seconds for the large models and measures nothing. Asked after each call.
        return (training is not None and training.recorder.step >= total) or time.monotonic() > deadline

    begin, began_at, error, device = time.monotonic(), time.time(), None, None
    settings = Settings(cpu_logical_devices=spec.training.devices)
    found = detect_device(settings.cpu_logical_devices)
    with tempfile.TemporaryDirectory(prefix="gpu-speedup-") as checkpoint_dir:
        try:  # run_job's steps, with the Training at hand for should_stop
            try:
                training = Training(spec, reporter, Path(checkpoint_dir), should_stop, settings, found)
                device = training.run().device.describe()
            except DomainError:
                raise
            except Exception as exc:
                raise named_failure(exc, spec.precision_policy.compute_dtype, found.backend, found.kind) from exc
        except JobFailed as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            training = None
            release_memory()
    records = reporter.records[warmup - 1:]  # from the end of the last warm-up step
    n = len(records)
    chunks = [records[i * (n - 1) // windows:(i + 1) * (n - 1) // windows + 1] for i in range(windows)]
    measured = reporter.records[warmup:]
    return {
        "round": round_, "windows_ms": [(c[-1].time - c[0].time) / (len(c) - 1) * 1e3 for c in chunks if len(c) > 1],
        "engine_step_time_ms": median(r.step_time_ms for r in measured) if measured else None,
        "steps_done": len(reporter.records), "skipped_steps": sum(r.skipped for r in measured),
        "fp8_tensors": len(reporter.records[-1].fp8 or ()) if reporter.records else 0,  # rows of its last record
        "setup_s": reporter.records[0].time - began_at if reporter.records else None,
        "wall_s": time.monotonic() - begin,
        "stopped_by_budget": error is None and len(reporter.records) < total, "error": error, "device": device,
    }


def summarize(case: Case, baseline: Case, one_per_call: Case, peak_tflops: float) -> dict[str, Any]:
    """`baseline`: float32 at the same steps per call; `one_per_call`: the same model and policy at one."""
    spec = case.model.spec(case.policy, 1, DEVICES, case.per_call, case.fp8)
    windows = case.windows()
    step_ms = median(windows) if windows else None
    ratios = [median(baseline.windows(r)) / median(case.windows(r))
              for r in sorted({run["round"] for run in case.runs}) if case.windows(r) and baseline.windows(r)]
    speedup = 1.0 if case is baseline and windows else (median(ratios) if ratios else None)
    per_call = [median(one_per_call.windows(r)) / median(case.windows(r))
                for r in sorted({run["round"] for run in case.runs}) if case.windows(r) and one_per_call.windows(r)]
    flops = flops_per_step(spec)
    tflops = flops / (step_ms / 1e3) / 1e12 if step_ms else None
    has_goal = case.model.name == "transformer" and case.policy != "float32" and case.per_call == 1 and not case.fp8
    return {
        "model": case.model.name, "policy": case.policy, "fp8": case.fp8, "label": case.label,
        "per_call": case.per_call, "per_call_speedup": median(per_call) if per_call else None,
        "model_spec": spec.model.model_dump(), "batch_size": spec.training.batch_size, "devices": DEVICES,
        "flops_per_step": flops, "step_time_ms": step_ms,
        "window_ms_min": min(windows) if windows else None, "window_ms_max": max(windows) if windows else None,
        "examples_per_sec": spec.training.batch_size / (step_ms / 1e3) if step_ms else None,
        "speedup": speedup, "speedup_per_round": [1.0] * len(ratios) if case is baseline else ratios,
        "tflops": tflops, "peak_percent": 100 * tflops / peak_tflops if tflops else None,
        "goal": f">= {GOAL}x float32" if has_goal else "",
        "met": (speedup is not None and speedup >= GOAL) if has_goal else None,
        "runs": case.runs,
    }


def estimate(case: Case, cases: list[Case]) -> float:
    """Seconds the case's next run should take: as its repeats took (their compile
    comes from the cache), else its first run less the set-up, else the longest run
    of its model, else of any."""
    if len(case.runs) > 1:
        return float(max(r["wall_s"] for r in case.runs[1:]))
    if case.runs:
        return float(case.runs[0]["wall_s"] - (case.runs[0]["setup_s"] or 0.0))
    for same_model in (True, False):
        walls = [r["wall_s"] for c in cases if c.model == case.model or not same_model for r in c.runs]
        if walls:
            return float(max(walls))
    return 0.0


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(args: argparse.Namespace) -> dict[str, Any]:
    if BACKEND != "jax":
        import tensorflow as tf

        from worker.engine.devices import detect_device

        found = detect_device(args.devices)  # on a CPU, splits it into --devices logical devices first
        return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "devices_per_job": args.devices,
                "devices": [d.name for d in tf.config.list_logical_devices(found.kind.upper())],
                "platform": found.kind, "device_kind": found.name, "compute_capability": found.compute_capability,
                "tensorflow": tf.__version__, "keras": keras.__version__, "keras_backend": keras.backend.backend(),
                "python": platform.python_version(), "host": f"{platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} CPUs", "float32_matmul": "TensorFlow's default", "peak_tflops": args.peak_tflops}
    device = jax.devices()[0]
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "devices": [str(d) for d in jax.devices()], "platform": device.platform,
        "device_kind": device.device_kind, "compute_capability": getattr(device, "compute_capability", None),
        "jax": jax.__version__, "jaxlib": _version("jaxlib"), "keras": keras.__version__,
        "keras_backend": keras.backend.backend(), "python": platform.python_version(),
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "float32_matmul": FLOAT32_MATMUL[args.float32_matmul], "peak_tflops": args.peak_tflops,
    }


def _num(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def engine(env: dict[str, Any]) -> str:
    """`jax 0.4.35` for one device; `tensorflow 2.20.0, 2 devices per job` for one job on several."""
    if "jax" in env:
        return f"jax {env['jax']}"
    return f"tensorflow {env['tensorflow']}, {env['devices_per_job']} devices per job"


def report(results: list[dict[str, Any]], env: dict[str, Any], notes: list[str], args: argparse.Namespace) -> str:
    float32 = {(r["model"], r["per_call"]): r for r in results if r["policy"] == "float32" and not r["fp8"]}
    one = {(r["model"], r["policy"], r["fp8"]): r for r in results if r["per_call"] == 1}
    rows = [Row("gpu speedup", f"{r['model']} {r['label']}", label("float32", r["per_call"]),
                float32[r["model"], r["per_call"]]["examples_per_sec"], r["examples_per_sec"], "examples/s",
                r["speedup"], r["goal"], r["met"]) for r in results if r["examples_per_sec"] is not None]
    rows += [Row("steps per call", f"{r['model']} {r['label']}", label(r["policy"], 1, r["fp8"]),
                 one[r["model"], r["policy"], r["fp8"]]["examples_per_sec"], r["examples_per_sec"], "examples/s",
                 r["per_call_speedup"]) for r in results if r["per_call"] != 1 and r["examples_per_sec"] is not None]
    lines = [
        f"# GPU speedup through the engine — {env['date']}",
        "",
        f"{env['device_kind']} ({env['platform']}, {len(env['devices'])} device(s)), {engine(env)}, "
        f"keras {env['keras']} ({env['keras_backend']}), Python {env['python']}; float32 matmuls: "
        f"{env['float32_matmul']}; {args.warmup} warm-up + {args.steps} measured steps in {args.windows} "
        f"windows per run, up to {args.rounds} round(s); peak {args.peak_tflops:g} TFLOP/s (dense bf16).",
        "",
        table(rows),
        "",
        "| model | policy | batch | step ms (median) | windows min–max ms | examples/s | speedup | TFLOP/s "
        "| % of bf16 peak | runs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ok = [run for run in r["runs"] if run["windows_ms"]]
        spread = f"{_num(r['window_ms_min'])}–{_num(r['window_ms_max'])}" if ok else "—"
        lines.append(f"| {r['model']} | {r['label']} | {r['batch_size']} | {_num(r['step_time_ms'])} | "
                     f"{spread} | {_num(r['examples_per_sec'])} | {_times(r['speedup'])} | {_num(r['tflops'])} | "
                     f"{_num(r['peak_percent'])} | {len(ok)} |")
    goal = [r for r in results if r["goal"]]
    verdict = "met" if goal and all(r["met"] for r in goal) else "NO"
    parts = ", ".join(f"{r['label']} {_times(r['speedup'])}" for r in goal)
    if goal or "transformer" in args.models.split(","):  # --models without it: no goal to judge
        lines += ["", f"Goal (transformer, each mixed policy >= {GOAL}x float32): **{verdict}** ({parts})."]
    lines += ["", *[f"- {n}" for n in notes]] if notes else []
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the table and JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few steps (CPU), same code path")
    parser.add_argument("--rounds", type=int, help="times each case runs, policies alternating (3; smoke 1)")
    parser.add_argument("--warmup", type=int, help="steps left out of each run's timing (5; smoke 2)")
    parser.add_argument("--steps", type=int, help="measured steps per run (30; smoke 6)")
    parser.add_argument("--windows", type=int, help="measurement windows per run (3; smoke 2)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget from start-up, seconds")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="the chip's dense bf16 peak")
    parser.add_argument("--float32-matmul", choices=tuple(FLOAT32_MATMUL), default="default",
                        help="JAX matmul precision for float32 inputs: default is TF32 on Ampere and newer")
    parser.add_argument("--models", default="transformer,cnn", help="which models, comma-separated")
    parser.add_argument("--per-call", default="1,auto",
                        help="steps per call to run each case at, comma-separated: whole numbers or auto")
    parser.add_argument("--fp8", default=",".join(FP8_POLICIES),
                        help="policies to also train the transformer in under FP8, comma-separated (empty: none)")
    parser.add_argument("--devices", type=int, default=1,
                        help="devices one job trains on (tf.distribute, TensorFlow backend); 1: JAX, one device")
    args = parser.parse_args(argv)
    for name, full, smoke in (("rounds", 3, 1), ("warmup", 5, 2), ("steps", 30, 6), ("windows", 3, 2)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if args.warmup < 1 or args.steps < args.windows or args.windows < 1 or args.rounds < 1:
        parser.error("need warmup >= 1, windows >= 1, steps >= windows and rounds >= 1")
    if unknown := [p for p in args.fp8.split(",") if p and p not in FP8_POLICIES]:
        parser.error(f"--fp8 takes {', '.join(FP8_POLICIES)}. Received: {', '.join(unknown)}")
    if args.devices != DEVICES:
        parser.error(f"--devices is read when the module loads: {DEVICES} then, {args.devices} now")
    return args


def measure(args: argparse.Namespace, cases: list[Case], env: dict[str, Any], notes: list[str]) -> None:
    """Run the cases round after round, policies back to back, within the budget."""
    deadline = STARTED + args.budget_s
    skipped: dict[int, list[str]] = {}
    for round_ in range(1, args.rounds + 1):
        for model in dict.fromkeys(c.model.name for c in cases):
            group = [c for c in cases if c.model.name == model]
            for i, case in enumerate(group):
                # After round 1, a round's float32 run is only worth starting if its mixed runs fit too.
                need = sum(estimate(c, cases) for c in group) if round_ > 1 and i == 0 else estimate(case, cases)
                if time.monotonic() + need > deadline:
                    names = group[i:] if round_ > 1 else [case]
                    skipped.setdefault(round_, []).extend(f"{c.model.name} {c.label}" for c in names)
                    if round_ > 1:
                        break
                    continue
                spec = case.model.spec(case.policy, args.warmup + args.steps, args.devices, case.per_call, case.fp8)
                run = run_once(spec, args.warmup, args.steps, args.windows, deadline, round_)
                case.runs.append(run)
                name = f"round {round_}: {case.model.name} {case.label}"
                if run["stopped_by_budget"]:
                    notes.append(f"{name} was stopped by the budget after {run['steps_done']} steps.")
                if run["error"]:
                    notes.append(f"{name} failed: {run['error']}")
                if run["skipped_steps"]:  # Overflow skips leave out the update: cheaper steps.
                    notes.append(f"{name} skipped {run['skipped_steps']} of its measured steps (loss scale).")
                print(f"{name}: {', '.join(f'{w:.2f}' for w in run['windows_ms']) or 'no'} ms/step, "
                      f"setup {_num(run['setup_s'])} s, wall {run['wall_s']:.1f} s", flush=True)
                write(args, cases, env, notes)
    notes += [f"round {r}: skipped {'all' if len(names) == len(cases) else ', '.join(names)}: too little of the "
              f"{args.budget_s:g} s budget was left." for r, names in skipped.items()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if keras.backend.backend() != BACKEND:
        raise SystemExit(f"Expected the {BACKEND} backend. Received: keras backend {keras.backend.backend()!r} "
                         f"(keras was imported before this module set KERAS_BACKEND={BACKEND}).")
    if args.float32_matmul != "default" and BACKEND == "jax":
        jax.config.update("jax_default_matmul_precision", args.float32_matmul)
    env = environment(args)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = [int(n) if n != "auto" else n for n in args.per_call.split(",")]
    fp8 = [p for p in args.fp8.split(",") if p] if DEVICES == 1 else []  # FP8 trains on one device
    cases = [Case(m, p, n, f) for m in (SMOKE if args.smoke else FULL) if m.name in args.models.split(",")
             for n in dict.fromkeys([1, *settings])
             for p, f in [*((p, False) for p in POLICIES), *((p, True) for p in fp8 if m.fp8)]]
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-speedup-cache-") as cache:
        # Later rounds build the same programs: the cache spares them most of the compile time.
        if BACKEND == "jax":
            jax.config.update("jax_compilation_cache_dir", cache)
        measure(args, cases, env, notes)
    results, text = write(args, cases, env, notes)
    print(text, end="")
    missing = [f"{r['model']} {r['label']}" for r in results if r["step_time_ms"] is None]
    if missing:
        print(f"Not measured: {', '.join(missing)} (see the notes).", file=sys.stderr)
    return 1 if missing else 0


def write(args: argparse.Namespace, cases: list[Case], env: dict[str, Any],
          notes: list[str]) -> tuple[list[dict[str, Any]], str]:
    """Write the table and the raw JSON (after every run, so a killed run leaves them)."""
    baselines = {(c.model.name, c.per_call): c for c in cases if c.policy == "float32" and not c.fp8}
    ones = {(c.model.name, c.policy, c.fp8): c for c in cases if c.per_call == 1}
    results = [summarize(c, baselines[c.model.name, c.per_call], ones[c.model.name, c.policy, c.fp8],
                         args.peak_tflops) for c in cases]
    text = report(results, env, notes, args)
    payload = {
        "benchmark": "gpu speedup", "smoke": args.smoke, "config": vars(args),
        "environment": env, "cases": results, "notes": notes, "elapsed_s": time.monotonic() - STARTED,
        "heavy_modules_imported": sorted(m for m in HEAVY_MODULES if m in sys.modules and m != BACKEND),
    }
    (args.out / "gpu_speedup.md").write_text(text)
    (args.out / "gpu_speedup.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return results, text


if __name__ == "__main__":
    sys.exit(main())

"""The GPU speedup benchmark's smoke run, as on a GPU host that has JAX but not the service's stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from scripts.stack import ROOT

ABSENT = ("tensorflow", "redis", "rq", "fastapi", "tensorboard")

# Makes ABSENT unimportable, as on the GPU host: an import that needs one fails
# the run, and an optional one (Keras probes for TensorFlow) takes the other branch.
HOST_WITHOUT = f"""
import importlib.abc, runpy, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} on this host", name=name)
        return None

sys.meta_path.insert(0, Absent())
sys.argv = ["gpu_speedup", *sys.argv[1:]]
runpy.run_module("bench.gpu_speedup", run_name="__main__", alter_sys=True)
"""


def env() -> dict[str, str]:
    return {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
            # Tiny models: LLVM's optimisations would take longer than the steps they speed up.
            "XLA_FLAGS": "--xla_backend_optimization_level=0"}


def test_importing_the_benchmark_imports_none_of_the_service_stack() -> None:
    check = f"import sys, bench.gpu_speedup; print([m for m in {ABSENT!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env(), cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_smoke_run_reports_every_case_without_the_service_stack(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # One FP8 policy of the two (`--fp8`, both by default): the FP8 path at half its cost in the suite.
    done = subprocess.run([sys.executable, "-c", HOST_WITHOUT, "--smoke", "--fp8", "mixed_bfloat16", "--out",
                           str(out)], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    table = (out / "gpu_speedup.md").read_text()
    data: dict[str, Any] = json.loads((out / "gpu_speedup.json").read_text())
    assert table in done.stdout
    assert data["heavy_modules_imported"] == []
    assert data["environment"]["keras_backend"] == "jax"
    assert data["environment"]["platform"] == "cpu"
    cases = data["cases"]
    fp8 = [("mixed_bfloat16", True)]  # the transformer's alone (the model with FP8 cases)
    assert [(c["model"], c["per_call"], c["policy"], c["fp8"]) for c in cases] == [
        (model, per_call, policy, on) for model in ("transformer", "cnn") for per_call in (1, "auto")
        for policy, on in [("float32", False), ("mixed_float16", False), ("mixed_bfloat16", False),
                           *(fp8 if model == "transformer" else [])]
    ]
    assert [c["label"] for c in cases if c["fp8"]] == ["mixed_bfloat16 + fp8", "mixed_bfloat16 + fp8, auto per call"]
    for case in cases:
        assert case["step_time_ms"] > 0 and case["examples_per_sec"] > 0, case
        assert case["speedup"] > 0
        assert case["tflops"] > 0 and case["peak_percent"] > 0
        assert [run["error"] for run in case["runs"]] == [None]
        assert case["runs"][0]["steps_done"] == data["config"]["warmup"] + data["config"]["steps"]
        # FP8 cases trained FP8 layers (their records have fp8 rows), the others none.
        assert (case["runs"][0]["fp8_tensors"] > 0) is case["fp8"], case
        assert f"| {case['model']} | {case['label']} |" in table
    assert [c["speedup"] for c in cases if c["policy"] == "float32"] == [1.0] * 4
    # Each case, FP8 ones included, is set against float32 of the same model and steps per call.
    for case in cases:
        baseline = "float32" if case["per_call"] == 1 else "float32, auto per call"
        assert f"| gpu speedup | {case['model']} {case['label']} | {baseline} |" in table
    # Each case at the automatic steps per call set against itself at one, and in the table's own rows.
    assert all(c["per_call_speedup"] > 0 for c in cases)
    assert [c["per_call_speedup"] for c in cases if c["per_call"] == 1] == [1.0] * 7
    for case in cases:
        assert (f"| steps per call | {case['model']} {case['label']} |" in table) is (case["per_call"] != 1)
    # The transformer's FLOPs per step, by the docstring's formula at the smoke shapes.
    b, s, d, f, layers, classes = 8, 16, 32, 64, 1, 10
    expected = 6 * layers * (4 * d * d + 2 * d * f) * b * s + 12 * layers * s * s * d * b + 6 * d * classes * b
    assert cases[0]["flops_per_step"] == expected
    assert [c["flops_per_step"] for c in cases if c["model"] == "transformer"] == [expected] * 8
    assert [c["goal"] != "" for c in cases] == [False, True, True] + [False] * 11  # FP8 rows have none
    assert "Goal (transformer, each mixed policy >= 2.5x float32)" in table


def test_smoke_run_trains_each_job_on_two_devices(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--smoke", "--devices", "2", "--models", "cnn", "--warmup", "1", "--steps", "2", "--windows", "1",
            "--per-call", "1"]
    done = subprocess.run([sys.executable, "-m", "bench.gpu_speedup", *args, "--out", str(out)],
                          capture_output=True, text=True, env={**env(), "TF_CPP_MIN_LOG_LEVEL": "2"}, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    data: dict[str, Any] = json.loads((out / "gpu_speedup.json").read_text())
    assert data["environment"]["keras_backend"] == "tensorflow"
    assert len(data["environment"]["devices"]) == 2 and data["environment"]["devices_per_job"] == 2
    assert [c["policy"] for c in data["cases"]] == ["float32", "mixed_float16", "mixed_bfloat16"]
    for case in data["cases"]:
        assert case["devices"] == 2 and case["batch_size"] == 16  # 8 rows on each device
        assert [run["error"] for run in case["runs"]] == [None] and case["step_time_ms"] > 0
    table = (out / "gpu_speedup.md").read_text()
    assert "2 devices per job" in table and "Goal (" not in table  # no transformer, no goal to judge

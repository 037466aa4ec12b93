"""A job on two devices (MirroredStrategy over two logical CPUs) reports what the same job on one does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from scripts.stack import ROOT
from tests.processes.replica_runs import STEPS

REPO = ROOT
COMPARED = ("loss", "grad_norm", "zero_grad_fraction")
EXACT = ("step", "loss_scale", "grads_finite", "skipped")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run of tests/processes/replica_runs.py, made in one process whose CPU is two devices."""
    out = tmp_path_factory.mktemp("replicas") / "runs.json"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}  # tf.distribute
    done = subprocess.run([sys.executable, "-m", "tests.processes.replica_runs", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["devices"] == 2
    return result


def assert_same_steps(one: list[dict[str, Any]], two: list[dict[str, Any]], rel: float, compared: int,
                      zeros_abs: float = 0.0) -> None:
    """Every step's EXACT fields equal; the COMPARED numbers of the first `compared` steps within `rel`
    (a skipped step's loss only)."""
    assert len(one) == len(two) > 0
    for a, b in zip(one, two, strict=True):
        assert {k: a[k] for k in EXACT} == {k: b[k] for k in EXACT}, f"step {a['step']}"
    for a, b in zip(one[:compared], two[:compared], strict=True):
        # A skipped step's gradient overflowed: no norm, and its zeros are those of inf and NaN.
        for key in ("loss",) if a["skipped"] else COMPARED:
            tolerance = zeros_abs if key == "zero_grad_fraction" else 1e-7
            assert b[key] == pytest.approx(a[key], rel=rel, abs=tolerance), f"{key} at step {a['step']}"
        assert (a["grad_norm"] is None) == (b["grad_norm"] is None) == a["skipped"]


def test_two_replicas_report_what_one_does_in_float32(runs: dict[str, Any]) -> None:
    one, two = runs["float32/1"], runs["float32/2"]
    assert_same_steps(one, two, rel=1e-4, compared=len(one))
    assert not any(r["skipped"] for r in two)
    # growth_steps=2 from 256: the scale doubles after every second step, on both.
    assert [r["loss_scale"] for r in two[:5]] == [256.0, 256.0, 512.0, 512.0, 1024.0]


def test_two_replicas_without_a_loss_scale_apply_every_step(runs: dict[str, Any]) -> None:
    one, two = runs["plain/1"], runs["plain/2"]
    assert_same_steps(one, two, rel=1e-4, compared=len(one))
    assert [r["loss_scale"] for r in two] == [1.0] * len(two) and not any(r["skipped"] for r in two)
    # The dynamic float32 run's scales are powers of two, exact to unscale: the same first steps.
    scaled = runs["float32/2"]
    for key in COMPARED:
        assert [r[key] for r in two[:3]] == pytest.approx([r[key] for r in scaled[:3]], rel=1e-6)


def test_step_one_norm_is_the_whole_batchs_gradient(runs: dict[str, Any]) -> None:
    # A plain GradientTape over all 16 rows on the initial weights: not half of them, not twice.
    tape = runs["tape_grad_norm"]
    assert runs["float32/1"][0]["grad_norm"] == pytest.approx(tape, rel=1e-5)
    assert runs["float32/2"][0]["grad_norm"] == pytest.approx(tape, rel=1e-5)


def test_an_overflow_is_skipped_at_the_same_steps_on_two_replicas(runs: dict[str, Any]) -> None:
    one, two = runs["overflow/1"], runs["overflow/2"]
    # 2**28 overflows float16 at once; each skip halves the scale until the gradients are finite.
    first = next(r["step"] for r in one if not r["skipped"])
    assert first > 2 and all(r["grad_norm"] is None and not r["grads_finite"] for r in one[:first - 1])
    assert [r["loss_scale"] for r in one[:first]] == [2.0**28 / 2**k for k in range(first)]
    # growth_steps=3: after three finite steps the doubled scale overflows again, and is skipped.
    assert one[first + 2]["loss_scale"] == 2 * one[first - 1]["loss_scale"] and one[first + 2]["skipped"]
    # Every step skips, or not, at the same scale on both. float16 rounds each replica's half of
    # the batch on its own, so the numbers agree to float16's precision while the weights still
    # agree: through the skipped steps and the first three applied ones (later, Adam's
    # trajectories drift apart by more than that). A gradient value or two may come out
    # exactly zero in one sum and not in the other (one value is about 1e-4 of the MLP's).
    assert_same_steps(one, two, rel=2e-2, compared=first + 2, zeros_abs=2.5e-4)
    assert two[first - 1]["grad_norm"] == pytest.approx(one[first - 1]["grad_norm"], rel=1e-3)


def test_a_two_device_job_resumes_from_its_checkpoint(runs: dict[str, Any]) -> None:
    whole, resumed = runs["overflow/2"], runs["overflow/2/resumed"]
    assert [r["step"] for r in resumed] == [r["step"] for r in whole]
    for a, b in zip(whole, resumed, strict=True):
        assert {k: a[k] for k in (*EXACT, *COMPARED)} == {k: b[k] for k in (*EXACT, *COMPARED)}


def test_two_replicas_at_eight_steps_per_call_report_what_one_step_per_call_does(runs: dict[str, Any]) -> None:
    one_per_call, eight_per_call = runs["overflow/2"], runs["overflow/2/per_call_8"]
    timing = {"time", "step_time_ms", "examples_per_sec"}
    assert [r["step"] for r in eight_per_call] == list(range(1, STEPS + 1))
    assert any(r["skipped"] for r in eight_per_call[1:7]), "skips inside the first call"
    assert ([{k: v for k, v in r.items() if k not in timing} for r in eight_per_call]
            == [{k: v for k, v in r.items() if k not in timing} for r in one_per_call])

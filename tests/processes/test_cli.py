"""The `mpjobs` CLI as a user runs it: a subprocess against the real API, worker and Redis."""

from __future__ import annotations

import csv
import io
import json
import os
import pty
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from mpjobs import Client
from mpjobs.cli import CliError, Exit, build_parser, comparison_report, main, summary_lines
from mpjobs.cli.commands import cmd_compare
from mpjobs.contract.records import STEP_SCALARS, LayerNumerics
from mpjobs.contract.spec import ComparisonSpec
from scripts.stack import ROOT, Stack, free_port, freeze_mid_run, wait_until
from tests.app.store.test_layer_checks import check
from tests.app.store.test_missing_steps import finish, record
from tests.processes.test_layers_api import ended_job, running_job

STEPS = 30
FLOAT32 = ["--model", "mlp", "--policy", "float32", "--samples", "512"]
LONG = [*FLOAT32, "--steps", "20000"]
"""Runs for about a minute: long enough to cancel or interrupt, never left to finish."""


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MPJOBS_")}
    return {**clean, "PYTHONPATH": str(ROOT)}


def argv(stack: Stack, *args: str) -> list[str]:
    return [sys.executable, "-m", "mpjobs.cli", "--url", stack.base_url, *args]


def mpjobs(stack: Stack, *args: str, stdin: str | None = None, timeout: float = 120
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv(stack, *args), cwd=ROOT, env=env(), input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def spawn(stack: Stack, log: Path, *args: str) -> subprocess.Popen[str]:
    """A long-running CLI process; its stderr goes to `log`, its stdout to a pipe."""
    return subprocess.Popen(argv(stack, *args), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True)


def step_lines(stderr: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+)/", stderr, re.MULTILINE)]


# The CLI's number rules (docs/cli.md), written here with Python's own formatting, not the CLI's code.


def _positional(scientific: str) -> str:
    """"6.931e-01" -> "0.6931": the digits a scientific format kept, without trailing zeros."""
    return format(Decimal(scientific).normalize(), "f")


def four_digits(value: float) -> str:
    """Losses: 4 significant digits, whole numbers whole, scientific below 0.001 and from a million up."""
    if value == int(value):
        return str(int(value))
    mantissa, exponent = f"{value:.3e}".split("e")
    if 1e-3 <= abs(value) < 1e6:
        return _positional(f"{value:.3e}")
    return f"{_positional(mantissa)}e{int(exponent):+d}"


def percent_of(share: float, sign: bool = False) -> str:
    """Shares: two significant digits under 10%, whole from 10% up, never 100% below it."""
    value = share * 100
    if value == 0:
        return "0%"
    text = _positional(f"{abs(value):.1e}") if abs(value) < 10 else f"{abs(value):.0f}"
    text = "99" if text == "100" and abs(value) < 100 else text
    return f"{'-' if value < 0 else '+' if sign else ''}{text}%"


def rate_of(value: float) -> str:
    """Examples/s: whole with thousands separators from 100 up, three significant digits below."""
    return f"{value:,.0f}" if abs(value) >= 100 else "0" if value == 0 else _positional(f"{value:.2e}")


def ratio_of(value: float) -> str:
    """Step time against float32's: two decimals, two significant digits under 0.1."""
    fixed = f"{value:.2f}"
    return f"{fixed if abs(float(fixed)) >= 0.1 or value == 0 else _positional(f'{value:.1e}')}×"


def variant_cells(v: dict[str, Any]) -> list[str]:
    """A comparison variant's row in `compare`'s table, from the API's values."""
    def shown(value: Any, show: Callable[[Any], str]) -> str:
        return "-" if value is None else show(value)

    speed = v["speed"]
    figures = speed and f"{ratio_of(speed['slowdown'])} ({ratio_of(speed['low'])[:-1]}–{ratio_of(speed['high'])[:-1]})"
    step_time = "1 (baseline)" if v["baseline"] else figures or ("not timed" if v["speed_error"] else "-")
    return [v["label"] + (" (baseline)" if v["baseline"] else ""), v["state"],
            f"{v['progress']['step']}/{v['progress']['total_steps']}", shown(v["final_loss"], four_digits),
            shown(v["loss_gap"], lambda gap: percent_of(gap, sign=True)), shown(v["examples_per_sec"], rate_of),
            step_time, shown(v["skipped_steps"], str), shown(v["peak_zero_grad_fraction"], percent_of),
            shown(v["peak_excess_zero_fraction"], percent_of), ",".join(d["code"] for d in v["diagnoses"]) or "-",
            v["job_id"]]


def cell_starts(line: str) -> list[int]:
    """Where each cell of a table line begins (cells are apart by two spaces or more)."""
    return [m.start() for m in re.finditer(r"\S+(?: \S+)*", line)]


@pytest.fixture(scope="module")
def finished(stack: Stack) -> Iterator[tuple[subprocess.CompletedProcess[str], str]]:
    """`submit --watch` of a small float32 job, run once for the tests that read its output."""
    done = mpjobs(stack, "submit", *FLOAT32, "--steps", str(STEPS), "--name", "cli", "--watch", "--interval", "0")
    yield done, done.stdout.splitlines()[0]


def test_submit_watch_runs_the_job_to_the_end_and_ends_with_its_summary(
    finished: tuple[subprocess.CompletedProcess[str], str], client: httpx.Client
) -> None:
    done, job_id = finished
    assert done.returncode == Exit.OK, done.stderr
    assert re.fullmatch(r"[0-9a-f]{32}", job_id)
    job = client.get(f"/jobs/{job_id}").json()
    assert job["state"] == "succeeded" and job["name"] == "cli"
    assert done.stdout.splitlines()[1].startswith("queued: mlp, float32 with no loss scaling, 30 steps of batch 32")
    s = job["summary"]
    assert (s["float32_checks"], s["precision_speed"], s["diagnoses"]) == (0, None, []), s  # float32: no such lines
    summary = [
        f"job {job_id} succeeded after {STEPS} of {STEPS} steps",
        f"  final loss       {four_digits(s['final_loss'])} (mean batch loss of the last steps)",
        "  skipped steps    0",
        "  loss scale       min 1, max 1, final 1",
        f"  peak zero grads  {percent_of(s['peak_zero_grad_fraction'])} of gradient elements exactly zero",
        f"  throughput       {rate_of(s['mean_examples_per_sec'])} examples/s, up to {s['steps_per_call']} steps "
        "per call",
        "  diagnoses        none",
    ]
    assert done.stdout.splitlines()[-len(summary):] == summary
    # Not a terminal: one plain line per step (--interval 0), each step once and in order.
    steps = step_lines(done.stderr)
    assert steps == list(range(steps[0], STEPS + 1)) and steps[0] <= 2, done.stderr
    assert "\x1b[" not in done.stderr
    assert done.stderr.rstrip().endswith("state: succeeded (finished 30 steps)")


def test_a_failing_job_exits_1_with_its_reason(stack: Stack, client: httpx.Client) -> None:
    # Three samples fit the model (checked at submission) but not one batch of 32 (found by the worker).
    np.savez(stack.data / "three.npz", x=np.zeros((3, 784), np.float32), y=np.zeros(3, np.int32))
    spec = {"model": {"name": "mlp"}, "training": {"steps": 5}, "dataset": {"kind": "npz", "path": "three.npz"}}
    done = mpjobs(stack, "submit", "-", "--watch", stdin=json.dumps(spec))
    assert done.returncode == Exit.FAILED, done.stdout + done.stderr
    job = client.get(f"/jobs/{done.stdout.splitlines()[0]}").json()
    assert job["state"] == "failed" and job["error"]["reason"] == "invalid_dataset"
    assert ("  error            invalid_dataset: dataset has 3 samples, fewer than training.batch_size=32."
            in done.stdout.splitlines())
    assert done.stdout.splitlines()[-1] == "  summary          none: no step finished"


def test_metrics_csv_has_one_row_per_step_with_the_api_values(
    finished: tuple[subprocess.CompletedProcess[str], str], stack: Stack, client: httpx.Client, tmp_path: Path
) -> None:
    _, job_id = finished
    points = client.get(f"/jobs/{job_id}/metrics", params={"limit": 1000}).json()["points"]
    out = tmp_path / "steps.csv"
    done = mpjobs(stack, "metrics", job_id, "--csv", "--output", str(out))
    assert done.returncode == Exit.OK and done.stdout == "" and done.stderr == ""
    with out.open(newline="") as f:
        reader = csv.reader(f)
        header, rows = next(reader), list(reader)
    assert header == list(STEP_SCALARS)
    assert [int(r[0]) for r in rows] == list(range(1, STEPS + 1))
    for row, point in zip(rows, points, strict=True):
        record = dict(zip(header, row, strict=True))
        assert float(record["loss"]) == point["loss"] and float(record["grad_norm"]) == point["grad_norm"]
        assert record["skipped"] == "false" and float(record["loss_scale"]) == 1.0
    lines = mpjobs(stack, "metrics", job_id).stdout.splitlines()
    assert [json.loads(line) for line in lines] == points


def test_delete_of_a_succeeded_job_is_409_with_its_state_and_changes_nothing(
    finished: tuple[subprocess.CompletedProcess[str], str], client: httpx.Client
) -> None:
    _, job_id = finished
    before = client.get(f"/jobs/{job_id}").json()
    assert before["state"] == "succeeded"
    refused = client.delete(f"/jobs/{job_id}")
    assert refused.status_code == 409 and refused.json()["state"] == "succeeded", refused.text
    assert refused.json()["detail"] == (f"Job {job_id!r} has already ended (succeeded): there is nothing to cancel. "
                                        f"To delete it for good: DELETE /jobs/{job_id}?purge=true.")
    assert client.get(f"/jobs/{job_id}").json() == before


@pytest.mark.parametrize("command", ["metrics", "layers"])
@pytest.mark.parametrize("to_file", [False, True])
def test_a_csv_of_a_job_that_does_not_exist_writes_nothing(stack: Stack, tmp_path: Path, command: str,
                                                           to_file: bool) -> None:
    out = tmp_path / "x.csv"
    done = mpjobs(stack, command, "f" * 32, "--csv", *(["--output", str(out)] if to_file else []))
    assert done.returncode == Exit.NOT_FOUND, done.stderr
    assert done.stdout == "" and not out.exists()  # no header, no empty file
    assert "ffffffff" in done.stderr


def test_layers_csv_has_one_row_per_step_and_layer_with_the_api_values(stack: Stack, tmp_path: Path) -> None:
    job_id = ended_job(stack)  # checks at steps 1 and 5, two layers each
    out = tmp_path / "layers.csv"
    done = mpjobs(stack, "layers", job_id, "--csv", "-o", str(out))
    assert done.returncode == Exit.OK and done.stdout == "" and done.stderr == ""
    with out.open(newline="") as f:
        reader = csv.reader(f)
        header, rows = next(reader), list(reader)
    assert header == ["step", "compute_dtype", "loss_scale", *LayerNumerics.model_fields]
    expected = [(c.step, layer) for c in (check(1), check(5, underflow=None)) for layer in c.layers]
    assert [(int(r[0]), r[3]) for r in rows] == [(step, layer.name) for step, layer in expected]
    for row, (_, layer) in zip(rows, expected, strict=True):
        cells = dict(zip(header, row, strict=True))
        assert (cells["compute_dtype"], float(cells["loss_scale"])) == ("float16", 1.0)
        for field, value in layer.model_dump().items():
            want = "" if value is None else str(value).lower() if isinstance(value, bool) else value
            assert (cells[field] if isinstance(want, str) else type(want)(cells[field])) == want, field


def test_layers_prints_the_latest_check_and_marks_where_underflow_begins(stack: Stack) -> None:
    store, job_id = running_job(stack, steps=3)
    assert mpjobs(stack, "layers", job_id).stdout == (
        f"job {job_id}: no layer checks yet (under float32 there are none unless training.layer_check_every "
        "is set)\n")
    store.streams.append_steps(job_id, [record(1), record(2)], [], [check(1, underflow=None)])
    latest = check(2).model_copy(update={"overflow_layer": "conv3d_1", "loss_scale": 32768.0,
                                          "recovery": "recovered", "recovery_scale": 2.0**20,
                                          "recovery_excess_zero_fraction": 0.0})
    store.streams.append_steps(job_id, [record(3)], [], [latest])
    finish(store, job_id, steps_done=3)
    done = mpjobs(stack, "layers", job_id)
    assert done.returncode == Exit.OK, done.stderr
    title, header, *rows = done.stdout.splitlines()
    assert title == f"job {job_id}: layer check at step 2 (the latest of 2), float16 compute, loss scale 32768"
    assert re.split(r"  +", header) == ["LAYER", "KIND", "ZERO GRADS", "EXCESS ZEROS", "GRAD NORM", "MAX |G|",
                                        "MIN |G|", "ACT MAX", "HEADROOM (DOUBLINGS)", "SUBNORMAL ACT"]
    # The values of tests/app/store/test_layer_checks.py's check(): a gradient of 2^-20 norm, 2^-21 at most, ...
    assert [re.split(r"  +", row) for row in rows[:2]] == [
        ["conv3d_1", "Conv3D", "50%", "50%", "9.537e-7", "2^-21", "2^-24", "3.5", "14.1", "25%",
         "underflow begins here, near overflow"],
        ["max_pooling3d", "MaxPooling3D", "-", "-", "-", "-", "-", "3.5", "126", "0%"]]
    assert rows[2:] == [
        "gradient underflow begins at conv3d_1: the layer nearest the output that loses gradient values float32 "
        "keeps (backpropagation reaches it first)",
        "the same step at loss scale 1048576 keeps the gradients of conv3d_1 (0% excess zeros left)",
        "activations near overflow from conv3d_1: within two doublings of their dtype's largest value"]


@pytest.mark.parametrize(("args", "field"), [
    (["--steps", "0"], "training.steps: Input should be greater than or equal to 1"),
    (["--learning-rate", "20"], "training.learning_rate: Input should be less than or equal to 10"),
])
def test_a_bad_flag_value_prints_the_field_exits_2_and_writes_nothing(
    stack: Stack, args: list[str], field: str
) -> None:
    before = stack.writes()
    done = mpjobs(stack, "submit", "--model", "mlp", *args)
    assert done.returncode == Exit.USAGE
    assert done.stdout == ""
    assert done.stderr.splitlines() == ["mpjobs: the API refused the request (422):", f"  {field}"]
    assert stack.writes() == before


def test_a_bad_spec_file_and_a_bad_flag_type_exit_2(stack: Stack, tmp_path: Path) -> None:
    before = stack.writes()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": {"name": "mlp"}, "precision_policy": "fp8"}))
    done = mpjobs(stack, "submit", str(spec))
    assert done.returncode == Exit.USAGE and "  precision_policy: Input should be 'float32'" in done.stderr
    not_a_number = mpjobs(stack, "submit", "--model", "mlp", "--steps", "ten")
    assert not_a_number.returncode == Exit.USAGE and "argument --steps: invalid int value: 'ten'" in not_a_number.stderr
    assert stack.writes() == before


def test_cancel_a_running_job_and_watch_exits_3_after_ctrl_c_left_it_running(
    stack: Stack, client: httpx.Client, tmp_path: Path
) -> None:
    job_id = mpjobs(stack, "submit", *LONG).stdout.splitlines()[0]
    first_log, second_log = tmp_path / "first.err", tmp_path / "second.err"
    first = spawn(stack, first_log, "watch", job_id, "--interval", "0.2")
    wait_until(lambda: step_lines(first_log.read_text()), 60, "the first watch to show a step")
    first.send_signal(signal.SIGINT)
    assert first.wait(10) == Exit.INTERRUPTED
    assert f"Cancel it with: mpjobs cancel {job_id}" in first_log.read_text()
    assert client.get(f"/jobs/{job_id}").json()["state"] == "running", "Ctrl-C in watch never cancels"

    second = spawn(stack, second_log, "watch", job_id, "--interval", "0.2")
    wait_until(lambda: step_lines(second_log.read_text()), 60, "the second watch to show a step")
    canceled = mpjobs(stack, "cancel", job_id)
    assert canceled.returncode == Exit.OK
    assert canceled.stdout in {f"{job_id}: running; cancel requested, it stops after its current step\n",
                               f"{job_id}: canceled\n"}
    out, _ = second.communicate(timeout=30)
    assert second.returncode == Exit.CANCELED
    job = client.get(f"/jobs/{job_id}").json()
    assert job["state"] == "canceled" and job["progress"]["step"] < 20000
    assert f"job {job_id} canceled after {job['progress']['step']} of 20000 steps" in out
    assert "state: canceled" in second_log.read_text()


def test_cancel_a_queued_job_and_watch_exits_3_at_once(stack: Stack, client: httpx.Client) -> None:
    # No GPU worker runs in the tests, so a gpu job stays queued.
    job_id = mpjobs(stack, "submit", "--model", "mlp", "--steps", "5", "--device", "gpu").stdout.splitlines()[0]
    done = mpjobs(stack, "cancel", job_id, "--wait")
    assert done.returncode == Exit.CANCELED and done.stdout == f"{job_id}: canceled\n"
    watched = mpjobs(stack, "watch", job_id)
    assert watched.returncode == Exit.CANCELED
    assert watched.stdout.splitlines()[:2] == [f"job {job_id} canceled after 0 of 5 steps",
                                               "  error            canceled: Canceled before it started."]
    assert client.get(f"/jobs/{job_id}").json()["started_at"] is None


def test_watch_reconnects_after_the_api_dies_and_sees_every_step_once(
    stack: Stack, client: httpx.Client, tmp_path: Path
) -> None:
    # Its worker frozen mid-run until the API is dead, however fast the machine trains.
    job_id, pid, spec = freeze_mid_run(stack, client, {"model": {"name": "mlp"}, "precision_policy": "float32",
                                                       "dataset": {"samples": 512}, "training": {"steps": 300}}, 3)
    steps = spec["training"]["steps"]
    log = tmp_path / "watch.err"
    try:
        watcher = spawn(stack, log, "watch", job_id, "--interval", "0")
        wait_until(lambda: step_lines(log.read_text()), 60, "the watch to show a step")
        assert stack.api is not None
        stack.api.kill()  # the stream drops mid-run, as in a crash
        stack.api.wait(10)
    finally:
        os.killpg(pid, signal.SIGCONT)
    shown_before = step_lines(log.read_text())
    assert shown_before[-1] < steps, "the API died while the job still ran"
    stack.start_api()
    out, _ = watcher.communicate(timeout=120)
    assert watcher.returncode == Exit.OK, log.read_text()
    seen = step_lines(log.read_text())
    assert seen == list(range(seen[0], steps + 1)), "each step once, in order, across the reconnect"
    assert f"job {job_id} succeeded after {steps} of {steps} steps" in out


def test_compare_watch_prints_the_table_and_verdict(stack: Stack, client: httpx.Client) -> None:
    done = mpjobs(stack, "compare", "--model", "mlp", "--samples", "512", "--steps", "5", "--name", "cli compare",
                  "--watch", timeout=240)
    comparison_id = done.stdout.splitlines()[0]
    comparison: dict[str, Any] = client.get(f"/comparisons/{comparison_id}").json()
    assert comparison["state"] == "done"
    assert [v["label"] for v in comparison["variants"]] == [
        "float32", "mixed_float16 + dynamic", "mixed_float16 + none", "mixed_bfloat16"]
    worst = max(Exit.OK if v["state"] == "succeeded" else Exit.FAILED if v["state"] == "failed" else Exit.CANCELED
                for v in comparison["variants"])
    assert done.returncode == worst, done.stderr
    first, *lines = done.stdout.splitlines()
    assert first == comparison_id
    variants = comparison["variants"]
    assert lines[0] == f"comparison {comparison_id}  'cli compare'  (done)"
    header, rows = lines[1], lines[2:2 + len(variants)]
    assert re.split(r"  +", header) == [
        "VARIANT", "STATE", "STEP", "FINAL LOSS", "VS FLOAT32", "THROUGHPUT EX/S", "STEP TIME VS FLOAT32", "SKIPPED",
        "ZERO GRADS", "EXCESS ZEROS", "DIAGNOSES", "JOB"]
    assert [re.split(r"  +", row) for row in rows] == [variant_cells(v) for v in variants]
    assert all(cell_starts(row) == cell_starts(header) for row in rows), "\n".join(lines)
    notes = [line for v in variants for line in (
        [f"  {v['label']} {v['state']}: {v['error']['reason']}: {v['error']['message']}"] if v["error"] else []) + (
        [f"  {v['label']} not timed: {v['speed_error']}"] if v["speed_error"] else [])]
    assert lines[2 + len(variants):] == [*notes, f"verdict: {comparison['verdict']}"]
    report = "\n".join(lines)
    shown = mpjobs(stack, "compare", "--show", comparison_id)
    assert shown.returncode == worst and shown.stdout == report + "\n"


def test_compare_without_a_float32_variant_is_refused_by_the_api(stack: Stack) -> None:
    before = stack.writes()
    done = mpjobs(stack, "compare", "--model", "mlp", "--variant", "mixed_float16:dynamic",
                  "--variant", "mixed_bfloat16")
    assert done.returncode == Exit.USAGE
    assert "variants: Value error, variants must include a 'float32' variant" in done.stderr
    assert stack.writes() == before


def test_compare_keeps_the_loss_scale_flags_and_refuses_policy(stack: Stack, client: httpx.Client) -> None:
    before = stack.writes()
    refused = mpjobs(stack, "compare", "--model", "mlp", "--policy", "float16")
    assert refused.returncode == Exit.USAGE
    assert refused.stderr.splitlines()[-1] == ("mpjobs compare: error: compare runs each variant's own policy: "
                                               "use --variant POLICY[:MODE] instead of --policy.")
    assert stack.writes() == before
    done = mpjobs(stack, "compare", "--model", "mlp", "--steps", "3", "--loss-scale", "dynamic",
                  "--initial-scale", "1024", "--growth-steps", "10")
    assert done.returncode == Exit.OK, done.stderr
    assert done.stderr == "", "nothing from a file to leave out"
    comparison = client.get(f"/comparisons/{done.stdout.split()[0]}").json()
    scaled = {v["label"]: v for v in comparison["variants"]}["mixed_float16 + dynamic"]
    assert scaled["loss_scale"] == {"mode": "dynamic", "initial_scale": 1024.0, "growth_steps": 10}
    assert len(comparison["variants"]) == 4
    client.delete(f"/comparisons/{comparison['id']}")


def test_compare_warns_of_the_spec_files_policy_and_names_jobs_after_what_they_run(
    stack: Stack, client: httpx.Client
) -> None:
    # The example is a mixed_float16 job named after its policy, with a dynamic loss scale of its own.
    done = mpjobs(stack, "compare", "examples/mlp_mixed_float16.json", "--steps", "3", "--samples", "512")
    assert done.returncode == Exit.OK, done.stderr
    assert done.stderr == (
        "warning: examples/mlp_mixed_float16.json's precision_policy 'mixed_float16' is not used by compare: each "
        "variant sets its own (float32, mixed_float16 + dynamic, mixed_float16 + none, mixed_bfloat16); its "
        "loss_scale goes on mixed_float16 + dynamic.\n")
    comparison = client.get(f"/comparisons/{done.stdout.split()[0]}").json()
    scaled = {v["label"]: v for v in comparison["variants"]}["mixed_float16 + dynamic"]
    assert scaled["loss_scale"] == {"mode": "dynamic", "initial_scale": 32768.0, "growth_steps": 2000}
    jobs = [client.get(f"/jobs/{v['job_id']}").json() for v in comparison["variants"]]
    assert [(j["name"], j["spec"]["precision_policy"]) for j in jobs] == [
        ("mlp · float32", "float32"), ("mlp · mixed_float16 + dynamic", "mixed_float16"),
        ("mlp · mixed_float16 + none", "mixed_float16"), ("mlp · mixed_bfloat16", "mixed_bfloat16")]
    client.delete(f"/comparisons/{comparison['id']}")


def test_compare_help_lists_only_the_options_compare_takes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as helped:
        main(["compare", "--help"])
    assert helped.value.code == Exit.OK
    text = capsys.readouterr().out
    assert "--policy" not in text and "--loss-scale {fixed,dynamic}" in text and "--variant POLICY[:MODE]" in text
    for given in (["--policy", "float16"], ["--policy=float32"], ["--policy"]):
        with pytest.raises(SystemExit) as refused:
            main(["compare", "--model", "mlp", *given])
        assert refused.value.code == Exit.USAGE, given
        assert capsys.readouterr().err.splitlines()[-1] == (
            "mpjobs compare: error: compare runs each variant's own policy: use --variant POLICY[:MODE] instead "
            "of --policy.")
    with pytest.raises(SystemExit) as unscaled:  # mixed_float16 without scaling is a default variant already
        main(["compare", "--model", "mlp", "--loss-scale", "none"])
    assert unscaled.value.code == Exit.USAGE
    assert "argument --loss-scale: invalid choice: 'none'" in capsys.readouterr().err


def fake_api(posted: list[dict[str, Any]]) -> Client:
    """An API that validates the comparison as the server does and answers it queued, in-process."""
    def answer(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content))
        spec = ComparisonSpec.model_validate(posted[-1])
        variants = [{"label": v.label, "precision_policy": v.precision_policy.value, "baseline": v.label == "float32",
                     "loss_scale": v.loss_scale and v.loss_scale.model_dump(mode="json"), "state": "queued",
                     "progress": {"step": 0, "total_steps": 3}, "job_id": f"job{i}", "final_loss": None,
                     "loss_gap": None, "examples_per_sec": None, "skipped_steps": None,
                     "peak_zero_grad_fraction": None, "diagnoses": [], "error": None, "device": None}
                    for i, v in enumerate(spec.variants or [])]
        return httpx.Response(201, json={"id": "c1", "name": spec.name, "created_at": "2026-01-01T00:00:00Z",
                                         "state": "running", "spec": spec.model_dump(mode="json"),
                                         "variants": variants, "verdict": "0 of 4 variants finished."})

    return Client("http://mpjobs.test", transport=httpx.MockTransport(answer))


@pytest.mark.parametrize(("spec", "variants", "warning"), [
    ({"precision_policy": "mixed_float16", "loss_scale": "none"}, [],
     "SPEC.json's precision_policy 'mixed_float16' and loss_scale 'none' are not used by compare: each variant sets "
     "its own (float32, mixed_float16 + dynamic, mixed_float16 + none, mixed_bfloat16)."),
    ({"precision_policy": "float32", "loss_scale": {"mode": "fixed", "scale": 256}}, [],
     "SPEC.json's precision_policy 'float32' is not used by compare: each variant sets its own (float32, "
     "mixed_float16 + fixed 256, mixed_float16 + none, mixed_bfloat16); its loss_scale goes on mixed_float16 + "
     "fixed 256."),
    ({"loss_scale": {"mode": "dynamic", "initial_scale": 1024}}, ["float32", "mixed_bfloat16"],
     "SPEC.json's loss_scale {\"mode\": \"dynamic\", \"initial_scale\": 1024} is not used by compare: each variant "
     "sets its own (float32, mixed_bfloat16)."),
    ({"speed_check": []}, ["float32", "mixed_bfloat16"],
     "SPEC.json's speed_check is not used by compare: the float32 variant times every other one in turns."),
    ({"precision_policy": "bfloat16", "speed_check": None}, ["float32", "mixed_bfloat16"],
     "SPEC.json's precision_policy 'bfloat16' is not used by compare: each variant sets its own (float32, "
     "mixed_bfloat16)."),
    ({"precision_policy": "bfloat16", "speed_check": [{"precision_policy": "float16"}]}, ["float32", "bfloat16"],
     "SPEC.json's precision_policy 'bfloat16' is not used by compare: each variant sets its own (float32, "
     "bfloat16). Its speed_check is not used either: the float32 variant times every other one in turns."),
    ({"loss_scale": "dynamic"}, [], None),
    ({"loss_scale": None}, ["float32", "bfloat16"], None),
])
def test_compare_warns_of_what_spec_json_sets_that_no_variant_runs(
    spec: dict[str, Any], variants: list[str], warning: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("SPEC.json").write_text(json.dumps({"name": "mlp mixed_float16", "model": {"name": "mlp"}, **spec}))
    posted: list[dict[str, Any]] = []
    argv = ["compare", "SPEC.json", *(f"--variant={v}" for v in variants)]
    assert cmd_compare(fake_api(posted), build_parser().parse_args(argv)) == Exit.OK
    out, err = capsys.readouterr()
    assert err == ("" if warning is None else f"warning: {warning}\n")
    assert out.splitlines()[0] == "c1" and len(posted) == 1


def test_compare_refuses_loss_scale_flags_that_no_variant_would_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    posted: list[dict[str, Any]] = []
    args = build_parser().parse_args(["compare", "--model", "mlp", "--variant", "float32", "--variant",
                                      "mixed_float16:dynamic", "--initial-scale", "1024"])
    with pytest.raises(CliError) as refused:
        cmd_compare(fake_api(posted), args)
    assert refused.value.code == Exit.USAGE and posted == []
    assert refused.value.message == (
        "with --variant, each variant sets its own loss scale (mixed_float16:dynamic, mixed_float16:fixed=1024); "
        "the loss-scale flags only set the default variants' scaled one. Received: --initial-scale 1024")
    # From stdin the file has no name of its own.
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"model": {"name": "mlp"}, "precision_policy": "float16"})))
    assert cmd_compare(fake_api(posted), build_parser().parse_args(["compare", "-", "--loss-scale", "fixed"])) == 0
    assert capsys.readouterr().err == (
        "warning: stdin's precision_policy 'float16' is not used by compare: each variant sets its own (float32, "
        "mixed_float16 + fixed 1024, mixed_float16 + none, mixed_bfloat16).\n")
    assert posted[-1]["variants"][1] == {"precision_policy": "mixed_float16", "loss_scale": {"mode": "fixed"}}


def test_not_found_unreachable_and_usage_exit_codes(stack: Stack) -> None:
    for args in (["show", "nosuchjob"], ["watch", "nosuchjob"], ["metrics", "nosuchjob"], ["cancel", "nosuchjob"],
                 ["layers", "nosuchjob"], ["compare", "--show", "nosuchcomparison"]):
        done = mpjobs(stack, *args)
        assert done.returncode == Exit.NOT_FOUND, args
        assert done.stderr.startswith("mpjobs: No "), done.stderr
    port = free_port()
    down = subprocess.run([sys.executable, "-m", "mpjobs.cli", "--url", f"http://127.0.0.1:{port}", "list"], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=60)
    assert down.returncode == Exit.UNAVAILABLE
    assert down.stderr.startswith(f"mpjobs: cannot reach the API at http://127.0.0.1:{port}")
    assert mpjobs(stack, "submit").returncode == Exit.USAGE  # neither SPEC.json nor --model


def test_list_and_show(finished: tuple[subprocess.CompletedProcess[str], str], stack: Stack) -> None:
    _, job_id = finished
    listed = mpjobs(stack, "list", "--state", "succeeded", "--limit", "200")
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["ID", "STATE", "POLICY", "LOSS", "SCALE", "STEP", "DIAGNOSES", "NAME"]
    assert [job_id, "succeeded", "float32", "none", f"{STEPS}/{STEPS}", "-", "cli"] in [r.split() for r in rows]
    shown = mpjobs(stack, "show", job_id)
    assert shown.returncode == Exit.OK and shown.stdout.splitlines()[0] == f"job {job_id}  'cli'"
    raw = json.loads(mpjobs(stack, "show", job_id, "--json").stdout)
    assert raw["id"] == job_id and raw["progress"] == {"step": STEPS, "total_steps": STEPS}


def test_the_cli_imports_no_server_code_and_documents_its_exit_codes() -> None:
    probe = ("import sys, mpjobs.cli; print(sorted({m.split('.')[0] for m in sys.modules} & "
             "{'tensorflow', 'keras', 'worker', 'redis', 'fastapi', 'starlette', 'rq'}))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert loaded.stdout.strip() == "[]", loaded.stderr
    # The console script pyproject.toml declares, as installed next to this interpreter.
    helped = subprocess.run([str(Path(sys.executable).parent / "mpjobs"), "--help"], cwd=ROOT, env=env(),
                            capture_output=True, text=True)
    assert helped.returncode == Exit.OK, helped.stderr
    docs = (ROOT / "docs" / "cli.md").read_text()
    for code in Exit:
        assert re.search(rf"^  {code.value} ", helped.stdout, re.MULTILINE), code
        assert f"| {code.value} |" in docs, code


def test_on_a_terminal_watch_draws_one_redrawn_bar(stack: Stack) -> None:
    master, terminal = pty.openpty()
    with subprocess.Popen(argv(stack, "submit", *FLOAT32, "--steps", str(STEPS), "--watch"), cwd=ROOT, env=env(),
                          stdout=subprocess.PIPE, stderr=terminal, text=True) as process:
        os.close(terminal)
        drawn = b""
        while chunk := _read(master):
            drawn += chunk
        assert process.wait(60) == Exit.OK
    os.close(master)
    text = drawn.decode()
    bars = re.findall(r"\r\x1b\[K\[([#.]{24})\] (\d+)/30 ", text)
    assert bars and bars[-1] == ("#" * 24, "30"), text
    assert [int(step) for _, step in bars] == sorted(int(step) for _, step in bars)
    assert step_lines(text.replace("\r", "\n")) == [], "no plain lines on a terminal"


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: every writer of the terminal has exited
        return b""


def test_api_keys_from_the_flag_or_the_environment_and_a_refusal_exits_5(stack: Stack) -> None:
    port = free_port()
    api = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port)], cwd=ROOT,
                           env={**stack.env, "API_KEYS": "key-cli:tenant-cli"}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/healthz").status_code == 200, 30, "the keyed API")

        def run(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "mpjobs.cli", *args], cwd=ROOT, env={**env(), **extra_env},
                                  capture_output=True, text=True, timeout=60)

        none = run("--url", url, "list")
        assert none.returncode == Exit.UNAVAILABLE
        assert "Send 'Authorization: Bearer <key>'. (401; pass --api-key or set MPJOBS_API_KEY)" in none.stderr
        wrong = run("list", "--url", url, "--api-key", "key-z")
        assert wrong.returncode == Exit.UNAVAILABLE and "That API key is not valid." in wrong.stderr
        assert run("list", MPJOBS_URL=url, MPJOBS_API_KEY="key-cli").stdout == "no jobs\n"
        assert run("--api-key", "key-cli", "--url", url, "show", "x").returncode == Exit.NOT_FOUND
    finally:
        api.terminate()
        api.wait(10)


# -- the words for known values, written out: the formatters are what these tests check ---------

KNOWN_JOB: dict[str, Any] = {
    "id": "j1", "state": "succeeded", "progress": {"step": 30, "total_steps": 30}, "error": None,
    "summary": {
        "steps_done": 30, "final_loss": 0.693147, "skipped_steps": 2, "loss_scale_min": 16384.0,
        "loss_scale_max": 32768.0, "loss_scale_final": 32768.0, "peak_zero_grad_fraction": 0.00053,
        "mean_examples_per_sec": 14921.7, "steps_per_call": 24, "float32_checks": 3,
        "peak_excess_zero_fraction": 0.0123,
        "peak_grad_rel_error": 0.000456, "float32_check_error": None,
        "precision_speed": {"policy_ms": 8.4, "float32_ms": 2.0, "slowdown": 4.2, "steps": 36, "low": 3.9,
                            "high": 4.5, "noise_low": 0.95, "noise_high": 1.06, "rounds": 9,
                            "difference": "slower"},
        "variant_speeds": [],
        "diagnoses": [{"code": "overflow_skips", "message": "2 steps skipped.", "first_step": 3}],
    },
}


def test_summary_lines_of_known_values() -> None:
    assert summary_lines(KNOWN_JOB) == [
        "job j1 succeeded after 30 of 30 steps",
        "  final loss       0.6931 (mean batch loss of the last steps)",
        "  skipped steps    2",
        "  loss scale       min 16384, max 32768, final 32768",
        "  peak zero grads  0.053% of gradient elements exactly zero",
        "  vs float32       on 3 checked steps, at most 1.2% of values zero only here, gradient error 4.6e-4",
        "  throughput       14,922 examples/s, up to 24 steps per call",
        "  precision speed  4.20× slower than float32 (3.90–4.50×) (8.4 ms against 2 ms per step, 95% interval of 9 "
        "rounds; float32 against itself 0.95–1.06×)",
        "  diagnoses        overflow_skips",
        "    - 2 steps skipped. (overflow_skips, from step 3)",
    ]
    faster = {**KNOWN_JOB, "summary": {**KNOWN_JOB["summary"], "final_loss": 0.000123456, "skipped_steps": 0,
                                       "peak_zero_grad_fraction": 0.997, "mean_examples_per_sec": 42.46,
                                       "float32_checks": 0, "diagnoses": [],
                                       "precision_speed": {**KNOWN_JOB["summary"]["precision_speed"],
                                                           "policy_ms": 1.0, "slowdown": 0.5, "low": 0.4,
                                                           "high": 0.625,
                                                           "difference": "faster"}}}
    assert summary_lines(faster)[1:] == [
        "  final loss       1.235e-4 (mean batch loss of the last steps)",
        "  skipped steps    0",
        "  loss scale       min 16384, max 32768, final 32768",
        "  peak zero grads  99% of gradient elements exactly zero",
        "  throughput       42.5 examples/s, up to 24 steps per call",
        "  precision speed  2.00× faster than float32 (1.60–2.50×) (1 ms against 2 ms per step, 95% interval of 9 "
        "rounds; float32 against itself 0.95–1.06×)",
        "  diagnoses        none",
    ]
    located = {**KNOWN_JOB, "summary": {**KNOWN_JOB["summary"], "underflow_layer": "conv3d_1", "underflow_step": 1,
                                        "overflow_layer": "dense", "overflow_step": 200}}
    assert summary_lines(located)[6:8] == [
        "  underflow from   conv3d_1 (step 1; mpjobs layers j1)",
        "  overflow risk    dense (step 200)",
    ]


def test_comparison_report_of_known_values() -> None:
    speed = {"policy_ms": 2.6, "float32_ms": 2.0, "slowdown": 1.3, "steps": 36, "low": 1.2, "high": 1.45,
             "noise_low": 0.95, "noise_high": 1.06, "rounds": 9, "difference": "slower"}
    comparison = {"id": "c1", "name": "mlp check", "state": "done", "verdict": "Keep float32.", "variants": [
        {"label": "float32", "baseline": True, "state": "succeeded", "progress": {"step": 5, "total_steps": 5},
         "final_loss": 0.5, "loss_gap": 0.0, "examples_per_sec": 1234.5, "speed": None, "speed_error": None,
         "skipped_steps": 0, "peak_zero_grad_fraction": 0.0, "peak_excess_zero_fraction": None, "diagnoses": [],
         "error": None, "job_id": "j0"},
        {"label": "mixed_float16 + dynamic", "baseline": False, "state": "succeeded",
         "progress": {"step": 5, "total_steps": 5}, "final_loss": 0.50123, "loss_gap": 0.00246,
         "examples_per_sec": 42.46, "speed": speed, "speed_error": None, "skipped_steps": 1,
         "peak_zero_grad_fraction": 0.25, "peak_excess_zero_fraction": 0.0456,
         "diagnoses": [{"code": "overflow_skips", "message": "1 step skipped.", "first_step": 2}], "error": None,
         "job_id": "j1"},
        {"label": "mixed_float16 + none", "baseline": False, "state": "failed",
         "progress": {"step": 2, "total_steps": 5}, "final_loss": None, "loss_gap": None,
         "examples_per_sec": None, "speed": None, "speed_error": "unsupported_precision_on_device: no kernel",
         "skipped_steps": None, "peak_zero_grad_fraction": None, "peak_excess_zero_fraction": None,
         "diagnoses": [], "error": {"reason": "diverged", "message": "Loss was NaN for 10 steps."}, "job_id": "j2"},
    ]}
    assert comparison_report(comparison).splitlines() == [
        "comparison c1  'mlp check'  (done)",
        "VARIANT                  STATE      STEP  FINAL LOSS  VS FLOAT32  THROUGHPUT EX/S  STEP TIME VS FLOAT32  "
        "SKIPPED  ZERO GRADS  EXCESS ZEROS  DIAGNOSES       JOB",
        "float32 (baseline)       succeeded  5/5   0.5         0%          1,235            1 (baseline)          "
        "0        0%          -             -               j0",
        "mixed_float16 + dynamic  succeeded  5/5   0.5012      +0.25%      42.5             1.30× (1.20–1.45)     "
        "1        25%         4.6%          overflow_skips  j1",
        "mixed_float16 + none     failed     2/5   -           -           -                not timed             "
        "-        -           -             -               j2",
        "  mixed_float16 + none failed: diverged: Loss was NaN for 10 steps.",
        "  mixed_float16 + none not timed: unsupported_precision_on_device: no kernel",
        "verdict: Keep float32.",
    ]

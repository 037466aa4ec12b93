"""Issue 34 from outside: FP8 in job and comparison specs, against the real API, Redis and a worker.

A spec FP8 cannot apply to is a 422 naming why, with nothing written; an FP8 comparison runs its FP8 variant,
serves its per-step FP8 state with each record, times it against float32 in the baseline's turns and judges
it in the verdict like any other variant.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from mpjobs.contract.formats import num, percent
from scripts.stack import Stack
from tests.processes.test_cli import mpjobs
from tests.processes.test_comparisons_http import finished, speed_call
from tests.processes.test_layer_policies_http import refused

MLP = {"name": "mlp", "input_dim": 16, "hidden_units": 16, "classes": 4}


@pytest.mark.parametrize(("body", "words"), [
    ({"model": {"name": "conv3d_unet"}, "fp8": {}}, "fp8 applies to Dense and EinsumDense layers"),
    ({"model": MLP, "precision_policy": "float16", "fp8": {}},
     "around a precision_policy of 'float32', 'mixed_bfloat16', 'mixed_float16'. Received: precision_policy='float16'"),
    ({"model": MLP, "fp8": {}, "training": {"devices": 2}}, "fp8 trains on one device"),
    ({"model": MLP, "fp8": {"amax_history_length": 0}}, "greater than or equal to 1"),
    ({"model": MLP, "fp8": {"history": 16}}, "Extra inputs are not permitted"),
])
def test_a_spec_fp8_cannot_apply_to_is_422_saying_why(stack: Stack, client: httpx.Client, body: dict[str, Any],
                                                      words: str) -> None:
    assert words in refused(stack, client, "/jobs", body)


def test_a_comparison_variant_with_fp8_is_checked_like_a_job(stack: Stack, client: httpx.Client) -> None:
    message = refused(stack, client, "/comparisons", {"spec": {"model": {"name": "conv3d_unet"}}, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16", "fp8": {}}]})
    assert "variants[1].fp8 applies to Dense and EinsumDense layers" in message


def test_an_fp8_comparison_runs_serves_its_fp8_state_and_judges_it(stack: Stack, client: httpx.Client) -> None:
    created = client.post("/comparisons", json={
        "spec": {"model": MLP, "training": {"steps": 24, "seed": 1, "underflow_check_every": 10},
                 "dataset": {"samples": 256}},
        "variants": [{"precision_policy": "float32"},
                     {"precision_policy": "mixed_bfloat16", "fp8": {"amax_history_length": 16}}]})
    assert created.status_code == 201, created.text
    report = finished(client, created.json()["id"])
    base, fp8 = report["variants"]
    assert fp8["label"] == "mixed_bfloat16 + fp8 (history 16)" and fp8["fp8"] == {"amax_history_length": 16}
    assert base["baseline"] and base["fp8"] is None
    assert {base["state"], fp8["state"]} == {"succeeded"}, report
    job = client.get(f"/jobs/{fp8['job_id']}").json()
    assert job["spec"]["fp8"] == {"amax_history_length": 16}
    assert job["summary"]["fp8"] == {"amax_history_length": 16, "layers": ["dense", "dense_1"], "kept": []}
    assert any("Keras simulates FP8" in note for note in job["notes"]), job["notes"]
    points = client.get(f"/jobs/{fp8['job_id']}/metrics", params={"limit": 100}).json()["points"]
    assert [p["step"] for p in points] == list(range(1, 25))
    for point in points:
        rows = {(r["layer"], r["tensor"]) for r in point["fp8"]}
        assert rows == {(layer, tensor) for layer in ("dense", "dense_1")
                        for tensor in ("inputs", "kernel", "outputs_grad")}
        checked = point["step"] in (1, 10, 20)
        assert all((r["saturated_fraction"] is not None) == checked for r in point["fp8"]), point["step"]
        assert point["grad_rel_error"] is not None or not checked  # compared with its float32 twin
    assert all(p["fp8"] is None for p in client.get(f"/jobs/{base['job_id']}/metrics").json()["points"])
    # Timed by the baseline in turns, like every variant, and judged in the verdict with that speed.
    (timed,) = client.get(f"/jobs/{base['job_id']}").json()["summary"]["variant_speeds"]
    assert timed["label"] == fp8["label"] and timed["speed"] is not None
    assert fp8["speed"] == timed["speed"]
    assert "mixed_bfloat16 + fp8 (history 16)" in report["verdict"]
    assert speed_call(fp8["speed"]) in report["verdict"] or "FP8 lost values" in report["verdict"]
    # `mpjobs layers` ends with the FP8 table of the latest step, its shares from step 20, the latest checked.
    done = mpjobs(stack, "layers", fp8["job_id"])
    assert done.returncode == 0, done.stderr
    table = done.stdout.split(f"job {fp8['job_id']}: FP8 scaling at step 24; SATURATED and LOST counted at step 20")
    assert len(table) == 2, done.stdout
    rows = {tuple(line.split()[:2]): line.split() for line in table[1].splitlines()[2:8]}
    for row, counted in zip(points[23]["fp8"], points[19]["fp8"], strict=True):
        cells = rows[row["layer"], row["tensor"]]
        assert cells[2:5] == [num(row["scale"]), num(row["amax"]), num(row["range_use"])]
        assert cells[6:8] == [percent(counted["saturated_fraction"]), percent(counted["underflow_fraction"])]

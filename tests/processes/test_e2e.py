"""Must show 1 and 5 of the service: whole jobs over HTTP, against real processes."""

from __future__ import annotations

import io
import json
import zipfile

import httpx
import pytest
import redis
from rq.job import Job as RQJob

from mpjobs.cli import Exit, main
from scripts.stack import iter_sse
from tests.processes.conftest import Stack

FIELDS = {"step", "loss", "loss_scale", "grad_norm", "grads_finite", "skipped", "zero_grad_fraction",
          "regularization_loss", "excess_zero_fraction", "grad_rel_error", "fp8", "learning_rate", "examples_per_sec",
          "step_time_ms", "time"}


def test_mixed_float16_job_end_to_end(stack: Stack, client: httpx.Client) -> None:
    steps = 70
    spec = {"name": "e2e", "model": {"name": "mlp"}, "precision_policy": "mixed_float16", "loss_scale": "dynamic",
            "training": {"steps": steps, "checkpoint_every": 20}, "dataset": {"samples": 512}}
    created = client.post("/jobs", json=spec)
    assert created.status_code == 201, created.text
    job = created.json()
    assert created.headers["location"] == f"/jobs/{job['id']}"
    # The answer is the job as read back after its enqueue: an idle worker may have taken it already.
    assert job["transitions"][0]["state"] == "queued" and job["state"] in {"queued", "running"}
    assert job["spec"]["loss_scale"]["initial_scale"] == 32768.0

    rq_job = RQJob.fetch(job["id"], connection=redis.Redis.from_url(stack.redis.url))
    assert rq_job.timeout == -1, "never RQ's 180 s default"
    done = stack.wait_for_state(client, job["id"], {"succeeded", "failed", "canceled"})
    assert done["state"] == "succeeded", done["error"]
    assert [t["state"] for t in done["transitions"]] == ["queued", "running", "succeeded"]
    assert done["progress"] == {"step": steps, "total_steps": steps}
    assert done["attempt"] == 1 and done["worker"]["device"]["kind"] == "cpu"
    assert done["summary"]["steps_done"] == steps and done["started_at"] and done["finished_at"]

    points, after = [], 0
    while True:
        page = client.get(f"/jobs/{job['id']}/metrics", params={"after": after, "limit": 25}).json()
        points += page["points"]
        if page["next_after"] is None:
            break
        after = page["next_after"]
    assert [p["step"] for p in points] == list(range(1, steps + 1))
    assert all(set(p) == FIELDS for p in points)
    # The float32 check ran on step 1 (and would on every 100th): its values are null on the other steps.
    assert [p["step"] for p in points if p["excess_zero_fraction"] is not None] == [1]
    assert points[0]["excess_zero_fraction"] == 0.0 and 0 < points[0]["grad_rel_error"] < 0.05  # float16 rounding
    assert all(p["regularization_loss"] is None for p in points)  # the mlp has no penalties
    assert points[0]["loss_scale"] == 32768.0

    view = client.get(f"/jobs/{job['id']}/metrics", params={"max_points": 8}).json()
    buckets = view["buckets"]
    assert 1 <= len(buckets) <= 8 and view["total_steps"] == steps
    assert buckets[0]["first_step"] == 1 and buckets[-1]["last_step"] == steps
    assert sum(b["steps"] for b in buckets) == steps
    assert all(b["loss"]["min"] <= b["loss"]["mean"] <= b["loss"]["max"] for b in buckets)

    artifact = client.get(f"/jobs/{job['id']}/artifacts/model.keras")
    assert artifact.status_code == 200
    import keras

    path = stack.artifacts / "downloaded.keras"
    path.write_bytes(artifact.content)
    assert zipfile.is_zipfile(io.BytesIO(artifact.content))
    model = keras.models.load_model(path, compile=False)
    assert model.output_shape == (None, 10)


def test_zero_gradients_over_the_api_and_the_layer_where_they_begin(
        stack: Stack, client: httpx.Client, capsys: pytest.CaptureFixture[str]) -> None:
    # No speed check after training (`speed_check: []`): it would time two more models, and the diagnoses
    # read here come from the steps.
    spec = {"model": {"name": "conv3d_unet", "volume": 8, "filters": 4}, "precision_policy": "mixed_float16",
            "loss_scale": "none", "speed_check": [],
            "training": {"steps": 3, "batch_size": 2, "optimizer": "sgd", "learning_rate": 0.1},
            "dataset": {"samples": 8}}
    job = client.post("/jobs", json=spec).json()
    done = stack.wait_for_state(client, job["id"], {"succeeded", "failed", "canceled"})
    assert done["state"] == "succeeded", done["error"]
    summary = done["summary"]
    codes = {d["code"]: d for d in summary["diagnoses"]}
    assert codes["gradient_underflow"]["first_step"] == 1
    assert summary["peak_zero_grad_fraction"] >= 0.99

    # The layer where it begins: the check of step 1 names it, and so do the summary, its diagnosis,
    # the live stream and the CLI.
    checks = client.get(f"/jobs/{job['id']}/layers").json()["checks"]
    assert checks[0]["step"] == 1 and checks[0]["underflow_layer"] is not None, checks[0]
    layer = checks[0]["underflow_layer"]
    assert (summary["underflow_layer"], summary["underflow_step"]) == (layer, 1)
    assert codes["layer_underflow"]["layer"] == layer and codes["layer_underflow"]["first_step"] == 1
    streamed = []
    for event, _, data, _ in iter_sse(client, f"/jobs/{job['id']}/metrics/stream"):
        if event == "layers":
            streamed.append(json.loads(data))
        if event == "end":
            break
    assert streamed == checks
    assert main(["--url", stack.base_url, "layers", job["id"]]) == Exit.OK
    shown = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in shown if "underflow begins here" in row] == [layer]
    assert any(line.startswith(f"gradient underflow begins at {layer}: ") for line in shown)


def test_openapi_has_an_example_for_every_policy_and_mode(client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/jobs"]["post"]["requestBody"]["content"]["application/json"]
    examples = [e["value"] for e in body["examples"].values()]
    policies = {e.get("precision_policy") for e in examples}
    assert policies == {"float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16"}
    modes = {(e["loss_scale"] if isinstance(e["loss_scale"], str) else e["loss_scale"]["mode"])
             for e in examples if "loss_scale" in e}
    assert modes == {"none", "fixed", "dynamic"}
    assert client.get("/docs").status_code == 200


def test_metrics_limit_is_capped(stack: Stack, client: httpx.Client) -> None:
    job = client.post("/jobs", json={"model": {"name": "mlp"}, "training": {"steps": 3}}).json()
    stack.wait_for_state(client, job["id"], {"succeeded"})
    page = client.get(f"/jobs/{job['id']}/metrics", params={"limit": 10**9})
    assert page.status_code == 200 and len(page.json()["points"]) == 3

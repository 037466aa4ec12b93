"""Evaluations on held-out rows through the real API, worker and Redis: the route, the SSE events, the client,
the CLI, the summary and final.npz; and a bad `validation` refused with a 422 that writes nothing."""

from __future__ import annotations

import json

import httpx
import numpy as np

import mpjobs
from scripts.stack import Stack, iter_sse
from tests.app.store.test_evaluations_store import evaluation
from tests.app.store.test_missing_steps import finish, record
from tests.processes.test_cli import mpjobs as cli
from tests.processes.test_layers_api import running_job

SPEC = {"model": {"name": "mlp", "input_dim": 8, "hidden_units": 16, "classes": 3},
        "dataset": {"samples": 256}, "training": {"steps": 7, "batch_size": 16, "checkpoint_every": 100},
        "validation": {"split": 0.25, "seed": 5, "metrics": ["accuracy", "sparse_categorical_accuracy"],
                       "eval_every": 3}}


def test_a_job_is_evaluated_at_every_interval_and_at_the_end_and_served_everywhere(
        stack: Stack, client: httpx.Client) -> None:
    created = client.post("/jobs", json=SPEC)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    job = stack.wait_for_state(client, job_id, {"succeeded", "failed"})
    assert job["state"] == "succeeded", job
    page = client.get(f"/jobs/{job_id}/evaluations").json()
    records = page["evaluations"]
    assert [r["step"] for r in records] == [3, 6, 7] and page["next_after"] is None
    assert all(r["examples"] == 64 and set(r["metrics"]) == {"accuracy", "sparse_categorical_accuracy"}
               for r in records)
    assert all(r["metrics"]["accuracy"] == r["metrics"]["sparse_categorical_accuracy"] for r in records)
    assert job["summary"]["validation"] == records[-1]
    assert job["summary"]["data"]["rows"] == 192 and job["summary"]["data"]["held_out_rows"] == 64
    final = np.load(stack.artifacts / job_id / "evaluation" / "final.npz")
    assert len(final["rows"]) == len(final["loss"]) == 64 and int(final["step"]) == 7
    assert abs(float(final["loss"].mean(dtype=np.float64)) - records[-1]["loss"]) < 1e-6
    assert float(final["correct"].mean()) == records[-1]["metrics"]["accuracy"]

    events = [(e, json.loads(d)) for e, _, d, _ in iter_sse(client, f"/jobs/{job_id}/metrics/stream") if e != "end"]
    sent = [(e, d["step"]) for e, d in events if e in ("evaluation", "metrics")]
    for step in (3, 6, 7):
        assert sent.index(("evaluation", step)) == sent.index(("metrics", step)) - 1  # just before its step
    with mpjobs.Client(stack.base_url, api_key="") as c:
        assert [r.model_dump(mode="json") for r in c.job(job_id).evaluations()] == records
    shown = cli(stack, "evaluations", job_id)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0].split() == ["step", "loss", "accuracy", "sparse_categorical_accuracy",
                                                    "examples", "seconds"]
    assert [line.split()[0] for line in shown.stdout.splitlines()[1:]] == ["3", "6", "7"]
    assert "validation" in cli(stack, "show", job_id).stdout


def test_evaluations_are_paged_and_a_missing_job_is_a_404(stack: Stack, client: httpx.Client) -> None:
    store, job_id = running_job(stack)
    store.streams.append_steps(job_id, [record(s) for s in range(1, 7)], [])
    store.evaluations.append(job_id, [evaluation(3), evaluation(6)])
    finish(store, job_id, steps_done=6)
    first = client.get(f"/jobs/{job_id}/evaluations", params={"limit": 1}).json()
    assert first == {"job_id": job_id, "evaluations": [evaluation(3).model_dump(mode="json")], "next_after": 3}
    rest = client.get(f"/jobs/{job_id}/evaluations", params={"after": 3}).json()
    assert rest["evaluations"] == [evaluation(6).model_dump(mode="json")] and rest["next_after"] is None
    assert client.get(f"/jobs/{job_id}/evaluations", params={"limit": 0}).status_code == 422
    assert client.get("/jobs/no-such-job/evaluations").status_code == 404


def test_a_bad_validation_is_a_422_naming_the_field_and_nothing_is_written(stack: Stack, client: httpx.Client
                                                                          ) -> None:
    before = [j["id"] for j in client.get("/jobs", params={"limit": 200}).json()["jobs"]]
    unknown = client.post("/jobs", json={**SPEC, "validation": {"split": 0.2, "metrics": ["f1"]}})
    assert unknown.status_code == 422
    assert "validation.metrics" in unknown.text and "'auc'" in unknown.text
    misfit = client.post("/jobs", json={**SPEC, "validation": {"split": 0.2, "metrics": ["mse"]}})
    assert misfit.status_code == 422 and "cannot measure a model trained with loss" in misfit.text
    alone = client.post("/jobs", json={**SPEC, "validation": None, "metrics": ["accuracy"]})
    assert alone.status_code == 422 and "metrics" in alone.text
    assert [j["id"] for j in client.get("/jobs", params={"limit": 200}).json()["jobs"]] == before

"""Issue 32, item 3 from outside: a job's precision plan through `GET /jobs/{id}/plan`, the client and the CLI,
against the real stack; and a job without one says why."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

import mpjobs
from scripts.stack import Stack, wait_until
from tests.processes.test_cli import mpjobs as cli
from tests.worker.numerics.test_plan import CASES, build


def ended(client: httpx.Client, job_id: str) -> dict[str, Any]:
    return wait_until(lambda: (j := client.get(f"/jobs/{job_id}").json())["state"] in ("succeeded", "failed")
                      and j, 180, f"job {job_id} to end")


def test_an_overflowing_model_gets_its_plan_and_a_clean_or_float32_job_says_why_it_has_none(
        stack: Stack, client: httpx.Client) -> None:
    model = {"keras_json": build(CASES["overflow"], "sequential").to_json(),
             "loss": "sparse_categorical_crossentropy"}
    created = client.post("/jobs", json={"model": model, "precision_policy": "mixed_float16", "loss_scale": "dynamic",
                                         "training": {"steps": 2, "batch_size": 16}, "dataset": {"samples": 64}})
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    job = ended(client, job_id)
    assert job["summary"]["overflow_layer"] == "loud", job["summary"]

    view = client.get(f"/jobs/{job_id}/plan")
    assert view.status_code == 200, view.text
    plan = view.json()
    assert plan["plan"]["holds"] and plan["plan"]["layer_policies"] == {"loud": "float32", "quiet": "float32"}
    assert plan["spec_fragment"] == {"layer_policies": {"loud": "float32", "quiet": "float32"}}
    assert 'for name in ["loud", "quiet"]:' in plan["keras"]
    layers = client.get(f"/jobs/{job_id}/layers").json()["checks"]
    assert [c["plan"] is not None for c in layers][:1] == [True]  # the first flagged check carries it

    with mpjobs.Client(stack.base_url, api_key="") as c:
        assert c.job(job_id).plan().plan.layer_policies == {"loud": "float32", "quiet": "float32"}
    shown = cli(stack, "plan", job_id)
    assert shown.returncode == 0, shown.stderr
    assert "keeping `loud`, `quiet` in float32" in shown.stdout and '{"layer_policies": {"loud": "float32"' in \
        shown.stdout and "0. the step as it was: flagged" in shown.stdout

    float32 = client.post("/jobs", json={"model": {"name": "mlp", "input_dim": 8, "hidden_units": 8},
                                         "training": {"steps": 1}}).json()["id"]
    ended(client, float32)
    missing = client.get(f"/jobs/{float32}/plan")
    assert missing.status_code == 404 and "it computes in float32" in missing.json()["detail"]
    healthy = client.post("/jobs", json={"model": {"name": "mlp", "input_dim": 8, "hidden_units": 8},
                                         "precision_policy": "mixed_bfloat16", "training": {"steps": 1}}).json()["id"]
    ended(client, healthy)
    none = client.get(f"/jobs/{healthy}/plan")
    assert none.status_code == 404 and "nothing needs pinning" in none.json()["detail"], none.text
    assert np.isfinite(plan["plan"]["moves"][-1]["grad_rel_error"])

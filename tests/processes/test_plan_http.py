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


def test_a_comparison_with_plan_auto_ends_with_the_plan_variant_and_a_verdict_about_it(
        stack: Stack, client: httpx.Client) -> None:
    """Issue 32, item 4: float32, mixed_float16 + dynamic, and that variant with its plan, on the real stack."""
    model = {"keras_json": build(CASES["overflow"], "sequential").to_json(),
             "loss": "sparse_categorical_crossentropy"}
    spec = {"model": model, "training": {"steps": 4, "batch_size": 16}, "dataset": {"samples": 64}}
    created = client.post("/comparisons", json={"name": "plan auto", "spec": spec, "plan": "auto", "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_float16", "loss_scale": "dynamic"}]})
    assert created.status_code == 201, created.text
    comparison_id = created.json()["id"]
    assert [v["label"] for v in created.json()["variants"]] == [
        "float32", "mixed_float16 + dynamic", "mixed_float16 + dynamic + plan"]
    report = wait_until(lambda: (c := client.get(f"/comparisons/{comparison_id}").json())["state"] == "done" and c,
                        300, "the comparison to finish")
    base, policy, planned = report["variants"]
    assert [v["state"] for v in report["variants"]] == ["succeeded"] * 3, report["verdict"]
    job = client.get(f"/jobs/{planned['job_id']}").json()
    assert job["spec"]["plan"] == "auto" and job["summary"]["plan"]["layer_policies"] == {"loud": "float32",
                                                                                       "quiet": "float32"}
    assert client.get(f"/jobs/{policy['job_id']}").json()["summary"]["overflow_layer"] == "loud"
    assert job["summary"]["overflow_layer"] is None and planned["underflow_layer"] is None
    assert planned["speed"] is not None  # its own measurement against float32, pins included
    sentence = report["verdict"].split("mixed_float16 + dynamic + plan (")[-1]
    assert sentence.startswith("`loud`, `quiet` in float32; found at step 1): it removed the overflow at `loud`; "), \
        report["verdict"]
    assert "it matched float32 within" in sentence or "from float32's loss" in sentence
    shown = cli(stack, "compare", "--show", comparison_id)
    assert shown.returncode in (0, 1), shown.stderr
    assert "mixed_float16 + dynamic + plan" in shown.stdout

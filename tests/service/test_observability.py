"""Must show 4 and 5: TensorBoard event files and Prometheus metrics, from real jobs."""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.stack import Stack, wait_until

TAGS = {"loss", "loss_scale", "grad_norm", "zero_grad_fraction", "examples_per_sec", "skipped"}
CHECKED = {"excess_zero_fraction", "grad_rel_error"}
"""Written on the float32 check's steps only: step 1 here."""


def test_finished_job_has_one_tensorboard_scalar_per_step(stack: Stack, client: httpx.Client) -> None:
    steps = 40
    spec = {"model": {"name": "mlp", "input_dim": 32}, "precision_policy": "mixed_float16",
            "training": {"steps": steps}, "dataset": {"samples": 256}}
    job = client.post("/jobs", json=spec).json()
    assert stack.wait_for_state(client, job["id"], {"succeeded", "failed"})["state"] == "succeeded"

    events = EventAccumulator(str(stack.artifacts / job["id"] / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == TAGS | CHECKED
    assert [e.step for e in events.Scalars("excess_zero_fraction")] == [1]
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, steps + 1))
    points = client.get(f"/jobs/{job['id']}/metrics").json()["points"]
    assert [e.value for e in loss] == [math.nan if p["loss"] is None else _f32(p["loss"]) for p in points]
    assert [e.value for e in events.Scalars("loss_scale")] == [_f32(p["loss_scale"]) for p in points]
    assert events.Scalars("loss_scale")[0].value == 32768.0
    # The Text tab names the run: job ids alone cannot tell a comparison's variants apart.
    (note,) = events.Tensors("run")
    assert note.step == 0 and job["id"].encode() in note.tensor_proto.string_val[0]
    assert b"mixed_float16, loss scale dynamic" in note.tensor_proto.string_val[0]


def _f32(value: float) -> float:
    """TensorBoard keeps scalars as float32."""
    import numpy as np

    return float(np.float32(value))


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_prometheus_counters_move_as_jobs_run(stack: Stack, client: httpx.Client) -> None:
    before = scrape(client)
    assert before[("mpjobs_workers", (("device", "cpu"),))] >= 1
    for queue in ("gpu", "cpu", "any"):
        assert ("mpjobs_queue_depth", (("queue", queue),)) in before

    steps = 3
    spec = {"model": {"name": "conv3d_unet"}, "precision_policy": "mixed_float16", "loss_scale": "none",
            "training": {"steps": steps, "batch_size": 2, "optimizer": "sgd", "learning_rate": 0.1},
            "dataset": {"samples": 8}}
    job = client.post("/jobs", json=spec).json()
    assert stack.wait_for_state(client, job["id"], {"succeeded", "failed"})["state"] == "succeeded"
    overflow = {**spec, "model": {"name": "mlp", "input_dim": 16}, "loss_scale": {"mode": "fixed", "scale": 2**40},
                "training": {"steps": 4}, "dataset": {"samples": 64}}
    skipper = client.post("/jobs", json=overflow).json()
    done = stack.wait_for_state(client, skipper["id"], {"succeeded", "failed"})
    assert done["summary"]["skipped_steps"] == 4

    waiting = client.post("/jobs", json={**spec, "device": "gpu"}).json()  # no GPU worker here: it waits
    try:
        assert scrape(client)[("mpjobs_queue_depth", (("queue", "gpu"),))] \
            == before[("mpjobs_queue_depth", (("queue", "gpu"),))] + 1
    finally:
        client.delete(f"/jobs/{waiting['id']}")
    after = scrape(client)
    assert after[("mpjobs_queue_depth", (("queue", "gpu"),))] == before[("mpjobs_queue_depth", (("queue", "gpu"),))]
    assert after[("mpjobs_steps_total", ())] - before[("mpjobs_steps_total", ())] >= steps + 4
    assert after[("mpjobs_skipped_steps_total", ())] - before[("mpjobs_skipped_steps_total", ())] >= 4
    underflow = ("mpjobs_diagnoses_total", (("code", "gradient_underflow"),))
    assert after[underflow] - before[underflow] >= 1
    assert after[("mpjobs_gradient_underflow_jobs_total", ())] == after[underflow]
    succeeded = ("mpjobs_jobs", (("state", "succeeded"),))
    assert after[succeeded] - before[succeeded] >= 2


def test_running_job_reports_its_examples_per_second(stack: Stack, client: httpx.Client) -> None:
    spec = {"model": {"name": "mlp", "input_dim": 32}, "training": {"steps": 200_000}, "dataset": {"samples": 256}}
    job = client.post("/jobs", json=spec).json()
    try:
        key = ("mpjobs_running_examples_per_second", (("job_id", job["id"]), ("precision_policy", "float32")))
        speed = wait_until(lambda: scrape(client).get(key), 60, "a running job's examples/s")
        assert speed > 0
        assert scrape(client)[("mpjobs_jobs", (("state", "running"),))] >= 1
    finally:
        client.delete(f"/jobs/{job['id']}")
        stack.wait_for_state(client, job["id"], {"canceled"})

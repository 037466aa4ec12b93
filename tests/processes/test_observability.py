"""Must show 4 and 5: TensorBoard event files and Prometheus metrics, from real jobs."""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis
from rq.job import Job as RQJob
from rq.job import JobStatus
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from scripts.stack import Stack, wait_until

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
    tags = set(events.Tags()["scalars"])
    assert {t for t in tags if not t.startswith("layers/")} == TAGS | CHECKED
    assert [e.step for e in events.Scalars("excess_zero_fraction")] == [1]
    # The layer check rides on the same step: one scalar per layer and field, from the API's check.
    (check,) = client.get(f"/jobs/{job['id']}/layers").json()["checks"]
    expected = {f"layers/{layer['name']}/{field}": value for layer in check["layers"] for field, value in layer.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)}
    assert {t for t in tags if t.startswith("layers/")} == set(expected)
    for tag, value in expected.items():
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(1, _f32(value))], tag
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


Sample = tuple[str, tuple[tuple[str, str], ...]]


def scrape(client: httpx.Client) -> dict[Sample, float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def delta(before: dict[Sample, float], after: dict[Sample, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def wait_until_idle(client: httpx.Client) -> None:
    """No job runs and none waits for this stack's cpu worker (a gpu job waits forever here and
    writes nothing), so the counters move for this test's jobs alone."""
    def idle() -> bool:
        now = scrape(client)
        return (now[("mpjobs_jobs", (("state", "running"),))] == 0
                and now[("mpjobs_jobs", (("state", "queued"),))] == now[("mpjobs_queue_depth", (("queue", "gpu"),))])

    wait_until(idle, 600, "the jobs of earlier tests to end", interval=0.25)


def wait_until_the_task_returned(stack: Stack, job_id: str) -> None:
    """RQ marks its job finished after the task returns: after its last write to the counters."""
    connection = Redis.from_url(stack.redis.url)
    wait_until(lambda: RQJob.fetch(job_id, connection=connection).get_status() == JobStatus.FINISHED, 60,
               f"RQ to finish job {job_id}")


def test_prometheus_counters_move_as_jobs_run(stack: Stack, client: httpx.Client) -> None:
    wait_until_idle(client)
    before = scrape(client)
    assert before[("mpjobs_workers", (("device", "cpu"),))] >= 1
    for queue in ("gpu", "cpu", "any"):
        assert ("mpjobs_queue_depth", (("queue", queue),)) in before

    steps = 3
    # The zero-gradient net at its smallest: its gradients (1/384³ per voxel) underflow all the same. No
    # speed check after training (`speed_check: []`): it times two more models and moves no counter here.
    spec = {"model": {"name": "conv3d_unet", "volume": 4, "filters": 2}, "precision_policy": "mixed_float16",
            "loss_scale": "none", "speed_check": [],
            "training": {"steps": steps, "batch_size": 2, "optimizer": "sgd", "learning_rate": 0.1},
            "dataset": {"samples": 8}}
    job = client.post("/jobs", json=spec).json()
    assert stack.wait_for_state(client, job["id"], {"succeeded", "failed"})["state"] == "succeeded"
    overflow = {**spec, "model": {"name": "mlp", "input_dim": 16}, "loss_scale": {"mode": "fixed", "scale": 2**40},
                "training": {"steps": 4}, "dataset": {"samples": 64}}
    skipper = client.post("/jobs", json=overflow).json()
    done = stack.wait_for_state(client, skipper["id"], {"succeeded", "failed"})
    assert done["state"] == "succeeded" and done["summary"]["skipped_steps"] == 4

    waiting = client.post("/jobs", json={**spec, "device": "gpu"}).json()  # no GPU worker here: it waits
    try:
        assert scrape(client)[("mpjobs_queue_depth", (("queue", "gpu"),))] \
            == before[("mpjobs_queue_depth", (("queue", "gpu"),))] + 1
    finally:
        client.delete(f"/jobs/{waiting['id']}")
    for ran in (job, skipper):
        wait_until_the_task_returned(stack, ran["id"])
    summaries = [client.get(f"/jobs/{ran['id']}").json()["summary"] for ran in (job, skipper)]
    assert [s["steps_done"] for s in summaries] == [steps, 4]
    assert [s["skipped_steps"] for s in summaries] == [0, 4]
    codes = [{d["code"] for d in s["diagnoses"]} for s in summaries]
    assert "gradient_underflow" in codes[0], codes
    after = scrape(client)
    assert after[("mpjobs_queue_depth", (("queue", "gpu"),))] == before[("mpjobs_queue_depth", (("queue", "gpu"),))]
    # Exact: a step counted twice, or a diagnosis counted on each summary write, shows here.
    assert delta(before, after, "mpjobs_steps_total") == steps + 4
    assert delta(before, after, "mpjobs_skipped_steps_total") == 4
    counted = {labels[0][1]: delta(before, after, name, code=labels[0][1])
               for name, labels in after if name == "mpjobs_diagnoses_total"}
    assert counted == {code: sum(code in job_codes for job_codes in codes) for code in counted}
    assert set().union(*codes) <= set(counted)
    assert delta(before, after, "mpjobs_gradient_underflow_jobs_total") == counted["gradient_underflow"]
    assert delta(before, after, "mpjobs_jobs", state="succeeded") == 2
    assert delta(before, after, "mpjobs_jobs", state="canceled") == 1


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

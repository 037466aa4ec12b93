"""The API contract against real processes: SSE, cancel, bad input, 404 and 503."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

import httpx
import pytest
import redis
from rq.job import Job as RQJob

from tests.stack import ROOT, Stack, free_port, iter_sse, wait_until

SLOW_MLP = {"model": {"name": "mlp"}, "precision_policy": "mixed_float16", "dataset": {"samples": 512}}


def submit(client: httpx.Client, steps: int, **extra: Any) -> str:
    spec = {**SLOW_MLP, "training": {"steps": steps}, **extra}
    response = client.post("/jobs", json=spec)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def read_events(client: httpx.Client, job_id: str, headers: dict[str, str], stop_after_metrics: int | None
                ) -> list[tuple[str, str | None, str]]:
    """(event, id, data) tuples, until `end` or `stop_after_metrics` metrics events."""
    events: list[tuple[str, str | None, str]] = []
    for event, event_id, data, _ in iter_sse(client, f"/jobs/{job_id}/metrics/stream", headers):
        events.append((event, event_id, data))
        metrics_seen = sum(1 for e in events if e[0] == "metrics")
        if event == "end" or (stop_after_metrics and metrics_seen >= stop_after_metrics):
            break
    return events


def test_sse_resumes_with_last_event_id_without_gap_or_duplicate(stack: Stack, client: httpx.Client) -> None:
    steps = 60
    job_id = submit(client, steps)
    first = read_events(client, job_id, {}, stop_after_metrics=12)
    last_id = [e for e in first if e[0] == "metrics"][-1][1]
    assert last_id is not None
    assert client.get(f"/jobs/{job_id}").json()["state"] != "succeeded", "reconnect must happen mid-run"
    second = read_events(client, job_id, {"Last-Event-ID": last_id}, stop_after_metrics=None)
    assert second[-1][0] == "end" and json.loads(second[-1][2])["state"] == "succeeded"
    steps_seen = [int(e[1]) for e in first + second if e[0] == "metrics" and e[1] is not None]
    assert steps_seen == list(range(1, steps + 1))
    data_steps = [json.loads(e[2])["step"] for e in first + second if e[0] == "metrics"]
    assert data_steps == steps_seen
    states = [json.loads(e[2])["state"] for e in second if e[0] == "state"]
    assert states[-1] == "succeeded"


def test_cancel_running_job_stops_within_five_seconds(stack: Stack, client: httpx.Client) -> None:
    job_id = submit(client, 5000)
    wait_until(lambda: client.get(f"/jobs/{job_id}").json()["progress"]["step"] >= 3, 60, "the job to run")
    asked = time.monotonic()
    response = client.delete(f"/jobs/{job_id}")
    assert response.status_code == 202
    done = stack.wait_for_state(client, job_id, {"canceled", "failed", "succeeded"}, timeout=10)
    assert time.monotonic() - asked <= 5.0
    assert done["state"] == "canceled" and done["error"]["reason"] == "canceled"
    assert done["attempt"] == 1
    assert [t["state"] for t in done["transitions"]] == ["queued", "running", "canceled"]
    time.sleep(1.0)
    assert client.get(f"/jobs/{job_id}").json()["attempt"] == 1, "a canceled job is never retried"
    # The worker is free for the next job.
    next_id = submit(client, 5, precision_policy="float32")
    assert stack.wait_for_state(client, next_id, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    # Canceling a terminal job changes nothing.
    again = client.delete(f"/jobs/{job_id}")
    assert again.status_code == 202 and again.json()["state"] == "canceled"


def test_cancel_queued_job_is_immediate(stack: Stack, client: httpx.Client) -> None:
    blocker = submit(client, 5000)
    queued = submit(client, 50)
    response = client.delete(f"/jobs/{queued}")
    assert response.json()["state"] == "canceled"
    assert response.json()["error"]["reason"] == "canceled"
    client.delete(f"/jobs/{blocker}")
    stack.wait_for_state(client, blocker, {"canceled"}, timeout=60)
    time.sleep(0.5)
    assert client.get(f"/jobs/{queued}").json()["started_at"] is None


BAD_SPECS = [
    ({"model": {"name": "mlp"}, "precision_policy": "fp8"}, ["body", "precision_policy"]),
    ({"model": {"name": "mlp"}, "loss_scale": "sometimes"}, ["body", "loss_scale"]),
    ({"model": {"name": "mlp"}, "training": {"learning_rate": -1}}, ["body", "training", "learning_rate"]),
    ({"model": {"name": "resnet"}}, ["body", "model"]),
    ({"model": {"name": "mlp"}, "dataset": {"kind": "npz", "path": "../../etc/passwd"}},
     ["body", "dataset", "npz", "path"]),
]


@pytest.mark.parametrize(("spec", "loc"), BAD_SPECS)
def test_bad_spec_is_422_naming_the_field_and_queues_nothing(
    stack: Stack, client: httpx.Client, spec: dict[str, Any], loc: list[str]
) -> None:
    before = stack.writes()
    response = client.post("/jobs", json=spec)
    assert response.status_code == 422
    assert [e["loc"] for e in response.json()["detail"]] == [loc]
    assert stack.writes() == before


def test_the_write_check_sees_an_accepted_job(stack: Stack, client: httpx.Client) -> None:
    before = stack.writes()
    assert client.post("/jobs", json={"model": {"name": "mlp"}, "training": {"steps": 1}}).status_code == 201
    assert stack.writes() != before


def test_malformed_json_is_422(client: httpx.Client) -> None:
    response = client.post("/jobs", content=b'{"model": ', headers={"content-type": "application/json"})
    assert response.status_code == 422


@pytest.mark.parametrize("path", ["", "/metrics", "/metrics/stream", "/artifacts/model.keras"])
def test_unknown_job_is_404(client: httpx.Client, path: str) -> None:
    response = client.get(f"/jobs/nosuchjob{path}")
    assert response.status_code == 404
    assert "nosuchjob" in response.json()["detail"]
    assert client.delete("/jobs/nosuchjob").status_code == 404


def test_list_is_newest_first_and_paged(stack: Stack, client: httpx.Client) -> None:
    ids = [submit(client, 1, precision_policy="float32", name=f"page-{i}") for i in range(3)]
    page = client.get("/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in page["jobs"]] == ids[::-1][:2]
    rest = client.get("/jobs", params={"limit": 2, "cursor": page["next_cursor"]}).json()
    assert rest["jobs"][0]["id"] == ids[0]
    for job_id in ids:
        stack.wait_for_state(client, job_id, {"succeeded"}, timeout=60)
    succeeded = client.get("/jobs", params={"state": "succeeded", "limit": 200}).json()["jobs"]
    assert set(ids) <= {j["id"] for j in succeeded}
    assert client.get("/jobs", params={"state": "exploded"}).status_code == 422


def test_redis_down_is_503_with_a_clear_message(stack: Stack) -> None:
    port, dead = free_port(), free_port()
    env = {**stack.env, "REDIS_URL": f"redis://127.0.0.1:{dead}/0"}
    api = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port)], cwd=ROOT,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, 30, "the second API")
        for method, path, body in [("GET", "/jobs/abc", None), ("GET", "/jobs", None),
                                   ("POST", "/jobs", {"model": {"name": "mlp"}}), ("GET", "/readyz", None)]:
            response = httpx.request(method, base + path, json=body, timeout=10)
            assert response.status_code == 503, (path, response.text)
            assert "Redis is unreachable" in response.json()["detail"]
    finally:
        api.terminate()
        api.wait(10)


def test_worker_runs_jobs_in_process_and_starts_warm(stack: Stack, client: httpx.Client) -> None:
    """TrainingWorker is a SimpleWorker: no fork per job, so TensorFlow loads once per worker."""
    worker_pids = {w.pid for w in stack.workers}
    raw = redis.Redis.from_url(stack.redis.url)
    for _ in range(2):
        job_id = submit(client, 3, precision_policy="float32")
        done = stack.wait_for_state(client, job_id, {"succeeded", "failed"}, timeout=60)
        assert done["state"] == "succeeded"
        assert done["worker"]["pid"] in worker_pids
        dequeued = RQJob.fetch(job_id, connection=raw).started_at
        assert dequeued is not None
        first = client.get(f"/jobs/{job_id}/metrics", params={"limit": 1}).json()["points"][0]
        first_step_began = first["time"] - first["step_time_ms"] / 1000
        startup = first_step_began - dequeued.timestamp()
        assert startup <= 2.0, f"{startup:.2f} s from dequeue to step 1"
        assert isinstance(datetime.fromisoformat(done["started_at"].replace("Z", "+00:00")), datetime)


def test_a_job_no_worker_can_take_says_why(stack: Stack, client: httpx.Client) -> None:
    # A GPU worker that was SIGKILLed: still in RQ's per-queue set, its own key long expired.
    r = stack.redis.client()
    r.sadd("rq:workers:gpu", "rq:worker:killed-gpu-worker")
    r.sadd("rq:workers", "rq:worker:killed-gpu-worker")
    job_id = submit(client, 5, device="gpu")
    time.sleep(1.1)  # past the API's one-second reuse of a queue's worker count
    job = client.get(f"/jobs/{job_id}").json()
    assert job["state"] == "queued"
    assert "queue 'gpu'" in job["waiting_reason"] and "GPU worker" in job["waiting_reason"]
    assert not r.sismember("rq:workers:gpu", "rq:worker:killed-gpu-worker")
    assert client.delete(f"/jobs/{job_id}").json()["state"] == "canceled"


def test_an_ended_jobs_bucket_view_is_cached_and_identical(stack: Stack, client: httpx.Client) -> None:
    job = client.post("/jobs", json={"model": {"name": "mlp"}, "training": {"steps": 30}}).json()
    stack.wait_for_state(client, job["id"], {"succeeded"})
    first = client.get(f"/jobs/{job['id']}/metrics", params={"max_points": 500})
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    key = f"mpjobs:job:{job['id']}:view:500"
    r = stack.redis.client()
    assert r.get(key) == first.text and 23 * 3600 < r.ttl(key) <= 24 * 3600
    view = first.json()
    assert view["total_steps"] == 30 and sum(b["steps"] for b in view["buckets"]) == 30
    r.set(key, json.dumps({**view, "total_steps": 999}), keepttl=True)  # a marker: is the cache what is served?
    assert client.get(f"/jobs/{job['id']}/metrics", params={"max_points": 500}).json()["total_steps"] == 999
    # Other sizes are computed each time: no client can fill Redis with a key per size.
    assert client.get(f"/jobs/{job['id']}/metrics", params={"max_points": 7}).json()["total_steps"] == 30
    assert not r.exists(f"mpjobs:job:{job['id']}:view:7")


def test_a_running_jobs_bucket_view_is_at_most_a_second_old(stack: Stack, client: httpx.Client) -> None:
    job = client.post("/jobs", json={"model": {"name": "mlp"}, "training": {"steps": 100_000}}).json()
    try:
        stack.wait_for_state(client, job["id"], {"running"})
        wait_until(lambda: client.get(f"/jobs/{job['id']}").json()["progress"]["step"] > 0, 30, "a first step")
        first = client.get(f"/jobs/{job['id']}/metrics", params={"max_points": 1000}).json()
        ttl_ms = stack.redis.client().pttl(f"mpjobs:job:{job['id']}:view:1000:fresh")
        assert 0 < ttl_ms <= 1000
        later = wait_until(lambda: (lambda v: v if v["total_steps"] > first["total_steps"] else None)(
            client.get(f"/jobs/{job['id']}/metrics", params={"max_points": 1000}).json()), 5, "a newer view")
        assert later["total_steps"] > first["total_steps"]
        # While another caller recomputes a stale view (it holds the refresh claim), the rest are
        # served the stale one rather than all recomputing at once.
        r, key = stack.redis.client(), f"mpjobs:job:{job['id']}:view:1000"
        r.set(key, json.dumps({**later, "total_steps": -1}))
        r.set(f"{key}:fresh", 1, px=3000)
        assert client.get(f"/jobs/{job['id']}/metrics", params={"max_points": 1000}).json()["total_steps"] == -1
        r.delete(f"{key}:fresh")
        assert client.get(f"/jobs/{job['id']}/metrics", params={"max_points": 1000}).json()["total_steps"] > 0
    finally:
        client.delete(f"/jobs/{job['id']}")
        stack.wait_for_state(client, job["id"], {"canceled"})

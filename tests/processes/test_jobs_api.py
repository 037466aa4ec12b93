"""The API contract against real processes: SSE, cancel, bad input, 404 and 503."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rq import Queue
from rq.job import Job as RQJob
from rq.job import JobStatus

from app.store.keys import RUNNING, lease_key
from app.store.queue import QUEUES
from scripts.stack import ROOT, Stack, free_port, freeze_mid_run, iter_sse, private_stack, wait_until

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
    # The worker is frozen past step 12, so the reconnect happens mid-run on any machine.
    job_id, pid, spec = freeze_mid_run(stack, client, {**SLOW_MLP, "training": {"steps": 60}, "speed_check": []},
                                        past_step=12)  # no speed check: the stream ends after the last step
    steps = spec["training"]["steps"]
    try:
        first = read_events(client, job_id, {}, stop_after_metrics=12)
        last_id = [e for e in first if e[0] == "metrics"][-1][1]
        assert last_id is not None
        second: list[tuple[str, str | None, str]] = []
        for event, event_id, data, _ in iter_sse(client, f"/jobs/{job_id}/metrics/stream",
                                                 {"Last-Event-ID": last_id}):
            if not second:
                assert client.get(f"/jobs/{job_id}").json()["state"] == "running"
                os.killpg(pid, signal.SIGCONT)  # reconnected while it runs: the rest arrives live
            second.append((event, event_id, data))
            if event == "end":
                break
    finally:
        os.killpg(pid, signal.SIGCONT)
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
    # The worker is free for the next job.
    next_id = submit(client, 5, precision_policy="float32")
    assert stack.wait_for_state(client, next_id, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    # Canceling a job that has ended is a 409 with its state, and changes nothing.
    again = client.delete(f"/jobs/{job_id}")
    assert again.status_code == 409 and again.json()["state"] == "canceled"
    assert again.json()["detail"] == (f"Job {job_id!r} has already ended (canceled): there is nothing to cancel. "
                                      f"To delete it for good: DELETE /jobs/{job_id}?purge=true.")
    assert client.get(f"/jobs/{job_id}").json()["transitions"] == done["transitions"]


SHORT_LEASE_S, SHORT_REAP_INTERVAL_S = 2.0, 0.5


@pytest.fixture(scope="module")
def short_lease_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One worker whose reaper would requeue a job within a few seconds of its lease running out."""
    with private_stack(tmp_path_factory.mktemp("short-lease"), LEASE_S=str(SHORT_LEASE_S),
                       REAP_INTERVAL_S=str(SHORT_REAP_INTERVAL_S)) as s:
        yield s


def waiting_rq_jobs(raw: redis.Redis, job_id: str) -> list[str]:
    """RQ jobs for `job_id` waiting in any queue: its first attempt's (`{id}`) or a retry's (`{id}-a{n}`)."""
    return [rq_id for name in QUEUES for rq_id in Queue(name, connection=raw).get_job_ids()
            if rq_id == job_id or rq_id.startswith(f"{job_id}-a")]


def test_a_canceled_running_job_is_never_retried(short_lease_stack: Stack) -> None:
    stack, r = short_lease_stack, short_lease_stack.redis.client()
    raw = redis.Redis.from_url(stack.redis.url)
    with stack.client() as client:
        job_id = submit(client, 10_000_000)
        wait_until(lambda: client.get(f"/jobs/{job_id}").json()["progress"]["step"] >= 1, 60, "the job to run")
        assert client.delete(f"/jobs/{job_id}").status_code == 202
        assert stack.wait_for_state(client, job_id, {"canceled", "failed", "succeeded"}, timeout=30)["state"] == \
            "canceled"
        # RQ records the attempt's end after the attempt dropped its lease.
        wait_until(lambda: RQJob.fetch(job_id, connection=raw).get_status() == JobStatus.FINISHED, 30,
                   "the attempt to end")
        assert not r.exists(lease_key(job_id)), "the canceled attempt left its lease behind"
        # Long enough for any lease to run out and the live worker's reaper to look twice since.
        time.sleep(SHORT_LEASE_S + 2 * SHORT_REAP_INTERVAL_S)
        job = client.get(f"/jobs/{job_id}").json()
        assert [t["state"] for t in job["transitions"]] == ["queued", "running", "canceled"]
        assert job["state"] == "canceled" and job["attempt"] == 1
        assert not r.sismember(RUNNING, job_id) and not r.exists(lease_key(job_id))
        assert waiting_rq_jobs(raw, job_id) == []
        assert not RQJob.exists(f"{job_id}-a2", connection=raw), "a retry was enqueued"
        assert all(w.poll() is None for w in stack.workers), "the worker that would take a retry is alive"


def test_cancel_queued_job_is_immediate(stack: Stack, client: httpx.Client) -> None:
    raw = redis.Redis.from_url(stack.redis.url)
    blocker = submit(client, 5000)
    stack.wait_for_state(client, blocker, {"running"})  # the worker is busy: the next job waits in its queue
    queued = submit(client, 50)
    rq_queue = Queue(client.get(f"/jobs/{queued}").json()["queue"], connection=raw)
    assert queued in rq_queue.get_job_ids()
    response = client.delete(f"/jobs/{queued}")
    assert response.json()["state"] == "canceled"
    assert response.json()["error"]["reason"] == "canceled"
    assert queued not in rq_queue.get_job_ids(), "the canceled job's RQ job is still in its queue"
    client.delete(f"/jobs/{blocker}")
    stack.wait_for_state(client, blocker, {"canceled"}, timeout=60)
    # A job queued after it has run to its end: the worker is past where it stood, and never took it.
    later = submit(client, 1, precision_policy="float32")
    assert stack.wait_for_state(client, later, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    assert client.get(f"/jobs/{queued}").json()["started_at"] is None
    assert RQJob.fetch(queued, connection=raw).started_at is None


BAD_SPECS = [
    ({"model": {"name": "mlp"}, "precision_policy": "fp8"}, ["body", "precision_policy"]),
    ({"model": {"name": "mlp"}, "loss_scale": "sometimes"}, ["body", "loss_scale"]),
    ({"model": {"name": "mlp"}, "training": {"learning_rate": -1}}, ["body", "training", "learning_rate"]),
    ({"model": {"name": "mlp"}, "training": {"devices": 64}}, ["body", "training", "devices"]),
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


@pytest.mark.parametrize("path", ["", "/metrics", "/metrics/stream", "/layers", "/artifacts/model.keras"])
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
    held = socket.socket()  # bound, never listening: a connection to it is refused, and no one else can bind it
    held.bind(("127.0.0.1", 0))
    port, dead = free_port(), held.getsockname()[1]
    env = {**stack.env, "REDIS_URL": f"redis://127.0.0.1:{dead}/0"}
    api = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port)], cwd=ROOT,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, 30, "the second API")
        # A well-formed id: a malformed one is a 404 before Redis is asked.
        for method, path, body in [("GET", f"/jobs/{'0' * 32}", None), ("GET", "/jobs", None),
                                   ("POST", "/jobs", {"model": {"name": "mlp"}}), ("GET", "/readyz", None)]:
            response = httpx.request(method, base + path, json=body, timeout=10)
            assert response.status_code == 503, (path, response.text)
            assert "Redis is unreachable" in response.json()["detail"]
    finally:
        api.terminate()
        api.wait(10)
        held.close()


def backend_libraries(pid: int) -> set[str]:
    """The ML backend's native libraries (TensorFlow's or JAX's) mapped into process `pid`."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps
            if ".so" in line and ("/tensorflow/" in line or "/jaxlib/" in line)}


def test_worker_runs_jobs_in_process_and_starts_warm(stack: Stack, client: httpx.Client) -> None:
    """TrainingWorker is a SimpleWorker: each job runs in the worker's own process, no fork per
    job, so the backend is imported once per worker, and before its first job."""
    (worker,) = [w for w in stack.workers if w.poll() is None]
    pids = []
    for _ in range(2):
        job_id = submit(client, 3, precision_policy="float32")
        done = stack.wait_for_state(client, job_id, {"succeeded", "failed"}, timeout=60)
        assert done["state"] == "succeeded"
        assert isinstance(datetime.fromisoformat(done["started_at"].replace("Z", "+00:00")), datetime)
        pids.append(done["worker"]["pid"])
    assert pids == [worker.pid, worker.pid], "both jobs ran in the worker process itself"
    # A worker that has just registered, with no job to take, holds the backend already.
    assert stack.writes()[2:] == (0, 0, 0), "queues empty: the new worker can take no job"
    fresh = stack.start_worker()
    try:
        assert backend_libraries(fresh.pid), "the worker registered before importing its backend"
    finally:
        fresh.terminate()
        fresh.wait(30)
        stack.workers.remove(fresh)


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


def test_a_job_on_more_devices_than_any_worker_has_says_why(stack: Stack, client: httpx.Client) -> None:
    # The stack's worker has one CPU device: it listens on `cpu` and `any`, never on `any-x2`.
    job_id = submit(client, 5, training={"steps": 5, "devices": 2})
    # The API reuses a queue's worker count for a second: await the reason rather than assume when it shows.
    job = wait_until(lambda: (j := client.get(f"/jobs/{job_id}").json())["waiting_reason"] and j, 10,
                     "the job's waiting reason")
    assert job["state"] == "queued" and job["queue"] == "any-x2"
    assert job["waiting_reason"].startswith("No live worker has 2 devices for this job (training.devices=2")
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
        assert ttl_ms == -2 or 0 < ttl_ms <= 1000, "never without an expiry (-1), never past a second"  # -2: expired
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

"""`DELETE ...?purge=true` against real processes: a trained job leaves no trace in Redis or on disk;
another tenant, a job that has not ended, and a comparison's job are refused and left whole."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from redis import Redis
from rq.job import Job as RQJob
from rq.job import JobStatus

from mpjobs.cli import Exit
from scripts.stack import ROOT, Stack, free_port, wait_until
from tests.app.api.test_deletion import snapshot, traces
from tests.processes.test_cli import mpjobs

SPEC = {"model": {"name": "mlp"}, "precision_policy": "mixed_float16", "training": {"steps": 70},
        "dataset": {"samples": 64}}
"""Steps past a whole rollup (64), layer checks (mixed_float16) and a speed check: every kind of record."""
LONG = {"model": {"name": "mlp"}, "training": {"steps": 200_000}, "dataset": {"samples": 256}}


def trained(stack: Stack, client: httpx.Client, spec: dict[str, Any] = SPEC) -> str:
    """A job run to success, its bucketed views read (so cached) and its model downloaded."""
    response = client.post("/jobs", json=spec)
    assert response.status_code == 201, response.text
    job_id = str(response.json()["id"])
    assert stack.wait_for_state(client, job_id, {"succeeded", "failed"})["state"] == "succeeded"
    for size in (500, 1000):
        assert client.get(f"/jobs/{job_id}/metrics", params={"max_points": size}).status_code == 200
    assert client.get(f"/jobs/{job_id}/artifacts/model.keras").status_code == 200
    return job_id


def test_deleting_a_job_removes_every_trace_files_included(stack: Stack, client: httpx.Client) -> None:
    job_id = trained(stack, client)
    folder = stack.artifacts / job_id
    assert {p.name for p in folder.iterdir()} >= {"model.keras", "tensorboard"}
    assert len(traces(stack.redis, job_id)) >= 8
    # At once: the worker may still be letting go of the job (its lease, RQ's record of the task).
    response = client.delete(f"/jobs/{job_id}", params={"purge": "true"})
    assert (response.status_code, response.content) == (204, b"")
    assert traces(stack.redis, job_id) == []
    assert not folder.exists()
    for path in ("", "/metrics", "/metrics?max_points=500", "/layers", "/artifacts/model.keras"):
        assert client.get(f"/jobs/{job_id}{path}").status_code == 404, path
    assert job_id not in {j["id"] for j in client.get("/jobs", params={"limit": 200}).json()["jobs"]}
    missing = client.delete(f"/jobs/{job_id}", params={"purge": "true"})
    assert missing.status_code == 404 and missing.json() == {"detail": f"No job with id {job_id!r}."}
    # The worker has since run another job: nothing of the deleted one came back after it went.
    trained(stack, client, {**SPEC, "precision_policy": "float32", "training": {"steps": 2}})
    assert traces(stack.redis, job_id) == [] and not folder.exists()


@pytest.fixture(scope="module")
def keyed_api(stack: Stack) -> Iterator[str]:
    """A second API on the stack's Redis with two tenants."""
    port = free_port()
    env = {**stack.env, "API_KEYS": "key-a:tenant-a,key-b:tenant-b"}
    api = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port)], cwd=ROOT,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, 30, "the keyed API")
        yield base
    finally:
        api.terminate()
        api.wait(10)


def test_another_tenant_cannot_delete_a_job_and_gets_the_answer_for_a_missing_one(
        stack: Stack, keyed_api: str) -> None:
    a = httpx.Client(base_url=keyed_api, headers={"Authorization": "Bearer key-a"}, timeout=30)
    b = httpx.Client(base_url=keyed_api, headers={"Authorization": "Bearer key-b"}, timeout=30)
    job_id = trained(stack, a)
    rq = Redis.from_url(stack.redis.url)  # RQ's record of the task, written last: the snapshot below stays still
    wait_until(lambda: RQJob.fetch(job_id, connection=rq).get_status() == JobStatus.FINISHED, 60, "RQ's record")
    before = snapshot(stack.redis)
    refused = b.delete(f"/jobs/{job_id}", params={"purge": "true"})
    unknown = b.delete("/jobs/0123456789abcdef0123456789abcdef", params={"purge": "true"})
    assert (refused.status_code, unknown.status_code) == (404, 404)
    assert refused.json()["detail"] == unknown.json()["detail"].replace("0123456789abcdef0123456789abcdef", job_id)
    assert {k: v for k, v in snapshot(stack.redis).items() if job_id.encode() in k} == \
        {k: v for k, v in before.items() if job_id.encode() in k}
    assert (stack.artifacts / job_id / "model.keras").is_file()
    assert a.get(f"/jobs/{job_id}").json()["state"] == "succeeded"
    assert a.delete(f"/jobs/{job_id}", params={"purge": "true"}).status_code == 204
    assert traces(stack.redis, job_id) == []


def test_a_running_job_is_refused_untouched_and_deleted_once_canceled(stack: Stack, client: httpx.Client) -> None:
    job_id = client.post("/jobs", json=LONG).json()["id"]
    wait_until(lambda: client.get(f"/jobs/{job_id}").json()["progress"]["step"] > 0, 120, "the job's first steps")
    refused = client.delete(f"/jobs/{job_id}", params={"purge": "true"})
    assert refused.status_code == 409
    assert refused.json()["detail"] == (f"Job {job_id!r} is running; only an ended job can be deleted. Cancel it "
                                        f"first (DELETE /jobs/{job_id}), then delete it once it has ended. "
                                        "Nothing was deleted.")
    step = client.get(f"/jobs/{job_id}").json()["progress"]["step"]
    wait_until(lambda: client.get(f"/jobs/{job_id}").json()["progress"]["step"] > step, 60, "more steps")
    assert client.delete(f"/jobs/{job_id}").status_code == 202  # without purge: cancel, as before
    stack.wait_for_state(client, job_id, {"canceled"})
    assert client.delete(f"/jobs/{job_id}", params={"purge": "true"}).status_code == 204
    assert traces(stack.redis, job_id) == [] and not (stack.artifacts / job_id).exists()


def test_a_comparisons_jobs_go_with_the_comparison_once_all_have_ended(stack: Stack, client: httpx.Client) -> None:
    created = client.post("/comparisons", json={"spec": {**SPEC, "training": {"steps": 3}}, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16"}]})
    assert created.status_code == 201, created.text
    comparison_id, job_ids = created.json()["id"], [v["job_id"] for v in created.json()["variants"]]
    early = client.delete(f"/comparisons/{comparison_id}", params={"purge": "true"})  # its jobs just queued
    assert early.status_code == 409
    assert "has jobs that have not ended" in early.json()["detail"] and "Nothing was deleted" in early.text
    for job_id in job_ids:
        stack.wait_for_state(client, job_id, {"succeeded"})
    alone = client.delete(f"/jobs/{job_ids[1]}", params={"purge": "true"})
    assert alone.status_code == 409
    assert alone.json()["detail"] == (
        f"Job {job_ids[1]!r} belongs to comparison {comparison_id!r}, and is deleted with it: DELETE "
        f"/comparisons/{comparison_id}?purge=true deletes the comparison and all its jobs. Nothing was deleted.")
    assert client.get(f"/comparisons/{comparison_id}").json()["state"] == "done"
    assert client.delete(f"/comparisons/{comparison_id}", params={"purge": "true"}).status_code == 204
    assert client.get(f"/comparisons/{comparison_id}").status_code == 404
    for trace_id in [comparison_id, *job_ids]:
        assert traces(stack.redis, trace_id) == [], trace_id
        assert not (stack.artifacts / trace_id).exists()


def test_mpjobs_delete(stack: Stack, client: httpx.Client) -> None:
    job_id = trained(stack, client, {**SPEC, "precision_policy": "float32", "training": {"steps": 2}})
    done = mpjobs(stack, "delete", job_id)
    assert (done.returncode, done.stdout) == (Exit.OK, f"{job_id}: deleted\n"), done.stderr
    assert traces(stack.redis, job_id) == []
    gone = mpjobs(stack, "delete", job_id)
    assert (gone.returncode, gone.stderr) == (Exit.NOT_FOUND, f"mpjobs: No job with id {job_id!r}.\n")
    queued = client.post("/jobs", json={**SPEC, "device": "gpu"}).json()["id"]  # no GPU worker: it waits
    refused = mpjobs(stack, "delete", queued)
    assert refused.returncode == Exit.USAGE and "is queued; only an ended job can be deleted" in refused.stderr
    assert client.delete(f"/jobs/{queued}").json()["state"] == "canceled"
    assert mpjobs(stack, "delete", queued).returncode == Exit.OK


def test_mpjobs_delete_comparison(stack: Stack, client: httpx.Client) -> None:
    created = client.post("/comparisons", json={"spec": {**SPEC, "device": "gpu"}, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16"}]}).json()  # no GPU worker: they wait
    refused = mpjobs(stack, "delete", "--comparison", created["id"])
    assert refused.returncode == Exit.USAGE and "has jobs that have not ended" in refused.stderr, refused.stderr
    assert client.delete(f"/comparisons/{created['id']}").json()["state"] == "done"  # every variant canceled
    done = mpjobs(stack, "delete", "--comparison", created["id"])
    assert (done.returncode, done.stdout) == (Exit.OK, f"{created['id']}: deleted with all its jobs\n"), done.stderr
    for trace_id in [created["id"], *(v["job_id"] for v in created["variants"])]:
        assert traces(stack.redis, trace_id) == [], trace_id

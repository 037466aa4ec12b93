"""Load: 24 small jobs posted at once, twelve times the two workers; none lost, none run twice."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from scripts.stack import Stack, wait_until

JOBS = 24
"""Posted at once, one thread each: each worker has a queue of jobs waiting, every claim contends."""
TINY = {"model": {"name": "mlp", "hidden_units": 8}, "training": {"steps": 1, "batch_size": 16},
        "dataset": {"samples": 16}}


@pytest.fixture
def two_workers(stack: Stack) -> Iterator[Stack]:
    """The shared stack with a second worker, stopped after: the tests after this one in its process count on one."""
    added = []
    while len([w for w in stack.workers if w.poll() is None]) < 2:
        added.append(stack.start_worker())
    yield stack
    for worker in added:
        worker.terminate()  # RQ's warm shutdown: an idle worker exits at once
        worker.wait(30)
        stack.workers.remove(worker)


@pytest.mark.slow
def test_two_dozen_concurrent_jobs_all_succeed_once(two_workers: Stack, client: httpx.Client) -> None:
    stack = two_workers

    def post(i: int) -> str:
        response = httpx.post(f"{stack.base_url}/jobs", json={**TINY, "name": f"load-{i}"}, timeout=60)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        ids = list(pool.map(post, range(JOBS)))
    assert len(set(ids)) == JOBS

    r = stack.redis.client()

    def all_done() -> bool:
        states = [r.hget(f"mpjobs:job:{job_id}", "state") for job_id in ids]
        return all(s in {"succeeded", "failed", "canceled"} for s in states)

    wait_until(all_done, 300, f"{JOBS} jobs to finish", interval=0.25)
    pids = set()
    for job_id in ids:
        job = client.get(f"/jobs/{job_id}").json()
        assert job["state"] == "succeeded", job["error"]
        assert job["attempt"] == 1
        assert [t["state"] for t in job["transitions"]] == ["queued", "running", "succeeded"]
        assert r.xlen(f"mpjobs:job:{job_id}:metrics") == 1
        pids.add(job["worker"]["pid"])
    assert len(pids) == 2, "both workers took jobs"
    assert [r.llen(f"rq:queue:{q}") for q in ("gpu", "cpu", "any")] == [0, 0, 0]

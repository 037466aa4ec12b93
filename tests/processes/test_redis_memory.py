"""A bounded Redis, against real processes: the API reports its memory in /readyz and /metrics, and near
its maxmemory (or over it) answers 503 to new jobs with the reason, writing nothing; deletes still work."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.stack import ROOT, Stack, free_port, private_stack, wait_until
from tests.app.api.test_deletion import snapshot, traces
from tests.mpjobs.contract.test_schemas import padded_keras_json

SPEC = {"model": {"name": "mlp"}, "training": {"steps": 2}}
HIGH_WATER = 0.5


@pytest.fixture(scope="module")
def apis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    """A Redis of its own, no worker, and two APIs on it: one with REDIS_MEMORY_HIGH_WATER=0.5 (the
    stack's), one with 1.0 (which only Redis itself stops)."""
    with private_stack(tmp_path_factory.mktemp("memory"), workers=0, REDIS_MEMORY_HIGH_WATER=str(HIGH_WATER)) as s:
        port = free_port()
        api = subprocess.Popen([sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port)], cwd=ROOT,
                               env={**s.env, "REDIS_MEMORY_HIGH_WATER": "1.0"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: httpx.get(f"{base}/healthz").status_code == 200, 30, "the second API")
            yield s, base
        finally:
            api.terminate()
            api.wait(10)
            s.redis.client().config_set("maxmemory", 0)


def memory_of(client: httpx.Client) -> dict[str, object]:
    body = client.get("/readyz").json()  # 503 here, with no worker: its body still reports Redis
    assert body["redis"] == "ok"
    return body["redis_memory"]  # type: ignore[no-any-return]


def gauges(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("mpjobs_redis_")}


def reads_limit(client: httpx.Client, limit: int) -> bool:
    return memory_of(client)["maxmemory_bytes"] == limit


def used_memory(stack: Stack) -> int:
    return int(stack.redis.client().info("memory")["used_memory"])


def test_memory_is_reported_and_past_the_high_water_mark_new_jobs_get_503_and_write_nothing(
        apis: tuple[Stack, str]) -> None:
    stack, _ = apis
    r = stack.redis.client()
    with stack.client() as client:
        unbounded = memory_of(client)
        assert unbounded["maxmemory_bytes"] == 0 and unbounded["used_fraction"] is None
        assert unbounded["accepting_jobs"] is True and unbounded["high_water"] == HIGH_WATER
        assert abs(int(unbounded["used_memory_bytes"]) - used_memory(stack)) < 200_000  # type: ignore[call-overload]
        assert gauges(client)["mpjobs_redis_maxmemory_bytes"] == 0
        assert abs(gauges(client)["mpjobs_redis_used_memory_bytes"] - used_memory(stack)) < 200_000
        assert client.post("/jobs", json=SPEC).status_code == 201  # room: taken

        limit = int(used_memory(stack) / 0.7)  # 70% used: past 50%, far from Redis's own refusals
        r.config_set("maxmemory", limit)
        wait_until(lambda: memory_of(client)["accepting_jobs"] is False, 10, "the API to read the new limit")
        reported = memory_of(client)
        assert reported["maxmemory_bytes"] == limit and gauges(client)["mpjobs_redis_maxmemory_bytes"] == limit
        assert abs(float(reported["used_fraction"]) - 0.7) < 0.05  # type: ignore[arg-type]
        before = snapshot(stack.redis)
        for path, body in (("/jobs", SPEC), ("/comparisons", {"spec": SPEC})):
            response = client.post(path, json=body, headers={"Idempotency-Key": f"full-{path}"})
            assert response.status_code == 503, response.text
            detail = response.json()["detail"]
            assert re.search(rf"^Redis holds [\d.]+ MiB of its {limit / 2**20:.3g} MiB maxmemory \(\d+%\), over "
                             "the 50% high-water mark", detail), detail
            for advice in ("DELETE /jobs/{id}?purge=true", "HISTORY_RETENTION_S", "raise Redis's maxmemory",
                           "nothing was written"):
                assert advice in detail, detail
        assert snapshot(stack.redis) == before
        assert client.post("/jobs", json={"model": {"name": "nope"}}).status_code == 422  # a bad spec is still 422


def test_a_create_redis_refuses_as_out_of_memory_is_503_and_writes_nothing_and_deletes_still_work(
        apis: tuple[Stack, str], tmp_path: Path) -> None:
    stack, base = apis
    r = stack.redis.client()
    r.config_set("maxmemory", 0)
    with httpx.Client(base_url=base, timeout=30) as client:
        ended = client.post("/jobs", json=SPEC).json()["id"]
        assert client.delete(f"/jobs/{ended}").json()["state"] == "canceled"
        before = snapshot(stack.redis)
        big = {"model": {"keras_json": padded_keras_json(900_000), "loss": "huber"}}
        for path, body in (("/jobs", big), ("/comparisons", {"spec": big})):  # a comparison writes all its jobs
            # Room by every reading, until the 900 kB record is written: Redis refuses it inside the EXEC.
            limit = used_memory(stack) + 400_000
            r.config_set("maxmemory", limit)
            wait_until(functools.partial(reads_limit, client, limit), 10, "the API to read the new limit")
            response = client.post(path, json=body, headers={"Idempotency-Key": f"oom-{path}"})
            assert response.status_code == 503, response.text
            assert "and refused a write as out of memory: no new job is taken, and nothing was written" in \
                response.json()["detail"]
        after = snapshot(stack.redis)
        after.pop(b"mpjobs:seq"), before.pop(b"mpjobs:seq")  # the creation counter may move: it numbers, holds nothing
        assert after == before
        # Over maxmemory, Redis refuses every write; a delete frees memory and is still taken.
        r.config_set("maxmemory", used_memory(stack) - 100_000)
        assert client.post("/jobs", json=SPEC).status_code == 503
        assert client.delete(f"/jobs/{ended}", params={"purge": "true"}).status_code == 204
        assert traces(stack.redis, ended) == []

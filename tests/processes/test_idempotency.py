"""Idempotency-Key on POST /jobs and POST /comparisons: the key exists exactly when what it names does,
so a crashed API strands no key. Own Redis and API (two tenants), no worker: every job stays queued."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from app.store.keys import (
    comparison_idempotency_key,
    comparison_index_key,
    comparison_key,
    idempotency_key,
    index_key,
    job_key,
)
from scripts.stack import Stack, private_stack, stopped, wait_until

TENANT_A, TENANT_B = "tenant-a", "tenant-b"
AUTH_A, AUTH_B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
SPEC = {"model": {"name": "mlp"}, "training": {"steps": 2}, "dataset": {"samples": 64}}
COMPARISON = {"spec": SPEC, "variants": [{"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16"}]}
IN_FLIGHT = 150
"""Keyed POSTs in flight when the API is killed, as in the run that found keys stranded for a day."""


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with private_stack(tmp_path_factory.mktemp("idempotency"), workers=0,
                       API_KEYS=f"key-a:{TENANT_A},key-b:{TENANT_B}") as stack:
        yield stack


def post(stack: Stack, path: str, body: dict[str, Any], key: str, auth: dict[str, str] = AUTH_A) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, headers={"Idempotency-Key": key, **auth}, timeout=60)


def stranded(stack: Stack, keys: list[str]) -> list[str]:
    """Keys stored for TENANT_A whose record names a job that does not exist."""
    r = stack.redis.client()
    held = [json.loads(raw) for raw in r.mget([idempotency_key(TENANT_A, key) for key in keys]) if raw]
    return [record["job_id"] for record in held if not r.exists(job_key(record["job_id"]))]


def test_keys_in_flight_when_the_api_is_sigkilled_each_give_one_job_that_exists(keyed_stack: Stack) -> None:
    stack, r = keyed_stack, keyed_stack.redis.client()
    assert stack.api is not None
    keys = [f"crash-{n}" for n in range(IN_FLIGHT)]
    before = r.zcard(index_key(TENANT_A))

    def first_try(key: str) -> httpx.Response | None:
        try:
            return post(stack, "/jobs", SPEC, key)
        except httpx.HTTPError:  # the API died under it
            return None

    with ThreadPoolExecutor(max_workers=IN_FLIGHT) as pool:
        pending = [pool.submit(first_try, key) for key in keys]
        wait_until(lambda: r.zcard(index_key(TENANT_A)) >= before + 20, 60, "the first jobs", interval=0.001)
        os.killpg(stack.api.pid, signal.SIGSTOP)  # frozen first, so the kill lands mid-burst however fast it runs
        wait_until(lambda: stopped(stack.api.pid), 10, "the API to stop", interval=0.001)  # type: ignore[union-attr]
        assert r.zcard(index_key(TENANT_A)) < before + IN_FLIGHT, "every job was written before the freeze"
        os.killpg(stack.api.pid, signal.SIGKILL)
        stack.api.wait(10)
        answered = {key: response.json()["id"] for key, future in zip(keys, pending, strict=True)
                    if (response := future.result()) is not None and response.status_code in (200, 201)}
    assert len(answered) < IN_FLIGHT, "every POST was answered before the kill: it landed after the burst"
    assert stranded(stack, keys) == [], "a key names a job that was never written"

    stack.start_api()
    with ThreadPoolExecutor(max_workers=32) as pool:
        retries = list(pool.map(lambda key: post(stack, "/jobs", SPEC, key), keys))
    for key, response in zip(keys, retries, strict=True):
        assert response.status_code in (200, 201), f"{key}: {response.status_code} {response.text}"
    ids = {key: response.json()["id"] for key, response in zip(keys, retries, strict=True)}
    assert {key: ids[key] for key in answered} == answered, "a key answered before the kill changed its job"
    assert len(set(ids.values())) == IN_FLIGHT
    assert all(r.exists(job_key(job_id)) for job_id in ids.values())
    assert r.zcard(index_key(TENANT_A)) == before + IN_FLIGHT, "a key made a second job"


def test_a_key_that_names_a_missing_job_is_reclaimed_by_the_next_request(keyed_stack: Stack) -> None:
    r = keyed_stack.redis.client()
    first = post(keyed_stack, "/jobs", SPEC, "stale-1")
    assert first.status_code == 201
    r.delete(job_key(first.json()["id"]))  # the job is gone (deleted by hand); its key stays
    reclaimed = post(keyed_stack, "/jobs", SPEC, "stale-1")
    assert reclaimed.status_code == 201, reclaimed.text
    assert reclaimed.json()["id"] != first.json()["id"] and r.exists(job_key(reclaimed.json()["id"]))
    again = post(keyed_stack, "/jobs", SPEC, "stale-1")
    assert (again.status_code, again.json()["id"]) == (200, reclaimed.json()["id"])
    # A record an older version wrote before it died, naming a job it never created.
    r.set(idempotency_key(TENANT_A, "stale-2"), json.dumps({"fingerprint": "0" * 64, "job_id": "never-written"}),
          ex=3600)
    created = post(keyed_stack, "/jobs", {**SPEC, "name": "after the crash"}, "stale-2")
    assert created.status_code == 201, created.text
    assert created.json()["name"] == "after the crash" and r.exists(job_key(created.json()["id"]))


def test_a_comparison_key_returns_the_first_comparison_and_refuses_another_spec(keyed_stack: Stack) -> None:
    r = keyed_stack.redis.client()
    first = post(keyed_stack, "/comparisons", COMPARISON, "cmp-1")
    assert first.status_code == 201, first.text
    made = (r.zcard(comparison_index_key(TENANT_A)), r.zcard(index_key(TENANT_A)))
    again = post(keyed_stack, "/comparisons", COMPARISON, "cmp-1")
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["location"] == f"/comparisons/{first.json()['id']}"
    other = post(keyed_stack, "/comparisons", {**COMPARISON, "name": "another"}, "cmp-1")
    assert other.status_code == 409 and "Idempotency-Key" in other.json()["detail"]
    assert (r.zcard(comparison_index_key(TENANT_A)), r.zcard(index_key(TENANT_A))) == made
    # Per tenant, and apart from the keys of POST /jobs.
    theirs = post(keyed_stack, "/comparisons", COMPARISON, "cmp-1", auth=AUTH_B)
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]
    assert post(keyed_stack, "/jobs", SPEC, "cmp-1").status_code == 201
    assert 23 * 3600 < r.ttl(comparison_idempotency_key(TENANT_A, "cmp-1")) <= 24 * 3600


def test_twenty_concurrent_comparison_posts_with_one_key_create_one(keyed_stack: Stack) -> None:
    r = keyed_stack.redis.client()
    before = r.zcard(comparison_index_key(TENANT_A)), r.zcard(index_key(TENANT_A))
    with ThreadPoolExecutor(max_workers=20) as pool:
        responses = list(pool.map(lambda _: post(keyed_stack, "/comparisons", COMPARISON, "cmp-race"), range(20)))
    assert sorted(response.status_code for response in responses) == [200] * 19 + [201]
    assert len({response.json()["id"] for response in responses}) == 1
    assert (r.zcard(comparison_index_key(TENANT_A)), r.zcard(index_key(TENANT_A))) == (before[0] + 1, before[1] + 2)


def test_a_comparison_key_that_names_a_missing_comparison_is_reclaimed(keyed_stack: Stack) -> None:
    r = keyed_stack.redis.client()
    first = post(keyed_stack, "/comparisons", COMPARISON, "cmp-stale")
    assert first.status_code == 201
    r.delete(comparison_key(first.json()["id"]))
    reclaimed = post(keyed_stack, "/comparisons", COMPARISON, "cmp-stale")
    assert reclaimed.status_code == 201, reclaimed.text
    assert reclaimed.json()["id"] != first.json()["id"]
    with keyed_stack.client() as client:
        assert client.get(f"/comparisons/{reclaimed.json()['id']}", headers=AUTH_A).status_code == 200

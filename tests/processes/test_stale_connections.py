"""The API's first request after a Redis restart succeeds: its pooled connections to the Redis that went are checked or
retried once (app/store/connect.py), on the sync path and the async one. Own Redis and API, no worker."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from scripts.stack import Stack, private_stack

SPEC = {"model": {"name": "mlp"}, "training": {"steps": 2}, "dataset": {"samples": 64}}


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with private_stack(tmp_path_factory.mktemp("stale"), workers=0) as stack:
        yield stack


READS: dict[str, Callable[[httpx.Client, str], httpx.Response]] = {
    "sync": lambda client, job_id: client.get("/jobs"),  # the store's client, on a worker thread
    "async": lambda client, job_id: client.get(f"/jobs/{job_id}"),  # redis.asyncio, on the event loop
}


@pytest.mark.parametrize("path", sorted(READS))
def test_the_first_request_after_a_redis_restart_succeeds(own_stack: Stack, path: str) -> None:
    read = READS[path]
    with own_stack.client() as client:
        job_id = client.post("/jobs", json=SPEC).json()["id"]
        assert read(client, job_id).status_code == 200  # its connection is pooled, and left open
        own_stack.redis.stop()  # SIGTERM: Redis closes its connections and writes its AOF
        own_stack.redis.start()
        response = read(client, job_id)
        assert response.status_code == 200, response.text
        assert client.post("/jobs", json=SPEC, headers={"Idempotency-Key": f"after-{path}"}).status_code == 201

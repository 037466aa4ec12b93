"""POST /jobs while Redis loads its data after a restart (`--key-load-delay`): with an Idempotency-Key or without,
each answer is a success or a 503 with Retry-After, never a 500, on a connection the API keeps open; once Redis has
loaded, each key's retry returns its job, one job per key. Own Redis and API, no worker: every job stays queued."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import httpx

from app.store.keys import index_key
from scripts.stack import RedisServer, private_stack, wait_until

SPEC = {"model": {"name": "mlp"}, "training": {"steps": 2}, "dataset": {"samples": 64}}
TENANT = "default"
KEYS = [f"loading-{n}" for n in range(3)]
FILLER_KEYS = 3000
FILLER = "x" * 1024
"""A kilobyte per key: Redis answers its clients once per key it loads."""
LOADING = ("--key-load-delay", "1000", "--loading-process-events-interval-bytes", "1024")
"""1 ms per key: about 3 s of loading, and Redis answers clients (LOADING) every kilobyte it reads meanwhile."""


def fill(server: RedisServer) -> None:
    """FILLER_KEYS keys, rewritten into the AOF's RDB base: the part whose loading `--key-load-delay` slows."""
    r = server.client()
    with r.pipeline(transaction=False) as pipe:
        for n in range(FILLER_KEYS):
            pipe.set(f"filler:{n}", FILLER)
        pipe.execute()
    r.bgrewriteaof()

    def rewritten() -> bool:
        persistence = r.info("persistence")
        return persistence["aof_rewrite_in_progress"] == 0 and persistence["aof_rewrite_scheduled"] == 0

    wait_until(rewritten, 30, "the AOF rewrite")


def loading(server: RedisServer) -> bool:
    return bool(server.client().info("persistence")["loading"])


def client_port(response: httpx.Response) -> int:
    """The local port of the connection the response came on: the same port, the same kept-alive connection."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_posts_while_redis_loads_get_503_with_retry_after_or_succeed_and_each_key_makes_one_job(
        tmp_path: Path) -> None:
    with private_stack(tmp_path, workers=0) as stack, stack.client() as client:
        warm = client.post("/jobs", json=SPEC)  # the API's pooled connections exist before the restart
        assert warm.status_code == 201
        fill(stack.redis)
        stack.redis.stop()
        stack.redis.start(*LOADING, loaded=False)

        answers: list[tuple[str, httpx.Response]] = []
        assert loading(stack.redis), "Redis loaded before any request came: nothing was tested"
        while loading(stack.redis):
            answers.append(("", client.post("/jobs", json=SPEC)))
            answers += [(key, client.post("/jobs", json=SPEC, headers={"Idempotency-Key": key})) for key in KEYS]
        statuses = [response.status_code for _, response in answers]
        assert set(statuses) <= {200, 201, 503}, statuses
        assert all(response.headers.get("retry-after") == "1" for _, response in answers
                   if response.status_code == 503)
        assert {"", KEYS[0]} <= {key for key, response in answers if response.status_code == 503}, \
            "the first unkeyed and keyed POSTs met Redis loading"
        assert len({client_port(response) for _, response in answers}) == 1, "no answer closed the connection"

        made: dict[str, set[str]] = defaultdict(set)
        for key, response in answers:
            if response.status_code in (200, 201):
                made[key].add(response.json()["id"])
        for key in KEYS:
            retry = client.post("/jobs", json=SPEC, headers={"Idempotency-Key": key})
            assert retry.status_code in (200, 201), retry.text
            made[key].add(retry.json()["id"])
        assert all(len(made[key]) == 1 for key in KEYS), dict(made)
        unkeyed = len(made[""])
        assert stack.redis.client().zcard(index_key(TENANT)) == 1 + len(KEYS) + unkeyed, "one job per key"

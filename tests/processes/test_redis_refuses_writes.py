"""A Redis that refuses writes until its operator acts (NOREPLICAS here, MISCONF alike): the API answers 503 and
names the reply, writes nothing, and works again once Redis takes writes. Before, each POST was a 500."""

from __future__ import annotations

import httpx

from scripts.stack import Stack

SPEC = {"model": {"name": "mlp", "input_dim": 8, "hidden_units": 8}, "training": {"steps": 1}}


def test_a_redis_that_refuses_writes_is_a_503_that_names_why_and_nothing_is_written(
        stack: Stack, client: httpx.Client) -> None:
    r = stack.redis.client()
    before = stack.writes()
    r.config_set("min-replicas-to-write", 1)  # no replica: every write is refused with NOREPLICAS
    try:
        refused = client.post("/jobs", json=SPEC)
        assert refused.status_code == 503, refused.text
        assert refused.json()["detail"].startswith("Redis refuses writes until its operator acts: NOREPLICAS")
        assert "retry-after" not in refused.headers  # waiting alone fixes nothing
        comparison = client.post("/comparisons", json={"spec": SPEC})
        assert comparison.status_code == 503, comparison.text
    finally:
        r.config_set("min-replicas-to-write", 0)
    assert stack.writes() == before
    assert client.post("/jobs", json=SPEC).status_code == 201

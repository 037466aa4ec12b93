"""An Idempotency-Key that other requests keep rewriting, against a real redis-server: after a bounded number of
reads the request gives up with a 503 that says so, and writes nothing."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis import Redis
from redis.client import Pipeline

from app.api import services
from app.core.errors import IdempotencyKeyContended
from app.main import _status_of
from app.store import JobStore
from app.store.keys import comparison_idempotency_key, idempotency_key
from mpjobs.contract.spec import ComparisonSpec, JobSpec
from scripts.stack import RedisServer
from tests.app.api.test_deletion import snapshot

TENANT, KEY = "tenant-a", "retry-me"
READS = 8
"""docs/reliability.md: a key rewritten under each of 8 reads gets a 503."""


@pytest.fixture
def store(server: RedisServer) -> Iterator[JobStore]:
    client = server.client()
    client.flushdb()
    yield JobStore(client)
    client.close()


class Rival:
    """Another request's writes to one Idempotency-Key, made between this request's WATCH and its EXEC: each
    names a job of its own that is not (yet) stored, so the key never names anything this request can return."""

    def __init__(self, server: RedisServer, key: str, names: str) -> None:
        self.client, self.key, self.names = Redis.from_url(server.url), key, names
        self.writes = 0

    def write(self) -> None:
        self.writes += 1
        self.client.set(self.key, json.dumps({"fingerprint": "another request's", self.names: f"rival-{self.writes}"}))


def contended(server: RedisServer, rival: Rival) -> Redis:
    """RQ's connection, as the API's, whose transactions the rival interrupts: the key it WATCHes changes
    after this request read it and before its MULTI, so every EXEC is refused."""

    class RivalPipeline(Pipeline):
        def multi(self) -> None:
            rival.write()
            super().multi()

    class Contended(Redis):
        def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
            return RivalPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)

    return Contended.from_url(server.url)


def job_submit(store: JobStore, rq: Redis) -> Any:
    spec = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": 5}})
    return services.submit(store, rq, spec, TENANT, KEY)


def comparison_submit(store: JobStore, rq: Redis) -> Any:
    spec = ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}, "training": {"steps": 5}}})
    return services.submit_comparison(store, rq, spec, TENANT, KEY)


@pytest.mark.parametrize(("submit", "redis_key", "names"), [
    (job_submit, idempotency_key(TENANT, KEY), "job_id"),
    (comparison_submit, comparison_idempotency_key(TENANT, KEY), "comparison_id"),
], ids=["job", "comparison"])
def test_a_key_rewritten_under_every_read_is_a_503_that_writes_nothing(
        server: RedisServer, store: JobStore, submit: Callable[[JobStore, Redis], Any], redis_key: str,
        names: str) -> None:
    rival = Rival(server, redis_key, names)
    rq = contended(server, rival)
    before = snapshot(server)
    try:
        with pytest.raises(IdempotencyKeyContended) as raised:
            submit(store, rq)
    finally:
        rq.close()
        rival.client.close()
    assert rival.writes == READS  # the key changed under each read, and the request read it no more
    assert _status_of(raised.value) == 503
    assert str(raised.value) == ("This Idempotency-Key was rewritten by concurrent requests each of the 8 times it "
                                 "was read, so no job was created or returned by this request; retry it.")
    after = snapshot(server)
    assert after.pop(redis_key.encode())[1] == json.dumps({"fingerprint": "another request's",
                                                            names: f"rival-{READS}"}).encode()
    after.pop(b"mpjobs:seq", None), before.pop(b"mpjobs:seq", None)  # the creation counter: it numbers, holds nothing
    assert after == before  # no job, comparison, index entry or RQ job: every EXEC was refused whole
    assert store.comparisons.list_comparisons(TENANT, 10, None)[0] == []

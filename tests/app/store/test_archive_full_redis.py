"""Archiving frees a Redis that is over its maxmemory, against a real redis-server; and a trim Redis refuses
removes nothing and says why."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.store import JobStore
from app.store.keys import ARCHIVED_FIELD, ENDED, archive_claim_key, job_key, layers_key, metrics_key, rollup_key
from app.store.retention import Archiver
from scripts.stack import RedisServer
from tests.app.store.history import ended_job
from tests.app.store.test_archive import every_read

STEPS = 3000
"""Steps of each job: about 1.5 MB of streams, against a limit set 100 kB under what Redis holds."""


@pytest.fixture
def store(server: RedisServer, tmp_path: Path) -> Iterator[JobStore]:
    client = server.client()
    client.flushall()
    yield JobStore(client, tmp_path / "artifacts")
    client.config_set("maxmemory", 0)
    client.config_set("min-replicas-to-write", 0)


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def refuses_writes(r: redis.Redis) -> bool:
    try:
        r.set("probe", "x")
    except redis.exceptions.OutOfMemoryError:
        return True
    r.delete("probe")
    return False


def history_keys(job_id: str) -> list[str]:
    return [metrics_key(job_id), rollup_key(job_id), layers_key(job_id)]


@pytest.mark.parametrize("limit", ["100 kB under", "far under"])
def test_an_archive_frees_a_redis_that_is_over_its_maxmemory(store: JobStore, limit: str) -> None:
    job_id, written, checks = ended_job(store, STEPS)
    before = every_read(store, job_id)
    r = store.redis
    streams = sum(int(r.memory_usage(key, samples=0) or 0) for key in history_keys(job_id))
    held = used(r)
    # "far under": still over the limit once the streams are gone; Redis checks memory only before a
    # script's first write, so the record's field is set after the deletes all the same.
    r.config_set("maxmemory", held - 100_000 if limit == "100 kB under" else 100_000)
    assert refuses_writes(r)

    assert Archiver(store, retention_s=0).archive(job_id) == "archived"
    assert not r.exists(*history_keys(job_id)) and r.zscore(ENDED, job_id) is None
    assert store.history.archive_info(job_id) is not None and r.hget(job_key(job_id), "state") == "succeeded"
    assert held - used(r) > 0.7 * streams > 1_000_000, (held, used(r), streams)  # measured: 0.8 to 0.9
    assert refuses_writes(r) == (limit == "far under")
    store.history.archives = type(store.history.archives)()  # read from the files, not from what the archiver parsed
    assert every_read(store, job_id) == before
    assert store.history.read_metrics(job_id, 0, 10_000).points == written
    assert store.history.read_layers(job_id, 0, 10_000).checks == checks


def test_a_trim_that_redis_refuses_removes_nothing_and_names_the_reason(
        store: JobStore, caplog: pytest.LogCaptureFixture) -> None:
    job_id, written, _ = ended_job(store, 300)
    before = every_read(store, job_id)
    r = store.redis

    def refuse_writes(_: str) -> None:  # a replica gone: Redis refuses every write, the trim script's first too
        r.config_set("min-replicas-to-write", 1)

    with caplog.at_level(logging.WARNING, logger="mpjobs.archive"):
        assert Archiver(store, retention_s=0, before_trim=refuse_writes).archive(job_id) == "refused"
    r.config_set("min-replicas-to-write", 0)
    refused = [rec.getMessage() for rec in caplog.records if job_id in rec.getMessage()]
    assert any("NOREPLICAS" in message and "stays in Redis" in message for message in refused), caplog.text
    assert r.hget(job_key(job_id), ARCHIVED_FIELD) is None and r.zscore(ENDED, job_id) is not None
    assert r.xlen(metrics_key(job_id)) == len(written)
    assert every_read(store, job_id) == before
    # Its claim could not be dropped either (a write); it lapses after ARCHIVE_CLAIM_S. Then a pass completes it.
    assert r.exists(archive_claim_key(job_id))
    r.delete(archive_claim_key(job_id))
    assert Archiver(store, retention_s=0).archive(job_id) == "archived"
    assert every_read(store, job_id) == before


def test_a_sweep_over_maxmemory_archives_what_it_can_then_indexes_the_rest(store: JobStore) -> None:
    indexed, _, _ = ended_job(store, STEPS)
    older, _, _ = ended_job(store, 50, seed=1)
    store.redis.zrem(ENDED, older)  # as a job that ended before mpjobs kept `ended`: the sweep must ZADD it
    store.redis.config_set("maxmemory", used(store.redis) - 100_000)
    assert refuses_writes(store.redis)
    archiver = Archiver(store, retention_s=0)
    assert archiver.sweep() == [indexed], "the index's ZADD is refused; the sweep goes on"
    assert not refuses_writes(store.redis)
    assert archiver.sweep() == [older], "the next sweep indexes it"

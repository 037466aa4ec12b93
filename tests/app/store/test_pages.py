"""Metrics pages assembled from the stored records (app/store/pages.py) against a real redis-server: the same
bytes, record for record, as validating every record and dumping the page the way the API's response
model does; from Redis, from the archive, and from an archive of format version 1 (no `record` column)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis.asyncio
from pydantic import TypeAdapter

from app.api.page_reads import PageReads
from app.store import JobStore
from app.store.archive import METRICS_FILE, RECORD_COLUMN
from app.store.retention import Archiver
from mpjobs.contract.jobs import MetricsBuckets, MetricsPage
from scripts.stack import RedisServer
from tests.app.store.history import ended_job

RESPONSE = TypeAdapter(MetricsPage | MetricsBuckets)
"""What FastAPI dumps a page with: the metrics route's response model."""
READS = [(0, 1), (0, 7), (0, 1000), (0, 10_000), (4, 3), (4, 10), (199, 2), (1500, 100), (2990, 100), (3000, 5),
         (5000, 5)]
"""(after, limit): the first page, pages across the gaps (5-6 and 200), the last page just full and not, past
the end."""


@pytest.fixture
def store(server: RedisServer, tmp_path: Path) -> JobStore:
    server.client().flushall()
    return JobStore(server.client(), tmp_path / "artifacts")


def pages(store: JobStore, job_id: str) -> list[tuple[bytes, bytes]]:
    """(assembled, validated and dumped) for each of READS; assembled by the store and by the API's async
    reader (app/api/page_reads.py), which must agree."""
    async def served() -> list[bytes]:
        kwargs = store.redis.connection_pool.connection_kwargs
        async with redis.asyncio.Redis(host=kwargs["host"], port=kwargs["port"]) as aredis:
            reads = PageReads(aredis, store)
            return [(await reads.page(job_id, "t", after, limit)).json(job_id) for after, limit in READS]

    assembled = [store.history.read_metrics_raw(job_id, after, limit).json(job_id) for after, limit in READS]
    assert asyncio.run(served()) == assembled
    return [(raw, RESPONSE.dump_json(store.history.read_metrics(job_id, after, limit)))
            for raw, (after, limit) in zip(assembled, READS, strict=True)]


def test_a_page_from_the_stored_bytes_is_the_validated_page_byte_for_byte(store: JobStore) -> None:
    job_id, written, _ = ended_job(store, 3000, skip=frozenset({5, 6, 200}))
    from_redis = pages(store, job_id)
    for assembled, validated in from_redis:
        assert assembled == validated
    first = json.loads(from_redis[3][0])  # all of it, read back independently of both paths
    assert first["points"] == [r.model_dump() for r in written] and first["missing_steps"] == [[5, 6], [200, 200]]
    assert first["next_after"] is None and json.loads(from_redis[1][0])["next_after"] == 9, "7 steps after 2 gone"
    assert b"null" in from_redis[3][0] and b"-0.0" in from_redis[3][0] and b"5e-324" in from_redis[3][0]

    assert Archiver(store, retention_s=0).archive(job_id) == "archived"
    store.history.archives = type(store.history.archives)()
    assert pages(store, job_id) == from_redis, "the archive serves the same bytes"

    # An archive written before the `record` column: its pages are dumped from the typed columns, same bytes.
    info = store.history.archive_info(job_id)
    assert info is not None and store.artifacts_dir is not None
    path = store.artifacts_dir / info.dir / METRICS_FILE
    pq.write_table(pq.read_table(path).drop_columns([RECORD_COLUMN]), path)
    store.history.archives = type(store.history.archives)()
    assert pages(store, job_id) == from_redis

"""Reads of an archived history against the same reads from Redis, through the real API, in the same run.

Real processes: a private redis-server and `uvicorn app.main:app` (one process, no access log), no
worker. Three 100,000-step jobs are written straight into Redis by the worker's own `RedisReporter`
(rollups cut as in production, the same records in each) and marked succeeded; then one of them is
archived (app/store/retention.py: its streams leave Redis, its reads come from Parquet). The other
two stay in Redis: the second is an A/A pair for the first, which shows how much two identical sides
differ on this machine now. One client (httpx, one connection) then asks the three jobs the same
questions in turns, in rotated order, so every side sees the machine at the same moments:

- `GET /jobs/{id}/metrics?after=A&limit=1000`, A drawn at random over the run (the same A for both);
- `GET /jobs/{id}/metrics?max_points=500`, its cached copy dropped first (an ended job's view is
  otherwise served from Redis for a day, archived or not): the cost of cutting the view itself.

Rows: p50 and p99 of the archive beside Redis, and their ratio archive / Redis. Goals: the archive's
500-bucket view at p99 <= 100 ms (the API's goal for a 100k-step view), and no slower than Redis: a
ratio at most 1, or within the A/A pair's own distance from 1 (its ratio is in the `goal` column).
Beside them, once: how long the API takes to open a 100k-step archive (its first read after a start;
later reads find it parsed in the API's cache of a few archives).

    python -m bench.archived_reads [--quick] [--repeats 300]
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import httpx
import redis

from app.store import JobStore
from app.store.archive import ArchivedHistory
from app.store.keys import view_fresh_key, view_key
from app.store.retention import Archiver
from bench.api_throughput import BUCKETS_P99_GOAL_MS, MAX_POINTS, PAGE, finished_job
from bench.loadgen import redis_server, serve
from bench.report import Row, cli, median, percentile

BENCH = "archived reads"


def _timed_ms(client: httpx.Client, url: str, params: dict[str, int]) -> float:
    start = time.perf_counter()
    response = client.get(url, params=params)
    elapsed = (time.perf_counter() - start) * 1000
    response.raise_for_status()
    return elapsed


def _rows(case: str, redis_ms: list[float], twin_ms: list[float], archive_ms: list[float], view: bool) -> list[Row]:
    rows = []
    for q in (50, 99):
        ours, theirs = percentile(archive_ms, q), percentile(redis_ms, q)
        noise = percentile(twin_ms, q) / theirs
        allowed = 1 + abs(noise - 1)
        goals = [f"ratio <= {allowed:.3f} (A/A {noise:.3f})"] + (
            [f"<= {BUCKETS_P99_GOAL_MS:.0f} ms"] if view and q == 99 else [])
        met = ours / theirs <= allowed and (not view or q != 99 or ours <= BUCKETS_P99_GOAL_MS)
        rows.append(Row(BENCH, f"{case}: p{q}, {len(archive_ms)} requests a side", "the same job in Redis", theirs,
                        ours, "ms", ours / theirs, ", ".join(goals), met))
    return rows


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    """Quick: 10k-step jobs, 21 requests a side (the smoke test's size)."""
    steps = 10_000 if quick else 100_000
    repeats = repeats or (21 if quick else 300)
    rng = random.Random(0)
    with redis_server() as (server, env), tempfile.TemporaryDirectory() as logs:
        client_redis, rq_redis = server.client(), redis.Redis.from_url(server.url)
        store = JobStore(client_redis, Path(env["ARTIFACTS_DIR"]))
        with serve("app.main:app", env, Path(logs) / "api.log") as api, \
                httpx.Client(base_url=api.url, timeout=30) as client:
            in_redis = finished_job(client, store, rq_redis, steps)
            twin = finished_job(client, store, rq_redis, steps)
            archived = finished_job(client, store, rq_redis, steps)
            started = time.perf_counter()
            assert Archiver(store, retention_s=0).archive(archived) == "archived"
            archive_s = time.perf_counter() - started
            folder = Path(env["ARTIFACTS_DIR"]) / archived / "history"
            opens = []
            for _ in range(3 if quick else 7):
                started = time.perf_counter()
                ArchivedHistory(folder).rollups()
                opens.append((time.perf_counter() - started) * 1000)
            sides = [in_redis, twin, archived]
            pages: dict[str, list[float]] = {job_id: [] for job_id in sides}
            views: dict[str, list[float]] = {job_id: [] for job_id in sides}
            for job_id in sides:  # warm: the archive parsed, every path run once
                _timed_ms(client, f"/jobs/{job_id}/metrics", {"limit": PAGE})
                _timed_ms(client, f"/jobs/{job_id}/metrics", {"max_points": MAX_POINTS})
            for i in range(repeats):
                after = rng.randrange(0, steps - PAGE)
                order = sides[i % 3:] + sides[:i % 3]
                for job_id in order:
                    pages[job_id].append(_timed_ms(client, f"/jobs/{job_id}/metrics", {"after": after, "limit": PAGE}))
                for job_id in order:
                    client_redis.delete(view_key(job_id, MAX_POINTS), view_fresh_key(job_id, MAX_POINTS))
                    views[job_id].append(_timed_ms(client, f"/jobs/{job_id}/metrics", {"max_points": MAX_POINTS}))
    size = f"{steps // 1000}k-step job"
    return [
        *_rows(f"GET /jobs/{{id}}/metrics?after=A&limit={PAGE}, {size}", pages[in_redis], pages[twin],
               pages[archived], False),
        *_rows(f"GET /jobs/{{id}}/metrics?max_points={MAX_POINTS}, {size}, view not cached", views[in_redis],
               views[twin], views[archived], True),
        Row(BENCH, f"open a {size}'s archive (the API's first read of it), median of {len(opens)}", "none", None,
            median(opens), "ms", None),
        Row(BENCH, f"archive a {size} (read its streams, write 3 files, trim Redis)", "none", None, archive_s,
            "s", None),
    ]


if __name__ == "__main__":
    cli("Archived reads", __doc__, run)

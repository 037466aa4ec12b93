"""Scaling: metric reads at 1k, 10k and 100k steps, and job throughput with 1 vs 2 workers.

Real processes: a private redis-server, the API and `python -m worker` workers,
started as `scripts.stack.Stack` starts them (the API with uvicorn's defaults).

1. Metric reads. One job per size, its steps written into Redis by the
   worker's own `RedisReporter` (rollups as in production) and marked
   succeeded; no worker runs meanwhile. For each size: the whole series read
   through the API page by page (`limit=10000`), and the `max_points=500` view.
   Sizes alternate within each repeat; figures are medians, and each ratio is
   the median of per-repeat ratios against the 1k-step job. Paging should grow
   linearly (flat time per step); the bucket view reads rollups beyond 4,096
   steps, so it should grow far slower than the run.
2. Job throughput: a batch of small float32 mlp jobs, from the first POST to
   the last job's `finished_at`, with 1 and then 2 workers (each warmed by one
   job first). A worker's TensorFlow uses every core, and the project's VM has
   2: expect well under 2x.

    python -m bench.scaling [--quick] [--repeats 5] [--jobs 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import redis

from app.store import JobStore
from bench import report
from bench.api_throughput import finished_job
from bench.report import Row
from scripts.stack import RedisServer, Stack

BENCH = "scaling"
SIZES = (1_000, 10_000, 100_000)
QUICK_SIZES = (1_000, 10_000)
PAGE_LIMIT = 10_000
MAX_POINTS = 500
JOB_SPEC = {
    "model": {"name": "mlp", "input_dim": 32, "hidden_units": 32, "classes": 4},
    "precision_policy": "float32", "training": {"steps": 20, "batch_size": 32}, "dataset": {"samples": 640},
    "device": "cpu",
}
"""About as small as a real job gets: what is left is the per-job cost of the service and Keras."""
JOB_TIMEOUT_S = 600.0


def read_all_pages(client: httpx.Client, job_id: str) -> int:
    """Every step record through the API, PAGE_LIMIT at a time; returns how many."""
    read, after = 0, 0
    while after is not None:
        response = client.get(f"/jobs/{job_id}/metrics", params={"after": after, "limit": PAGE_LIMIT})
        response.raise_for_status()
        page = response.json()
        read += len(page["points"])
        after = page["next_after"]
    return read


def read_buckets(client: httpx.Client, job_id: str) -> int:
    response = client.get(f"/jobs/{job_id}/metrics", params={"max_points": MAX_POINTS})
    response.raise_for_status()
    return int(response.json()["total_steps"])


def _seconds(read: Callable[[httpx.Client, str], int], client: httpx.Client, job_id: str) -> float:
    start = time.perf_counter()
    read(client, job_id)
    return time.perf_counter() - start


def _growth(case: str, times: dict[int, list[float]], n: int, unit: str, per_step: bool) -> Row:
    """Median of `times[n]` (seconds, shown in `unit`), beside the smallest size's and their per-repeat ratio."""
    scale = 1e6 if per_step else 1e3
    first = min(times)
    ours = [t * scale / (n if per_step else 1) for t in times[n]]
    if n == first:
        return Row(BENCH, case, "—", None, report.median(ours), unit, None)
    base = [t * scale / (first if per_step else 1) for t in times[first]]
    return Row(BENCH, case, f"same, {first:,} steps", report.median(base), report.median(ours), unit,
               report.median(o / b for o, b in zip(ours, base, strict=True)))


def metric_reads(stack: Stack, sizes: tuple[int, ...], repeats: int) -> list[Row]:
    store = JobStore(stack.redis.client())
    rq_redis = redis.Redis.from_url(stack.redis.url)
    pages: dict[int, list[float]] = {n: [] for n in sizes}
    buckets: dict[int, list[float]] = {n: [] for n in sizes}
    with stack.client() as client:
        jobs = {n: finished_job(client, store, rq_redis, n) for n in sizes}
        for n, job_id in jobs.items():  # warm, and check what each read returns
            assert read_all_pages(client, job_id) == n and read_buckets(client, job_id) == n
        for _ in range(repeats):
            for n, job_id in jobs.items():
                pages[n].append(_seconds(read_all_pages, client, job_id))
                buckets[n].append(_seconds(read_buckets, client, job_id))
    rows = []
    for n in sizes:
        rows += [
            _growth(f"metrics, all pages (limit {PAGE_LIMIT:,}), {n:,} steps", pages, n, "ms", False),
            _growth(f"metrics, all pages, {n:,} steps: per step", pages, n, "µs/step", True),
            _growth(f"metrics?max_points={MAX_POINTS}, {n:,} steps", buckets, n, "ms", False),
        ]
    return rows


def run_batch(stack: Stack, jobs: int) -> float:
    """Jobs per second for `jobs` jobs: first POST to the last one's finished_at."""
    store = JobStore(stack.redis.client())
    with stack.client() as client:
        start = time.time()
        ids = []
        for _ in range(jobs):
            response = client.post("/jobs", json=JOB_SPEC)
            response.raise_for_status()
            ids.append(response.json()["id"])
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while True:
            found = store.jobs.get_many(ids)
            if all(job is not None and job.state.terminal for job in found):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs not finished after {JOB_TIMEOUT_S:.0f} s (logs in {stack.logs})")
            time.sleep(0.1)
    failed = [job for job in found if job is not None and job.state.value != "succeeded"]
    if failed:
        raise AssertionError(f"{len(failed)} jobs did not succeed, e.g. {failed[0].error} (logs in {stack.logs})")
    last = max(datetime.fromisoformat(job.finished_at).timestamp() for job in found if job and job.finished_at)
    return jobs / (last - start)


def start_workers(stack: Stack, count: int) -> None:
    """Start `count` workers side by side, then warm each with one job (idle workers take one each)."""
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(lambda _: stack.start_worker(), range(count)))
    run_batch(stack, count)


def stop_worker(stack: Stack) -> None:
    """RQ's warm shutdown of the newest worker; it is idle, so it leaves at once."""
    worker = stack.workers[-1]
    worker.terminate()
    worker.wait(30)


def job_throughput(stack: Stack, jobs: int, rounds: int) -> list[Row]:
    """Each round: 2 workers, then the second stopped, 1 worker; ratio per round."""
    one, two = [], []
    start_workers(stack, 2)
    for round_ in range(rounds):
        if round_:
            start_workers(stack, 1)
        two.append(run_batch(stack, jobs))
        stop_worker(stack)
        one.append(run_batch(stack, jobs))
    case = f"{jobs} float32 mlp jobs of {JOB_SPEC['training']['steps']} steps"  # type: ignore[index]
    return [
        Row(BENCH, f"job throughput, 1 worker, {case}", "—", None, report.median(one), "jobs/s", None),
        Row(BENCH, f"job throughput, 2 workers, {case} (2 cores: expect < 2x)", "1 worker",
            report.median(one), report.median(two), "jobs/s",
            report.median(t / o for t, o in zip(two, one, strict=True))),
    ]


def run(quick: bool = False, repeats: int | None = None, jobs: int | None = None,
        rounds: int | None = None) -> list[Row]:
    """Quick: 1k and 10k steps, 3 repeats, 4 jobs, one round (the smoke test's size)."""
    sizes = QUICK_SIZES if quick else SIZES
    repeats = repeats or (3 if quick else 5)
    jobs = jobs or (4 if quick else 20)
    rounds = rounds or (1 if quick else 2)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        stack = Stack(server, Path(tmp))
        try:
            stack.start_api()
            rows = metric_reads(stack, sizes, repeats)
            rows += job_throughput(stack, jobs, rounds)
        finally:
            stack.stop()
            server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1k and 10k steps, 3 repeats, 4 jobs, one round")
    parser.add_argument("--repeats", type=int, help="metric reads per size (default 5, quick 3)")
    parser.add_argument("--jobs", type=int, help="jobs per batch (default 20, quick 4)")
    parser.add_argument("--rounds", type=int, help="2-worker/1-worker rounds (default 2, quick 1)")
    args = parser.parse_args()
    rows = run(args.quick, args.repeats, args.jobs, args.rounds)
    print(f"# Scaling — {report.machine()}")
    print(report.table(rows))


if __name__ == "__main__":
    main()

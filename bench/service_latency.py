"""Service latency on a warm CPU worker, through real processes.

1. Metric delivery: from a step's end (its record's `time`, stamped in the
   worker) to its SSE event at a client; p50 and p95. Goal: p95 <= 100 ms.
2. Dequeue to first step: from RQ's dequeue (`started_at`) to the start of the
   job's step 1. Goal: <= 2 s.

    python -m bench.service_latency [--jobs 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import redis
from rq.job import Job as RQJob

from tests.stack import RedisServer, Stack, iter_sse

SPEC = {"model": {"name": "mlp"}, "precision_policy": "float32", "training": {"steps": 1500},
        "dataset": {"samples": 2048}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        stack = Stack(server, Path(tmp))
        try:
            stack.start_api()
            stack.start_worker()
            latencies, startups = [], []
            raw = redis.Redis.from_url(server.url)
            with stack.client() as client:
                for _ in range(args.jobs):
                    job_id = client.post("/jobs", json=SPEC).json()["id"]
                    for event, _, data, arrived in iter_sse(client, f"/jobs/{job_id}/metrics/stream"):
                        if event == "metrics":
                            latencies.append((arrived - json.loads(data)["time"]) * 1000)
                        if event == "end":
                            break
                    first = client.get(f"/jobs/{job_id}/metrics", params={"limit": 1}).json()["points"][0]
                    dequeued = RQJob.fetch(job_id, connection=raw).started_at
                    assert dequeued is not None
                    startups.append(first["time"] - first["step_time_ms"] / 1000 - dequeued.timestamp())
        finally:
            stack.stop()
            server.stop()
    p50, p95 = percentile(latencies, 50), percentile(latencies, 95)
    print(f"# Service latency — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{args.jobs} jobs of {SPEC['training']['steps']} float32 mlp steps")  # type: ignore[index]
    print("| measure | p50 | p95 | max | goal | met |")
    print("|---|---:|---:|---:|---|---|")
    print(f"| step end -> SSE event (ms), {len(latencies)} events | {p50:.1f} | {p95:.1f} | {max(latencies):.1f} "
          f"| p95 <= 100 ms | {'yes' if p95 <= 100 else 'NO'} |")
    s50 = statistics.median(startups)
    print(f"| dequeue -> first step (s), {len(startups)} jobs | {s50:.2f} | {percentile(startups, 95):.2f} "
          f"| {max(startups):.2f} | <= 2 s | {'yes' if max(startups) <= 2 else 'NO'} |")


if __name__ == "__main__":
    main()

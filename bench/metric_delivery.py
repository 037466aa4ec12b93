"""Metric delivery, through real processes.

1. Latency from a step's end (its record's `time`, stamped in the worker) to
   its SSE event at a client: p50 and p95 over every step of several float32
   mlp jobs on a warm CPU worker, at the engine's automatic steps per call
   (worker/engine/stepper.py: calls of about 20 ms, whose steps are reported
   once the call ends). Goal: p95 <= one call plus 100 ms, 120 ms. (Both ends
   read the same machine's clock.)
2. Throughput: step records per second that one job's `RedisReporter` pushes
   into Redis (batches of `report_max_records`, as the worker sends them),
   against `redis-benchmark`'s XADD rate on the same server with the same
   payload size and the same pipeline depth. Medians over repeats, alternating.

    python -m bench.metric_delivery [--repeats 3] [--quick]
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from app.core.config import Settings
from app.store import JobStore
from app.store.keys import job_key, metrics_key, rollup_key
from bench.report import Row, cli, median, percentile
from mpjobs.contract.records import StepRecord
from scripts.stack import RedisServer, Stack, iter_sse
from worker.engine.stepper import TARGET_CALL_S

SPEC: dict[str, Any] = {"model": {"name": "mlp"}, "precision_policy": "float32", "training": {"steps": 1500},
                        "dataset": {"samples": 2048}}
GOAL_P95_MS = 100.0 + TARGET_CALL_S * 1000
"""One call (a step waits on the device for the rest of its call) plus 100 ms."""


def sse_latencies(server: RedisServer, tmp: Path, jobs: int, steps: int) -> list[float]:
    stack = Stack(server, tmp)
    spec = {**SPEC, "training": {"steps": steps}}
    latencies: list[float] = []
    try:
        stack.start_api()
        stack.start_worker()
        with stack.client() as client:
            for _ in range(jobs):
                job_id = client.post("/jobs", json=spec).json()["id"]
                for event, _, data, arrived in iter_sse(client, f"/jobs/{job_id}/metrics/stream"):
                    if event == "metrics":
                        latencies.append((arrived - json.loads(data)["time"]) * 1000)
                    if event == "end":
                        break
    finally:
        stack.stop()
    return latencies


def _record(step: int) -> StepRecord:
    return StepRecord(step=step, loss=2.302585092994046 / (1 + step * 1e-4), loss_scale=32768.0,
                      grad_norm=0.123456789, grads_finite=True, skipped=False, zero_grad_fraction=0.000123,
                      learning_rate=0.001, examples_per_sec=16543.21, step_time_ms=1.934, time=time.time())


def reporter_rate(store: JobStore, records: int, batch: int) -> float:
    """Records/s through RedisReporter.steps, for a fresh job id."""
    from worker.telemetry.redis_reporter import RedisReporter

    job_id = f"bench-{time.monotonic_ns()}"
    store.redis.hset(job_key(job_id), mapping={"id": job_id, "step": 0})
    reporter = RedisReporter(store, job_id)
    prepared = [_record(step) for step in range(1, records + 1)]
    start = time.perf_counter()
    for i in range(0, records, batch):
        reporter.steps(prepared[i:i + batch])
    elapsed = time.perf_counter() - start
    assert not reporter.pending
    store.redis.delete(job_key(job_id), metrics_key(job_id), rollup_key(job_id))
    return records / elapsed


def redis_benchmark_xadd(port: int, records: int, pipeline: int, payload: str) -> float:
    """redis-benchmark's XADD requests/s with our payload and pipeline depth."""
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-n", str(records), "-P", str(pipeline), "-c", "1",
         "-q", "XADD", "bench:xadd", "*", "r", payload],
        capture_output=True, text=True, check=True, timeout=300).stdout
    found = re.findall(r"([\d.]+) requests per second", out.replace(",", ""))
    assert found, out
    subprocess.run(["redis-cli", "-p", str(port), "DEL", "bench:xadd"], capture_output=True, check=True)
    return float(found[-1])


def run(quick: bool = False, repeats: int = 3) -> list[Row]:
    if shutil.which("redis-benchmark") is None:
        raise SystemExit("redis-benchmark is missing: apt-get install redis-tools (make bench does it)")
    jobs, steps, records = (1, 300, 20_000) if quick else (5, 1500, 100_000)
    batch = Settings().report_max_records
    payload = _record(1).model_dump_json()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        try:
            latencies = sse_latencies(server, Path(tmp), jobs, steps)
            store = JobStore(server.client())
            ours, theirs, ratios = [], [], []
            for _ in range(repeats):
                ours.append(reporter_rate(store, records, batch))
                theirs.append(redis_benchmark_xadd(server.port, records, batch, payload))
                ratios.append(ours[-1] / theirs[-1])
        finally:
            server.stop()
    p50, p95 = percentile(latencies, 50), percentile(latencies, 95)
    return [
        Row("metric delivery", f"step end -> SSE event p50, {len(latencies)} events", "", None, p50, "ms", None),
        Row("metric delivery", f"step end -> SSE event p95, {len(latencies)} events", "goal", GOAL_P95_MS, p95, "ms",
            p95 / GOAL_P95_MS, f"p95 <= {GOAL_P95_MS:g} ms (one call + 100 ms)", p95 <= GOAL_P95_MS),
        Row("metric delivery", f"RedisReporter records/s (batches of {batch}, {len(payload)} B each)",
            f"redis-benchmark XADD -P {batch}", median(theirs), median(ours), "records/s", median(ratios)),
    ]


if __name__ == "__main__":
    cli("Metric delivery", __doc__, run)

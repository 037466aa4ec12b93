"""A 100,000-step loss series read back for a chart: the mpjobs API against a local MLflow tracking server.

Real processes on this machine: a private redis-server and `uvicorn app.main:app` (as in
`bench.archived_reads`), and `mlflow server --backend-store-uri sqlite:///...` on a free port. mpjobs
holds two 100,000-step jobs written by the worker's own `RedisReporter`: one still running, one ended and
archived (its reads come from Parquet). MLflow holds the same losses (NaN where a step was skipped),
logged with `log_batch` 1,000 at a time. One client asks, in rotated order each round:

- mpjobs `GET /jobs/{id}/metrics?max_points=500`, its cached view dropped first (what the dashboard's
  chart asks; the cost of cutting the view itself), the JSON parsed;
- MLflow `MlflowClient.get_metric_history` (every point, the client's pages of 25,000 included);
- MLflow `get-history-bulk-interval` with `max_results=500` (the sampled read its own UI's charts make),
  the JSON parsed.

Rows: p50 and p99 of each. The cheap reads run `READS` times a round, `get_metric_history` once.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis

from app.store import JobStore
from app.store.keys import view_fresh_key, view_key
from app.store.retention import Archiver
from bench.api_throughput import BUCKETS_P99_GOAL_MS, MAX_POINTS, finished_job, record, running_job
from bench.loadgen import redis_server, serve
from bench.report import Row, percentile
from scripts.stack import free_port, wait_until

BENCH = "peers: history"
LOG_BATCH = 1000
"""MLflow's most metrics per log_batch call."""
READS = 10
"""Reads of each cheap side per round."""


@contextmanager
def mlflow_server(folder: Path) -> Iterator[Callable[[], str]]:
    """`mlflow server` with a SQLite backend, started in its own process group at once (it takes tens of
    seconds to create its tables); yields a function that waits until it answers and returns its URL."""
    port = free_port()
    with open(folder / "mlflow-server.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
             "--default-artifact-root", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            # Tracking only: no job runner and queue consumers (GenAI jobs) beside it.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server exited: see {folder / 'mlflow-server.log'}")
        try:
            return httpx.get(f"{url}/health").status_code == 200
        except httpx.TransportError:
            return False

    def ready() -> str:
        wait_until(answers, 180, "mlflow server")
        return url

    try:
        yield ready
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # its uvicorn is a child in the same group
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def log_history(url: str, steps: int) -> str:
    """A new MLflow run holding steps 1..`steps` of `bench.api_throughput.record`'s loss; its run id."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(tracking_uri=url)
    run = client.create_run(client.create_experiment("history"))
    stamp, t0 = int(time.time() * 1000), time.time()
    for first in range(1, steps + 1, LOG_BATCH):
        losses = [(step, record(step, t0).loss) for step in range(first, min(first + LOG_BATCH, steps + 1))]
        client.log_batch(run.info.run_id, metrics=[
            Metric("loss", math.nan if loss is None else loss, stamp, step) for step, loss in losses])
    return str(run.info.run_id)


def _timed_ms(read: Callable[[], int]) -> tuple[float, int]:
    """(milliseconds, points returned)."""
    start = time.perf_counter()
    points = read()
    return (time.perf_counter() - start) * 1000, points


def _measure(reads: dict[str, Callable[[], int]], full: str, rounds: int, repeat: int
             ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Milliseconds per read of each side, and the points it returned: `rounds` rounds in rotated order,
    `repeat` reads of each side a round but `full` (once)."""
    times: dict[str, list[float]] = {name: [] for name in reads}
    points = {name: read() for name, read in reads.items()}  # warm: every path run once
    order = list(reads.items())
    for i in range(rounds):
        for name, read in order[i % len(order):] + order[:i % len(order)]:
            for _ in range(1 if name == full else repeat):
                elapsed, points[name] = _timed_ms(read)
                times[name].append(elapsed)
    return times, points


def run(quick: bool = False, rounds: int | None = None) -> list[Row]:
    """Quick: 5,000-step histories (past the 4,096 steps where views switch to rollups), 2 rounds of 3 cheap reads."""
    from mlflow import MlflowClient

    steps = 5_000 if quick else 100_000
    rounds = rounds or (2 if quick else 6)
    with tempfile.TemporaryDirectory() as tmp, mlflow_server(Path(tmp)) as mlflow_ready, \
            redis_server() as (server, env):
        client_redis, rq_redis = server.client(), redis.Redis.from_url(server.url)
        store = JobStore(client_redis, Path(env["ARTIFACTS_DIR"]))
        with serve("app.main:app", env, Path(tmp) / "api.log") as api, \
                httpx.Client(base_url=api.url, timeout=60) as client:
            started = time.perf_counter()
            running = running_job(client, store, rq_redis, steps)
            written_s = time.perf_counter() - started
            archived = finished_job(client, store, rq_redis, steps)
            assert Archiver(store, retention_s=0).archive(archived) == "archived"
            ml_url = mlflow_ready()
            started = time.perf_counter()
            run_id = log_history(ml_url, steps)
            logged_s = time.perf_counter() - started
            tracking = MlflowClient(tracking_uri=ml_url)

            def view(job_id: str) -> Callable[[], int]:
                def read() -> int:
                    client_redis.delete(view_key(job_id, MAX_POINTS), view_fresh_key(job_id, MAX_POINTS))
                    response = client.get(f"/jobs/{job_id}/metrics", params={"max_points": MAX_POINTS})
                    response.raise_for_status()
                    return len(response.json()["buckets"])
                return read

            def sampled() -> int:
                response = httpx.get(f"{ml_url}/api/2.0/mlflow/metrics/get-history-bulk-interval", timeout=600,
                                     params={"run_ids": run_id, "metric_key": "loss", "max_results": MAX_POINTS})
                response.raise_for_status()
                return len(response.json()["metrics"])

            full = "MLflow MlflowClient.get_metric_history, every point"
            times, points = _measure({
                f"mpjobs GET /jobs/{{id}}/metrics?max_points={MAX_POINTS}, job running": view(running),
                f"mpjobs GET /jobs/{{id}}/metrics?max_points={MAX_POINTS}, job ended and archived": view(archived),
                f"MLflow get-history-bulk-interval, max_results={MAX_POINTS}": sampled,
                full: lambda: len(tracking.get_metric_history(run_id, "loss")),
            }, full, rounds, 3 if quick else READS)
    return _rows(steps, times, points) + [
        Row(BENCH, f"write the {steps:,}-step series: MLflow log_batch, {LOG_BATCH:,} metrics a call, over HTTP "
            f"(the loss only)", "mpjobs RedisReporter straight into Redis (every field of every step)", written_s,
            logged_s, "s", logged_s / written_s)]


def _rows(steps: int, times: dict[str, list[float]], points: dict[str, int]) -> list[Row]:
    full = next(name for name in times if "get_metric_history" in name)
    rows = []
    for name, ms in times.items():
        for q in (50, 99):
            value = percentile(ms, q)
            mpjobs = name.startswith("mpjobs")
            goal = f"<= {BUCKETS_P99_GOAL_MS:.0f} ms" if mpjobs and q == 99 else ""
            baseline = None if name == full else percentile(times[full], q)
            rows.append(Row(BENCH, f"{name}: p{q} of {len(ms)} reads of a {steps:,}-step loss series, "
                            f"{points[name]:,} points returned", "MLflow get_metric_history" if baseline else "—",
                            baseline, value, "ms", None if baseline is None else value / baseline, goal,
                            value <= BUCKETS_P99_GOAL_MS if goal else None))
    return rows

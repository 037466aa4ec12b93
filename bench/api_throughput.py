"""API throughput under load, against a bare FastAPI app doing one Redis GET.

Real processes: a private redis-server, `uvicorn app.main:app` and
`uvicorn bench.baseline_app:app` with the same options (one process, 127.0.0.1,
`--log-level warning --no-access-log`), and `wrk` as the client. No worker
runs. A 100,000-step job is written straight into Redis by the worker's own
`RedisReporter`, so its rollups are cut exactly as in production, then marked
succeeded (its bucketed view is then cached after the first read); a second
100,000-step job stays `running`, so its view is computed on every request; a
third job stays queued, so `GET /jobs/{id}` also takes the "is any worker
listening?" path.

Each repeat loads the baseline, then every endpoint, one after the other, so a
ratio compares runs seconds apart; the table shows medians over the repeats and
the median of the per-repeat ratios. Client and server share the machine's
cores (2 on the project's VM): wrk takes one thread, the API one Python process.

Goals: `GET /jobs/{id}` at >= 0.70x the baseline's req/s; the 500-bucket view
of a 100k-step run (running and ended) at p99 <= 100 ms, under the same `-c8`
load as every other row and for a lone client (`-c1`).

    python -m bench.api_throughput [--quick] [--duration 10] [--repeats 3]

wrk is Debian's package: `apt-get install -y wrk`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import redis
from rq import Queue

from app.core import clock
from app.core.job import JobState, WorkerInfo
from app.core.records import StepRecord, Summary
from app.store import JobStore
from bench import baseline_app, report
from bench.report import Row
from tests.stack import ROOT, RedisServer, free_port, wait_until
from worker.reporter import RedisReporter

BENCH = "api throughput"
WRK_INSTALL = "apt-get install -y wrk"
UVICORN_OPTIONS = ("--host", "127.0.0.1", "--log-level", "warning", "--no-access-log")
"""Both servers run with exactly these; access logging off on both (production's uvicorn logs
every request: that cost is not what this compares)."""
WRK_THREADS = 1
"""One client thread leaves the other core to the server; wrk's one thread outruns a Python server."""
CONNECTIONS = 8
"""Enough to keep one uvicorn process busy at all times; more only lengthens the queue."""
RATIO_GOAL = 0.70
BUCKETS_P99_GOAL_MS = 100.0
MAX_POINTS = 500
PAGE = 1000
BATCH = 256
"""Records per reporter batch: the worker's REPORT_MAX_RECORDS."""


@dataclass(frozen=True)
class Load:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    """Non-2xx answers plus socket errors."""
    server_cpu_us: float | None = None
    """The server process's CPU time (user + system) per request: steadier than req/s on a busy machine."""


@dataclass(frozen=True)
class Server:
    url: str
    pid: int


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    server: Server
    connections: int = CONNECTIONS


def _ms(text: str) -> float:
    """wrk's `817.00us`, `3.94ms`, `1.26s` or `1.02m` in milliseconds."""
    found = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if found is None:
        raise ValueError(f"Expected a wrk duration such as 3.94ms. Received: {text!r}")
    number, unit = float(found.group(1)), found.group(2)
    return {"us": number / 1000, "ms": number, "s": number * 1000, "m": number * 60_000}[unit]


def parse_wrk(output: str) -> Load:
    """Req/s, p50, p99 and errors from `wrk --latency` output."""
    rate = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M)
    p50 = re.search(r"^\s+50%\s+(\S+)", output, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", output, re.M)
    done = re.search(r"^\s+(\d+) requests in", output, re.M)
    if not (rate and p50 and p99 and done):
        raise ValueError(f"Expected wrk --latency output. Received:\n{output}")
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    sockets = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    errors = (int(non_2xx.group(1)) if non_2xx else 0) + (sum(map(int, sockets.groups())) if sockets else 0)
    return Load(float(rate.group(1)), _ms(p50.group(1)), _ms(p99.group(1)), int(done.group(1)), errors)


def require_wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit(f"wrk is not installed; it is Debian's package: {WRK_INSTALL}")
    return path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, duration_s: float, connections: int = CONNECTIONS, server_pid: int | None = None) -> Load:
    """Load `url` for `duration_s` (whole seconds, at least 1); with `server_pid`, its CPU per request too."""
    args = [require_wrk(), f"-t{WRK_THREADS}", f"-c{connections}", f"-d{max(1, round(duration_s))}s",
            "--timeout", "10s", "--latency", url]
    before = cpu_seconds(server_pid) if server_pid else 0.0
    done = subprocess.run(args, capture_output=True, text=True, check=True, timeout=duration_s + 30)
    load = parse_wrk(done.stdout)
    if load.errors:
        raise RuntimeError(f"wrk saw {load.errors} failed requests at {url}:\n{done.stdout}")
    if server_pid and load.requests:
        load = replace(load, server_cpu_us=(cpu_seconds(server_pid) - before) / load.requests * 1e6)
    return load


@contextmanager
def serve(app: str, env: dict[str, str], log: Path) -> Iterator[Server]:
    """`uvicorn APP` in its own process (one, no workers) with UVICORN_OPTIONS."""
    port = free_port()
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "uvicorn", app, *UVICORN_OPTIONS, "--port", str(port)],
                                   cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: process.poll() is None and httpx.get(f"{base}/openapi.json").status_code == 200,
                   60, app)
        yield Server(base, process.pid)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


@contextmanager
def redis_server() -> Iterator[tuple[RedisServer, dict[str, str]]]:
    """A private redis-server and the environment the API needs to use it."""
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp))
        server.start()
        env = {**os.environ, "REDIS_URL": server.url, "PYTHONPATH": str(ROOT), "API_KEYS": "",
               "ARTIFACTS_DIR": str(Path(tmp) / "artifacts"), "DATA_ROOT": str(Path(tmp) / "data")}
        try:
            yield server, env
        finally:
            server.stop()


def record(step: int, t0: float) -> StepRecord:
    """A plausible mixed_float16 step: decaying loss, a skip (and a halved scale) every 2,000 steps."""
    skipped = step % 2000 == 0
    return StepRecord(
        step=step, loss=None if skipped else 2.0 * math.exp(-step / 30_000) + 0.05 * math.sin(step),
        loss_scale=32768.0 / (1 + step // 2000 % 2), grad_norm=None if skipped else 1.0 + 0.5 * math.cos(step / 7),
        grads_finite=not skipped, skipped=skipped, zero_grad_fraction=0.002, learning_rate=0.001,
        examples_per_sec=5000.0, step_time_ms=6.4, time=t0 + step * 0.0064)


def write_steps(store: JobStore, job_id: str, steps: int) -> None:
    """Steps 1..`steps` through the worker's reporter (rollups every ROLLUP_STEPS), BATCH at a time."""
    reporter, t0 = RedisReporter(store, job_id), time.time()
    for first in range(1, steps + 1, BATCH):
        reporter.steps([record(step, t0) for step in range(first, min(first + BATCH, steps + 1))])
    assert not reporter.pending, "records left unwritten"


def create_job(client: httpx.Client, steps: int) -> str:
    spec = {"model": {"name": "mlp"}, "precision_policy": "mixed_float16", "loss_scale": "dynamic",
            "training": {"steps": steps}, "device": "cpu"}
    response = client.post("/jobs", json=spec)
    response.raise_for_status()
    return str(response.json()["id"])


def running_job(client: httpx.Client, store: JobStore, rq_redis: redis.Redis, steps: int) -> str:
    """A job `running` with `steps` steps written, its RQ entry gone: as a worker has it mid-run."""
    job_id = create_job(client, steps)
    queued = store.get(job_id)
    assert queued is not None
    Queue(queued.queue, connection=rq_redis).remove(job_id)
    worker = WorkerInfo(host="bench", pid=1, device={"kind": "cpu", "name": "bench"})
    store.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "running on bench",
                     started_at=clock.iso(), attempt=1,
                     worker=worker.model_dump_json())
    write_steps(store, job_id, steps)
    return job_id


def finished_job(client: httpx.Client, store: JobStore, rq_redis: redis.Redis, steps: int) -> str:
    """A job that ran `steps` steps and succeeded: its bucketed views are cached after their first read."""
    job_id = running_job(client, store, rq_redis, steps)
    summary = Summary(steps_done=steps, final_loss=0.08, skipped_steps=steps // 2000, loss_scale_min=16384.0,
                      loss_scale_max=32768.0, loss_scale_final=32768.0, peak_zero_grad_fraction=0.002,
                      mean_examples_per_sec=5000.0)
    moved, _ = store.transition(job_id, JobState.SUCCEEDED, [JobState.RUNNING], "finished",
                                summary=summary.model_dump_json())
    assert moved
    return job_id


def _beside_baseline(case: str, runs: list[Load], base: list[Load], figure: str, unit: str,
                     ratio_goal: float | None = None) -> Row:
    """One Load field: medians of the endpoint and the baseline, and the median of per-repeat ratios."""
    values, bases = [getattr(r, figure) for r in runs], [getattr(b, figure) for b in base]
    ratio = report.median(v / b for v, b in zip(values, bases, strict=True))
    return Row(BENCH, case, "bare FastAPI + 1 Redis GET", report.median(bases), report.median(values), unit, ratio,
               f">= {ratio_goal:.2f}x" if ratio_goal else "", ratio >= ratio_goal if ratio_goal else None)


def rows_for(target: Target, runs: list[Load], base: list[Load], steps: int) -> list[Row]:
    """Loaded: req/s (goal on GET /jobs/{id}), p99 and server CPU/request, each beside the baseline.
    One connection: the p99 a lone client sees (goal on the 100k-step bucket view), no baseline."""
    if target.connections == 1:
        lone_p99 = report.median(r.p99_ms for r in runs)
        goal = "max_points" in target.name and steps == 100_000
        return [Row(BENCH, f"{target.name}, 1 connection: p99", "none (absolute goal)", None, lone_p99, "ms", None,
                    f"<= {BUCKETS_P99_GOAL_MS:.0f} ms" if goal else "",
                    lone_p99 <= BUCKETS_P99_GOAL_MS if goal else None)]
    ratio_goal = RATIO_GOAL if target.name.startswith("GET /jobs/{id},") else None
    p99 = _beside_baseline(f"{target.name}: p99", runs, base, "p99_ms", "ms")
    if "max_points" in target.name and steps == 100_000:  # the goal holds under load too
        p99 = dataclasses.replace(p99, goal=f"<= {BUCKETS_P99_GOAL_MS:.0f} ms",
                                  met=p99.value <= BUCKETS_P99_GOAL_MS)
    return [
        _beside_baseline(f"{target.name}: req/s", runs, base, "requests_per_s", "req/s", ratio_goal),
        p99,
        _beside_baseline(f"{target.name}: server CPU/request", runs, base, "server_cpu_us", "µs"),
    ]


def run(quick: bool = False, duration_s: float | None = None, repeats: int | None = None) -> list[Row]:
    """Quick: a 10k-step job, 1 s loads, one repeat (the smoke test's size)."""
    require_wrk()
    steps = 10_000 if quick else 100_000
    duration_s = duration_s or (1.0 if quick else 10.0)
    repeats = repeats or (1 if quick else 3)
    with redis_server() as (server, env), tempfile.TemporaryDirectory() as logs:
        client_redis, rq_redis = server.client(), redis.Redis.from_url(server.url)
        client_redis.set(baseline_app.KEY, "x" * 64)
        store = JobStore(client_redis)
        with serve("app.main:app", env, Path(logs) / "api.log") as api, \
                serve("bench.baseline_app:app", env, Path(logs) / "baseline.log") as bare, \
                httpx.Client(base_url=api.url, timeout=30) as client:
            done_id = finished_job(client, store, rq_redis, steps)
            running_id = running_job(client, store, rq_redis, steps)
            queued_id = create_job(client, 200)
            size = f"{steps // 1000}k-step job"
            buckets = (f"GET /jobs/{{id}}/metrics?max_points={MAX_POINTS}, {size} running "
                       "(recomputed at most once a second)")
            buckets_url = f"{api.url}/jobs/{running_id}/metrics?max_points={MAX_POINTS}"
            cached = f"GET /jobs/{{id}}/metrics?max_points={MAX_POINTS}, {size} ended (cached)"
            cached_url = f"{api.url}/jobs/{done_id}/metrics?max_points={MAX_POINTS}"
            baseline = Target("baseline", f"{bare.url}/get", bare)
            targets = [
                Target("GET /jobs/{id}, succeeded", f"{api.url}/jobs/{done_id}", api),
                Target("GET /jobs/{id}, queued, no worker", f"{api.url}/jobs/{queued_id}", api),
                Target(f"GET /jobs/{{id}}/metrics?limit={PAGE}, {size}",
                       f"{api.url}/jobs/{done_id}/metrics?limit={PAGE}", api),
                Target(buckets, buckets_url, api),
                Target(buckets, buckets_url, api, connections=1),
                Target(cached, cached_url, api),
                Target(cached, cached_url, api, connections=1),
                Target("async variant of the baseline (redis.asyncio)", f"{bare.url}/aget", bare),
            ]
            for target in [baseline, *targets]:  # each answers 200, and is warm, before anything is timed
                httpx.get(target.url, timeout=30).raise_for_status()
                if not quick:
                    wrk(target.url, 1, target.connections)
            base: list[Load] = []
            loads: list[list[Load]] = [[] for _ in targets]
            for _ in range(repeats):
                base.append(wrk(baseline.url, duration_s, baseline.connections, bare.pid))
                for target, runs in zip(targets, loads, strict=True):
                    runs.append(wrk(target.url, duration_s, target.connections, target.server.pid))
    return [row for target, runs in zip(targets, loads, strict=True) for row in rows_for(target, runs, base, steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 10k-step job, 1 s loads, one repeat")
    parser.add_argument("--duration", type=float, help="seconds per load (default 10, quick 1)")
    parser.add_argument("--repeats", type=int, help="default 3, quick 1")
    args = parser.parse_args()
    rows = run(args.quick, args.duration, args.repeats)
    print(f"# API throughput — {report.machine()}")
    print(f"wrk -t{WRK_THREADS} -c{CONNECTIONS} (one row: -c1), client and servers sharing the same cores; "
          "each server one uvicorn process, no access log.")
    print(report.table(rows))


if __name__ == "__main__":
    main()

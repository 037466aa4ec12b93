"""Live streams for many viewers, from one API process.

Three cases, one after another in the same run against the same API process:
1. one viewer of one running job: the baseline (its delivery lag, the API's CPU and Redis
   connections, and `GET /jobs/{id}` latency with nothing else going on);
2. VIEWERS viewers of one running job;
3. VIEWERS viewers spread over JOBS running jobs.
Every viewer connects before its jobs' steps start, then must receive every step exactly once, in
order, and `end`, its body whole. The viewers are split over CLIENT_PROCESSES processes (asyncio on raw
sockets, scripts/sse_client.py), so the client side is not the bottleneck.

There is no worker: a producer process writes each job's steps as a worker does (RedisReporter, a batch
every REPORT_INTERVAL_S) at STEPS_PER_S a job, each record stamped with its write time. So 50 jobs can
run at once on any machine, and the API's side is all that is measured:
- delivery lag: a record's write time to its arrival at a viewer, p50 and p95 over every event;
- the API's CPU (cores, from /proc) and the Redis connections it holds (CLIENT LIST) while they stream;
- `GET /jobs/{id}` latency, one request every 50 ms while they stream.

    python -m bench.fanout [--quick]
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import httpx
import redis

from app.core.config import Settings
from app.store import JobStore
from bench.report import Row, cli, percentile
from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import StepRecord, Summary
from scripts.sse_client import open_stream
from scripts.stack import RedisServer, Stack

VIEWERS, JOBS, STEPS_PER_S, STEPS, CLIENT_PROCESSES = 1000, 50, 20, 200, 4
QUICK = (20, 2, 40, 40, 2)
SPEC = {"model": {"name": "cnn"}, "precision_policy": "float32", "training": {"steps": 100_000}}
BENCH = "bench-fanout"
"""The CLIENT SETNAME of this benchmark's own Redis connections, left out of the API's count."""


def _record(step: int) -> StepRecord:
    return StepRecord(step=step, loss=2.302585092994046 / (1 + step * 1e-4), loss_scale=32768.0,
                      grad_norm=0.123456789, grads_finite=True, skipped=False, zero_grad_fraction=0.000123,
                      learning_rate=0.001, examples_per_sec=16543.21, step_time_ms=1.934, time=time.time())


def produce(url: str, job_ids: list[str], steps: int, steps_per_s: float) -> None:
    """Every job's steps 1..`steps` at `steps_per_s`, a RedisReporter batch per job every report interval; then
    each job succeeds."""
    from worker.telemetry.redis_reporter import RedisReporter

    store = JobStore(redis.Redis.from_url(url, decode_responses=True, client_name=BENCH))
    reporters = {job_id: RedisReporter(store, job_id) for job_id in job_ids}
    interval, start, done = Settings().report_interval_s, time.monotonic(), 0
    while done < steps:
        due = min(steps, int((time.monotonic() - start) * steps_per_s))
        if due > done:
            for reporter in reporters.values():
                reporter.steps([_record(step) for step in range(done + 1, due + 1)])
            done = due
        time.sleep(interval)
    summary = Summary(steps_done=steps, final_loss=1.0, skipped_steps=0, loss_scale_min=1.0, loss_scale_max=1.0,
                      loss_scale_final=1.0, peak_zero_grad_fraction=0.0, mean_examples_per_sec=1.0, diagnoses=[])
    for job_id in job_ids:
        store.jobs.transition(job_id, JobState.SUCCEEDED, [JobState.RUNNING], "finished",
                              summary=summary.model_dump_json())


@dataclass
class Seen:
    """What one client process saw: streams whole with every step once and `end`, the others, every lag (s)."""

    good: int
    bad: list[str]
    lags: list[float]


def view(port: int, job_ids: list[str], steps: int, ready: Queue[str], results: Queue[Seen]) -> None:
    """A client process: a stream per job id in `job_ids` (repeats allowed), read to the end."""

    async def run() -> Seen:
        streams = await asyncio.gather(*(open_stream("127.0.0.1", port, f"/jobs/{j}/metrics/stream") for j in job_ids))
        refused = [f"HTTP {s.status}: {s.body[:200]!r}" for s in streams if s.status != 200]
        ready.put("ready" if not refused else refused[0])

        async def drain(stream: Any) -> None:
            async for _ in stream.events():
                pass

        await asyncio.gather(*(drain(s) for s in streams if s.status == 200))
        seen = Seen(0, refused, [])
        for stream in streams:
            if stream.status != 200:
                continue
            if not stream.whole or stream.steps() != list(range(1, steps + 1)) or stream.received[-1].kind != "end":
                last = stream.received[-1].data[:200] if stream.received else "nothing"
                seen.bad.append(f"whole={stream.whole} steps={len(stream.steps())} last={last}")
                continue
            seen.good += 1
            seen.lags += [e.at - json.loads(e.data)["time"] for e in stream.received if e.kind == "metrics"]
        return seen

    results.put(asyncio.run(run()))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def api_connections(server: RedisServer) -> int:
    clients = server.client().client_list()
    return sum(1 for c in clients if c["name"] != BENCH and c["cmd"] != "client|list")


@dataclass
class Case:
    name: str
    viewers: int
    good: int
    bad: list[str]
    lag_p50: float
    lag_p95: float
    cpu_cores: float
    connections: int
    get_p50: float
    get_p95: float
    get_ok: int
    get_failed: list[str]
    """The probe's requests that got no 200 (their status, or the error)."""


def run_case(stack: Stack, name: str, viewers: int, jobs: int, scale: tuple[int, ...]) -> Case:
    _, _, steps_per_s, steps, processes = scale
    store = JobStore(redis.Redis.from_url(stack.redis.url, decode_responses=True, client_name=BENCH))
    with stack.client() as http:
        job_ids = [http.post("/jobs", json=SPEC).json()["id"] for _ in range(jobs)]
    for job_id in job_ids:
        store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "running")
    watched = [job_ids[n % jobs] for n in range(viewers)]
    spawn = multiprocessing.get_context("spawn")
    ready: Queue[str] = spawn.Queue()
    results: Queue[Seen] = spawn.Queue()
    shares = [watched[p::processes] for p in range(min(processes, viewers))]
    clients = [spawn.Process(target=view, args=(stack.port, share, steps, ready, results)) for share in shares]
    for client in clients:
        client.start()
    answers = [ready.get(timeout=300) for _ in clients]
    assert set(answers) == {"ready"}, answers
    latencies: list[float] = []
    failed: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        with stack.client() as http:
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    answer = http.get(f"/jobs/{job_ids[0]}")
                except httpx.HTTPError as exc:
                    failed.append(type(exc).__name__)
                    continue
                if answer.status_code == 200:
                    latencies.append(time.perf_counter() - start)
                else:
                    failed.append(str(answer.status_code))
                time.sleep(0.05)

    assert stack.api is not None
    producer = spawn.Process(target=produce, args=(stack.redis.url, job_ids, steps, steps_per_s))
    prober = threading.Thread(target=probe)
    cpu, wall = cpu_seconds(stack.api.pid), time.monotonic()
    producer.start()
    prober.start()
    time.sleep(steps / steps_per_s / 2)
    connections = api_connections(stack.redis)
    producer.join()
    cpu, wall = cpu_seconds(stack.api.pid) - cpu, time.monotonic() - wall
    stop.set()
    prober.join()
    seen = [results.get(timeout=300) for _ in clients]
    for client in clients:
        client.join()
    lags = [lag for s in seen for lag in s.lags] or [float("nan")]
    answered = latencies or [float("nan")]
    return Case(name, viewers, sum(s.good for s in seen), [b for s in seen for b in s.bad],
                percentile(lags, 50) * 1000, percentile(lags, 95) * 1000, cpu / wall, connections,
                percentile(answered, 50) * 1000, percentile(answered, 95) * 1000, len(latencies), failed)


def rows(base: Case, case: Case) -> list[Row]:
    b = "fanout"
    one = f"1 viewer ({base.name})"
    return [
        Row(b, f"{case.name}: streams whole, every step once, `end`", "streams opened", case.viewers, case.good,
            "streams", case.good / case.viewers, "all", case.good == case.viewers and not case.bad),
        Row(b, f"{case.name}: delivery lag p50", one, base.lag_p50, case.lag_p50, "ms", case.lag_p50 / base.lag_p50),
        Row(b, f"{case.name}: delivery lag p95", one, base.lag_p95, case.lag_p95, "ms", case.lag_p95 / base.lag_p95),
        Row(b, f"{case.name}: API CPU", one, base.cpu_cores, case.cpu_cores, "cores", case.cpu_cores / base.cpu_cores),
        Row(b, f"{case.name}: API's Redis connections", one, base.connections, case.connections, "connections",
            case.connections / base.connections, "no more than with 1 viewer", case.connections <= base.connections),
        Row(b, f"{case.name}: GET /jobs/{{id}} answered 200", "requests sent", case.get_ok + len(case.get_failed),
            case.get_ok, "requests", case.get_ok / max(1, case.get_ok + len(case.get_failed)), "all",
            not case.get_failed),
        Row(b, f"{case.name}: GET /jobs/{{id}} p50", one,
            base.get_p50, case.get_p50, "ms", case.get_p50 / base.get_p50),
        Row(b, f"{case.name}: GET /jobs/{{id}} p95", one,
            base.get_p95, case.get_p95, "ms", case.get_p95 / base.get_p95),
    ]


def run(quick: bool = False, repeats: int = 1) -> list[Row]:
    scale = QUICK if quick else (VIEWERS, JOBS, STEPS_PER_S, STEPS, CLIENT_PROCESSES)
    viewers, jobs = scale[0], scale[1]
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis")
        (Path(tmp) / "redis").mkdir()
        server.start()
        stack = Stack(server, Path(tmp) / "stack")
        stack.env["MAX_STREAMS"] = str(max(2000, viewers + 10))
        try:
            stack.start_api()
            httpx.get(f"{stack.base_url}/healthz").raise_for_status()
            base = run_case(stack, "1 job", 1, 1, scale)
            one_job = run_case(stack, f"{viewers} viewers, 1 job", viewers, 1, scale)
            spread = run_case(stack, f"{viewers} viewers over {jobs} jobs", viewers, jobs, scale)
        finally:
            stack.stop()
            server.stop()
    for case in (base, one_job, spread):
        print(f"# {case.name}: {case.good}/{case.viewers} streams good; {len(case.bad)} bad: {case.bad[:3]}",
              flush=True)
    return rows(base, one_job) + rows(base, spread)


if __name__ == "__main__":
    cli("Live streams for many viewers", __doc__, run)

"""Service overhead: one job through the whole service against the engine run locally.

The same spec both ways. Baseline: `run_job` in this process, warm (TensorFlow
imported, one warm-up run done), timed from the call to its return. Service:
from just before `POST /jobs` to the moment the client reads the `end` event on
the job's SSE stream, with a warm worker (one warm-up job done). Runs
alternate local/service; figures are medians over the repeats.

The service time is split with the timestamps the system records:

- queue wait: job created (API) -> dequeued by the worker (RQ's `started_at`)
- worker start-up: dequeued -> step 1 begins (spec load, model build, data)
- training: step 1 begins -> last step ends
- finishing: last step ends -> `succeeded` recorded (final checkpoint, model save)
- delivery: `succeeded` recorded -> the client reads `end`

Goal: no more than 2 s extra over the local run on a warm worker.

Time to the first step at any length: dequeued -> step 1 begins for the same spec at 300
and at 50,000 steps (the long job is canceled after its first step), in turns. Goal: the
long job's start-up within 1.2x the short one's (it used to gather up to 256 MiB of batches
first: 2.3 s at 300 steps, 6.5-7 s at 5,000).

    python -m bench.service_overhead [--repeats 5] [--quick]
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import redis  # noqa: E402
from rq.job import Job as RQJob  # noqa: E402

from bench.report import Row, cli, median  # noqa: E402
from scripts.stack import Stack, iter_sse, private_stack  # noqa: E402

GOAL_EXTRA_S = 2.0
LONG_STEPS = 50_000
GOAL_START_RATIO = 1.2
SPEC: dict[str, Any] = {"model": {"name": "mlp"}, "precision_policy": "float32",
                        "training": {"steps": 300, "checkpoint_every": 100}, "dataset": {"samples": 2048}}
PHASES = ("queue wait", "worker start-up", "training", "finishing", "delivery")


def local_run(spec_json: dict[str, Any]) -> tuple[float, float]:
    """(wall seconds, training seconds) of `run_job` in this (warm) process."""
    from app.core.config import Settings
    from mpjobs.contract.spec import JobSpec
    from worker.engine.training import run_job
    from worker.telemetry.reporters import ListReporter

    spec = JobSpec.model_validate(spec_json)
    reporter = ListReporter()
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        run_job(spec, reporter=reporter, checkpoint_dir=Path(out), settings=Settings())
        wall = time.perf_counter() - start
    first, last = reporter.records[0], reporter.records[-1]
    return wall, last.time - (first.time - first.step_time_ms / 1000)


def service_run(stack: Stack, raw: redis.Redis, spec: dict[str, Any]) -> tuple[float, dict[str, float]]:
    with stack.client() as client:
        start = time.time()
        job_id = client.post("/jobs", json=spec).json()["id"]
        for event, _, data, arrived in iter_sse(client, f"/jobs/{job_id}/metrics/stream"):
            if event == "end":
                assert '"succeeded"' in data, data
                end = arrived
                break
        job = client.get(f"/jobs/{job_id}").json()
        first = client.get(f"/jobs/{job_id}/metrics", params={"limit": 1}).json()["points"][0]
        last = client.get(f"/jobs/{job_id}/metrics", params={"after": spec["training"]["steps"] - 1}
                          ).json()["points"][0]
    dequeued = RQJob.fetch(job_id, connection=raw).started_at
    assert dequeued is not None
    created = datetime.fromisoformat(job["created_at"]).timestamp()
    finished = datetime.fromisoformat(job["finished_at"]).timestamp()
    step1 = first["time"] - first["step_time_ms"] / 1000
    phases = {"queue wait": dequeued.timestamp() - created, "worker start-up": step1 - dequeued.timestamp(),
              "training": last["time"] - step1, "finishing": finished - last["time"], "delivery": end - finished}
    return end - start, phases


def start_up(stack: Stack, raw: redis.Redis, spec: dict[str, Any]) -> float:
    """Seconds from dequeue to the beginning of step 1; a job still running then is canceled."""
    with stack.client() as client:
        job_id = client.post("/jobs", json=spec).json()["id"]
        deadline = time.monotonic() + 120
        while not (points := client.get(f"/jobs/{job_id}/metrics", params={"limit": 1}).json()["points"]):
            assert time.monotonic() < deadline, f"job {job_id} trained no step within 120 s"
            time.sleep(0.02)
        client.delete(f"/jobs/{job_id}")
        stack.wait_for_state(client, job_id, {"succeeded", "canceled", "failed"})
    dequeued = RQJob.fetch(job_id, connection=raw).started_at
    assert dequeued is not None
    return float(points[0]["time"] - points[0]["step_time_ms"] / 1000 - dequeued.timestamp())


def run(quick: bool = False, repeats: int = 5) -> list[Row]:
    spec = {**SPEC, "training": {**SPEC["training"], "steps": 60 if quick else SPEC["training"]["steps"]}}
    repeats = 1 if quick else repeats  # quick: one pair of each, for a smoke check
    local_run(spec)  # warm: TensorFlow's graphs and the allocator, as a long-lived worker has them
    locals_, services, extras, phases = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp, private_stack(Path(tmp)) as stack:
        raw = redis.Redis.from_url(stack.redis.url)
        service_run(stack, raw, spec)  # warm the worker the same way
        for _ in range(repeats):
            wall, _ = local_run(spec)
            total, split = service_run(stack, raw, spec)
            locals_.append(wall)
            services.append(total)
            extras.append(total - wall)
            phases.append(split)
        shorts, longs = [], []
        for _ in range(repeats):  # in turns: a slower minute on this machine slows both
            shorts.append(start_up(stack, raw, spec))
            longs.append(start_up(stack, raw, {**spec, "training": {**spec["training"], "steps": LONG_STEPS}}))
    local, service, extra = median(locals_), median(services), median(extras)
    case = f"mlp float32, {spec['training']['steps']} steps"
    rows = [Row("service overhead", f"{case}: POST -> end event", "local run_job (warm)", local, service, "s",
                service / local, f"extra <= {GOAL_EXTRA_S:g} s (extra {extra:.2f} s)", extra <= GOAL_EXTRA_S)]
    for name in PHASES:
        rows.append(Row("service overhead", f"  {name}", "", None, median(p[name] for p in phases), "s", None))
    ratio = median(long / short for short, long in zip(shorts, longs, strict=True))
    rows.append(Row("service overhead", f"dequeue -> step 1, {LONG_STEPS:,} steps",
                    f"{spec['training']['steps']} steps", median(shorts), median(longs), "s", ratio,
                    f"<= {GOAL_START_RATIO:g}x the short run's", ratio <= GOAL_START_RATIO))
    return rows


if __name__ == "__main__":
    cli("Service overhead", __doc__, run)

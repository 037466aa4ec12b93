"""Redis memory per job, measured: MEMORY USAGE of each key of real jobs, per step and per layer check.

    python -m bench.redis_memory [--steps 1000] [--views-only]

Runs jobs of `--steps` steps on a private Redis and one worker (float32: no layer checks;
mixed_bfloat16, fast on a CPU: layer checks at step 1 and every 100 steps), reads each job's cached
`max_points` views (500 and 1000, as the dashboard does), then prints what each key of each job
holds, and the arithmetic of docs/reliability.md: a 10,000-step job, 1,000 of them, and the maxmemory
that implies; and what an ended job's cached views add while they are kept (VIEW_TTL_S, 24 h).
A view's size depends on its number of buckets, not on the model: beyond 4,096 steps a bucket is
never finer than one 64-step rollup. So the views are also measured for runs of VIEW_RUNS steps,
written straight into Redis by the worker's reporter (as bench.api_throughput does), on a private
Redis and API with no worker (`--views-only`: only these).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import httpx
import redis

from app.api.services import CACHED_VIEW_SIZES
from app.store import JobStore
from app.store.keys import events_key, job_key, layers_key, metrics_key, rollup_key, view_fresh_key, view_key
from bench.api_throughput import finished_job
from bench.loadgen import redis_server, serve
from scripts.stack import private_stack

JOBS: dict[str, dict[str, Any]] = {
    "mlp float32": {"model": {"name": "mlp"}, "precision_policy": "float32"},
    "mlp mixed_bfloat16": {"model": {"name": "mlp"}, "precision_policy": "mixed_bfloat16"},
    "cnn mixed_bfloat16": {"model": {"name": "cnn"}, "precision_policy": "mixed_bfloat16"},
}
VIEW_RUNS = (1_000, 4_096, 10_000, 32_000, 64_000, 100_000)
"""Run lengths whose cached views are measured: at most 4,096 steps, a view has min(steps, max_points)
buckets; beyond, about min(steps / 64, max_points)."""
HEADROOM = 0.9
"""REDIS_MEMORY_HIGH_WATER's default: new jobs stop at 90% of maxmemory."""


def measure(steps: int) -> dict[str, dict[str, int]]:
    """{job: {key kind: bytes}} for one job of each kind, trained to the end on a worker of its own."""
    found: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp, private_stack(Path(tmp), workers=1) as stack:
        r = stack.redis.client()
        with stack.client() as client:
            for name, spec in JOBS.items():
                job_id = client.post("/jobs", json={**spec, "training": {"steps": steps},
                                                    "dataset": {"samples": 256}}).json()["id"]
                job = stack.wait_for_state(client, job_id, {"succeeded", "failed"}, timeout=1800)
                assert job["state"] == "succeeded", job
                keys = {"record": job_key(job_id), "events": events_key(job_id), "metrics": metrics_key(job_id),
                        "rollups": rollup_key(job_id), "layer checks": layers_key(job_id),
                        "rq job": f"rq:job:{job_id}"}
                for points in sorted(CACHED_VIEW_SIZES):  # as the dashboard reads them; cached 24 h once ended
                    client.get(f"/jobs/{job_id}/metrics", params={"max_points": points}).raise_for_status()
                    keys[f"view {points}"] = view_key(job_id, points)
                    keys[f"view {points} fresh"] = view_fresh_key(job_id, points)
                found[name] = {kind: int(r.memory_usage(key, samples=0) or 0) for kind, key in keys.items()}
                found[name]["checks"] = int(r.xlen(layers_key(job_id)))
                found[name]["steps"] = int(r.xlen(metrics_key(job_id)))
    return found


def measure_views() -> dict[int, dict[int, int]]:
    """{steps: {max_points: bytes of the cached view and its fresh flag}} for an ended job of each VIEW_RUNS."""
    found: dict[int, dict[int, int]] = {}
    with redis_server() as (server, env), tempfile.TemporaryDirectory() as logs:
        r, rq = server.client(), redis.Redis.from_url(server.url)
        store = JobStore(r, Path(env["ARTIFACTS_DIR"]))
        with serve("app.main:app", env, Path(logs) / "api.log") as api, \
                httpx.Client(base_url=api.url, timeout=60) as client:
            for steps in VIEW_RUNS:
                job_id = finished_job(client, store, rq, steps)
                found[steps] = {}
                for points in sorted(CACHED_VIEW_SIZES):
                    client.get(f"/jobs/{job_id}/metrics", params={"max_points": points}).raise_for_status()
                    found[steps][points] = sum(int(r.memory_usage(key, samples=0) or 0)
                                               for key in (view_key(job_id, points), view_fresh_key(job_id, points)))
                r.delete(metrics_key(job_id), rollup_key(job_id))  # the next run's room
    return found


def report_views(found: dict[int, dict[int, int]]) -> str:
    sizes = sorted(CACHED_VIEW_SIZES)
    lines = ["| steps | " + " | ".join(f"view of {points} points" for points in sizes) + " | both |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for steps, views in found.items():
        lines.append(f"| {steps:,} | " + " | ".join(f"{views[points]:,} B" for points in sizes)
                     + f" | {sum(views.values()):,} B |")
    return "\n".join(lines)


def report(found: dict[str, dict[str, int]]) -> str:
    lines = ["| job | steps | record + events + RQ job | metrics per step | rollups per step | layer checks | "
             "per check |", "|---|---|---|---|---|---|---|"]
    for name, sizes in found.items():
        checks = sizes["checks"]
        lines.append(f"| {name} | {sizes['steps']:,} | {sizes['record'] + sizes['events'] + sizes['rq job']:,} B | "
                     f"{sizes['metrics'] / sizes['steps']:.1f} B | {sizes['rollups'] / sizes['steps']:.1f} B | "
                     f"{checks} | {sizes['layer checks'] / checks if checks else 0:,.0f} B |")
    lines.append("")
    for name, sizes in found.items():
        per_step = (sizes["metrics"] + sizes["rollups"]) / sizes["steps"]
        per_check = sizes["layer checks"] / sizes["checks"] if sizes["checks"] else 0
        fixed = sizes["record"] + sizes["events"] + sizes["rq job"]
        checks = 10_000 // 100 + 1 if sizes["checks"] else 0
        job = fixed + 10_000 * per_step + checks * per_check
        lines.append(f"{name}: a 10,000-step job {job / 2**20:.2f} MiB; 1,000 of them {1000 * job / 2**30:.2f} GiB, "
                     f"a maxmemory of {1000 * job / HEADROOM / 2**30:.2f} GiB at the 90% high-water mark")
    lines.append("")
    for name, sizes in found.items():
        views = {points: sizes[f"view {points}"] + sizes[f"view {points} fresh"]
                 for points in sorted(CACHED_VIEW_SIZES)}
        lines.append(f"{name}: cached views of {sizes['steps']:,} steps, kept 24 h: "
                     + ", ".join(f"{points} points {size:,} B" for points, size in views.items())
                     + f"; {sum(views.values()):,} B in all")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--views-only", action="store_true", help="only the cached views by run length")
    args = parser.parse_args()
    if not args.views_only:
        print(report(measure(args.steps)) + "\n")
    print(report_views(measure_views()))


if __name__ == "__main__":
    main()

"""Redis memory per job, measured: MEMORY USAGE of each key of real jobs, per step and per layer check.

    python -m bench.redis_memory [--steps 1000]

Runs jobs of `--steps` steps on a private Redis and one worker (float32: no layer checks;
mixed_bfloat16, fast on a CPU: layer checks at step 1 and every 100 steps), then prints what each
key of each job holds, and the arithmetic of docs/reliability.md: a 10,000-step job, 1,000 of
them, and the maxmemory that implies.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from app.store.keys import events_key, job_key, layers_key, metrics_key, rollup_key
from tests.stack import private_stack

JOBS: dict[str, dict[str, Any]] = {
    "mlp float32": {"model": {"name": "mlp"}, "precision_policy": "float32"},
    "mlp mixed_bfloat16": {"model": {"name": "mlp"}, "precision_policy": "mixed_bfloat16"},
    "cnn mixed_bfloat16": {"model": {"name": "cnn"}, "precision_policy": "mixed_bfloat16"},
}
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
                found[name] = {kind: int(r.memory_usage(key, samples=0) or 0) for kind, key in keys.items()}
                found[name]["checks"] = int(r.xlen(layers_key(job_id)))
                found[name]["steps"] = int(r.xlen(metrics_key(job_id)))
    return found


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
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    print(report(measure(parser.parse_args().steps)))


if __name__ == "__main__":
    main()

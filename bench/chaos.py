"""The chaos soak: jobs and comparisons through a real stack while workers are SIGKILLed and Redis restarts.

    python -m bench.chaos --duration 600 --kill-every 10 --redis-every 60 --redis-sigkill-every 0

A private stack (scripts/stack.py: Redis with AOF `everysec` and `noeviction`, the API, `--workers`
workers) takes `--jobs` short jobs (mlp; float32, mixed_float16 + dynamic, mixed_bfloat16, in turn)
and `--comparisons` comparisons (float32 against mixed_bfloat16), submitted over the first
`--duration` seconds, as a user would: a 503 or a dropped connection is retried with the same
Idempotency-Key. Meanwhile a worker is SIGKILLed every `--kill-every` seconds (a new one is started
at once), Redis is restarted every `--redis-every` seconds (each `--redis-sigkill-every`-th with
SIGKILL, else SIGTERM, which flushes its AOF), and the API is SIGKILLed and restarted once at
`--api-kill-at`. A reader polls the jobs and comparisons all along. Once every job has ended the
faults stop, and the soak checks what users would: every job ended; each succeeded job holds its steps
1..N, each once; no status from the API was a 5xx other than 503; every comparison whose runs
succeeded has a speed for each variant. It reports how long a killed worker's job took to be requeued
and to run again. tests/processes/test_chaos_soak.py runs a bounded one; docs/reliability.md has
the figures of a long one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from app.store import JobStore
from bench.report import machine, median, percentile
from scripts.stack import Stack, private_stack

POLICIES = [("float32", None), ("mixed_float16", "dynamic"), ("mixed_bfloat16", None)]
MODEL = {"name": "mlp", "input_dim": 16, "hidden_units": 16}


@dataclass(frozen=True)
class Faults:
    kill_every_s: float = 10.0
    redis_every_s: float = 60.0
    redis_sigkill_every: int = 0
    """Every n-th Redis restart is a SIGKILL (AOF `everysec` may lose its last second); 0: all clean."""
    api_kill_at_s: float | None = None


@dataclass
class Soak:
    """What happened: the faults, every response, and each job and comparison as it ended."""

    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    comparisons: dict[str, dict[str, Any]] = field(default_factory=dict)
    statuses: Counter[str] = field(default_factory=Counter)
    """HTTP status codes from the API (as text), and `unreachable` for a refused or dropped connection."""
    kills: list[tuple[float, str | None, int]] = field(default_factory=list)
    """(time.time(), the job the killed worker ran or None, its attempt)."""
    redis_restarts: Counter[str] = field(default_factory=Counter)
    api_kills: int = 0
    incomplete: dict[str, str] = field(default_factory=dict)
    """Succeeded jobs whose stored steps are not 1..N each once: why."""
    unmeasured: list[str] = field(default_factory=list)
    """Comparisons whose runs all succeeded with a variant left without its speed."""
    lost: list[str] = field(default_factory=list)
    """Jobs created (201) that Redis no longer has: only a SIGKILL of Redis may lose one (its last second)."""
    seconds: float = 0.0

    def server_errors(self) -> dict[str, int]:
        return {code: n for code, n in self.statuses.items() if code.startswith("5") and code != "503"}

    def delays(self, state: str) -> list[float]:
        """Seconds from each kill of a worker running a job to that job's next `state` transition."""
        found = []
        for at, job_id, _ in self.kills:
            job = self.jobs.get(job_id or "")
            after = [stamp(t["at"]) for t in job["transitions"] if t["state"] == state] if job else []
            later = [t for t in after if t > at]
            if later:
                found.append(min(later) - at)
        return found


def stamp(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class User:
    """The API as a user's client meets it: every status counted; a 503 or dropped connection retried."""

    def __init__(self, stack: Stack, soak: Soak) -> None:
        self.stack, self.soak = stack, soak
        self.client = httpx.Client(base_url=stack.base_url, timeout=30)
        self.lock = threading.Lock()

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.TransportError:
            self.count("unreachable")
            return None
        self.count(str(response.status_code))
        return response

    def count(self, code: str) -> None:
        with self.lock:
            self.soak.statuses[code] += 1

    def until_answered(self, method: str, path: str, deadline: float, **kwargs: Any) -> httpx.Response:
        while True:
            response = self.call(method, path, **kwargs)
            if response is not None and response.status_code != 503:
                return response
            if time.monotonic() > deadline:
                raise TimeoutError(f"{method} {path}: no answer but 503 or a dropped connection")
            time.sleep(0.2)


def job_spec(index: int, steps: int, speed_check: bool) -> dict[str, Any]:
    """A short mlp job; `speed_check`: a half-precision one times its policy after its run (on a CPU)."""
    policy, scale = POLICIES[index % len(POLICIES)]
    spec: dict[str, Any] = {"model": MODEL, "precision_policy": policy, "dataset": {"samples": 256},
                            "training": {"steps": steps, "checkpoint_every": 20, "seed": index}}
    if not speed_check:
        spec["speed_check"] = []
    if scale:
        spec["loss_scale"] = {"mode": scale}
    return spec


def submit(user: User, jobs: int, comparisons: int, over_s: float, steps: tuple[int, int], speed_checks: bool,
           job_ids: list[str], comparison_ids: list[str], deadline: float) -> None:
    """Every job and comparison, spread over `over_s` seconds; each POST carries its own Idempotency-Key."""
    rng = random.Random(7)
    kinds = ["job"] * jobs + ["comparison"] * comparisons
    rng.shuffle(kinds)
    for index, kind in enumerate(kinds):
        time.sleep(over_s / max(1, len(kinds)))
        spec = job_spec(index, rng.randint(*steps), speed_checks or kind == "comparison")
        key = {"Idempotency-Key": str(uuid.uuid4())}
        if kind == "job":
            answer = user.until_answered("POST", "/jobs", deadline, json=spec, headers=key)
            assert answer.status_code in (200, 201), answer.text
            job_ids.append(answer.json()["id"])
        else:
            base = {k: v for k, v in spec.items() if k != "loss_scale"}
            body = {"spec": {**base, "precision_policy": "float32"}, "variants": [
                {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16"}]}
            answer = user.until_answered("POST", "/comparisons", deadline, json=body, headers=key)
            assert answer.status_code in (200, 201), answer.text
            comparison_ids.append(answer.json()["id"])
            job_ids.extend(v["job_id"] for v in answer.json()["variants"])


def running_on(stack: Stack, pid: int) -> tuple[str | None, int]:
    """The job the worker `pid` runs now, and its attempt (None when Redis cannot say)."""
    try:
        store = JobStore(stack.redis.client())
        for job_id in store.leases.running_ids():
            job = store.jobs.get(job_id)
            if job is not None and job.worker is not None and job.worker.pid == pid:
                return job_id, job.attempt
    except Exception:
        pass
    return None, 0


def fault(stack: Stack, soak: Soak, faults: Faults, rng: random.Random, started: float, due: dict[str, float]) -> None:
    """Whatever fault is due now: a worker killed, Redis restarted, the API killed."""
    now = time.monotonic()
    if now >= due["kill"]:
        due["kill"] = now + faults.kill_every_s
        live = [w for w in stack.workers if w.poll() is None]
        if live:
            victim = rng.choice(live)
            job_id, attempt = running_on(stack, victim.pid)
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            soak.kills.append((time.time(), job_id, attempt))
            stack.workers.remove(victim)
            stack.start_worker(registered=False)
    if now >= due["redis"]:
        due["redis"] = now + faults.redis_every_s
        count = sum(soak.redis_restarts.values()) + 1
        hard = faults.redis_sigkill_every > 0 and count % faults.redis_sigkill_every == 0
        process = stack.redis.process
        if process is not None:
            process.kill() if hard else process.terminate()
            process.wait(30)
            stack.redis.process = None
        stack.redis.start()
        soak.redis_restarts["SIGKILL" if hard else "SIGTERM"] += 1
    if faults.api_kill_at_s is not None and not soak.api_kills and now - started >= faults.api_kill_at_s:
        assert stack.api is not None
        os.killpg(stack.api.pid, signal.SIGKILL)
        stack.api.wait()
        soak.api_kills += 1
        stack.start_api()


def read_along(user: User, job_ids: list[str], comparison_ids: list[str], stop: threading.Event) -> None:
    """A dashboard's worth of reads all along: a job, its metrics, a comparison, in turn."""
    rng = random.Random(11)
    while not stop.wait(0.05):
        if job_ids:
            job_id = rng.choice(job_ids)
            user.call("GET", f"/jobs/{job_id}")
            user.call("GET", f"/jobs/{job_id}/metrics", params={"limit": 50})
        if comparison_ids:
            user.call("GET", f"/comparisons/{rng.choice(comparison_ids)}")


def check(user: User, soak: Soak, job_ids: list[str], comparison_ids: list[str], deadline: float) -> None:
    """Each job's last record, its steps (each once, none missing) and each comparison's speeds."""
    for job_id in job_ids:
        answer = user.until_answered("GET", f"/jobs/{job_id}", deadline)
        if answer.status_code == 404:
            soak.lost.append(job_id)
            continue
        soak.jobs[job_id] = job = answer.json()
        if job["state"] != "succeeded":
            continue
        steps = job["spec"]["training"]["steps"]
        page = user.until_answered("GET", f"/jobs/{job_id}/metrics", deadline, params={"limit": steps + 1}).json()
        held = [p["step"] for p in page["points"]]
        if held != list(range(1, steps + 1)) or page["missing_steps"] or job["summary"]["steps_done"] != steps:
            soak.incomplete[job_id] = (f"{len(held)} of {steps} steps stored, {len(set(held))} distinct; "
                                       f"missing {page['missing_steps']}")
    for comparison_id in comparison_ids:
        soak.comparisons[comparison_id] = report = user.until_answered(
            "GET", f"/comparisons/{comparison_id}", deadline).json()
        if all(v["state"] == "succeeded" for v in report["variants"]) and any(
                v["speed"] is None for v in report["variants"] if not v["baseline"]):
            soak.unmeasured.append(comparison_id)


def run(directory: Path, *, jobs: int, comparisons: int, duration_s: float, faults: Faults, workers: int = 2,
        steps: tuple[int, int] = (40, 120), speed_checks: bool = True, timeout_s: float = 600.0, **env: str) -> Soak:
    """Run one soak in `directory` (its stack's Redis, logs and artifacts); `env` goes to the stack's processes.
    `speed_checks=False`: only comparisons time anything after their run (a shorter soak)."""
    settings = {"LEASE_S": "3", "REAP_INTERVAL_S": "1", "CHECKPOINT_INTERVAL_S": "5", **env}
    soak, rng, started = Soak(), random.Random(3), time.monotonic()
    deadline = started + timeout_s
    with private_stack(directory, workers=workers, **settings) as stack:
        user = User(stack, soak)
        job_ids: list[str] = []
        comparison_ids: list[str] = []
        stop = threading.Event()
        submitter = threading.Thread(target=submit, args=(user, jobs, comparisons, duration_s, steps, speed_checks,
                                                          job_ids, comparison_ids, deadline), daemon=True)
        reader = threading.Thread(target=read_along, args=(user, job_ids, comparison_ids, stop), daemon=True)
        submitter.start()
        reader.start()
        store = JobStore(stack.redis.client())
        due = {"kill": started + faults.kill_every_s, "redis": started + faults.redis_every_s}

        states: Counter[str] = Counter()

        def all_ended() -> bool:
            try:
                jobs = [store.jobs.get(job_id) for job_id in list(job_ids)]
            except Exception:  # Redis restarting
                return False
            states.clear()
            states.update(job.state.value if job else "missing" for job in jobs)
            return not submitter.is_alive() and all(job is None or job.state.terminal for job in jobs)

        while not all_ended():
            assert time.monotonic() < deadline, f"jobs not ended after {timeout_s:.0f} s: {dict(states)}, {soak}"
            fault(stack, soak, faults, rng, started, due)
            time.sleep(0.1)
        stop.set()
        reader.join()
        check(user, soak, job_ids, comparison_ids, deadline)
    soak.seconds = time.monotonic() - started
    return soak


def summary(soak: Soak) -> dict[str, Any]:
    states = Counter(job["state"] for job in soak.jobs.values())
    reasons = Counter((job.get("error") or {}).get("reason") for job in soak.jobs.values() if job["state"] == "failed")
    attributed = [k for k in soak.kills if k[1]]
    out: dict[str, Any] = {"seconds": round(soak.seconds, 1), "jobs": len(soak.jobs), "states": dict(states),
                           "failed_reasons": dict(reasons), "comparisons": len(soak.comparisons),
                           "worker_kills": len(soak.kills), "kills_of_a_running_job": len(attributed),
                           "redis_restarts": dict(soak.redis_restarts), "api_kills": soak.api_kills,
                           "statuses": dict(soak.statuses), "server_errors_not_503": soak.server_errors(),
                           "incomplete_succeeded_jobs": soak.incomplete, "comparisons_without_speed": soak.unmeasured,
                           "lost_jobs": soak.lost}
    for state in ("queued", "running"):
        delays = soak.delays(state)
        out[f"kill_to_{state}_s"] = ({"n": len(delays), "median": round(median(delays), 2),
                                      "p90": round(percentile(delays, 90), 2), "max": round(max(delays), 2)}
                                     if delays else {"n": 0})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds over which work is submitted")
    parser.add_argument("--jobs", type=int, default=72)
    parser.add_argument("--comparisons", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=10.0, help="seconds between worker SIGKILLs")
    parser.add_argument("--redis-every", type=float, default=60.0, help="seconds between Redis restarts")
    parser.add_argument("--redis-sigkill-every", type=int, default=0, help="every n-th restart a SIGKILL; 0: none")
    parser.add_argument("--api-kill-at", type=float, default=None, help="SIGKILL the API once, at this second")
    parser.add_argument("--steps", type=int, nargs=2, default=(150, 400), metavar=("MIN", "MAX"))
    parser.add_argument("--lease-s", default="5", help="LEASE_S of the stack (the compose file's: 5 in the soak)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/chaos.json"))
    args = parser.parse_args(argv)
    faults = Faults(args.kill_every, args.redis_every, args.redis_sigkill_every, args.api_kill_at)
    with tempfile.TemporaryDirectory(prefix="chaos-") as directory:
        soak = run(Path(directory), jobs=args.jobs, comparisons=args.comparisons, duration_s=args.duration,
                   faults=faults, workers=args.workers, steps=tuple(args.steps), timeout_s=args.duration * 4 + 600,
                   LEASE_S=args.lease_s)
    result = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "out"},
              "faults": asdict(faults), **summary(soak)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    ok = not (soak.server_errors() or soak.incomplete or soak.unmeasured)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

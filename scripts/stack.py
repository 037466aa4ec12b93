"""Real processes for tests and benchmarks: a private redis-server on a free port,
`uvicorn app.main:app` and `python -m worker`, as a user would run them."""

from __future__ import annotations

import copy
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis

from app.store import JobStore
from mpjobs.contract.jobs import JobState

ROOT = Path(__file__).resolve().parents[1]


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` has stopped (SIGSTOP is delivered asynchronously)."""
    return all((task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
               for task in Path(f"/proc/{pid}/task").iterdir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, redis.RedisError, OSError):
            pass
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class RedisServer:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *options: str, loaded: bool = True) -> None:
        """Start redis-server with these extra `options` (`--key-load-delay`, `1000`); wait until it has
        loaded its data, or with `loaded=False` only until it answers (LOADING, while it loads)."""
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
             "--maxmemory-policy", "noeviction", *options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.BusyLoadingError:
                return not loaded

        wait_until(answers, 10, "redis-server")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)


class Stack:
    """The API and one worker, as a user would run them."""

    def __init__(self, redis_server: RedisServer, workdir: Path) -> None:
        self.redis = redis_server
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.artifacts = workdir / "artifacts"
        self.data = workdir / "data"
        self.logs = workdir / "logs"
        for d in (self.artifacts, self.data, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "REDIS_URL": redis_server.url, "ARTIFACTS_DIR": str(self.artifacts),
                    "DATA_ROOT": str(self.data), "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2",
                    # The speed check still runs after every half-precision job (all its rounds, the
                    # A/A pair), one step per piece: on a CPU where float16 is 25x slower, the default
                    # 4 steps cost seconds per job across the suite. Its own tests set their steps.
                    "SPEED_CHECK_STEPS": "1",
                    # One in-process worker per `python -m worker`, even on a GPU host: tests that want
                    # a slot per GPU inject their GPUs (start_supervisor).
                    "HOST_GPUS": "none"}
        self.api: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []

    def _spawn(self, args: list[str], log_name: str, **env: str) -> subprocess.Popen[bytes]:
        log = open(self.logs / log_name, "ab")  # noqa: SIM115  closed with the process
        return subprocess.Popen(args, cwd=ROOT, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def start_api(self) -> None:
        self.api = self._spawn([sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1",
                                "--port", str(self.port)], "api.log")
        wait_until(lambda: httpx.get(f"{self.base_url}/healthz").status_code == 200, 30, "the API")

    def start_worker(self, module: str = "worker", registered: bool = True, **env: str) -> subprocess.Popen[bytes]:
        """`python -m worker` (or `module`, a test's stand-in for it) with `env` added, its output in
        logs/worker{n}.log; waits until it has registered with RQ, unless `registered=False` (Redis is not
        up yet, or the caller does not wait)."""
        worker = self._spawn([sys.executable, "-m", module], f"worker{len(self.workers)}.log", **env)
        self.workers.append(worker)
        if registered:
            self.wait_registered(worker)
        return worker

    def wait_registered(self, worker: subprocess.Popen[bytes], timeout: float = 60) -> None:
        key = f"rq:worker:{socket.gethostname()}.{worker.pid}"
        wait_until(lambda: self.redis.client().exists(key), timeout, "the worker to register")

    def start_supervisor(self, host_gpus: str, **env: str) -> subprocess.Popen[bytes]:
        """`python -m worker` on a host given the GPUs `host_gpus` (`0,1`): waits until a slot per
        GPU it chose (WORKER_GPUS in `env`, default all) has registered as `{host}.{pid}.gpu{n}`."""
        supervisor = self._spawn([sys.executable, "-m", "worker"], f"worker{len(self.workers)}.log",
                                 HOST_GPUS=host_gpus, **env)
        self.workers.append(supervisor)
        chosen = env.get("WORKER_GPUS", host_gpus)
        wanted = {f"gpu{gpu}" for gpu in chosen.split(",")}
        wait_until(lambda: {name.rsplit(".", 1)[-1] for name in self.slot_names()} >= wanted, 60,
                   f"slots {sorted(wanted)} to register")
        return supervisor

    def slot_names(self) -> list[str]:
        """The RQ names of the live GPU slots on this host: `{host}.{pid}.gpu{n}` (`gpu0+1` for a slot with two)."""
        prefix = f"rq:worker:{socket.gethostname()}."
        return [key.removeprefix("rq:worker:") for key in self.redis.client().scan_iter(f"{prefix}*.gpu*")
                if re.fullmatch(r"\d+\.gpu\d+(\+\d+)*", key.removeprefix(prefix))]  # not RQ's `{name}:executions`

    def stop(self) -> None:
        for process in [*self.workers, self.api]:
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()

    def writes(self) -> tuple[object, ...]:
        """What any accepted job changes: the creation counter, the job index, the RQ queues.
        (Not DBSIZE: RQ's own keys expire in the background.)"""
        r = self.redis.client()
        queues = tuple(r.llen(f"rq:queue:{q}") for q in ("gpu", "cpu", "any"))
        return (r.get("mpjobs:seq"), r.zcard("mpjobs:jobs:default"), *queues)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30)

    def wait_for_state(
        self, client: httpx.Client, job_id: str, states: set[str], timeout: float = 120
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            job = client.get(f"/jobs/{job_id}").json()
            return job if job["state"] in states else None

        return wait_until(check, timeout, f"job {job_id} to reach {states}", interval=0.1)  # type: ignore[no-any-return]




def iter_sse(client: httpx.Client, path: str, headers: dict[str, str] | None = None
             ) -> Iterator[tuple[str, str | None, str, float]]:
    """(event, id, data, arrival time.time()) for each Server-Sent Event at `path`."""
    fields: dict[str, str] = {}
    with client.stream("GET", path, headers=headers or {}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                key, _, value = line.partition(": ")
                fields[key] = value
                continue
            yield fields["event"], fields.get("id"), fields["data"], time.time()
            fields = {}


@contextmanager
def private_stack(directory: Path, workers: int = 1, **env: str) -> Iterator[Stack]:
    """A redis-server of its own, the API and `workers` workers, with `env` added."""
    server = RedisServer(directory / "redis")
    (directory / "redis").mkdir(parents=True, exist_ok=True)
    server.start()
    stack = Stack(server, directory / "stack")
    stack.env.update(env)
    try:
        stack.start_api()
        for _ in range(workers):
            stack.start_worker()
        yield stack
    finally:
        stack.stop()
        server.stop()


def freeze_mid_run(stack: Stack, client: httpx.Client, spec: dict[str, Any], past_step: int
                   ) -> tuple[str, int, dict[str, Any]]:
    """Submit `spec`; once the job has passed `past_step`, SIGSTOP the worker running it and confirm,
    with the worker frozen, that the job is still mid-run. Whatever the caller does next (SIGKILL the
    worker, stop Redis under it) then lands mid-run, however fast the machine: a job that ended before
    the freeze is submitted again with four times the steps. Returns (job id, the frozen worker's
    pid, the spec it runs); the caller sends SIGCONT or SIGKILL to the pid's process group."""
    spec, store = copy.deepcopy(spec), JobStore(stack.redis.client())
    for _ in range(3):
        job_id = client.post("/jobs", json=spec).json()["id"]

        def started(job_id: str = job_id) -> int | None:
            worker = client.get(f"/jobs/{job_id}").json()["worker"]
            return None if worker is None else int(worker["pid"])

        def passed(job_id: str = job_id) -> bool:
            attempt = store.cancels.attempt(job_id)
            return attempt.state is not JobState.RUNNING or attempt.step > past_step

        pid = wait_until(started, 120, f"job {job_id} to start")
        wait_until(passed, 120, f"job {job_id} past step {past_step}", interval=0.001)
        os.killpg(pid, signal.SIGSTOP)
        wait_until(functools.partial(stopped, pid), 10, f"worker {pid} to stop", interval=0.001)
        attempt = store.cancels.attempt(job_id)
        if attempt.state is JobState.RUNNING and attempt.step < spec["training"]["steps"]:
            return job_id, pid, spec
        os.killpg(pid, signal.SIGCONT)  # it ended before the freeze: a longer job
        spec["training"]["steps"] *= 4
    raise AssertionError(f"no job of up to {spec['training']['steps'] // 4} steps was still running past step "
                         f"{past_step} when its worker was frozen")

"""Load generation for the HTTP benchmarks: `wrk` against uvicorn processes on a private redis-server.

Both the API and its baselines run as real processes with UVICORN_OPTIONS; `wrk --latency` loads one URL
at a time, and the server's CPU time per request is read from /proc beside it: the steadiest figure on a
shared machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from scripts.stack import ROOT, RedisServer, free_port, wait_until

WRK_INSTALL = "apt-get install -y wrk"
UVICORN_OPTIONS = ("--host", "127.0.0.1", "--log-level", "warning", "--no-access-log")
"""Both servers run with exactly these; access logging off on both (production's uvicorn logs
every request: that cost is not what this compares)."""
WRK_THREADS = 1
"""One client thread leaves the other core to the server; wrk's one thread outruns a Python server."""
CONNECTIONS = 8
"""Enough to keep one uvicorn process busy at all times; more only lengthens the queue."""


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

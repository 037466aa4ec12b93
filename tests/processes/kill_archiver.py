"""A child process for the kill-mid-archive test: archives one job and stops for good once its files are written.

    python -m tests.processes.kill_archiver REDIS_URL ARTIFACTS_DIR JOB_ID CLAIM_S

It prints `written` when the files are in place and Redis not yet trimmed, then waits to be killed.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import redis

from app.store import JobStore
from app.store.retention import Archiver


def stop_here(job_id: str) -> None:
    print("written", job_id, flush=True)
    threading.Event().wait()  # until SIGKILL


def main() -> None:
    url, artifacts, job_id, claim_s = sys.argv[1:5]
    store = JobStore(redis.Redis.from_url(url, decode_responses=True), Path(artifacts))
    Archiver(store, retention_s=0, claim_s=float(claim_s), before_trim=stop_here).archive(job_id)
    raise SystemExit("the archive ran past the point where it should have stopped")


if __name__ == "__main__":
    main()

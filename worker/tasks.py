"""The RQ task: run one queued job through the engine and record how it ended.

Imported once when a worker starts, so TensorFlow and the engine are warm
before the first job is dequeued.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from redis import Redis

from app import clock
from app.config import get_settings
from app.errors import FailureReason, JobFailed
from app.resources import JobState
from app.store import JobStore
from worker.devices import detect_device
from worker.engine import run_job
from worker.reporter import RedisReporter

log = logging.getLogger("mpjobs.worker")

CANCEL_POLL_S = 0.25
"""How often a running job checks for a cancel request; a cancel lands within this plus one step."""


class CancelWatcher:
    """Polls the job's cancel flag on a thread, so the training step never waits on Redis."""

    def __init__(self, store: JobStore, job_id: str) -> None:
        self.store, self.job_id = store, job_id
        self.requested = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=f"cancel-watch-{job_id}", daemon=True)

    def _poll(self) -> None:
        while not self._done.wait(CANCEL_POLL_S):
            try:
                if self.store.cancel_requested(self.job_id):
                    self.requested.set()
                    return
            except Exception:  # A Redis blip must not kill training; try again next poll.
                log.warning("cancel check failed for %s", self.job_id, exc_info=True)

    def __enter__(self) -> CancelWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def run_training(job_id: str) -> str:
    settings = get_settings()
    store = JobStore(Redis.from_url(settings.redis_url, decode_responses=True))
    job = store.get(job_id)
    if job is None or job.state is not JobState.QUEUED:
        return f"skipped: {'missing' if job is None else job.state.value}"
    device = detect_device()
    attempt = job.attempt + 1
    worker = {"host": socket.gethostname(), "pid": os.getpid(), "device": device.describe()}
    moved, now_state = store.transition(
        job_id, JobState.RUNNING, [JobState.QUEUED], f"attempt {attempt} on {worker['host']} ({device.kind})",
        started_at=clock.iso(), attempt=attempt, worker=worker,
    )
    if not moved:
        return f"skipped: {now_state.value if now_state else 'missing'}"
    with CancelWatcher(store, job_id) as watcher:
        try:
            result = run_job(job.spec, reporter=RedisReporter(store, job_id),
                             checkpoint_dir=settings.artifacts_dir / job_id,
                             should_stop=watcher.requested.is_set, settings=settings)
        except JobFailed as exc:
            _fail(store, job_id, exc.reason.value, exc.message)
            return f"failed: {exc.reason.value}"
        except Exception as exc:
            log.exception("job %s crashed", job_id)
            _fail(store, job_id, FailureReason.INTERNAL.value, f"{type(exc).__name__}: {exc}"[:500])
            return "failed: internal"
    if result.status == "stopped":
        store.transition(job_id, JobState.CANCELED, [JobState.RUNNING],
                         f"canceled at step {result.summary.steps_done}",
                         error={"reason": FailureReason.CANCELED.value,
                                "message": f"Canceled at step {result.summary.steps_done}."})
        return "canceled"
    store.transition(job_id, JobState.SUCCEEDED, [JobState.RUNNING],
                     f"finished {result.summary.steps_done} steps", summary=result.summary.model_dump_json())
    return "succeeded"


def _fail(store: JobStore, job_id: str, reason: str, message: str) -> None:
    store.transition(job_id, JobState.FAILED, [JobState.RUNNING], f"{reason}: {message}"[:300],
                     error={"reason": reason, "message": message})

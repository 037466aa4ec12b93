"""The RQ task: run one queued job through the engine and record how it ended.

Imported once when a worker starts, so TensorFlow and the engine are warm
before the first job is dequeued.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis
from redis import Redis

from app.core import clock
from app.core.config import Settings, get_settings
from app.core.errors import FailureReason, JobFailed
from app.core.job import JobState
from app.core.spec import JobSpec
from app.store import JobStore
from worker import checkpoint
from worker.devices import detect_device
from worker.engine import release_memory, run_job
from worker.gpus import pinned_gpus
from worker.reporter import RedisReporter
from worker.telemetry import FanOut
from worker.tensorboard import LOGDIR as TENSORBOARD_LOGDIR
from worker.tensorboard import TensorBoardReporter

log = logging.getLogger("mpjobs.worker")
T = TypeVar("T")

CANCEL_POLL_S = 0.25
"""How often a running job checks for a cancel request; a cancel lands within this plus one step."""
REDIS_OUTAGE_BUDGET_S = 120.0
"""How long a finished attempt keeps retrying to record its end while Redis is unreachable."""
LEASE_RENEWALS = 6
"""Renewals per lease period: a lease survives several missed renewals (a GC pause, a Redis blip)."""


class AttemptWatcher:
    """On a thread: polls the cancel flag and renews the attempt's lease, so the
    training step never waits on Redis and a dead worker's lease runs out."""

    def __init__(self, store: JobStore, job_id: str, owner: str, lease_s: float) -> None:
        self.store, self.job_id, self.owner, self.lease_s = store, job_id, owner, lease_s
        self.cancel_requested = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"attempt-{job_id}", daemon=True)

    def _watch(self) -> None:
        renew_every, renewed = self.lease_s / LEASE_RENEWALS, time.monotonic()
        failing = False
        while not self._done.wait(CANCEL_POLL_S):
            try:
                if time.monotonic() - renewed >= renew_every:
                    self.store.renew_lease(self.job_id, self.owner, self.lease_s)
                    renewed = time.monotonic()
                if not self.cancel_requested.is_set() and self.store.cancel_requested(self.job_id):
                    self.store.acknowledge_cancel(self.job_id, self.owner)  # else the API presumes it dead
                    self.cancel_requested.set()
                failing = False
            except Exception as exc:  # A Redis blip must not kill training; try again next poll.
                if not failing:
                    log.warning("attempt watch for %s failing, retrying: %s", self.job_id, exc)
                failing = True

    def __enter__(self) -> AttemptWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def run_training(job_id: str) -> str:
    settings = get_settings()
    client = Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        return _attempt(JobStore(client), job_id, settings)
    finally:
        client.close()  # a worker runs many jobs: one connection pool per job would pile up


def _attempt(store: JobStore, job_id: str, settings: Settings) -> str:
    job = store.get(job_id)
    if job is None or job.state is not JobState.QUEUED:
        return f"skipped: {'missing' if job is None else job.state.value}"
    if store.cancel_requested(job_id):  # canceled while its worker was being replaced
        store.transition(job_id, JobState.CANCELED, [JobState.QUEUED], "canceled before it resumed",
                         error={"reason": FailureReason.CANCELED.value, "message": "Canceled before it resumed."})
        return "canceled"
    out = settings.job_dir(job_id)
    resume_from = checkpoint.saved_step(out)
    if job.attempt:
        store.rewind_metrics(job_id, resume_from)
    device = detect_device()
    attempt = job.attempt + 1
    gpus = pinned_gpus()
    worker = {"host": socket.gethostname(), "pid": os.getpid(), "device": device.describe(), "gpus": gpus}
    owner = f"{worker['host']}:{worker['pid']}"
    on_gpus = f", GPU {','.join(gpus)}" if gpus else ""
    store.renew_lease(job_id, owner, settings.lease_s)  # before `running`: a reaper never sees one without it
    resumed = f", resuming from step {resume_from}" if resume_from else ""
    moved, now_state = store.transition(
        job_id, JobState.RUNNING, [JobState.QUEUED],
        f"attempt {attempt} on {worker['host']} ({device.kind}{on_gpus}){resumed}",
        started_at=clock.iso(), attempt=attempt, worker=worker,
    )
    if not moved:
        if now_state is not None and now_state.terminal:
            store.drop_lease(job_id)  # canceled while this worker took it: no attempt runs it
        return f"skipped: {now_state.value if now_state else 'missing'}"
    try:
        return _train(store, job_id, job.spec, out, owner, settings, resume_from)
    finally:
        release_memory()  # a canceled or failed job leaves no model in the worker
        _through_outage(lambda: store.drop_lease(job_id))


def _through_outage(write: Callable[[], T]) -> T:
    """Retry `write` while Redis is unreachable (a restart), up to REDIS_OUTAGE_BUDGET_S."""
    deadline, delay = time.monotonic() + REDIS_OUTAGE_BUDGET_S, 0.1
    while True:
        try:
            return write()
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() > deadline:
                raise
            log.warning("redis unavailable; retrying in %.1f s", delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _train(store: JobStore, job_id: str, spec: JobSpec, out: Path, owner: str, settings: Settings,
           resume_from: int) -> str:
    board = TensorBoardReporter(out / TENSORBOARD_LOGDIR, resume_step=resume_from,
                                description=describe(job_id, spec))
    steps = RedisReporter(store, job_id)
    reporter = FanOut(steps, board)
    with AttemptWatcher(store, job_id, owner, settings.lease_s) as watcher:
        try:
            try:
                result = run_job(spec, reporter=reporter, checkpoint_dir=out,
                                 should_stop=watcher.cancel_requested.is_set, settings=settings)
            finally:
                _drain(steps)  # whatever the job's last transition is, its steps are stored first
        except JobFailed as exc:
            _fail(store, job_id, exc.reason.value, exc.message)
            return f"failed: {exc.reason.value}"
        except Exception as exc:
            log.exception("job %s crashed", job_id)
            _fail(store, job_id, FailureReason.INTERNAL.value, f"{type(exc).__name__}: {exc}"[:500])
            return "failed: internal"
        finally:
            board.close()
    done = result.summary.steps_done
    if result.status == "stopped":
        _through_outage(lambda: store.transition(
            job_id, JobState.CANCELED, [JobState.RUNNING], f"canceled at step {done}",
            error={"reason": FailureReason.CANCELED.value, "message": f"Canceled at step {done}."}))
        return "canceled"
    _through_outage(lambda: store.transition(
        job_id, JobState.SUCCEEDED, [JobState.RUNNING], f"finished {done} steps",
        summary=result.summary.model_dump_json()))
    _through_outage(lambda: store.count_diagnoses(job_id, [d.code for d in result.summary.diagnoses]))
    return "succeeded"


def _drain(steps: RedisReporter) -> None:
    """Before the job's last transition: store the step records a Redis outage held back. If Redis
    stays away past the outage budget they are lost, and the API reports them in `missing_steps`."""
    try:
        _through_outage(steps.drain)
    except (redis.ConnectionError, redis.TimeoutError):
        log.error("redis unreachable past the outage budget: %d step records lost", len(steps.pending))


def describe(job_id: str, spec: JobSpec) -> str:
    """One line for TensorBoard's Text tab: which job, and what precision it ran."""
    scale = spec.loss_scale.mode if spec.loss_scale is not None else "none"
    model = getattr(spec.model, "name", "keras_json")
    return (f"**{spec.name or 'job'}** (`{job_id}`): {model}, {spec.precision_policy.value}, "
            f"loss scale {scale}, {spec.training.steps} steps")


def _fail(store: JobStore, job_id: str, reason: str, message: str) -> None:
    _through_outage(lambda: store.transition(job_id, JobState.FAILED, [JobState.RUNNING],
                                             f"{reason}: {message}"[:300],
                                             error={"reason": reason, "message": message}))

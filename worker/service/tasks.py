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
from app.core.errors import JobFailed, TimedOut
from app.store import JobStore
from app.store.retention import archive_at_once
from mpjobs.contract.jobs import FailureReason, JobState
from mpjobs.contract.spec import JobSpec
from worker.engine import checkpoint
from worker.engine.devices import detect_device
from worker.engine.stopping import (
    CancelInterrupt,
    DeadlineInterrupt,
    Interrupted,
    Interrupter,
    TimeLimit,
    current_phase,
    set_phase,
)
from worker.engine.training import release_memory, run_job
from worker.service.gpus import pinned_gpus
from worker.telemetry.redis_reporter import RedisReporter
from worker.telemetry.reporters import FanOut
from worker.telemetry.tensorboard import LOGDIR as TENSORBOARD_LOGDIR
from worker.telemetry.tensorboard import TensorBoardReporter

log = logging.getLogger("mpjobs.worker")
T = TypeVar("T")

CANCEL_POLL_S = 0.25
"""How often a running job checks for a cancel request; a cancel lands within this plus one step."""
REDIS_OUTAGE_BUDGET_S = 120.0
"""How long a finished attempt keeps retrying to record its end while Redis is unreachable."""
LEASE_RENEWALS = 6
"""Renewals per lease period: a lease survives several missed renewals (a GC pause, a Redis blip)."""
GRACEFUL_PHASES = frozenset({"training", "saving", "saving the model", "measuring speed against float32"})
"""Phases that stop by themselves when asked (after the step, with a checkpoint; between speed-check
pieces) or end soon. Outside them (building the model, preparing the data, restoring a checkpoint)
a cancel or the time limit interrupts the attempt at once."""
CANCEL_GRACE_S = 2.0
"""A canceled attempt in a graceful phase that has not stopped this long after the request is interrupted."""
DEADLINE_GRACE_S = 10.0
"""Likewise past its time limit; longer, so that a long step in progress can end and be checkpointed."""
STUCK_S = 60.0
"""An interrupted attempt still running this long after (one C++ call that never returns) ends
the worker process: its job is recorded as ended first, and the supervisor or the container's
restart policy starts a fresh worker."""
STUCK_EXIT_CODE = 70


class AttemptWatcher:
    """On a thread: polls the cancel flag, renews the attempt's lease and publishes its phase, so the
    training step never waits on Redis and a dead worker's lease runs out. A cancel or the time
    limit the attempt does not honour by itself within a grace period is raised in its thread
    (worker/engine/stopping.py); one it still does not honour ends the process (`on_stuck`)."""

    def __init__(self, store: JobStore, job_id: str, owner: str, lease_s: float, limit: TimeLimit | None = None,
                 interrupter: Interrupter | None = None,
                 on_stuck: Callable[[type[Interrupted]], None] | None = None) -> None:
        self.store, self.job_id, self.owner, self.lease_s = store, job_id, owner, lease_s
        self.limit, self.interrupter, self.on_stuck = limit, interrupter, on_stuck
        self.cancel_requested = threading.Event()
        self._canceled_at: float | None = None
        self._interrupted_at: float | None = None
        self._published_phase: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"attempt-{job_id}", daemon=True)

    def _watch(self) -> None:
        renew_every, renewed = self.lease_s / LEASE_RENEWALS, time.monotonic()
        failing = False
        while not self._done.wait(CANCEL_POLL_S):
            self._enforce()  # first, and without Redis: a Redis outage must not shield a stuck attempt
            try:
                if time.monotonic() - renewed >= renew_every:
                    self.store.leases.renew_lease(self.job_id, self.owner, self.lease_s)
                    renewed = time.monotonic()
                if not self.cancel_requested.is_set() and self.store.cancels.cancel_requested(self.job_id):
                    self.store.cancels.acknowledge_cancel(self.job_id, self.owner)  # else the API presumes it dead
                    self._canceled_at = time.monotonic()
                    self.cancel_requested.set()
                now_phase = current_phase()
                if now_phase != self._published_phase:
                    self.store.jobs.set_fields(self.job_id, phase=now_phase)
                    self._published_phase = now_phase
                failing = False
            except Exception as exc:  # A Redis blip must not kill training; try again next poll.
                if not failing:
                    log.warning("attempt watch for %s failing, retrying: %s", self.job_id, exc)
                failing = True

    def _enforce(self) -> None:
        """Interrupt an attempt past its grace period; end the process if that did not stop it."""
        if self.interrupter is None:
            return
        now = time.monotonic()
        if self._interrupted_at is not None:
            if self.interrupter.inside and now - self._interrupted_at > STUCK_S and self.on_stuck is not None:
                assert self.interrupter.sent is not None
                self.on_stuck(self.interrupter.sent)
            return
        graceful = current_phase() in GRACEFUL_PHASES
        kind: type[Interrupted] | None = None
        if self._canceled_at is not None and now - self._canceled_at > (CANCEL_GRACE_S if graceful else 0):
            kind = CancelInterrupt
        elif self.limit is not None and now > self.limit.deadline + (DEADLINE_GRACE_S if graceful else 0):
            kind = DeadlineInterrupt
        if kind is not None and self.interrupter.interrupt(kind):
            self._interrupted_at = now
            log.warning("job %s: %s while %s; interrupted", self.job_id,
                        "canceled" if kind is CancelInterrupt else "out of time", self.interrupter.where)

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
        store = JobStore(client, settings.artifacts_dir)
        outcome = _attempt(store, job_id, settings)
        archive_at_once(store, settings.history_retention_s, job_id)  # HISTORY_RETENTION_S=0: its history goes now
        return outcome
    finally:
        client.close()  # a worker runs many jobs: one connection pool per job would pile up


def _attempt(store: JobStore, job_id: str, settings: Settings) -> str:
    job = store.jobs.get(job_id)
    if job is None or job.state is not JobState.QUEUED:
        return f"skipped: {'missing' if job is None else job.state.value}"
    if store.cancels.cancel_requested(job_id):  # canceled while its worker was being replaced
        store.jobs.transition(job_id, JobState.CANCELED, [JobState.QUEUED], "canceled before it resumed",
                         error={"reason": FailureReason.CANCELED.value, "message": "Canceled before it resumed."})
        return "canceled"
    out = settings.job_dir(job_id)
    resume_from = checkpoint.saved_step(out)
    if job.attempt:
        store.streams.rewind_metrics(job_id, resume_from)
    device = detect_device()
    attempt = job.attempt + 1
    gpus = pinned_gpus()
    worker = {"host": socket.gethostname(), "pid": os.getpid(), "device": device.describe(), "gpus": gpus}
    owner = f"{worker['host']}:{worker['pid']}"
    on_gpus = f", GPU {','.join(gpus)}" if gpus else ""
    store.leases.renew_lease(job_id, owner, settings.lease_s)  # before `running`: a reaper never sees one without it
    resumed = f", resuming from step {resume_from}" if resume_from else ""
    moved, now_state = store.jobs.transition(
        job_id, JobState.RUNNING, [JobState.QUEUED],
        f"attempt {attempt} on {worker['host']} ({device.kind}{on_gpus}){resumed}",
        started_at=clock.iso(), attempt=attempt, worker=worker,
    )
    if not moved:
        if now_state is not None and now_state.terminal:
            store.leases.drop_lease(job_id)  # canceled while this worker took it: no attempt runs it
        return f"skipped: {now_state.value if now_state else 'missing'}"
    limit = TimeLimit.of(job.spec, settings)  # from the moment this worker took the job
    try:
        return _train(store, job_id, job.spec, out, owner, settings, resume_from, limit)
    finally:
        set_phase("starting")
        release_memory()  # a canceled or failed job leaves no model in the worker
        _through_outage(lambda: store.leases.drop_lease(job_id))


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
           resume_from: int, limit: TimeLimit) -> str:
    board = TensorBoardReporter(out / TENSORBOARD_LOGDIR, resume_step=resume_from,
                                description=describe(job_id, spec))
    steps = RedisReporter(store, job_id)
    reporter = FanOut(steps, board)
    interrupter = Interrupter()
    with AttemptWatcher(store, job_id, owner, settings.lease_s, limit, interrupter,
                        on_stuck=lambda kind: _abandon(store, job_id, kind, interrupter.where, limit)) as watcher:
        try:
            try:
                with interrupter:
                    result = run_job(spec, reporter=reporter, checkpoint_dir=out, limit=limit,
                                     should_stop=watcher.cancel_requested.is_set, settings=settings)
            finally:
                _drain(steps)  # whatever the job's last transition is, its steps are stored first
        except CancelInterrupt:
            where = interrupter.where
            _through_outage(lambda: store.jobs.transition(
                job_id, JobState.CANCELED, [JobState.RUNNING], f"canceled while {where}",
                error={"reason": FailureReason.CANCELED.value, "message": f"Canceled while {where}."}))
            return "canceled"
        except DeadlineInterrupt:
            timed_out = TimedOut(limit.message(f"while {interrupter.where}"))
            _fail(store, job_id, timed_out.reason.value, timed_out.message)
            return f"failed: {timed_out.reason.value}"
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
        _through_outage(lambda: store.jobs.transition(
            job_id, JobState.CANCELED, [JobState.RUNNING], f"canceled at step {done}",
            error={"reason": FailureReason.CANCELED.value, "message": f"Canceled at step {done}."}))
        return "canceled"
    _through_outage(lambda: store.jobs.transition(
        job_id, JobState.SUCCEEDED, [JobState.RUNNING], f"finished {done} steps",
        summary=result.summary.model_dump_json()))
    _through_outage(lambda: store.counters.count_diagnoses(job_id, [d.code for d in result.summary.diagnoses]))
    return "succeeded"


def _abandon(store: JobStore, job_id: str, kind: type[Interrupted], where: str, limit: TimeLimit) -> None:
    """The attempt ignored its interrupt for STUCK_S: record how the job ended, then end this process."""
    log.critical("job %s did not stop within %.0f s of its interrupt while %s; the worker exits (code %d) "
                 "and is restarted", job_id, STUCK_S, where, STUCK_EXIT_CODE)
    try:
        if kind is CancelInterrupt:
            store.jobs.transition(job_id, JobState.CANCELED, [JobState.RUNNING], f"canceled while {where}",
                             error={"reason": FailureReason.CANCELED.value, "message": f"Canceled while {where}."})
        else:
            _fail(store, job_id, FailureReason.TIMEOUT.value, limit.message(f"while {where}"))
        store.leases.drop_lease(job_id)
    finally:
        logging.shutdown()
        os._exit(STUCK_EXIT_CODE)


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
    _through_outage(lambda: store.jobs.transition(job_id, JobState.FAILED, [JobState.RUNNING],
                                             f"{reason}: {message}"[:300],
                                             error={"reason": reason, "message": message}))

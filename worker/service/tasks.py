"""The RQ task: run one queued job through the engine and record how it ended.

Imported once when a worker starts, so TensorFlow and the engine are warm
before the first job is dequeued.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from app.core import clock
from app.core.config import Settings, get_settings
from app.core.errors import JobFailed, TimedOut
from app.store import JobStore, connect
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
    set_phase,
)
from worker.engine.training import release_memory, run_job
from worker.service.gpus import pinned_gpus
from worker.service.reaper import requeue
from worker.service.watcher import STUCK_S, AttemptWatcher
from worker.telemetry.redis_reporter import RedisReporter
from worker.telemetry.reporters import FanOut
from worker.telemetry.tensorboard import LOGDIR as TENSORBOARD_LOGDIR
from worker.telemetry.tensorboard import TensorBoardReporter

log = logging.getLogger("mpjobs.worker")
T = TypeVar("T")

REDIS_OUTAGE_BUDGET_S = 120.0
"""How long a finished attempt keeps retrying to record its end while Redis is unreachable."""
STUCK_EXIT_CODE = 70


def run_training(job_id: str) -> str:
    settings = get_settings()
    client = connect.client(settings.redis_url)
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
    # From the newest checkpoint whose steps Redis holds every one of: a checkpoint ahead of them (their
    # records were held in memory through an outage, or lost in a Redis crash) would leave them out for good.
    resume_from = checkpoint.saved_step(out, at_most=store.streams.held_steps(job_id))
    checkpoint.discard_after(out, resume_from)
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
    # An attempt that starts past the last one's start shows that one made progress: the attempts lost in a row
    # without progress (the reaper's count against MAX_ATTEMPTS) start again from none.
    progressed = {"stalled": 0} if resume_from > store.jobs.resumed_from(job_id) else {}
    moved, now_state = store.jobs.transition(
        job_id, JobState.RUNNING, [JobState.QUEUED],
        f"attempt {attempt} on {worker['host']} ({device.kind}{on_gpus}){resumed}",
        started_at=clock.iso(), attempt=attempt, worker=worker, resumed_from=resume_from, **progressed,
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
        except connect.UNAVAILABLE:
            if time.monotonic() > deadline:
                raise
            log.warning("redis unavailable; retrying in %.1f s", delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _train(store: JobStore, job_id: str, spec: JobSpec, out: Path, owner: str, settings: Settings,
           resume_from: int, limit: TimeLimit) -> str:
    board = TensorBoardReporter(out / TENSORBOARD_LOGDIR, resume_step=resume_from,
                                description=describe(job_id, spec))
    steps = RedisReporter(store, job_id, durable=resume_from)
    reporter = FanOut(steps, board)
    interrupter = Interrupter()
    with AttemptWatcher(store, job_id, owner, settings.lease_s, limit, interrupter,
                        on_stuck=lambda kind: _abandon(store, job_id, kind, interrupter.where, limit)) as watcher:
        try:
            try:
                with interrupter:
                    result = run_job(spec, reporter=reporter, checkpoint_dir=out, limit=limit,
                                     should_stop=watcher.cancel_requested.is_set, settings=settings,
                                     resume=checkpoint.Resume(resume_from, steps.durable))
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
    held = _through_outage(lambda: store.streams.held_steps(job_id))
    if held < done:  # lost past the outage budget, or by a Redis crash: the next attempt recomputes them
        return _give_back(store, job_id, f"steps {held + 1}-{done} of {done} are not in Redis", settings)
    _through_outage(lambda: store.jobs.transition(
        job_id, JobState.SUCCEEDED, [JobState.RUNNING], f"finished {done} steps",
        summary=result.summary.model_dump_json()))
    _through_outage(lambda: store.counters.count_diagnoses(job_id, [d.code for d in result.summary.diagnoses]))
    return "succeeded"


def _give_back(store: JobStore, job_id: str, why: str, settings: Settings) -> str:
    """End the attempt without an outcome: requeue the job at the front of its queue as its next attempt,
    which resumes from a checkpoint whose steps Redis holds and recomputes the rest."""
    log.error("job %s: %s; requeued to recompute them", job_id, why)
    moved, _ = _through_outage(lambda: store.jobs.transition(
        job_id, JobState.QUEUED, [JobState.RUNNING], f"{why}; requeued to recompute them"))
    if not moved:
        return f"skipped: {why}"
    rq_redis = connect.client(settings.redis_url, decode_responses=False)
    try:
        _through_outage(lambda: requeue(store, rq_redis, job_id))
    finally:
        rq_redis.close()
    return f"requeued: {why}"


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
    except connect.UNAVAILABLE:
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

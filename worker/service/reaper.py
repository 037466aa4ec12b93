"""The reaper: requeues (or fails) running jobs whose lease expired, and archives ended jobs' histories when due."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis import Redis
from redis.client import Pipeline

from app.core.config import Settings
from app.store import JobStore
from app.store.connect import client
from app.store.queue import enqueue
from app.store.retention import Archiver

log = logging.getLogger("mpjobs.worker")


class Reaper:
    """Requeues running jobs whose lease expired (their worker died), on a thread.

    Every worker runs one; the check and the move happen in one Lua script, so
    exactly one reaper requeues a job. Each retry is a new RQ job (app/store/queue.py `retry_id`),
    at the front of its queue. An enqueue that fails after the move is retried on the next pass.

    On a second thread, as often, it archives the histories of jobs that ended more than
    HISTORY_RETENTION_S ago (app/store/retention.py; a claim per job keeps two workers off one job),
    so a long sweep never delays a requeue.
    """

    def __init__(self, settings: Settings, rq_redis: Redis) -> None:
        self.settings, self.rq_redis = settings, rq_redis
        self.store = JobStore(client(settings.redis_url), settings.artifacts_dir)
        self.archiver = Archiver(self.store, settings.history_retention_s)
        self._threads = [threading.Thread(target=self._loop, args=(self.reap_once, "reaper"), name="reaper",
                                          daemon=True),
                         threading.Thread(target=self._loop, args=(self.archiver.sweep, "archive sweep"),
                                          name="archive-sweep", daemon=True)]
        self._unqueued: set[str] = set()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _loop(self, once: Callable[[], object], what: str) -> None:
        while True:
            time.sleep(self.settings.reap_interval_s)
            try:
                once()
            except Exception:
                log.warning("%s pass failed", what, exc_info=True)

    def reap_once(self) -> list[str]:
        for job_id in self.store.leases.running_ids():
            outcome = self.store.leases.reap(job_id, self.settings.max_attempts)
            if outcome == "queued":
                self._unqueued.add(job_id)
            if outcome != "alive":
                log.warning("job %s lost its worker: %s", job_id, outcome)
        requeued = []
        for job_id in sorted(self._unqueued):
            try:
                self._requeue(job_id)
            except Exception:
                log.exception("requeue of %s failed; retrying next pass", job_id)
                continue
            self._unqueued.discard(job_id)
            requeued.append(job_id)
        return requeued

    def _requeue(self, job_id: str) -> None:
        requeue(self.store, self.rq_redis, job_id)


def requeue(store: JobStore, rq_redis: Redis, job_id: str) -> None:
    """Enqueue the next attempt of `job_id` (now `queued`) at the front of its queue: it has trained part
    of its run, and loses the least by going first. Also how a worker gives back an attempt whose steps
    Redis lost (worker/service/tasks.py)."""
    job = store.jobs.get(job_id)
    if job is None:
        return
    spec = job.spec

    def queue(rq_job_id: str, pipe: Pipeline) -> None:
        enqueue(rq_redis, spec, job_id, pipe, rq_job_id=rq_job_id, at_front=True)

    store.jobs.requeue(job_id, job.attempt + 1, queue, rq_redis.pipeline(transaction=True))

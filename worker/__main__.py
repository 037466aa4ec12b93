"""`python -m worker`: detect the device, warm the engine, and take jobs.

The worker class is `TrainingWorker`, an RQ `SimpleWorker`: jobs run in this
process, never in a forked work horse. TensorFlow is not fork-safe once CUDA
(or even its own thread pools) is initialised, and a fresh horse per job would
re-import TensorFlow every time, seconds per job. Running in-process keeps the
engine warm; a heartbeat thread keeps RQ's registries alive during long jobs
(SimpleWorker sends none), and cancels are polled by the task itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time

from redis import Redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.worker import WorkerStatus

from app.config import Settings, get_settings
from app.queue import enqueue, listening_queues
from app.store import JobStore, job_key

log = logging.getLogger("mpjobs.worker")

HEARTBEAT_INTERVAL_S = 10
"""Seconds between heartbeats while a job runs; far inside RQ's worker TTL."""


class TrainingWorker(SimpleWorker):
    def execute_job(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        done = threading.Event()

        def beat() -> None:
            while not done.wait(HEARTBEAT_INTERVAL_S):
                try:
                    self.maintain_heartbeats(job, execution)
                except Exception:
                    log.warning("heartbeat failed", exc_info=True)

        beater = threading.Thread(target=beat, name="rq-heartbeat", daemon=True)
        beater.start()
        try:
            self.perform_job(job, queue, execution)
        finally:
            done.set()
            beater.join()
        self.set_state(WorkerStatus.IDLE)


class Reaper:
    """Requeues running jobs whose lease expired (their worker died), on a thread.

    Every worker runs one; the check and the move happen in one Lua script, so
    exactly one reaper requeues a job. Each retry is a new RQ job, `{id}-a{n}`.
    An enqueue that fails after the move is retried on the next pass.
    """

    def __init__(self, settings: Settings, rq_redis: Redis) -> None:
        self.settings, self.rq_redis = settings, rq_redis
        self.store = JobStore(Redis.from_url(settings.redis_url, decode_responses=True))
        self._thread = threading.Thread(target=self._loop, name="reaper", daemon=True)
        self._unqueued: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.settings.reap_interval_s)
            try:
                self.reap_once()
            except Exception:
                log.warning("reaper pass failed", exc_info=True)

    def reap_once(self) -> list[str]:
        for job_id in self.store.running_ids():
            outcome = self.store.reap(job_id, self.settings.max_attempts)
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
        job = self.store.get(job_id)
        if job is None:
            return
        rq_job_id = f"{job_id}-a{job.attempt + 1}"
        with self.rq_redis.pipeline(transaction=True) as pipe:
            enqueue(self.rq_redis, job.spec, job_id, pipe, rq_job_id=rq_job_id)
            pipe.hset(job_key(job_id), "rq_job", rq_job_id)
            pipe.execute()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description="Run an mpjobs training worker.")
    parser.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    settings = get_settings()

    from worker import tasks  # noqa: F401  Warm: TensorFlow and the engine load once, here.
    from worker.devices import detect_device

    device = detect_device()
    queues = listening_queues(device.kind)
    log.info("device: %s; listening on %s", device.describe(), queues)
    redis = Redis.from_url(settings.redis_url)
    Reaper(settings, redis).start()
    worker = TrainingWorker(queues, connection=redis, name=f"{socket.gethostname()}.{os.getpid()}")
    worker.work(burst=args.burst, with_scheduler=False, logging_level="INFO")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m worker`: one job slot per GPU, or on a host without one, detect, warm up and take jobs.

On a GPU host this process is the supervisor (worker/service/slots.py): it starts one slot, `python -m
worker --slot GPU` pinned with CUDA_VISIBLE_DEVICES, per GPU that WORKER_GPUS chooses, and
never loads TensorFlow itself. A slot, or the worker of a host without a GPU, is what follows.

The worker class is `TrainingWorker`, an RQ `SimpleWorker`: jobs run in this
process, never in a forked work horse. TensorFlow is not fork-safe once CUDA
(or even its own thread pools) is initialised, and a fresh horse per job would
re-import TensorFlow every time, seconds per job. Running in-process keeps the
engine warm; a heartbeat thread keeps RQ's registries alive during long jobs
(SimpleWorker sends none), and cancels are polled by the task itself.

Redis may be away when the worker starts, or go later (a restart, a failover): the worker waits for
it, logging "waiting for redis at ...", and takes jobs again once it answers. Its RQ connection
(app/store/connect.py `waiting_client`) retries every command until Redis answers, so RQ's loop,
which ends on a Redis error anywhere but its dequeue, never sees one; SIGTERM ends the wait.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import threading
from types import FrameType
from typing import Any

from redis import Redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.worker import WorkerStatus

from app.core.config import get_settings
from app.store.connect import UNAVAILABLE, waiting_client
from app.store.queue import listening_queues
from worker.engine.memory import tune_allocator
from worker.service.gpus import chosen_gpus, host_gpus
from worker.service.reaper import Reaper
from worker.service.slots import Supervisor

log = logging.getLogger("mpjobs.worker")


class TrainingWorker(SimpleWorker):
    """`heartbeat_interval_s`: seconds between heartbeats while a job runs (default: the
    HEARTBEAT_INTERVAL_S setting, 10 s); far inside RQ's worker TTL. `stop`: the Event its
    connection's waiting retry (`waiting_client`) ends on, set once the worker's loop has ended."""

    def __init__(self, *args: Any, heartbeat_interval_s: float | None = None,
                 stop: threading.Event | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.heartbeat_interval_s = (get_settings().heartbeat_interval_s if heartbeat_interval_s is None
                                     else heartbeat_interval_s)
        self.stop = stop

    def teardown(self) -> None:
        """The loop has ended: stop waiting for Redis; if it is away, RQ's record of this worker expires
        by itself (its TTL) instead of being removed."""
        if self.stop is not None:
            self.stop.set()
        try:
            super().teardown()  # type: ignore[no-untyped-call]  # RQ leaves it untyped
        except UNAVAILABLE as exc:
            log.warning("redis unavailable as the worker stops (%s): its registration is left to expire", exc)

    def execute_job(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.heartbeat_interval_s):
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description="Run an mpjobs training worker.")
    parser.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    parser.add_argument("--slot", metavar="GPU", help=argparse.SUPPRESS)  # the supervisor's: run as GPU's slot
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tune_allocator()  # before TensorFlow loads: a job's memory goes back after it (worker/engine/memory.py)
    settings = get_settings()
    if args.slot is None:
        try:
            gpus = chosen_gpus(settings.worker_gpus, host_gpus(settings.host_gpus))
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        if gpus:
            log.info("GPUs %s: one job slot each", ", ".join(gpus))
            return Supervisor(gpus, burst=args.burst).run()

    from worker.engine.devices import detect_device
    from worker.service import tasks  # noqa: F401  Warm: TensorFlow and the engine load once, here.

    device = detect_device()
    # Everything loaded so far (TensorFlow, Keras, the engine) lives as long as the process: move it out
    # of the collector's sight, so the full collection after each job (release_memory) scans only what
    # jobs made: 0.3 s -> 0.02 s per job here.
    gc.collect()
    gc.freeze()
    queues = listening_queues(device.kind, device.count)  # N-device jobs too, up to this slot's devices
    log.info("device: %s; listening on %s", device.describe(), queues)
    stop = threading.Event()
    redis = waiting_client(settings.redis_url, stop)
    if not wait_for_redis(redis, stop):
        log.info("stopped while waiting for redis")
        return 0
    Reaper(settings, redis).start()
    # The RQ worker's name says which GPU(s) it has: .gpu1, or .gpu0+1 for a slot with two.
    slot = "" if args.slot is None else f".gpu{args.slot.replace(',', '+')}"
    worker = TrainingWorker(queues, connection=redis, name=f"{socket.gethostname()}.{os.getpid()}{slot}",
                            heartbeat_interval_s=settings.heartbeat_interval_s, stop=stop)
    worker.work(burst=args.burst, with_scheduler=False, logging_level="INFO")
    return 0


def wait_for_redis(redis: Redis, stop: threading.Event) -> bool:
    """Wait until Redis answers (the connection logs "waiting for redis at ..." while it does not), or until
    SIGTERM or SIGINT: then False. RQ installs its own handlers once its loop starts."""
    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        redis.ping()
        return True
    except UNAVAILABLE:
        if not stop.is_set():
            raise
        return False
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())

"""`GET /metrics`: the service in Prometheus's text format, read fresh from Redis on each scrape.

Counters live in Redis (the workers increment them), so every API replica serves
the same numbers and a restart of the API loses nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis import Redis
from rq import Queue, Worker

from app.api.deps import MemoryDep, RQRedisDep, StoreDep
from app.api.redis_memory import MemoryGauge
from app.store import JobStore
from app.store import queue as queues
from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import DiagnosisCode

router = APIRouter(tags=["health"])
DIAGNOSIS_CODES: tuple[str, ...] = tuple(code.value for code in DiagnosisCode)
DEVICE_CLASSES = ("gpu", "cpu")


class ServiceCollector:
    def __init__(self, store: JobStore, rq_redis: Redis, memory: MemoryGauge) -> None:
        self.store, self.rq_redis, self.memory = store, rq_redis, memory

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("mpjobs_jobs", "Jobs in each state, over all tenants.", labels=["state"])
        for state, count in self.store.counters.jobs_by_state().items():
            jobs.add_metric([state.value], count)
        yield jobs

        depth = GaugeMetricFamily("mpjobs_queue_depth", "Jobs waiting in each RQ queue.", labels=["queue"])
        for name in queues.QUEUES:
            depth.add_metric([name], Queue(name, connection=self.rq_redis).count)
        yield depth

        workers = GaugeMetricFamily("mpjobs_workers", "Live workers by device class (RQ's registry).",
                                    labels=["device"])
        live = dict.fromkeys(DEVICE_CLASSES, 0)
        for worker in Worker.all(connection=self.rq_redis):
            names = worker.queue_names()
            kind = names[0] if names and names[0] in live else "other"
            live[kind] = live.get(kind, 0) + 1
        for kind, count in live.items():
            workers.add_metric([kind], count)
        yield workers

        stats = self.store.counters.stats()
        yield CounterMetricFamily("mpjobs_steps", "Optimizer steps recorded (recomputed steps after a resume "
                                  "count again).", value=stats.get("steps", 0))
        yield CounterMetricFamily("mpjobs_skipped_steps", "Steps whose update was skipped for non-finite "
                                  "gradients.", value=stats.get("skipped_steps", 0))
        diagnoses = CounterMetricFamily("mpjobs_diagnoses", "Jobs that received each diagnosis, counted once "
                                        "per job.", labels=["code"])
        for code in DIAGNOSIS_CODES:
            diagnoses.add_metric([code], stats.get(f"diagnoses:{code}", 0))
        yield diagnoses
        yield CounterMetricFamily("mpjobs_gradient_underflow_jobs", "Jobs diagnosed with float16 gradient "
                                  "underflow.", value=stats.get("diagnoses:gradient_underflow", 0))

        memory = self.memory.read(max_age_s=0)
        yield GaugeMetricFamily("mpjobs_redis_used_memory_bytes", "Memory Redis holds (INFO memory used_memory).",
                                value=memory.used_memory_bytes)
        yield GaugeMetricFamily("mpjobs_redis_maxmemory_bytes", "Redis's maxmemory; 0: no limit. Past "
                                "REDIS_MEMORY_HIGH_WATER of it, new jobs get 503.", value=memory.maxmemory_bytes)

        speed = GaugeMetricFamily("mpjobs_running_examples_per_second",
                                  "Examples per second at the latest step of each running job.",
                                  labels=["job_id", "precision_policy"])
        running = sorted(self.store.leases.running_ids())
        latest = self.store.streams.latest_records(running)
        for job in self.store.jobs.get_many(running):
            if job is not None and job.state is JobState.RUNNING and job.id in latest:
                speed.add_metric([job.id, job.spec.precision_policy.value], latest[job.id].examples_per_sec)
        yield speed


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
def prometheus_metrics(store: StoreDep, rq_redis: RQRedisDep, memory: MemoryDep) -> Response:
    """Jobs by state, queue depths, live workers, step/skip/diagnosis counters, Redis's memory against its
    maxmemory, examples/s of running jobs."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(store, rq_redis, memory))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

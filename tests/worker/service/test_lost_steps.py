"""Issue 31, item 1 as a class: an attempt whose steps Redis does not hold at the end (a crash lost a batch it
had acknowledged) never succeeds; it goes back to the front of its queue, and the next attempt resumes from
the newest checkpoint Redis holds every step of and recomputes the rest."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from redis import Redis
from rq import Queue

from app.store import JobStore
from app.store.keys import entry_id, metrics_key
from app.store.queue import enqueue, queue_for
from app.store.rollup import Rollup
from app.store.streams import MetricStreams
from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import LayerCheck, StepRecord
from mpjobs.contract.spec import JobSpec
from scripts.stack import RedisServer
from worker.service.tasks import run_training

SPEC = JobSpec.model_validate({"model": {"name": "mlp", "input_dim": 8, "hidden_units": 8}, "speed_check": [],
                               "training": {"steps": 30, "checkpoint_every": 10}, "dataset": {"samples": 64}})


def test_steps_redis_lost_send_the_job_back_to_the_front_and_the_next_attempt_recomputes_them(
        server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server.client().flushall()
    monkeypatch.setenv("REDIS_URL", server.url)
    monkeypatch.setenv("ARTIFACTS_DIR", str(tmp_path))
    store, rq_redis = JobStore(server.client()), Redis.from_url(server.url)

    def create() -> str:
        job_id, _ = store.jobs.create(SPEC, "t", queue_for(SPEC), lambda i, pipe: enqueue(rq_redis, SPEC, i, pipe),
                                      rq_redis.pipeline(transaction=True))
        return job_id

    job_id, waiting = create(), create()
    queue = Queue(queue_for(SPEC), connection=rq_redis)
    queue.remove(job_id)  # this test's attempt took it
    real, lost = MetricStreams.append_steps, []

    def crash_loses_a_batch(self: MetricStreams, job: str, records: Sequence[StepRecord],
                            rollups: Sequence[tuple[int, Rollup]], layers: Sequence[LayerCheck] = ()) -> None:
        """Written and acknowledged, then gone: what a Redis crash with AOF `everysec` does to its last second."""
        real(self, job, records, rollups, layers)
        if not lost and records and 10 < records[0].step <= 20:
            self.redis.xdel(metrics_key(job), *(entry_id(r.step) for r in records))
            lost.extend(r.step for r in records)

    monkeypatch.setattr(MetricStreams, "append_steps", crash_loses_a_batch)
    outcome = run_training(job_id)
    assert lost and lost[0] == 11, lost
    assert outcome == "requeued: steps 11-30 of 30 are not in Redis", outcome
    job = store.jobs.get(job_id)
    assert job is not None and job.state is JobState.QUEUED and job.summary is None or job.state is JobState.QUEUED
    assert job.transitions[-1].message == "steps 11-30 of 30 are not in Redis; requeued to recompute them"
    assert queue.get_job_ids() == [f"{job_id}-a2", waiting], "the retry goes first"

    queue.remove(f"{job_id}-a2")
    assert run_training(job_id) == "succeeded"
    done = store.jobs.get(job_id)
    assert done is not None and done.state is JobState.SUCCEEDED and done.summary is not None
    assert "resuming from step 10" in done.transitions[-2].message, done.transitions
    stored = [r.step for r in store.history.read_metrics(job_id, after_step=0, limit=100).points]
    assert stored == list(range(1, 31)), "each step once, none missing"

"""RedisReporter against a real redis-server: layer checks ride with the next batch of steps, through an outage too."""

from __future__ import annotations

import pytest

from app.store import JobStore
from scripts.stack import RedisServer
from tests.app.store.test_layer_checks import check
from tests.app.store.test_missing_steps import job_with_steps, record
from worker.telemetry import redis_reporter
from worker.telemetry.redis_reporter import RedisReporter


@pytest.fixture
def store(server: RedisServer) -> JobStore:
    return JobStore(server.client())


def stored(store: JobStore, job_id: str) -> tuple[list[int], list[int]]:
    """(steps, layer-check steps) Redis holds."""
    steps = [p.step for p in store.history.read_metrics(job_id, 0, 1000).points]
    return steps, [c.step for c in store.history.read_layers(job_id, 0, 1000).checks]


def test_checks_wait_for_the_batch_of_steps_that_follows_them(store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    reporter = RedisReporter(store, job_id)
    reporter.layers([check(1)])
    assert stored(store, job_id) == ([], [])
    reporter.steps([record(1), record(2)])
    assert stored(store, job_id) == ([1, 2], [1]) and reporter.pending_layers == []


def test_checks_are_held_through_an_outage_and_written_once_when_redis_is_back(
        server: RedisServer, store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    reporter = RedisReporter(store, job_id)
    server.stop()  # SIGTERM: a clean restart, its AOF kept
    try:
        reporter.layers([check(1)])
        reporter.steps([record(1), record(2)])
        reporter.layers([check(3)])
        reporter.steps([record(3)])
        assert reporter.outage and [c.step for c in reporter.pending_layers] == [1, 3]
    finally:
        server.start()
    reporter.layers([check(4)])
    reporter.steps([record(4)])
    assert not reporter.outage and reporter.pending_layers == []
    assert stored(store, job_id) == ([1, 2, 3, 4], [1, 3, 4])


def test_drain_writes_the_checks_of_a_job_that_ended_during_an_outage(server: RedisServer, store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    reporter = RedisReporter(store, job_id)
    server.stop()
    try:
        reporter.layers([check(1)])
        reporter.steps([record(1)])
    finally:
        server.start()
    reporter.drain()  # the job's last steps: no batch follows to carry them
    assert stored(store, job_id) == ([1], [1])


def test_a_step_is_durable_once_redis_acknowledged_it_long_enough_ago(
        store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints past `durable()` are kept: a crash of Redis (AOF `everysec`) may still lose those steps."""
    now = [100.0]
    monkeypatch.setattr(redis_reporter.time, "monotonic", lambda: now[0])
    job_id = job_with_steps(store, [])
    reporter = RedisReporter(store, job_id, durable=10)
    reporter.steps([record(11), record(12)])
    now[0] += 1.0
    reporter.steps([record(13)])
    assert reporter.durable() == 10, "the step it resumed from, until the first batch is old enough"
    now[0] += redis_reporter.DURABLE_AFTER_S - 1.0
    assert reporter.durable() == 12
    now[0] += 1.0
    assert reporter.durable() == 13 and reporter.durable() == 13

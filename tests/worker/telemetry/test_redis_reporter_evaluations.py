"""RedisReporter's evaluations: written at once, held through an outage, written once when Redis is back."""

from __future__ import annotations

import pytest

from app.store import JobStore
from scripts.stack import RedisServer
from tests.app.store.test_evaluations_store import evaluation
from tests.app.store.test_missing_steps import job_with_steps, record
from worker.telemetry.redis_reporter import RedisReporter


@pytest.fixture
def store(server: RedisServer) -> JobStore:
    return JobStore(server.client())


def steps_of(store: JobStore, job_id: str) -> list[int]:
    return [e.step for e in store.evaluations.read(job_id, 0, 100).evaluations]


def test_an_evaluation_is_written_at_once(store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    RedisReporter(store, job_id).evaluations([evaluation(3)])
    assert steps_of(store, job_id) == [3]


def test_evaluations_are_held_through_an_outage_and_written_before_the_next_steps(
        server: RedisServer, store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    reporter = RedisReporter(store, job_id)
    server.stop()
    try:
        reporter.evaluations([evaluation(2)])
        reporter.steps([record(1), record(2)])
        assert reporter.outage and [e.step for e in reporter.pending_evaluations] == [2]
    finally:
        server.start()
    reporter.steps([record(3)])
    assert not reporter.outage and reporter.pending_evaluations == []
    assert steps_of(store, job_id) == [2]


def test_drain_writes_the_evaluations_of_a_job_that_ended_during_an_outage(
        server: RedisServer, store: JobStore) -> None:
    job_id = job_with_steps(store, [])
    reporter = RedisReporter(store, job_id)
    server.stop()
    try:
        reporter.evaluations([evaluation(5)])
    finally:
        server.start()
    reporter.drain()
    assert steps_of(store, job_id) == [5]

"""Deleting ended jobs for good, against a real redis-server: every key, index entry, RQ record and file
goes, or (refused) nothing does; and a full Redis refuses a create whole, yet still deletes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis
from redis import Redis

from app.api import deletion as purge
from app.api import services
from app.core.config import Settings
from app.core.errors import ComparisonNotEnded, JobInComparison, JobNotEnded, JobNotFound, JobStillHeld
from app.store import JobStore
from app.store import queue as queues
from app.store.archive import METRICS_FILE
from app.store.keys import ENDED, job_key, lease_key, metrics_key
from app.store.retention import Archiver
from app.store.rollup import ROLLUP_STEPS, Rollup
from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import Summary
from mpjobs.contract.spec import ComparisonSpec, JobSpec
from scripts.stack import RedisServer
from tests.app.store.test_layer_checks import check
from tests.app.store.test_missing_steps import record
from tests.mpjobs.contract.test_schemas import padded_keras_json

TENANT, OTHER = "tenant-a", "tenant-b"
STEPS = 2 * ROLLUP_STEPS + 6
"""Steps of each ended job: two whole rollups and a tail."""


@pytest.fixture
def store(server: RedisServer) -> Iterator[JobStore]:
    client = server.client()
    client.flushdb()
    yield JobStore(client)
    client.config_set("maxmemory", 0)
    client.close()


@pytest.fixture
def rq(server: RedisServer) -> Iterator[Redis]:
    """RQ's connection: raw bytes, as the API's."""
    client = Redis.from_url(server.url)
    yield client
    client.close()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(artifacts_dir=tmp_path / "artifacts")


def spec(steps: int = STEPS) -> JobSpec:
    return JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps": steps}})


def queued_job(store: JobStore, rq: Redis, tenant: str = TENANT) -> str:
    """A job with its RQ job in the `cpu` queue, as `POST /jobs` writes it."""
    s = spec()
    job_id, _ = store.jobs.create(s, tenant, queues.queue_for(s),
                             lambda job_id, pipe: queues.enqueue(rq, s, job_id, pipe), rq.pipeline(transaction=True))
    return job_id


def run(store: JobStore, job_id: str, settings: Settings) -> None:
    """Take the job and train it as a worker would: a lease, every step with its rollups and a layer
    check, a phase, the job's folder (checkpoint, model, TensorBoard, archived history)."""
    store.leases.renew_lease(job_id, "host:1", 30)
    assert store.jobs.transition(job_id, JobState.RUNNING, [JobState.QUEUED], "attempt 1", attempt=1)[0]
    records = [record(s) for s in range(1, STEPS + 1)]
    rollups = []
    for index in range(STEPS // ROLLUP_STEPS):
        rollup = Rollup()
        for r in records[index * ROLLUP_STEPS:(index + 1) * ROLLUP_STEPS]:
            rollup.add(r.model_dump())
        rollups.append((index + 1, rollup))
    store.streams.append_steps(job_id, records, rollups, [check(1), check(ROLLUP_STEPS)])
    store.jobs.set_fields(job_id, phase="training")
    folder = settings.job_dir(job_id)
    for name in ("checkpoint/weights.h5", "model.keras", "tensorboard/events.out", "history/metrics.parquet"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x" * 100)


def end(store: JobStore, job_id: str) -> None:
    """The attempt's last transition, its diagnoses counted, its lease dropped."""
    summary = Summary(steps_done=STEPS, final_loss=1.0, skipped_steps=0, loss_scale_min=1.0, loss_scale_max=1.0,
                      loss_scale_final=1.0, peak_zero_grad_fraction=0.0, mean_examples_per_sec=1.0, diagnoses=[])
    assert store.jobs.transition(job_id, JobState.SUCCEEDED, [JobState.RUNNING], "finished",
                            summary=summary.model_dump_json())[0]
    store.counters.count_diagnoses(job_id, ["gradient_underflow"])
    store.leases.drop_lease(job_id)


def ended_job(store: JobStore, rq: Redis, settings: Settings, tenant: str = TENANT) -> str:
    """A succeeded job with every kind of key a job has, its views cached, and its folder."""
    job_id = queued_job(store, rq, tenant)
    run(store, job_id, settings)
    end(store, job_id)
    for size in services.CACHED_VIEW_SIZES:
        services.buckets_json(store, job_id, tenant, size)
    return job_id


def contents(r: Redis, key: bytes) -> tuple[str, object]:
    """A key's type and value, in an order that does not depend on how Redis stores it."""
    kind = r.type(key).decode()
    value: object = {
        "string": lambda: r.get(key),
        "hash": lambda: sorted(r.hgetall(key).items()),
        "list": lambda: r.lrange(key, 0, -1),
        "set": lambda: sorted(r.smembers(key)),
        "zset": lambda: r.zrange(key, 0, -1, withscores=True),
        "stream": lambda: r.xrange(key),
    }.get(kind, lambda: None)()
    return kind, value


def traces(server: RedisServer, job_id: str) -> list[str]:
    """Every key whose name holds `job_id`, and every key whose content does: a set, sorted set or list
    member, a hash field or value, a string, a stream entry."""
    r = Redis.from_url(server.url)
    try:
        return sorted(f"{key.decode()} ({contents(r, key)[0]})" for key in r.scan_iter(count=1000)
                      if job_id.encode() in key or job_id.encode() in repr(contents(r, key)[1]).encode())
    finally:
        r.close()


def snapshot(server: RedisServer) -> dict[bytes, tuple[str, object]]:
    """Every key and its value: equal snapshots mean nothing was written."""
    r = Redis.from_url(server.url)
    try:
        return {key: contents(r, key) for key in r.scan_iter(count=1000)}
    finally:
        r.close()


def test_a_purge_leaves_no_key_no_member_no_rq_record_and_no_folder_of_the_job(
        server: RedisServer, store: JobStore, rq: Redis, settings: Settings) -> None:
    kept = ended_job(store, rq, settings)
    job_id = ended_job(store, rq, settings)
    assert len(traces(server, job_id)) >= 10  # the helper sees a job: record, streams, views, indexes, RQ
    kept_before = {k: v for k, v in snapshot(server).items() if kept.encode() in k}
    purge.purge_job(store, rq, settings, job_id, TENANT)
    assert traces(server, job_id) == []
    assert not settings.job_dir(job_id).exists()
    assert {k: v for k, v in snapshot(server).items() if kept.encode() in k} == kept_before
    assert settings.model_path(kept).is_file()
    assert [job.id for job in store.jobs.list(TENANT, None, 10, None)[0]] == [kept]
    with pytest.raises(JobNotFound):
        purge.purge_job(store, rq, settings, job_id, TENANT)


def test_a_purge_of_an_archived_job_leaves_no_key_no_member_and_no_folder_of_it(
        server: RedisServer, store: JobStore, rq: Redis, settings: Settings) -> None:
    job_id = ended_job(store, rq, settings)
    archiving = JobStore(store.redis, settings.artifacts_dir)
    assert Archiver(archiving, retention_s=0).archive(job_id) == "archived"
    history = settings.job_dir(job_id) / "history"
    assert pq.read_table(history / METRICS_FILE).num_rows == STEPS, "a real archive, not the planted file"
    assert archiving.history.read_metrics(job_id, 0, 10).points[0].step == 1, "read from the archive"
    assert not store.redis.exists(metrics_key(job_id)) and len(traces(server, job_id)) >= 5
    purge.purge_job(store, rq, settings, job_id, TENANT)
    assert traces(server, job_id) == []
    assert not history.exists() and not settings.job_dir(job_id).exists()
    assert store.redis.zscore(ENDED, job_id) is None and archiving.history.archive_info(job_id) is None


def test_another_tenant_gets_not_found_and_the_job_stays_whole(
        server: RedisServer, store: JobStore, rq: Redis, settings: Settings) -> None:
    job_id = ended_job(store, rq, settings)
    before = snapshot(server)
    with pytest.raises(JobNotFound) as refused:
        purge.purge_job(store, rq, settings, job_id, OTHER)
    assert str(refused.value) == str(JobNotFound(job_id)) == f"No job with id {job_id!r}."
    assert snapshot(server) == before and settings.model_path(job_id).is_file()
    # The script checks the tenant itself, whatever the caller read before.
    assert store.purges.purge(OTHER, [job_id], services.CACHED_VIEW_SIZES).reason == "missing"  # type: ignore[union-attr]
    assert snapshot(server) == before


@pytest.mark.parametrize("state", [JobState.QUEUED, JobState.RUNNING])
def test_a_job_that_has_not_ended_is_refused_and_stays_whole(
        server: RedisServer, store: JobStore, rq: Redis, settings: Settings, state: JobState) -> None:
    job_id = queued_job(store, rq)
    if state is JobState.RUNNING:
        run(store, job_id, settings)
    before = snapshot(server)
    with pytest.raises(JobNotEnded, match=rf"is {state.value}; only an ended job can be deleted. Cancel it first "
                                          rf"\(DELETE /jobs/{job_id}\).*Nothing was deleted."):
        purge.purge_job(store, rq, settings, job_id, TENANT)
    assert store.purges.purge(TENANT, [job_id], services.CACHED_VIEW_SIZES).reason == "active"  # type: ignore[union-attr]
    assert snapshot(server) == before


def test_an_ended_job_whose_attempt_still_holds_its_lease_waits_for_it_then_is_refused(
        monkeypatch: pytest.MonkeyPatch, server: RedisServer, store: JobStore, rq: Redis,
        settings: Settings) -> None:
    job_id = queued_job(store, rq)
    run(store, job_id, settings)
    end(store, job_id)
    store.leases.renew_lease(job_id, "host:1", 30)  # a worker that ended the job but has not let go of it
    monkeypatch.setattr(purge, "SETTLE_S", 0.2)
    before = snapshot(server)
    with pytest.raises(JobStillHeld, match="has not let go of it yet"):
        purge.purge_job(store, rq, settings, job_id, TENANT)
    assert snapshot(server) == before
    # A lease that lapses while the delete waits: the delete goes through.
    monkeypatch.setattr(purge, "SETTLE_S", 10.0)
    store.leases.renew_lease(job_id, "host:1", 0.3)
    purge.purge_job(store, rq, settings, job_id, TENANT)
    assert traces(server, job_id) == []


def comparison(store: JobStore, rq: Redis, tenant: str = TENANT) -> str:
    cmp_spec = ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}, "training": {"steps": STEPS}}})
    jobs = [(job_spec, queues.queue_for(job_spec)) for job_spec in cmp_spec.job_specs()]
    comparison_id, _ = store.comparisons.create_comparison(
        cmp_spec, tenant, jobs, lambda job_id, job_spec, pipe: queues.enqueue(rq, job_spec, job_id, pipe),
        rq.pipeline(transaction=True))
    return comparison_id


def test_a_comparisons_job_goes_only_with_the_comparison_and_then_all_of_them_go(
        server: RedisServer, store: JobStore, rq: Redis, settings: Settings) -> None:
    comparison_id = comparison(store, rq)
    job_ids = store.comparisons.get_comparison(comparison_id, TENANT).job_ids  # type: ignore[union-attr]
    for job_id in job_ids[1:]:
        run(store, job_id, settings)
        end(store, job_id)
    before = snapshot(server)
    with pytest.raises(ComparisonNotEnded, match=rf"{job_ids[0]!r} is queued"):
        purge.purge_comparison(store, rq, settings, comparison_id, TENANT)
    with pytest.raises(JobInComparison, match=rf"DELETE /comparisons/{comparison_id}\?purge=true"):
        purge.purge_job(store, rq, settings, job_ids[1], TENANT)
    assert snapshot(server) == before
    store.jobs.transition(job_ids[0], JobState.CANCELED, [JobState.QUEUED], "canceled")
    with pytest.raises(JobNotFound):
        purge.purge_comparison(store, rq, settings, comparison_id, OTHER)
    purge.purge_comparison(store, rq, settings, comparison_id, TENANT)
    assert traces(server, comparison_id) == [] and store.comparisons.list_comparisons(TENANT, 10, None)[0] == []
    for job_id in job_ids:
        assert traces(server, job_id) == [] and not settings.job_dir(job_id).exists()


def over_maxmemory(r: Redis) -> None:
    """Redis refuses writes from now on: maxmemory just under what it holds."""
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - 100_000)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        r.set("probe", "x")


def test_a_create_that_redis_refuses_as_out_of_memory_writes_nothing(
        server: RedisServer, store: JobStore, rq: Redis, settings: Settings) -> None:
    queued_job(store, rq)
    for _ in range(20):  # memory to spare under the limit set below
        store.redis.set(f"ballast:{_}", "x" * 50_000)
    before = snapshot(server)
    used = int(store.redis.info("memory")["used_memory"])
    store.redis.config_set("maxmemory", used + 600_000)
    big = JobSpec.model_validate({"model": {"keras_json": padded_keras_json(900_000), "loss": "huber"}})
    with pytest.raises(redis.exceptions.OutOfMemoryError):  # the record's HSET is over: the EXEC is refused whole
        store.jobs.create(big, TENANT, "cpu", lambda job_id, pipe: queues.enqueue(rq, big, job_id, pipe),
                     rq.pipeline(transaction=True))
    after = snapshot(server)
    after.pop(b"mpjobs:seq"), before.pop(b"mpjobs:seq")  # the creation counter may move: it numbers, holds nothing
    assert after == before


def test_a_purge_frees_a_redis_that_is_over_its_maxmemory(
        server: RedisServer, store: JobStore, rq: Redis, settings: Settings) -> None:
    job_id = ended_job(store, rq, settings)
    over_maxmemory(store.redis)
    purge.purge_job(store, rq, settings, job_id, TENANT)
    assert traces(server, job_id) == [] and not settings.job_dir(job_id).exists()


def test_a_late_write_does_not_bring_a_purged_job_back(
        server: RedisServer, store: JobStore, rq: Redis, settings: Settings) -> None:
    job_id = ended_job(store, rq, settings)
    purge.purge_job(store, rq, settings, job_id, TENANT)
    store.streams.rewind_metrics(job_id, keep_step=10)  # a resumed attempt that read the job just before it went
    store.counters.count_diagnoses(job_id, ["nan_loss"])
    assert traces(server, job_id) == [] and store.jobs.get(job_id) is None
    assert not store.redis.exists(job_key(job_id), lease_key(job_id))

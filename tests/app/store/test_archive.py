"""Archived histories (app/store/archive.py, retention.py, history.py) against a real redis-server: every read
the same from the files as from Redis, every field exact, the sweep's retention and claims, and a trim that
never removes what changed while it was read."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.core import clock
from app.store import JobStore
from app.store.archive import (
    CACHED_HISTORIES,
    LAYERS_FILE,
    METRICS_FILE,
    RECORD_COLUMN,
    ROLLUPS_FILE,
    ArchivedHistory,
    ArchiveInfo,
    HistoryCache,
    write_history,
)
from app.store.keys import ENDED, archive_claim_key, job_key, layers_key, metrics_key, rollup_key
from app.store.retention import Archiver
from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import STEP_SCALARS
from scripts.stack import RedisServer
from tests.app.store.history import SPEC, ended_job, records


@pytest.fixture
def store(server: RedisServer, tmp_path: Path) -> JobStore:
    server.client().flushall()
    return JobStore(server.client(), tmp_path / "artifacts")


def every_read(store: JobStore, job_id: str) -> dict[str, object]:
    """Every page (several sizes, from several steps, the last one just full and just not), view and layers
    page of the job, as the API reads them."""
    reads: dict[str, object] = {}
    for limit in (1, 7, 1000, 10_000):
        after: int | None = 0
        pages = []
        while after is not None:
            page = store.history.read_metrics(job_id, after, limit)
            pages.append(page.model_dump())
            after = page.next_after
            if len(pages) > 60:
                break
        reads[f"pages of {limit}"] = pages
    last = store.history.read_buckets(job_id, 1).total_steps
    for after_step in (0, 1, 63, 64, 65, 4095, 4097, 9_999, 10_000, 20_000, last - 101, last - 100, last - 99):
        reads[f"page after {after_step}"] = store.history.read_metrics(job_id, after_step, 100).model_dump()
        reads[f"layers after {after_step}"] = store.history.read_layers(job_id, after_step, 3).model_dump()
    for max_points in (1, 3, 7, 500, 1000, 10_000):
        reads[f"view {max_points}"] = store.history.read_buckets(job_id, max_points).model_dump()
    reads["all layers"] = store.history.read_layers(job_id, 0, 10_000).model_dump()
    return reads


@pytest.mark.parametrize("steps", [300, 10_000], ids=["raw view", "rollup view"])
def test_every_read_is_the_same_from_the_archive_as_from_redis(store: JobStore, steps: int) -> None:
    job_id, written, checks = ended_job(store, steps, skip=frozenset({5, 6, 200}))
    before = every_read(store, job_id)
    assert Archiver(store, retention_s=0).archive(job_id) == "archived"
    r = store.redis
    assert not r.exists(metrics_key(job_id), rollup_key(job_id), layers_key(job_id)), "the streams are gone"
    assert r.zscore(ENDED, job_id) is None
    info = store.history.archive_info(job_id)
    assert info is not None and (info.steps, info.layer_checks) == (len(written), len(checks))
    assert info.rollups == steps // 64 and info.dir == f"{job_id}/history"
    store.history.archives = type(store.history.archives)()  # a fresh API process: nothing cached
    assert every_read(store, job_id) == before
    # ...and what was written, independently of both readers: every field of every step and check.
    assert store.history.read_metrics(job_id, 0, 10_000).points == written
    assert store.history.read_layers(job_id, 0, 10_000).checks == checks
    assert before["page after 0"]["missing_steps"] == [(5, 6)]  # type: ignore[index]


def test_the_files_hold_a_typed_column_per_field_with_every_value_exact(store: JobStore) -> None:
    job_id, written, checks = ended_job(store, 700)
    Archiver(store, retention_s=0).archive(job_id)
    folder = store.artifacts_dir / job_id / "history"  # type: ignore[operator]
    metrics = pq.read_table(folder / METRICS_FILE)
    types = dict(zip(metrics.schema.names, metrics.schema.types, strict=True))
    assert types["step"] == pa.int64() and types["skipped"] == pa.bool_() and types["loss"] == pa.float64()
    assert list(types) == [*STEP_SCALARS, RECORD_COLUMN] and types[RECORD_COLUMN] == pa.string()
    typed = metrics.drop_columns([RECORD_COLUMN])
    # floats compared exactly, -0.0 and 5e-324 too (an FP8 job's per-layer rows are in the record's JSON only)
    assert typed.to_pylist() == [r.model_dump(exclude={"fp8"}) for r in written]
    assert metrics.column(RECORD_COLUMN).to_pylist() == [r.model_dump_json() for r in written], "the stored JSON"
    assert [str(r.loss) for r in written].count("-0.0") == [str(v) for v in metrics.column("loss").to_pylist()].count(
        "-0.0")
    layers = pq.read_table(folder / LAYERS_FILE).to_pylist()
    assert layers == [{"step": c.step, "check": c.model_dump_json()} for c in checks]
    assert pq.read_table(folder / ROLLUPS_FILE).num_rows == 700 // 64
    assert pq.ParquetFile(folder / METRICS_FILE).metadata.row_group(0).column(0).compression == "ZSTD"
    assert not list(folder.glob(".*")), "no temporary file is left"


def test_archiving_twice_changes_nothing(store: JobStore) -> None:
    job_id, _, _ = ended_job(store, 100)
    archiver = Archiver(store, retention_s=0)
    assert archiver.archive(job_id) == "archived"
    folder = store.artifacts_dir / job_id / "history"  # type: ignore[operator]
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    record = store.redis.hgetall(job_key(job_id))
    assert archiver.archive(job_id) == "already archived"
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert store.redis.hgetall(job_key(job_id)) == record


def test_every_way_a_job_ends_puts_it_where_the_sweep_finds_it(store: JobStore) -> None:
    succeeded, _, _ = ended_job(store, 10)
    failed, _, _ = ended_job(store, 10, state=JobState.FAILED)
    canceled, _ = store.jobs.create(SPEC, "t", "cpu", lambda _i, _p: None,
                            store.redis.pipeline(transaction=True))
    store.jobs.transition(canceled, JobState.CANCELED, [JobState.QUEUED], "canceled before it started")
    lost, _, _ = ended_job(store, 10, state=JobState.RUNNING)  # its worker died on its last attempt
    store.jobs.set_fields(lost, attempt=3)
    assert store.leases.reap(lost, max_attempts=3) == "failed"
    running, _ = store.jobs.create(SPEC, "t", "cpu", lambda _i, _p: None,
                           store.redis.pipeline(transaction=True))
    store.jobs.transition(running, JobState.RUNNING, [JobState.QUEUED], "attempt 1")
    assert set(store.redis.zrange(ENDED, 0, -1)) == {succeeded, failed, canceled, lost}


def test_the_sweep_archives_only_jobs_whose_retention_has_passed(store: JobStore,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    start = clock.now()
    monkeypatch.setattr(clock, "now", lambda: start)
    old, _, _ = ended_job(store, 50)
    monkeypatch.setattr(clock, "now", lambda: start + timedelta(seconds=3000))
    recent, _, _ = ended_job(store, 50)
    monkeypatch.setattr(clock, "now", lambda: start + timedelta(seconds=3601))
    archiver = Archiver(store, retention_s=3600)
    assert archiver.due() == [old]
    assert archiver.sweep() == [old]
    assert store.history.archive_info(old) is not None and store.history.archive_info(recent) is None
    assert store.redis.exists(metrics_key(recent)) and archiver.sweep() == []


def test_two_workers_sweeping_at_once_archive_each_job_exactly_once(store: JobStore) -> None:
    jobs = {ended_job(store, 200, seed=i)[0] for i in range(12)}
    outcomes: list[list[str]] = [[], []]

    def sweep(i: int) -> None:
        outcomes[i] = Archiver(JobStore(store.redis, store.artifacts_dir), retention_s=0).sweep()

    threads = [threading.Thread(target=sweep, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes[0] + outcomes[1]) == sorted(jobs), "each job archived by exactly one sweeper"
    assert all(store.history.archive_info(job_id) is not None for job_id in jobs)
    assert store.redis.zcard(ENDED) == 0 and not store.redis.keys("*:archiving")


def test_a_job_another_worker_claimed_is_left_to_it(store: JobStore) -> None:
    job_id, _, _ = ended_job(store, 50)
    store.redis.set(archive_claim_key(job_id), "another worker", px=60_000)
    assert Archiver(store, retention_s=0).archive(job_id) == "claimed"
    assert store.history.archive_info(job_id) is None and store.redis.exists(metrics_key(job_id))
    assert store.redis.get(archive_claim_key(job_id)) == "another worker", "its claim is not ours to drop"


def test_a_step_written_while_the_history_is_read_stops_the_trim(store: JobStore) -> None:
    job_id, written, _ = ended_job(store, 100)
    late = written[-1].model_copy(update={"step": 101})

    def late_write(jid: str) -> None:  # a zombie attempt's step, after the archive read the streams
        store.streams.append_steps(jid, [late], [])

    assert Archiver(store, retention_s=0, before_trim=late_write).archive(job_id) == "changed"
    assert store.history.archive_info(job_id) is None and store.redis.zscore(ENDED, job_id) is not None
    assert store.history.read_metrics(job_id, 0, 1000).points == [*written, late], "nothing was removed"
    assert Archiver(store, retention_s=0).archive(job_id) == "archived"
    assert store.history.read_metrics(job_id, 0, 1000).points == [*written, late]


def test_steps_rewound_and_rewritten_while_the_history_is_read_stop_the_trim(store: JobStore) -> None:
    job_id, written, _ = ended_job(store, 60, check_every=1000)  # a metrics stream only: no rollup, no check
    again = records(60, seed=1)[30:]  # a resumed attempt's steps 31..60: as many, the same ids, other values

    def rewrite(jid: str) -> None:
        store.streams.rewind_metrics(jid, keep_step=30)
        store.streams.append_steps(jid, again, [])
        assert store.redis.xlen(metrics_key(jid)) == 60

    assert Archiver(store, retention_s=0, before_trim=rewrite).archive(job_id) == "changed"
    assert store.history.archive_info(job_id) is None
    assert Archiver(store, retention_s=0).archive(job_id) == "archived"
    assert store.history.read_metrics(job_id, 0, 1000).points == [*written[:30], *again]


def test_a_job_deleted_while_it_is_archived_leaves_no_files(store: JobStore) -> None:
    job_id, _, _ = ended_job(store, 100)
    folder = store.artifacts_dir / job_id / "history"  # type: ignore[operator]

    def delete(jid: str) -> None:
        assert folder.is_dir()
        store.redis.delete(job_key(jid), metrics_key(jid), rollup_key(jid), layers_key(jid))

    assert Archiver(store, retention_s=0, before_trim=delete).archive(job_id) == "changed"
    assert not folder.exists() and not store.redis.exists(job_key(job_id))
    assert not folder.parent.exists(), "nor its job's folder, left empty"


def test_a_job_deleted_while_it_is_archived_keeps_its_other_files(store: JobStore) -> None:
    job_id, _, _ = ended_job(store, 100)
    model = store.artifacts_dir / job_id / "model.keras"  # type: ignore[operator]
    model.parent.mkdir(parents=True)
    model.write_bytes(b"a model the delete has yet to remove")

    def delete(jid: str) -> None:
        store.redis.delete(job_key(jid), metrics_key(jid), rollup_key(jid), layers_key(jid))

    assert Archiver(store, retention_s=0, before_trim=delete).archive(job_id) == "changed"
    assert not (model.parent / "history").exists() and model.read_bytes() == b"a model the delete has yet to remove"


def test_a_running_job_is_never_archived(store: JobStore) -> None:
    job_id, _, _ = ended_job(store, 20, state=JobState.RUNNING)
    assert Archiver(store, retention_s=0).archive(job_id) == "not ended"
    assert store.redis.exists(metrics_key(job_id)) and store.history.archive_info(job_id) is None


def test_the_record_describes_its_archive(store: JobStore) -> None:
    job_id, _, _ = ended_job(store, 130, check_every=13)
    Archiver(store, retention_s=0).archive(job_id)
    info = ArchiveInfo.model_validate_json(store.redis.hget(job_key(job_id), "archived") or "")
    assert (info.format, info.version, info.steps, info.rollups, info.layer_checks) == ("parquet", 2, 130, 2, 10)


def test_a_job_without_history_leaves_ended_and_no_files(store: JobStore) -> None:
    job_id, _ = store.jobs.create(SPEC, "t", "cpu", lambda _i, _p: None, store.redis.pipeline(transaction=True))
    store.jobs.transition(job_id, JobState.CANCELED, [JobState.QUEUED], "canceled before it started")
    assert Archiver(store, retention_s=0).archive(job_id) == "no history"
    assert store.redis.zscore(ENDED, job_id) is None and store.history.archive_info(job_id) is None
    assert not (store.artifacts_dir / job_id).exists()  # type: ignore[operator]
    assert store.history.read_metrics(job_id, 0, 10).points == []
    assert store.history.read_buckets(job_id, 500).buckets == []


def test_jobs_that_ended_before_the_index_existed_are_indexed_by_the_first_sweep(store: JobStore) -> None:
    older, _, _ = ended_job(store, 30)
    archived, _, _ = ended_job(store, 30)
    Archiver(store, retention_s=0).archive(archived)
    store.redis.delete(ENDED)  # as a database from before `ended` has it
    finished = datetime.fromisoformat(store.redis.hget(job_key(older), "finished_at") or "")
    archiver = Archiver(store, retention_s=3600)
    assert archiver.index_ended() == 1 and archiver.index_ended() == 0
    assert store.redis.zrange(ENDED, 0, -1, withscores=True) == [(older, finished.timestamp())]
    store.redis.delete(ENDED)
    assert Archiver(store, retention_s=0).sweep() == [older], "the first sweep indexes them, then archives them"


def test_the_api_keeps_a_few_archives_parsed_and_reopens_one_rewritten(tmp_path: Path) -> None:
    folders = [tmp_path / f"job{i}" for i in range(CACHED_HISTORIES + 1)]
    for folder in folders:
        write_history(folder, [r.model_dump() for r in records(3)], [r.model_dump_json() for r in records(3)], [], [])
    cache = HistoryCache()
    first = cache.open(folders[0])
    assert cache.open(folders[0]) is first, "a second read finds it parsed"
    write_history(folders[0], [r.model_dump() for r in records(5)], [r.model_dump_json() for r in records(5)], [],
                  [])  # a retry rewrote it
    again = cache.open(folders[0])
    assert again is not first and again.last_step == 5
    for folder in folders[1:]:
        cache.open(folder)
    assert cache.open(folders[1]) is cache.open(folders[1]) and cache.open(folders[0]) is not again, "evicted"


def test_an_opened_archive_holds_only_the_steps_and_their_json(tmp_path: Path) -> None:
    written = records(3000)
    jsons = [r.model_dump_json() for r in written]
    write_history(tmp_path, [r.model_dump() for r in written], jsons, [], [])
    history = ArchivedHistory(tmp_path)
    assert history.metrics.column_names == ["step", RECORD_COLUMN], "the typed columns stay on disk"
    # The JSON's bytes, an int32 offset per string (and one more), an int64 per step: nothing else.
    assert history.metrics.nbytes <= sum(len(j.encode()) for j in jsons) + 4 * (len(jsons) + 1) + 8 * len(jsons)
    assert list(history.steps) == [r.step for r in written] and history.last_step == 3000
    assert history.step_records(2990, 5) == written[2990:2995]
    assert history.records(2990, 2, fields=["step", "loss"]) == [{"step": r.step, "loss": r.loss}
                                                                 for r in written[2990:2992]]

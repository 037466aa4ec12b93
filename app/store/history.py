"""Reads of a job's metric history wherever it is: its Redis streams, or its archive once its record says so.

The archive replaces the streams in one Lua script (app/store/retention.py): the record gains
ARCHIVED_FIELD as the streams go. So each read asks Redis first and the record after: if the record
does not say "archived" yet, the streams were still whole when they were read; if it does, the
answer comes from the files, whatever the streams said. A page, a view or a layer check reads the
same either way (tests/app/store/test_archive.py).
"""

from __future__ import annotations

from pathlib import Path

from redis import Redis

from app.store.archive import FORMAT_VERSION, ArchivedHistory, ArchiveInfo, HistoryCache
from app.store.base import RedisBacked
from app.store.keys import ARCHIVED_FIELD, job_key
from app.store.pages import RawPage, raw_page
from app.store.rollup import SERIES, raw_buckets, rollup_buckets
from app.store.streams import RAW_BUCKET_LIMIT, MetricStreams, metrics_page
from mpjobs.contract.jobs import LayersPage, MetricsBuckets, MetricsPage
from mpjobs.contract.records import LayerCheck

BUCKET_FIELDS = ("step", "skipped", *SERIES)
"""What a bucket folds of each step record."""


class MetricHistory(RedisBacked):
    """The reads of `streams`, each falling back to the job's archive under `artifacts_dir` (ARTIFACTS_DIR:
    without it an archived job's history cannot be read). `archives` keeps the archives last opened."""

    def __init__(self, redis: Redis, streams: MetricStreams, artifacts_dir: Path | None) -> None:
        super().__init__(redis)
        self.streams, self.artifacts_dir = streams, artifacts_dir
        self.archives = HistoryCache()

    def archive_info(self, job_id: str) -> ArchiveInfo | None:
        """What the job record says about its archive; None while its history is in Redis."""
        raw = self.redis.hget(job_key(job_id), ARCHIVED_FIELD)
        return None if raw is None else ArchiveInfo.model_validate_json(raw)

    def archived_history(self, job_id: str) -> ArchivedHistory | None:
        """The job's archive, parsed (and cached), or None while its history is in Redis."""
        info = self.archive_info(job_id)
        return None if info is None else self.open_archive(job_id, info)

    def open_archive(self, job_id: str, info: ArchiveInfo) -> ArchivedHistory:
        if info.version > FORMAT_VERSION:
            raise RuntimeError(f"Expected an archive of format version {FORMAT_VERSION} or older. Received: "
                               f"version={info.version} for job {job_id} (a newer mpjobs wrote it)")
        if self.artifacts_dir is None:
            raise RuntimeError(f"Expected a JobStore built with artifacts_dir to read the archived history of "
                               f"job {job_id}. Received: artifacts_dir=None")
        return self.archives.open(self.artifacts_dir / info.dir)

    def read_metrics(self, job_id: str, after_step: int, limit: int) -> MetricsPage:
        page = self.streams.read_metrics(job_id, after_step, limit)
        history = self.archived_history(job_id)
        if history is None:
            return page
        points = history.step_records(after_step, limit + 1)
        return metrics_page(job_id, after_step, points[:limit], len(points) > limit)

    def read_metrics_raw(self, job_id: str, after_step: int, limit: int) -> RawPage:
        page = self.streams.read_metrics_raw(job_id, after_step, limit)
        info = self.archive_info(job_id)
        return page if info is None else self.archived_page(job_id, info, after_step, limit)

    def archived_page(self, job_id: str, info: ArchiveInfo, after_step: int, limit: int) -> RawPage:
        """`read_metrics_raw` from the archive the job record describes (`info`), with no read of Redis."""
        return raw_page(after_step, self.open_archive(job_id, info).step_jsons(after_step, limit + 1), limit)

    def read_layers(self, job_id: str, after_step: int, limit: int) -> LayersPage:
        page = self.streams.read_layers(job_id, after_step, limit)
        history = self.archived_history(job_id)
        if history is None:
            return page
        found = history.layer_checks(after_step, limit + 1)
        checks = [LayerCheck.model_validate_json(check) for _, check in found[:limit]]
        return LayersPage(job_id=job_id, checks=checks, next_after=checks[-1].step if len(found) > limit else None)

    def read_buckets(self, job_id: str, max_points: int) -> MetricsBuckets:
        """The same buckets from the archive as from the streams: the same records and rollups, cut the same way."""
        view = self.streams.read_buckets(job_id, max_points)
        history = self.archived_history(job_id)
        if history is None:
            return view
        total = history.last_step
        if total <= RAW_BUCKET_LIMIT:
            buckets = raw_buckets(history.records(0, fields=BUCKET_FIELDS), max_points)
        else:
            stored = history.rollups()
            tail = history.records(stored[-1]["last_step"] if stored else 0, fields=BUCKET_FIELDS)
            buckets = rollup_buckets(stored, tail, max_points)
        return MetricsBuckets(job_id=job_id, total_steps=total, buckets=buckets)

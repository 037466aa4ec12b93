"""The Redis data layer both processes use: one JobStore made of one part per concern.

Keys and stream entries are spelled in `keys.py` only. Connections are passed in;
the store owns none. It imports neither FastAPI nor TensorFlow. An ended job's
history may live in its archive under ARTIFACTS_DIR instead (`archive.py`).
The API's reads on `redis.asyncio` are in `async_reads.py`, on a connection of their own.
"""

from __future__ import annotations

from pathlib import Path

from redis import Redis

from app.store.cancel import CancelFlags
from app.store.comparisons import ComparisonRecord, Comparisons
from app.store.counters import Counters
from app.store.datasets import DatasetInUseBy, Datasets
from app.store.evaluations import Evaluations
from app.store.history import MetricHistory
from app.store.idempotency import IdempotencyKey
from app.store.jobs import JobRecords
from app.store.leases import Leases
from app.store.purge import PurgeRefusal, Purges
from app.store.streams import RAW_BUCKET_LIMIT, MetricStreams
from app.store.views import VIEW_TTL_S, ViewCache


class JobStore:
    """Jobs in Redis, one part per concern, each by name and each on the one connection `redis`:

    - `jobs`: records and their transitions (app/store/jobs.py);
    - `comparisons`: comparison records, their jobs written through `jobs` (comparisons.py);
    - `leases`: running attempts' leases, and the reap of an expired one (leases.py);
    - `cancels`: cancel flags, and the cancel of an attempt whose worker is silent (cancel.py);
    - `streams`: the metric streams' writes, and reads of what Redis holds of them (streams.py);
    - `history`: reads of a job's metric history wherever it is, the streams or the archive (history.py);
    - `counters`: counters since the database began, and jobs per state (counters.py);
    - `views`: the cached bucketed views (views.py);
    - `purges`: deleting ended jobs for good (purge.py);
    - `evaluations`: evaluations on the held-out rows, written and read page by page (evaluations.py).
    - `datasets`: uploaded datasets' records, and the jobs that train on them (datasets.py).

    `artifacts_dir` (ARTIFACTS_DIR) is where archived histories are read from; a store without it
    reads only what is in Redis.
    """

    def __init__(self, redis: Redis, artifacts_dir: Path | None = None) -> None:
        self.redis, self.artifacts_dir = redis, artifacts_dir
        self.jobs = JobRecords(redis)
        self.comparisons = Comparisons(redis, self.jobs)
        self.leases = Leases(redis)
        self.cancels = CancelFlags(redis)
        self.streams = MetricStreams(redis)
        self.history = MetricHistory(redis, self.streams, artifacts_dir)
        self.counters = Counters(redis)
        self.views = ViewCache(redis)
        self.purges = Purges(redis)
        self.evaluations = Evaluations(redis)
        self.datasets = Datasets(redis)


__all__ = ["RAW_BUCKET_LIMIT", "VIEW_TTL_S", "ComparisonRecord", "DatasetInUseBy", "IdempotencyKey",
           "JobStore", "PurgeRefusal"]

"""The Redis data layer both processes use: one JobStore made of one part per concern.

Keys and stream entries are spelled in `keys.py` only. Connections are passed in;
the store owns none. It imports neither FastAPI nor TensorFlow. An ended job's
history may live in its archive under ARTIFACTS_DIR instead (`archive.py`).
"""

from __future__ import annotations

from pathlib import Path

from redis import Redis

from app.store.archive import HistoryCache
from app.store.cancel import CancelFlags
from app.store.comparisons import ComparisonRecord, Comparisons
from app.store.counters import Counters
from app.store.history import MetricHistory
from app.store.idempotency import IdempotencyKey
from app.store.leases import Leases
from app.store.purge import PurgeRefusal, Purges
from app.store.streams import RAW_BUCKET_LIMIT
from app.store.views import VIEW_TTL_S, ViewCache


class JobStore(Comparisons, Leases, CancelFlags, MetricHistory, Counters, ViewCache, Purges):
    """Jobs in Redis: records and transitions (with comparisons and their idempotency keys), leases,
    cancel flags, metric streams (or their archive), counters, the view cache and purges, each from its own
    module.

    `artifacts_dir` (ARTIFACTS_DIR) is where archived histories are read from; a store without it
    reads only what is in Redis.
    """

    def __init__(self, redis: Redis, artifacts_dir: Path | None = None) -> None:
        super().__init__(redis)
        self.artifacts_dir = artifacts_dir
        self.histories = HistoryCache()


__all__ = ["RAW_BUCKET_LIMIT", "VIEW_TTL_S", "ComparisonRecord", "IdempotencyKey", "JobStore", "PurgeRefusal"]

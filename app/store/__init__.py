"""The Redis data layer both processes use: one JobStore made of one part per concern.

Keys and stream entries are spelled in `keys.py` only. Connections are passed in;
the store owns none. It imports neither FastAPI nor TensorFlow.
"""

from __future__ import annotations

from app.store.cancel import CancelFlags
from app.store.comparisons import ComparisonRecord, Comparisons
from app.store.counters import Counters
from app.store.idempotency import Idempotency
from app.store.leases import Leases
from app.store.purge import PurgeRefusal, Purges
from app.store.streams import RAW_BUCKET_LIMIT, MetricStreams
from app.store.views import VIEW_TTL_S, ViewCache


class JobStore(Comparisons, Idempotency, Leases, CancelFlags, MetricStreams, Counters, ViewCache, Purges):
    """Jobs in Redis: records and transitions (with comparisons), idempotency keys, leases,
    cancel flags, metric streams, counters, the view cache and purges, each from its own module."""


__all__ = ["RAW_BUCKET_LIMIT", "VIEW_TTL_S", "ComparisonRecord", "JobStore", "PurgeRefusal"]

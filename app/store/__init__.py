"""The Redis data layer both processes use: one JobStore made of one part per concern.

Keys and stream entries are spelled in `keys.py` only. Connections are passed in;
the store owns none. It imports neither FastAPI nor TensorFlow.
"""

from __future__ import annotations

from app.store.cancel import CancelFlags
from app.store.comparisons import ComparisonRecord, Comparisons
from app.store.counters import Counters
from app.store.idempotency import IdempotencyKey
from app.store.leases import Leases
from app.store.streams import RAW_BUCKET_LIMIT, MetricStreams
from app.store.views import VIEW_TTL_S, ViewCache


class JobStore(Comparisons, Leases, CancelFlags, MetricStreams, Counters, ViewCache):
    """Jobs in Redis: records and transitions (with comparisons and their idempotency keys), leases,
    cancel flags, metric streams, counters and the view cache, each from its own module."""


__all__ = ["RAW_BUCKET_LIMIT", "VIEW_TTL_S", "ComparisonRecord", "IdempotencyKey", "JobStore"]

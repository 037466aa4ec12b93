"""The cached bucketed view of a job's metrics: one JSON body per size, and who may refresh a stale one."""

from __future__ import annotations

from app.store.base import RedisBacked
from app.store.keys import view_fresh_key, view_key

VIEW_TTL_S = 24 * 3600
"""How long an ended job's bucketed view stays cached (it can no longer change)."""


class ViewCache(RedisBacked):
    def cached_view(self, job_id: str, max_points: int) -> tuple[str | None, bool]:
        """(the cached view or None, whether it is still fresh)."""
        key = view_key(job_id, max_points)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(key)
            pipe.exists(view_fresh_key(job_id, max_points))
            body, fresh = pipe.execute()
        return (None if body is None else str(body)), bool(fresh)

    def claim_view_refresh(self, job_id: str, max_points: int, fresh_s: float) -> bool:
        """Whether this caller recomputes a stale view: one caller per `fresh_s` wins."""
        return bool(self.redis.set(view_fresh_key(job_id, max_points), 1, nx=True, px=int(fresh_s * 1000)))

    def cache_view(self, job_id: str, max_points: int, body: str, fresh_s: float) -> None:
        """Keep the view VIEW_TTL_S, fresh for `fresh_s`."""
        key = view_key(job_id, max_points)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, body, ex=VIEW_TTL_S)
            pipe.set(view_fresh_key(job_id, max_points), 1, px=int(fresh_s * 1000))
            pipe.execute()

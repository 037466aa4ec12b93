"""`GET /jobs/{id}/metrics?after=&limit=`: the page and the job's check in one async round trip.

No threadpool hop: only an archived job's page is read in a thread (from its files).

The page is XRANGE's reply as hiredis parsed it (bytes, no dict per entry), its records joined as stored
(app/store/pages.py), read with the job's record by the store (app/store/async_reads.py).
"""

from __future__ import annotations

from fastapi.concurrency import run_in_threadpool
from redis.asyncio import Redis

from app.core.errors import JobNotFound
from app.store import JobStore
from app.store.archive import ArchiveInfo
from app.store.async_reads import AsyncPageReads
from app.store.pages import RawPage


class PageReads:
    """Pages of a job's step records on `aredis`'s connections; an archived job's from its files, through `store`."""

    def __init__(self, aredis: Redis, store: JobStore) -> None:
        self.store = store
        self.pages = AsyncPageReads(aredis)

    async def page(self, job_id: str, tenant: str, after_step: int, limit: int) -> RawPage:
        """The page after `after_step`; JobNotFound for a missing job or another tenant's. On an ended job's
        last page, the steps it trained after the last one stored are `missing_steps`."""
        found = await self.pages.page(job_id, tenant, after_step, limit)
        if found is None:
            raise JobNotFound(job_id)
        page = found.page
        if isinstance(page, ArchiveInfo):  # the files answer: read in a thread, as every archived read is
            page = await run_in_threadpool(self.store.history.archived_page, job_id, page, after_step, limit)
        steps_done = found.steps_done
        if steps_done is not None and not page.more and steps_done > page.last_step:
            page.missing_steps.append((page.last_step + 1, steps_done))
        return page

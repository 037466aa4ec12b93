"""`GET /jobs/{id}/metrics?after=&limit=` on the async Redis client: the page and the job's check in one round
trip, no threadpool hop. Only an archived job's page is read in a thread (from its files).

The page is XRANGE's reply as hiredis parsed it (bytes, no dict per entry), its records joined as stored
(app/store/pages.py). The job's record is read after the page, in the same pipeline, as every history read
does (app/store/history.py): a record that does not say "archived" yet means the stream was whole.
"""

from __future__ import annotations

import json

from fastapi.concurrency import run_in_threadpool
from redis.asyncio import Redis
from redis.client import NEVER_DECODE

from app.core.errors import JobNotFound
from app.store import JobStore
from app.store.archive import ArchiveInfo
from app.store.keys import ARCHIVED_FIELD, after, job_key, metrics_key
from app.store.pages import RawPage, stream_page, unparsed_xrange
from mpjobs.contract.jobs import JobState

HEAD = ("tenant", "state", "summary", ARCHIVED_FIELD)
"""The job record's fields read with the page."""


class PageReads:
    """Pages of a job's step records on `aredis`'s connections (a client of its own: XRANGE left unparsed);
    replies are read as bytes, whether or not `aredis` decodes."""

    def __init__(self, aredis: Redis, store: JobStore) -> None:
        self.store = store
        self.aredis = Redis(connection_pool=aredis.connection_pool)
        self.aredis.set_response_callback("XRANGE", unparsed_xrange)

    async def page(self, job_id: str, tenant: str, after_step: int, limit: int) -> RawPage:
        """The page after `after_step`; JobNotFound for a missing job or another tenant's. On an ended job's
        last page, the steps it trained after the last one stored are `missing_steps`."""
        async with self.aredis.pipeline(transaction=False) as pipe:
            pipe.execute_command("XRANGE", metrics_key(job_id), after(after_step), "+", "COUNT", limit + 1,
                                 **{NEVER_DECODE: []})
            pipe.execute_command("HMGET", job_key(job_id), *HEAD, **{NEVER_DECODE: []})
            entries, head = await pipe.execute()
        owner, state, summary, archived = (None if value is None else value.decode() for value in head)
        if state is None or owner != tenant:
            raise JobNotFound(job_id)
        if archived is not None:  # the files answer: read in a thread, as every archived read is
            info = ArchiveInfo.model_validate_json(archived)
            page = await run_in_threadpool(self.store.history.archived_page, job_id, info, after_step, limit)
        else:
            page = stream_page(after_step, entries, limit)
        steps_done = json.loads(summary)["steps_done"] if summary and JobState(state).terminal else None
        if steps_done is not None and not page.more and steps_done > page.last_step:
            page.missing_steps.append((page.last_step + 1, steps_done))
        return page

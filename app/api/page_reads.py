"""`GET /jobs/{id}/metrics?after=&limit=` on the async Redis client: the job's check and the page in one
atomic script call, no threadpool hop. Only an archived job's page is read in a thread (from its files).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.concurrency import run_in_threadpool
from redis.asyncio import Redis
from redis.client import NEVER_DECODE
from redis.exceptions import NoScriptError

from app.core.errors import JobNotFound
from app.core.job import JobState
from app.store import JobStore
from app.store.keys import ARCHIVED_FIELD, STEP_FIELD, after, job_key, metrics_key
from app.store.pages import RawPage
from app.store.streams import RAW_PAGE

HEAD = ("tenant", "state", "summary", ARCHIVED_FIELD)
"""The job record's fields read with the page."""


class PageReads:
    """Pages of a job's step records, as `services.metrics` reads them, on `aredis`."""

    def __init__(self, aredis: Redis, store: JobStore) -> None:
        self.aredis, self.store = aredis, store
        self._script = aredis.register_script(RAW_PAGE)

    async def page(self, job_id: str, tenant: str, after_step: int, limit: int) -> RawPage:
        """The page after `after_step`; JobNotFound for a missing job or another tenant's. On an ended job's
        last page, the steps it trained after the last one stored are `missing_steps`."""
        reply = await self._eval([metrics_key(job_id), job_key(job_id)],
                                 [after(after_step), limit, STEP_FIELD, *HEAD])
        body, steps, more, head = reply
        owner, state, summary, archived = (None if v is None else v.decode() for v in head)
        if state is None or owner != tenant:
            raise JobNotFound(job_id)
        if archived is not None:  # the files answer: read in a thread, as every archived read is
            page = await run_in_threadpool(self.store.read_metrics_raw, job_id, after_step, limit)
        else:
            page = RawPage(after_step, [int(step) for step in steps.split()], body, bool(more))
        steps_done = json.loads(summary)["steps_done"] if summary and JobState(state).terminal else None
        if steps_done is not None and not page.more and steps_done > page.last_step:
            page.missing_steps.append((page.last_step + 1, steps_done))
        return page

    async def _eval(self, keys: list[str], args: list[object]) -> list[Any]:
        """The script's reply as bytes (a page is passed on as it is, never decoded)."""
        command = ("EVALSHA", self._script.sha, len(keys), *keys, *args)
        try:
            reply: list[Any] = await self.aredis.execute_command(  # type: ignore[no-untyped-call]
                *command, **{NEVER_DECODE: []})
        except NoScriptError:  # Redis restarted, or its scripts were flushed: load it again
            await self.aredis.script_load(RAW_PAGE)
            reply = await self.aredis.execute_command(*command, **{NEVER_DECODE: []})  # type: ignore[no-untyped-call]
        return reply

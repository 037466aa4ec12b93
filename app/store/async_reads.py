"""The API's reads on redis.asyncio: a job with its transitions, and a page of its steps.

Each reader takes an async connection (the API's, made with decode_responses=True) and reads the keys the
sync parts of the store write (app/store/jobs.py, streams.py). What is built of the replies, and any read of
an archive's files (in a thread), is the caller's: these only read Redis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.client import NEVER_DECODE

from app.store.archive import ArchiveInfo
from app.store.keys import (
    ARCHIVED_FIELD,
    after,
    events_key,
    job_key,
    metrics_key,
)
from app.store.pages import RawPage, stream_page, unparsed_xrange
from mpjobs.contract.jobs import JobState

# The job's record and its transitions in one command: a script is one reply to parse, where a pipeline of
# HGETALL and XRANGE costs redis.asyncio twice the Python per request.
READ_JOB = """
return {redis.call('HGETALL', KEYS[1]), redis.call('XRANGE', KEYS[2], '-', '+')}
"""
HEAD = ("tenant", "state", "summary", ARCHIVED_FIELD)
"""The job record's fields read with a page."""


@dataclass(frozen=True)
class StoredJob:
    """A job's record (empty when there is none) and its transitions as the script returned them."""

    record: dict[str, str]
    events: list[Any]
    """[[id, [field, value, ...]], ...]: turned into dicts only when a job is built (`transitions`)."""

    @property
    def last_event_id(self) -> str | None:
        return str(self.events[-1][0]) if self.events else None

    def transitions(self) -> list[tuple[str, dict[str, str]]]:
        """The transitions as `JobRecords.job_from` takes them: (id, fields)."""
        return [(event_id, dict(zip(fields[::2], fields[1::2], strict=True))) for event_id, fields in self.events]


class AsyncJobReads:
    """`job:{id}` and its `events` stream, in one round trip."""

    def __init__(self, aredis: Redis) -> None:
        self._read = aredis.register_script(READ_JOB)

    async def job(self, job_id: str) -> StoredJob:
        flat, events = await self._read(keys=[job_key(job_id), events_key(job_id)])
        return StoredJob(dict(zip(flat[::2], flat[1::2], strict=True)), events)


@dataclass(frozen=True)
class StoredPage:
    """A page of a job's steps, read with what its record says."""

    page: RawPage | ArchiveInfo
    """From the metrics stream; once the history is archived, the archive its record names: the files answer."""
    steps_done: int | None
    """An ended job's steps trained, from its summary; None before it ends."""


class AsyncPageReads:
    """Pages of a job's step records, on `aredis`'s connections (a client of its own: XRANGE left unparsed);
    replies are read as bytes, whether or not `aredis` decodes."""

    def __init__(self, aredis: Redis) -> None:
        self.aredis = Redis(connection_pool=aredis.connection_pool)
        self.aredis.set_response_callback("XRANGE", unparsed_xrange)

    async def page(self, job_id: str, tenant: str, after_step: int, limit: int) -> StoredPage | None:
        """The steps after `after_step`, at most `limit`, and the job's record in the same round trip, read
        after the page as every history read does (app/store/history.py): a record that does not say
        "archived" yet means the stream was whole. None for a missing job or another tenant's."""
        async with self.aredis.pipeline(transaction=False) as pipe:
            pipe.execute_command("XRANGE", metrics_key(job_id), after(after_step), "+", "COUNT", limit + 1,
                                 **{NEVER_DECODE: []})
            pipe.execute_command("HMGET", job_key(job_id), *HEAD, **{NEVER_DECODE: []})
            entries, head = await pipe.execute()
        owner, state, summary, archived = (None if value is None else value.decode() for value in head)
        if state is None or owner != tenant:
            return None
        page = (stream_page(after_step, entries, limit) if archived is None
                else ArchiveInfo.model_validate_json(archived))
        steps_done = json.loads(summary)["steps_done"] if summary and JobState(state).terminal else None
        return StoredPage(page, steps_done)

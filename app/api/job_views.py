"""`GET /jobs/{id}`: one async round trip, no threadpool hop, and the job's JSON kept while its record holds.

The job's JSON is kept for as long as what it was built from is unchanged.

A job is read as its record (a hash) and its transitions (a stream). Building a `Job` validates its spec,
summary and error, and dumping it costs as much again; a job polled by a dashboard or a CLI changes only at
a step report or a transition. So the JSON is kept per job, keyed by everything it was built from: the
record's fields, the number and last id of its transitions, and whether a queued job has a worker. A
changed field is a new key, so no answer is ever stale.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from fastapi.concurrency import run_in_threadpool
from redis.asyncio import Redis

from app.api.services import LiveWorkers, waiting_reason
from app.core.errors import JobNotFound
from app.store import JobStore
from app.store.async_reads import AsyncJobReads
from mpjobs.contract.jobs import JobState

CACHED_JOBS = 1024
"""Jobs whose JSON an API process keeps, most recently read first: a few MB at most."""


class JobViews:
    """The JSON of `GET /jobs/{id}`, read with `aredis` in one round trip (app/store/async_reads.py) and built as
    `store.jobs.get` builds a job."""

    def __init__(self, aredis: Redis, store: JobStore, workers: LiveWorkers, size: int = CACHED_JOBS) -> None:
        self.aredis, self.store, self.workers, self.size = aredis, store, workers, size
        self.reads = AsyncJobReads(aredis)
        self._held: OrderedDict[str, tuple[Any, bytes]] = OrderedDict()

    async def json(self, job_id: str, tenant: str) -> bytes:
        """The job as `Job` JSON, or JobNotFound: another tenant's job is indistinguishable from none.
        A queued job that no live worker can take says why, as `services.get` has it."""
        stored = await self.reads.job(job_id)
        raw = stored.record
        if not raw or raw.get("tenant") != tenant:
            raise JobNotFound(job_id)
        unserved = raw.get("state") == JobState.QUEUED.value and not await self._workers(raw["queue"])
        version = (tuple(sorted(raw.items())), len(stored.events), stored.last_event_id, unserved)
        held = self._held.get(job_id)
        if held is not None and held[0] == version:
            self._held.move_to_end(job_id)
            return held[1]
        job = self.store.jobs.job_from(raw, stored.transitions())
        if unserved:
            job = job.model_copy(update={"waiting_reason": waiting_reason(job.queue)})
        body = job.model_dump_json().encode()
        self._held[job_id] = (version, body)
        self._held.move_to_end(job_id)
        while len(self._held) > self.size:
            self._held.popitem(last=False)
        return body

    async def _workers(self, queue: str) -> int:
        """Live workers on `queue`: the count of the last second, or counted now in a thread (sync RQ calls)."""
        count = self.workers.recent(queue)
        return count if count is not None else await run_in_threadpool(self.workers.count, queue)

"""The SSE stream of one job: its step records and state changes, resumable by step."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.asyncio import Redis

from app.core.job import JobState
from app.store.keys import STEP_FIELD, entry_id, events_key, job_key, metrics_key, number_of

BLOCK_MS = 1000
"""Longest one XREAD waits; also how often a silent stream checks for a disconnect."""
BATCH = 500


def _event(kind: str, data: str, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {data}\n\n"


async def stream_job(
    redis: Redis, job_id: str, after_step: int, disconnected: Callable[[], Awaitable[bool]]
) -> AsyncIterator[str]:
    cursors = {metrics_key(job_id): entry_id(after_step), events_key(job_id): entry_id(0)}
    terminal = False
    while not await disconnected():
        found = await redis.xread(cursors, count=BATCH, block=None if terminal else BLOCK_MS)
        for stream, entries in found or []:
            for stream_id, fields in entries:
                cursors[stream] = stream_id
                if stream == metrics_key(job_id):
                    yield _event("metrics", fields[STEP_FIELD], str(number_of(stream_id)))
                else:
                    terminal = terminal or JobState(fields["state"]).terminal
                    yield _event("state", json.dumps(fields))
        if terminal and not found:
            # The job ended and every step written before that has been sent.
            state = await redis.hget(job_key(job_id), "state")
            yield _event("end", json.dumps({"state": state}))
            return

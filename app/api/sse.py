"""The SSE stream of one job: its step records, layer checks and state changes, resumable by step."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.concurrency import run_in_threadpool
from redis.asyncio import Redis

from app.store.archive import ArchivedHistory
from app.store.keys import (
    LAYERS_FIELD,
    STEP_FIELD,
    entry_id,
    events_key,
    job_key,
    layers_key,
    metrics_key,
    number_of,
)
from mpjobs.contract.jobs import JobState

BLOCK_MS = 1000
"""Longest one XREAD waits; also how often a silent stream checks for a disconnect."""
BATCH = 500


def _event(kind: str, data: str, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {data}\n\n"


async def stream_job(
    redis: Redis, job_id: str, after_step: int, disconnected: Callable[[], Awaitable[bool]],
    archived: Callable[[], Awaitable[ArchivedHistory | None]] | None = None,
) -> AsyncIterator[str]:
    """`metrics` (id = step), `layers` (no id) and `state` events, then `end` once the job is terminal.

    A layer check at step s is sent just before the `metrics` event of step s, never after it: the store
    writes a batch's checks before its steps, and checks read ahead of the steps wait here. So a client
    that resumes after the last step it saw (`Last-Event-ID`) has every check up to that step already,
    and gets the rest from after it.

    An ended job whose history was archived (`archived()` returns it) is replayed from the archive, the
    same events with the same ids: its steps and checks, then its states, then `end`. One archived while
    it streams goes on from the archive after the last step sent.
    """
    metrics, layers, events = metrics_key(job_id), layers_key(job_id), events_key(job_id)
    cursors = {layers: entry_id(after_step), metrics: entry_id(after_step), events: entry_id(0)}
    held: list[tuple[int, str]] = []
    """Layer checks read but not sent yet: (step, LayerCheck JSON), in step order."""
    terminal = False
    history = await archived() if archived is not None else None
    if history is not None:
        async for event in _replay(history, after_step, after_step, [], disconnected):
            yield event
        for _, fields in await redis.xrange(events):
            yield _event("state", json.dumps(fields))
        yield _event("end", json.dumps({"state": await redis.hget(job_key(job_id), "state")}))
        return
    while not await disconnected():
        reply: Any = await redis.xread(cursors, count=BATCH, block=None if terminal else BLOCK_MS)
        found: dict[str, list[tuple[str, dict[str, str]]]] = dict(reply or [])
        for stream_id, fields in found.get(layers, []):
            cursors[layers] = stream_id
            held.append((number_of(stream_id), fields[LAYERS_FIELD]))
        # A full batch of checks: more may lie past the last one read.
        checks_read_to = number_of(cursors[layers]) if len(found.get(layers, [])) == BATCH else None
        for stream_id, fields in found.get(metrics, []):
            step = number_of(stream_id)
            if checks_read_to is not None and step > checks_read_to:
                break  # the next read brings the checks up to this step, then the step again
            while held and held[0][0] <= step:
                yield _event("layers", held.pop(0)[1])
            cursors[metrics] = stream_id
            yield _event("metrics", fields[STEP_FIELD], str(step))
        for stream_id, fields in found.get(events, []):
            cursors[events] = stream_id
            terminal = terminal or JobState(fields["state"]).terminal
            yield _event("state", json.dumps(fields))
        if terminal and not found:
            # The job ended and every step written before that has been sent (unless its history was
            # archived meanwhile: the rest comes from the archive); then any check left without a step
            # after it (its step lost to a Redis crash).
            history = await archived() if archived is not None else None
            if history is not None:
                async for event in _replay(history, number_of(cursors[metrics]), number_of(cursors[layers]), held,
                                           disconnected):
                    yield event
                held = []
            for _, check in held:
                yield _event("layers", check)
            state = await redis.hget(job_key(job_id), "state")
            yield _event("end", json.dumps({"state": state}))
            return


async def _replay(history: ArchivedHistory, after_step: int, checks_after: int, held: list[tuple[int, str]],
                  disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
    """The archive's steps after `after_step` with its checks after `checks_after` (`held` before them), each
    check just before its step's event, as the live stream sends them; then checks past the last step."""
    checks = deque(held + await run_in_threadpool(history.layer_checks, checks_after))
    while not await disconnected():
        steps = await run_in_threadpool(history.step_jsons, after_step, BATCH)
        if not steps:
            break
        for step, data in steps:
            while checks and checks[0][0] <= step:
                yield _event("layers", checks.popleft()[1])
            yield _event("metrics", data, str(step))
        after_step = steps[-1][0]
    for _, check in checks:
        yield _event("layers", check)

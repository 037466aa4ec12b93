"""The SSE stream of one job: its step records, layer checks, evaluations and state changes, resumable by step."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.concurrency import run_in_threadpool
from redis.asyncio import Redis

from app.store.archive import ArchivedHistory
from app.store.async_reads import AsyncStreamReads, StreamCursor
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
    """`metrics` (id = step), `layers` and `evaluation` (no id) and `state` events, then `end` once the job is
    terminal. An evaluation at step s is sent just before the `metrics` event of step s, as a layer check is
    (the worker writes it before that step); an archived job's come after its steps (they stay in Redis).

    A layer check at step s is sent just before the `metrics` event of step s, never after it: the store
    writes a batch's checks before its steps, and checks read ahead of the steps wait here. So a client
    that resumes after the last step it saw (`Last-Event-ID`) has every check up to that step already,
    and gets the rest from after it.

    An ended job whose history was archived (`archived()` returns it) is replayed from the archive, the
    same events with the same ids: its steps and checks, then its states, then `end`. One archived while
    it streams goes on from the archive after the last step sent.
    """
    streams = AsyncStreamReads(redis, job_id)
    cursor = StreamCursor(checks=after_step, steps=after_step, evaluations=after_step)
    held: list[tuple[int, str]] = []
    """Layer checks read but not sent yet: (step, LayerCheck JSON), in step order."""
    evaluations: list[tuple[int, str]] = []
    """Evaluations read but not sent yet: (step, EvalRecord JSON), in step order."""
    terminal = False
    history = await archived() if archived is not None else None
    if history is not None:
        async for event in _replay(history, after_step, after_step, [], disconnected):
            yield event
        for record in await streams.evaluations_after(after_step):
            yield _event("evaluation", record)
        for fields in await streams.transitions():
            yield _event("state", json.dumps(fields))
        yield _event("end", json.dumps({"state": await streams.state()}))
        return
    while not await disconnected():
        found = await streams.read(cursor, count=BATCH, block_ms=None if terminal else BLOCK_MS)
        for step, check in found.checks:
            cursor.checks = step
            held.append((step, check))
        for step, record in found.evaluations:
            cursor.evaluations = step
            evaluations.append((step, record))
        # A full batch of checks (or evaluations): more may lie past the last one read.
        full = [read_to for read_to, n in ((cursor.checks, len(found.checks)),
                                           (cursor.evaluations, len(found.evaluations))) if n == BATCH]
        checks_read_to = min(full) if full else None
        for step, record in found.steps:
            if checks_read_to is not None and step > checks_read_to:
                break  # the next read brings the checks up to this step, then the step again
            while held and held[0][0] <= step:
                yield _event("layers", held.pop(0)[1])
            while evaluations and evaluations[0][0] <= step:
                yield _event("evaluation", evaluations.pop(0)[1])
            cursor.steps = step
            yield _event("metrics", record, str(step))
        for event_id, fields in found.events:
            cursor.events = event_id
            terminal = terminal or JobState(fields["state"]).terminal
            yield _event("state", json.dumps(fields))
        if terminal and found.empty:
            # The job ended and every step written before that has been sent (unless its history was
            # archived meanwhile: the rest comes from the archive); then any check left without a step
            # after it (its step lost to a Redis crash).
            history = await archived() if archived is not None else None
            if history is not None:
                async for event in _replay(history, cursor.steps, cursor.checks, held, disconnected):
                    yield event
                held = []
            for _, check in held:
                yield _event("layers", check)
            for _, record in evaluations:
                yield _event("evaluation", record)
            yield _event("end", json.dumps({"state": await streams.state()}))
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

"""The SSE stream of one job: its step records, layer checks, evaluations and state changes, resumable by step.

A viewer first catches up on what Redis (or the job's archive) holds past its Last-Event-ID, on the live
fan-out's small pool, then joins the process's one reader of the job (app/api/live_hub.py) without a gap or
a repeat. Once the headers are sent a stream never just stops: it ends with `end`, or with an `error` event
naming why (`too_slow`, `redis_unavailable`, `internal_error`), after which the client
resumes from the last event id it received.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.api.live_hub import Ending, LiveHub
from app.api.live_order import BATCH, Sequencer, full, sse
from app.store.archive import ArchivedHistory, ArchiveInfo
from app.store.connect import UNAVAILABLE
from app.store.live_reads import JobHead, evaluations_after, job_head, read_streams, transitions

log = logging.getLogger("mpjobs.live")

KEEPALIVE_S = 15.0
"""A stream silent this long sends an SSE comment: proxies keep it open, and a client gone is noticed where the
server does not say so (Starlette ends a stream whose client left at once under uvicorn's ASGI 2.3)."""
Archives = Callable[[ArchiveInfo], Awaitable[ArchivedHistory]]
"""Opens the archive a job record names (its files, read in a thread)."""


def error_event(reason: str, detail: str) -> str:
    """The `error` event that ends a stream early, and why: the client resumes after the last id it received.

    >>> error_event("too_slow", "behind")
    'event: error\\ndata: {"reason": "too_slow", "detail": "behind"}\\n\\n'
    """
    return sse("error", json.dumps({"reason": reason, "detail": detail}))


class LiveStream(StreamingResponse):
    """The SSE response: its generator is closed (the viewer leaves the fan-out) and its place given back
    (`release`) however it ends, sent whole, cut, or never started."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content, self._release = content, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._content.aclose()  # type: ignore[attr-defined]
            finally:
                self._release()


async def stream_job(live: LiveHub, archives: Archives, job_id: str, after_step: int, head: JobHead
                     ) -> AsyncIterator[str]:
    """`metrics` (id = step), `layers` and `evaluation` (no id) and `state` events, then `end` once the job is
    terminal; or, when the stream cannot go on, an `error` event. An evaluation or layer check at step s is
    sent just before the `metrics` event of step s (the worker writes it before that step); an archived
    job's evaluations come after its steps (they stay in Redis).

    So a client that resumes after the last step it saw (`Last-Event-ID`) has every check up to that step
    already, and gets the rest from after it. An ended job whose history was archived (`head.archived`) is
    replayed from the archive, the same events with the same ids: its steps and checks, then its states,
    then `end`. One archived while it streams goes on from the archive after the last step sent.
    """
    sequencer = Sequencer(after_step)
    try:
        async for text in _events(live, archives, job_id, sequencer, head):
            yield text
    except UNAVAILABLE as exc:
        log.warning("a live stream of job %s lost redis: %s", job_id, exc)
        yield error_event("redis_unavailable", f"Redis is unavailable ({exc or type(exc).__name__}); resume after "
                          "the last event id received once it answers")
    except Exception:
        log.exception("a live stream of job %s failed", job_id)
        yield error_event("internal_error", "the stream failed; resume after the last event id received")


async def _events(live: LiveHub, archives: Archives, job_id: str, sequencer: Sequencer, head: JobHead
                  ) -> AsyncIterator[str]:
    after_step = sequencer.sent_step
    if head.archived is not None:
        async for text in _replay(await archives(head.archived), after_step, after_step, []):
            yield text
        for record in await evaluations_after(live.lane, job_id, after_step):
            yield sse("evaluation", record)
        for fields in await transitions(live.lane, job_id):
            yield sse("state", json.dumps(fields))
        yield sse("end", json.dumps({"state": (await job_head(live.lane, job_id)).state}))
        return
    # What Redis holds now, read alone: a viewer far behind never fills a queue while it catches up.
    async for text in _catch_up(live, job_id, sequencer):
        yield text
    if sequencer.whole:
        async for text in _finish(live, archives, job_id, sequencer, sequencer.cursor.checks):
            yield text
        return
    viewer = await live.join(job_id)
    try:
        # Joined: the queue gets every event the reader finds from now on. Read on to Redis's end, which
        # holds all the reader sent before; the queue's events this viewer already has are skipped.
        async for text in _catch_up(live, job_id, sequencer):
            yield text
        if sequencer.whole:
            async for text in _finish(live, archives, job_id, sequencer, sequencer.cursor.checks):
                yield text
            return
        # Checks held for a later step: the reader sends them, in their places (a check is stored before its
        # step). An evaluation may be stored after its step: this viewer sends those it read itself, and takes
        # from the reader only those past the last it read.
        sequencer.held.clear()
        step, state, evaluations_read = sequencer.sent_step, sequencer.state_id, sequencer.cursor.evaluations
        held = sequencer.evaluations
        while True:
            got = await viewer.next(KEEPALIVE_S)
            if got is None:
                yield ": keep-alive\n\n"
                continue
            if isinstance(got, Ending):
                sequencer.cursor.steps = step
                if got.reason is not None:
                    yield error_event(got.reason, got.detail)
                    return
                sequencer.held = deque(check for check in got.held if check[0] > step)
                held.extend(record for record in got.evaluations if record[0] > evaluations_read)
                checks_read = max(sequencer.cursor.checks, got.checks_read)
                async for text in _finish(live, archives, job_id, sequencer, checks_read):
                    yield text
                return
            texts = []
            for item in got:
                if item.kind == "evaluation":
                    if item.step > evaluations_read:
                        texts.append(item.text)
                        evaluations_read = item.step
                elif item.after(step, state):
                    if item.kind == "metrics":
                        while held and held[0][0] <= item.step:
                            texts.append(sse("evaluation", held.popleft()[1]))
                        step = item.step
                    elif item.kind == "state":
                        state = item.state_id
                    texts.append(item.text)
            sequencer.cursor.steps = step
            if texts:
                yield "".join(texts)
    finally:
        live.leave(job_id, viewer)


async def _catch_up(live: LiveHub, job_id: str, sequencer: Sequencer) -> AsyncIterator[str]:
    """Everything Redis holds past the sequencer's cursor, read in batches until one is not full."""
    while True:
        found = (await read_streams(live.lane, {job_id: sequencer.cursor}, BATCH, None))[job_id]
        items = sequencer.feed(found)
        if items:
            yield "".join(item.text for item in items)
        if sequencer.whole or not full(found):
            return


async def _finish(live: LiveHub, archives: Archives, job_id: str, sequencer: Sequencer, checks_read: int
                  ) -> AsyncIterator[str]:
    """The end of an ended job's stream: the archive's steps past the last sent (when its history was archived
    meanwhile), checks left without a step after them (their step lost to a Redis crash), evaluations, `end`."""
    head = await job_head(live.lane, job_id)
    if head.archived is not None:
        history = await archives(head.archived)
        async for text in _replay(history, sequencer.sent_step, checks_read, list(sequencer.held)):
            yield text
    else:
        for _, check in sequencer.held:
            yield sse("layers", check)
    for _, record in sequencer.evaluations:
        yield sse("evaluation", record)
    yield sse("end", json.dumps({"state": head.state}))


async def _replay(history: ArchivedHistory, after_step: int, checks_after: int, held: list[tuple[int, str]]
                  ) -> AsyncIterator[str]:
    """The archive's steps after `after_step` with its checks after `checks_after` (`held` before them), each
    check just before its step's event, as the live stream sends them; then checks past the last step."""
    checks: deque[tuple[int, str]] = deque(held + await run_in_threadpool(history.layer_checks, checks_after))
    while True:
        steps = await run_in_threadpool(history.step_jsons, after_step, BATCH)
        if not steps:
            break
        texts: list[str] = []
        for step, data in steps:
            while checks and checks[0][0] <= step:
                texts.append(sse("layers", checks.popleft()[1]))
            texts.append(sse("metrics", data, str(step)))
        yield "".join(texts)
        after_step = steps[-1][0]
    for _, check in checks:
        yield sse("layers", check)


"""One reader of Redis per API process for every live stream, its events fanned out to each viewer's bounded queue.

A job with viewers is a `Topic`: one `Sequencer` (app/api/live_order.py) turns what the reader finds into
events once, and each viewer's queue gets the same events. The reader is one task doing one XREAD over
every watched job's streams, on a connection of its own; viewers catching up read on a small pool. So the
connections a process holds do not depend on how many watch (CLIENT LIST names them `mpjobs-live`).

A viewer whose queue holds `queue_events` events when more come is dropped (`too_slow`): it ends its stream
with an `error` event, and its client resumes with Last-Event-ID. A Redis lost under the reader ends every
viewer the same way (`redis_unavailable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

from app.api.live_order import BATCH, Item, Sequencer
from app.store.connect import UNAVAILABLE, live_clients
from app.store.live_reads import StreamBatch, read_streams, tail

log = logging.getLogger("mpjobs.live")

BLOCK_MS = 1000
"""Longest the reader's XREAD waits; a viewer joining a job no one watched wakes it at once (CLIENT UNBLOCK)."""
RETRY_S = 0.5
"""The reader's pause after it lost Redis, before it reads again for any viewer that joined since."""


@dataclass(frozen=True)
class Ending:
    """How a viewer's live feed ended: the job's stream is whole (`reason` None), or the viewer must resume."""

    reason: str | None = None
    """`too_slow`, `redis_unavailable` or `internal_error`; None when the job ended."""
    detail: str = ""
    held: list[tuple[int, str]] = field(default_factory=list)
    """An ended job's layer checks with no step after them: (step, LayerCheck JSON)."""
    evaluations: list[tuple[int, str]] = field(default_factory=list)
    checks_read: int = 0
    """The last layer check the topic read (its step)."""


class Viewer:
    """One stream's place in the fan-out: the events waiting for it, and how its feed ended."""

    __slots__ = ("queue", "ready", "ending")

    def __init__(self) -> None:
        self.queue: deque[Item] = deque()
        self.ready = asyncio.Event()
        self.ending: Ending | None = None

    async def next(self, timeout: float) -> list[Item] | Ending | None:
        """The events waiting (all of them), else how the feed ended, else None after `timeout` seconds of nothing.
        A failure ends the feed at once, ahead of anything waiting; the job's end comes after its last events."""
        if not self.queue and self.ending is None:
            self.ready.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.ready.wait()
        if self.ending is not None and (self.ending.reason is not None or not self.queue):
            return self.ending
        if not self.queue:
            return None
        items = list(self.queue)
        self.queue.clear()
        return items


class Topic:
    """A watched job: its viewers, and its events as the reader finds them."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.viewers: set[Viewer] = set()
        self.sequencer = Sequencer(0)
        self.started = asyncio.Event()
        """Set once the sequencer starts from the job's tail; the reader reads the topic from then on."""
        self.failed: BaseException | None = None


class LiveHub:
    """The fan-out of one API process. `max_streams` streams may be open at once (`admit`)."""

    def __init__(self, url: str, queue_events: int, max_streams: int, read_connections: int) -> None:
        self.queue_events, self.max_streams, self.read_connections = queue_events, max_streams, read_connections
        self.reader, self.lane = live_clients(url, read_connections)
        self.topics: dict[str, Topic] = {}
        self.streams = 0
        """Streams open now, admitted and not yet ended."""
        self._wake = asyncio.Event()
        self._reader_id: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._opened = False

    # -- streams: the limit ------------------------------------------------------------------------------
    def admit(self) -> bool:
        """Takes a stream's place, or False when `max_streams` are open; `release` gives it back."""
        if self.streams >= self.max_streams:
            return False
        self.streams += 1
        return True

    def release(self) -> None:
        self.streams -= 1

    # -- viewers -----------------------------------------------------------------------------------------
    async def join(self, job_id: str) -> Viewer:
        """A viewer of `job_id`'s live events: every event the reader finds after this returns. A viewer
        joining a job no one watches starts its topic at the streams' tail (what is before it, the viewer
        reads itself). Raises what Redis raised when the topic could not start."""
        await self._open()
        viewer = Viewer()
        while True:
            topic = self.topics.get(job_id)
            if topic is None:
                topic = self.topics[job_id] = Topic(job_id)
                try:
                    end = await tail(self.lane, job_id)
                except BaseException as exc:
                    topic.failed = exc
                    self.topics.pop(job_id, None)
                    topic.started.set()
                    raise
                topic.sequencer = Sequencer(end.step, end.events)
                topic.sequencer.cursor.evaluations = end.evaluations  # one stored after its step is read too
                topic.sequencer.terminal = end.terminal
                topic.viewers.add(viewer)  # before any await: a topic started is never seen without a viewer
                topic.started.set()
                try:
                    await self._unblock()
                except BaseException:
                    self.leave(job_id, viewer)  # its stream was cancelled: it never reaches its own leave()
                    raise
                return viewer
            await topic.started.wait()
            if topic.failed is None and self.topics.get(job_id) is topic:
                topic.viewers.add(viewer)
                return viewer
            # the viewer that started it could not (gone, or Redis was), or it ended meanwhile: start it again

    def leave(self, job_id: str, viewer: Viewer) -> None:
        """`viewer` stops watching; a topic with no viewer left is no longer read."""
        topic = self.topics.get(job_id)
        if topic is not None:
            topic.viewers.discard(viewer)
            if not topic.viewers and topic.started.is_set():
                del self.topics[job_id]

    def _publish(self, topic: Topic, items: list[Item]) -> None:
        for viewer in list(topic.viewers):
            if viewer.queue and len(viewer.queue) + len(items) > self.queue_events:
                topic.viewers.discard(viewer)
                self._end(viewer, Ending("too_slow", f"this viewer fell {len(viewer.queue)} events behind the "
                                         f"live feed (STREAM_QUEUE_EVENTS={self.queue_events}); resume after "
                                         "the last event id received"))
                continue
            viewer.queue.extend(items)
            viewer.ready.set()

    @staticmethod
    def _end(viewer: Viewer, ending: Ending) -> None:
        if ending.reason is not None:
            viewer.queue.clear()
        viewer.ending = ending
        viewer.ready.set()

    def _end_all(self, reason: str, detail: str) -> None:
        for topic in list(self.topics.values()):
            if topic.started.is_set():
                del self.topics[topic.job_id]
                for viewer in topic.viewers:
                    self._end(viewer, Ending(reason, detail))

    # -- the reader --------------------------------------------------------------------------------------
    async def _open(self) -> None:
        """Opens every connection the fan-out keeps, together, when the first viewer comes: how many it holds
        never depends on how many watch. Starts the reader."""
        if not self._opened:
            # As many commands at once as the pool holds connections: it opens them all.
            await asyncio.gather(*(self.lane.ping() for _ in range(self.read_connections)))
            self._opened = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="mpjobs-live-reader")

    def _reconnected(self, connection: object) -> None:
        """The reader's connection was made again (redis-py retries a command once on a new one): its CLIENT ID
        changed, so none is unblocked until the reader has read the new one."""
        self._reader_id = None

    async def _unblock(self) -> None:
        """Wakes the reader, so that its next XREAD takes in a job just joined."""
        self._wake.set()
        if self._reader_id is not None:
            with contextlib.suppress(*UNAVAILABLE):
                await self.lane.client_unblock(self._reader_id)

    async def _run(self) -> None:
        while True:
            topics = [topic for topic in self.topics.values() if topic.started.is_set()]
            if not topics:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._wake.clear()
            # A job that ended is finished by the first read that finds nothing more of it: no waiting then.
            block = None if any(topic.sequencer.terminal for topic in topics) else BLOCK_MS
            try:
                if self._reader_id is None:
                    await self.reader.initialize()
                    assert self.reader.connection is not None
                    self.reader.connection.register_connect_callback(self._reconnected)  # type: ignore[no-untyped-call]
                    self._reader_id = int(await self.reader.client_id())
                found = await read_streams(self.reader, {t.job_id: t.sequencer.cursor for t in topics}, BATCH, block)
                self._deliver(topics, found)
            except UNAVAILABLE as exc:
                self._reader_id = None
                log.warning("live streams lost redis: %s", exc)
                self._end_all("redis_unavailable", f"Redis is unavailable ({exc or type(exc).__name__}); resume "
                              "after the last event id received once it answers")
                await asyncio.sleep(RETRY_S)
                continue
            except Exception:
                log.exception("the live reader failed")
                self._end_all("internal_error", "the API's live reader failed; resume after the last event id "
                              "received")
                await asyncio.sleep(RETRY_S)
                continue

    def _deliver(self, topics: list[Topic], found: dict[str, StreamBatch]) -> None:
        for topic in topics:
            if self.topics.get(topic.job_id) is not topic:
                continue  # every viewer left while the read was under way
            batch = found[topic.job_id]
            items = topic.sequencer.feed(batch)
            if items:
                self._publish(topic, items)
            if topic.sequencer.whole:
                del self.topics[topic.job_id]
                sequencer = topic.sequencer
                ending = Ending(None, "", list(sequencer.held), list(sequencer.evaluations), sequencer.cursor.checks)
                for viewer in topic.viewers:
                    self._end(viewer, ending)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._end_all("shutting_down", "the API is shutting down; resume after the last event id received")
        await self.reader.aclose()
        await self.lane.aclose()

"""A job's live events in the order its stream sends them, built from what reads of its four streams find."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass

from app.store.live_reads import StreamBatch, StreamCursor
from mpjobs.contract.jobs import JobState

BATCH = 500
"""The most entries one read takes of each stream."""


def sse(kind: str, data: str, event_id: str | None = None) -> str:
    """One Server-Sent Event's text.

    >>> sse("metrics", '{"step": 3}', "3")
    'id: 3\\nevent: metrics\\ndata: {"step": 3}\\n\\n'
    """
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {data}\n\n"


def stream_order(stream_id: str) -> tuple[int, int]:
    """A stream id as a pair that sorts as Redis orders ids.

    >>> stream_order("1700000000000-2") > stream_order("999-9")
    True
    """
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class Item:
    """One event ready to send: its SSE `text`, and where it stands in the job's stream."""

    kind: str
    """`metrics`, `layers`, `evaluation` or `state`."""
    step: int
    """The step of a step record, layer check or evaluation; -1 for a state change."""
    text: str
    state_id: tuple[int, int] = (0, 0)
    """A state change's stream id (`stream_order`)."""

    def after(self, step: int, state_id: tuple[int, int]) -> bool:
        """Whether this event comes after a viewer that has been sent every step up to `step` (each with the
        checks before it) and every state change up to `state_id`. (Not for an evaluation: one may be stored
        after its step, so a viewer places it by the last evaluation it read.)"""
        return self.state_id > state_id if self.kind == "state" else self.step > step


def full(found: StreamBatch) -> bool:
    """Whether a read may have left entries behind: one of its streams gave a whole batch."""
    return max(len(found.checks), len(found.steps), len(found.events), len(found.evaluations)) >= BATCH


class Sequencer:
    """Turns batches of a job's `layers`, `metrics`, `evaluations` and `events` entries into events, in the
    stream's order: a layer check or evaluation at step s just before the `metrics` event of step s (the
    worker writes them before that step, and those read ahead of their step wait here), a batch's state
    changes after its steps. `cursor` says what has been read; `sent_step`, every step sent."""

    def __init__(self, after_step: int, events_after: str = "0-0") -> None:
        self.cursor = StreamCursor(checks=after_step, steps=after_step, evaluations=after_step, events=events_after)
        self.held: deque[tuple[int, str]] = deque()
        """Layer checks read but not sent yet: (step, LayerCheck JSON), in step order."""
        self.evaluations: deque[tuple[int, str]] = deque()
        """Evaluations read but not sent yet: (step, EvalRecord JSON), in step order."""
        self.terminal = False
        """A terminal state change has been read."""
        self.whole = False
        """A terminal state change has been read, and then a read found nothing more: the job's stream is whole."""

    @property
    def sent_step(self) -> int:
        return self.cursor.steps

    @property
    def state_id(self) -> tuple[int, int]:
        return stream_order(self.cursor.events)

    def feed(self, found: StreamBatch) -> list[Item]:
        """The events `found` completes, in order; what waits for a later step is held."""
        items: list[Item] = []
        for step, check in found.checks:
            self.cursor.checks = step
            self.held.append((step, check))
        for step, record in found.evaluations:
            self.cursor.evaluations = step
            self.evaluations.append((step, record))
        # A full batch of checks (or evaluations): more may lie past the last one read.
        full = [read_to for read_to, n in ((self.cursor.checks, len(found.checks)),
                                           (self.cursor.evaluations, len(found.evaluations))) if n == BATCH]
        checks_read_to = min(full) if full else None
        for step, record in found.steps:
            if checks_read_to is not None and step > checks_read_to:
                break  # the next read brings the checks up to this step, then the step again
            while self.held and self.held[0][0] <= step:
                held_step, check = self.held.popleft()
                items.append(Item("layers", held_step, sse("layers", check)))
            while self.evaluations and self.evaluations[0][0] <= step:
                eval_step, evaluation = self.evaluations.popleft()
                items.append(Item("evaluation", eval_step, sse("evaluation", evaluation)))
            self.cursor.steps = step
            items.append(Item("metrics", step, sse("metrics", record, str(step))))
        for event_id, fields in found.events:
            self.cursor.events = event_id
            self.terminal = self.terminal or JobState(fields["state"]).terminal
            items.append(Item("state", -1, sse("state", json.dumps(fields)), stream_order(event_id)))
        self.whole = self.whole or (self.terminal and found.empty)
        return items


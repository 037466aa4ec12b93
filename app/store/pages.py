"""Metrics pages assembled from the stored JSON of each step, with no parse and no validation per record.

A step record is stored as `StepRecord.model_dump_json()` (app/store/keys.py), in the Redis stream and,
once archived, in the archive's `record` column. A page is those strings joined inside the envelope
`MetricsPage` would serialise to: the same bytes as validating every record and dumping the page, at a
fraction of the cost (tests/app/store/test_pages.py holds the two paths to the same bytes).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawPage:
    """The steps after `after_step`, each with its record's stored JSON, in step order."""

    after_step: int
    steps: Sequence[int]
    """In order; a `range` when they follow each other with no gap (the common case, checked at no cost)."""
    body: bytes
    """The records' stored JSON, comma-separated, in step order, UTF-8."""
    more: bool
    """Whether another page follows."""
    missing_steps: list[tuple[int, int]] = field(default_factory=list)
    """Inclusive ranges trained but not stored: the gaps inside this page, then any the caller adds."""

    def __post_init__(self) -> None:
        expected = self.after_step + 1
        if isinstance(self.steps, range):  # no gap inside: one before it at most
            if self.steps and self.steps.start > expected:
                self.missing_steps.append((expected, self.steps.start - 1))
            return
        for step in self.steps:
            if step > expected:
                self.missing_steps.append((expected, step - 1))
            expected = step + 1

    @property
    def next_after(self) -> int | None:
        return self.steps[-1] if self.more and self.steps else None

    @property
    def last_step(self) -> int:
        """The last step on this page, or `after_step` when it is empty."""
        return self.steps[-1] if self.steps else self.after_step

    def json(self, job_id: str) -> bytes:
        """The page as `MetricsPage(job_id=..., points=..., next_after=..., missing_steps=...)` dumps it."""
        next_after = "null" if self.next_after is None else str(self.next_after)
        missing = ",".join(f"[{first},{last}]" for first, last in self.missing_steps)
        return b"".join([f'{{"job_id":{json.dumps(job_id)},"points":['.encode(), self.body,
                         f'],"next_after":{next_after},"missing_steps":[{missing}]}}'.encode()])


def unparsed_xrange(response: Any, **options: Any) -> Any:
    """A response callback that leaves XRANGE's reply as hiredis parsed it: [[id, [field, value, ...]], ...]."""
    return response


def stream_page(after_step: int, entries: list[list[Any]], limit: int) -> RawPage:
    """A page from up to `limit + 1` raw XRANGE entries of a metrics stream, as bytes (each entry's one field
    is the record's JSON; its id is `{step}-0`)."""
    kept = entries[:limit]
    first, last = (int(kept[0][0][:-2]), int(kept[-1][0][:-2])) if kept else (0, -1)
    # Ids only grow: as many entries as steps from the first to the last means no step is missing.
    steps = range(first, last + 1) if last - first + 1 == len(kept) else [int(entry[0][:-2]) for entry in kept]
    return RawPage(after_step, steps, b",".join([entry[1][1] for entry in kept]), len(entries) > limit)


def raw_page(after_step: int, found: Sequence[tuple[int, str]], limit: int) -> RawPage:
    """A page from up to `limit + 1` (step, JSON) pairs: the extra one only says another page follows."""
    kept = found[:limit]
    return RawPage(after_step, [step for step, _ in kept], ",".join(record for _, record in kept).encode(),
                   len(found) > limit)

"""The live stream's reads on redis.asyncio: many jobs' streams in one XREAD, a job's tail, owner and state.

The API's live fan-out (app/api/live_hub.py) reads every watched job's `layers`, `metrics`, `events` and
`evaluations` streams with one XREAD on one connection; a viewer catching up reads its job's alone. Clients
here decode replies (decode_responses=True).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from app.store.archive import ArchiveInfo
from app.store.keys import (
    ARCHIVED_FIELD,
    EVALUATION_FIELD,
    LAYERS_FIELD,
    STEP_FIELD,
    after,
    entry_id,
    evaluations_key,
    events_key,
    job_key,
    layers_key,
    metrics_key,
    number_of,
)
from mpjobs.contract.jobs import JobState


@dataclass
class StreamCursor:
    """Where a live read of a job's streams stands: the last layer check, step and evaluation read (their
    steps), and the last transition read (its stream id; "0-0" before the first)."""

    checks: int
    steps: int
    events: str = "0-0"
    evaluations: int = 0


@dataclass
class StreamBatch:
    """What one read found past a cursor, each in stream order."""

    checks: list[tuple[int, str]] = field(default_factory=list)
    """(step, LayerCheck JSON as stored)."""
    steps: list[tuple[int, str]] = field(default_factory=list)
    """(step, StepRecord JSON as stored)."""
    events: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    """(stream id, the transition's fields)."""
    evaluations: list[tuple[int, str]] = field(default_factory=list)
    """(step, EvalRecord JSON as stored)."""

    @property
    def empty(self) -> bool:
        return not (self.checks or self.steps or self.events or self.evaluations)


def _keys(job_id: str, cursor: StreamCursor) -> dict[str, str]:
    return {layers_key(job_id): entry_id(cursor.checks), metrics_key(job_id): entry_id(cursor.steps),
            events_key(job_id): cursor.events, evaluations_key(job_id): entry_id(cursor.evaluations)}


def _batch(job_id: str, found: dict[str, list[tuple[str, dict[str, str]]]]) -> StreamBatch:
    return StreamBatch(
        checks=[(number_of(i), fields[LAYERS_FIELD]) for i, fields in found.get(layers_key(job_id), [])],
        steps=[(number_of(i), fields[STEP_FIELD]) for i, fields in found.get(metrics_key(job_id), [])],
        events=list(found.get(events_key(job_id), [])),
        evaluations=[(number_of(i), fields[EVALUATION_FIELD]) for i, fields in found.get(evaluations_key(job_id), [])])


async def read_streams(aredis: Redis, cursors: dict[str, StreamCursor], count: int,
                       block_ms: int | None) -> dict[str, StreamBatch]:
    """Up to `count` entries of each stream of each job past its cursor (job id -> cursor), in one XREAD,
    waiting up to `block_ms` for one (None: not at all)."""
    keys: dict[str, str] = {}
    for job_id, cursor in cursors.items():
        keys.update(_keys(job_id, cursor))
    reply: Any = await aredis.xread(keys, count=count, block=block_ms)
    found: dict[str, list[tuple[str, dict[str, str]]]] = dict(reply or [])
    return {job_id: _batch(job_id, found) for job_id in cursors}


@dataclass(frozen=True)
class JobHead:
    """Who owns a job, its state, and its archive (None while its history is in Redis); all None for no job."""

    tenant: str | None
    state: str | None
    archived: ArchiveInfo | None

    @property
    def terminal(self) -> bool:
        return self.state is not None and JobState(self.state).terminal


async def job_head(aredis: Redis, job_id: str) -> JobHead:
    tenant, state, archived = await aredis.hmget(job_key(job_id), ["tenant", "state", ARCHIVED_FIELD])
    return JobHead(tenant, state, None if archived is None else ArchiveInfo.model_validate_json(archived))


@dataclass(frozen=True)
class Tail:
    """Where a job's streams end now: its last step (0 before one), its last transition's id, its last evaluation's
    step (0 before one), whether it ended."""

    step: int
    events: str
    evaluations: int
    terminal: bool


async def tail(aredis: Redis, job_id: str) -> Tail:
    async with aredis.pipeline(transaction=False) as pipe:
        pipe.xrevrange(metrics_key(job_id), count=1)
        pipe.xrevrange(events_key(job_id), count=1)
        pipe.xrevrange(evaluations_key(job_id), count=1)
        pipe.hget(job_key(job_id), "state")
        last_step, last_event, last_evaluation, state = await pipe.execute()
    return Tail(number_of(last_step[0][0]) if last_step else 0, last_event[0][0] if last_event else "0-0",
                number_of(last_evaluation[0][0]) if last_evaluation else 0,
                state is not None and JobState(state).terminal)


async def evaluations_after(aredis: Redis, job_id: str, step: int) -> list[str]:
    """Every evaluation after `step`, as stored (EvalRecord JSON): archiving leaves them in Redis."""
    entries: Any = await aredis.xrange(evaluations_key(job_id), min=after(step), max="+")
    return [fields[EVALUATION_FIELD] for _, fields in entries]


async def transitions(aredis: Redis, job_id: str) -> list[dict[str, str]]:
    """Every transition's fields, in order."""
    entries: Any = await aredis.xrange(events_key(job_id))
    return [fields for _, fields in entries]

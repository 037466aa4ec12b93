"""Job records: create (with the enqueue, in one MULTI/EXEC), read, list, move between states atomically, requeue."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.client import Pipeline

from app.core import clock
from app.core.notes import spec_notes
from app.store.base import RedisBacked
from app.store.idempotency import IdempotencyKey, write_once
from app.store.ids import new_record_id
from app.store.keys import ENDED, JOB_INDEX_PREFIX, RUNNING, SEQ, TENANTS, events_key, index_key, job_key
from app.store.queue import retry_id
from mpjobs.contract.jobs import JobError, JobRecord, JobState, Progress, Transition, WorkerInfo
from mpjobs.contract.records import Summary
from mpjobs.contract.spec import JobSpec

# Atomic transition: check the current state, set fields, record the event, move indexes (an ended
# job also joins `ended`, scored by ARGV[7], where the archive sweep finds it).
TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {'missing', ''} end
local allowed = false
for s in string.gmatch(ARGV[4], '%S+') do if s == cur then allowed = true end end
if not allowed then return {'refused', cur} end
local seq = redis.call('HGET', KEYS[1], 'seq')
local index = ARGV[5] .. redis.call('HGET', KEYS[1], 'tenant') .. ':'
redis.call('HSET', KEYS[1], 'state', ARGV[1])
for i = 8, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('XADD', KEYS[2], '*', 'state', ARGV[1], 'at', ARGV[2], 'message', ARGV[3])
redis.call('ZREM', index .. cur, ARGV[6])
redis.call('ZADD', index .. ARGV[1], seq, ARGV[6])
if ARGV[1] == 'running' then
  redis.call('SADD', KEYS[3], ARGV[6])
else
  redis.call('SREM', KEYS[3], ARGV[6])
end
if ARGV[7] ~= '' then redis.call('ZADD', KEYS[4], ARGV[7], ARGV[6]) end
return {'ok', cur}
"""


class JobRecords(RedisBacked):
    """The `job:{id}` hash, its `events` stream and the tenant indexes."""

    SCRIPTS = {"transition": TRANSITION}

    def create(self, spec: JobSpec, tenant: str, queue: str, enqueue: Callable[[str, Pipeline], None],
               pipe: Pipeline, once: IdempotencyKey | None = None) -> tuple[str, bool]:
        """Enqueue and write the record in one MULTI/EXEC on `pipe`: both or neither. With `once`, its
        Idempotency-Key goes in the same MULTI/EXEC, or the job it already names is returned.
        Returns (job id, created).
        """
        def write(pipe: Pipeline) -> str:
            job_id = new_record_id()
            enqueue(job_id, pipe)
            self.write_new(pipe, job_id, spec, tenant, queue)
            return job_id

        return write_once(pipe, once, self.exists, write)

    def write_new(self, pipe: Pipeline, job_id: str, spec: JobSpec, tenant: str, queue: str,
                  comparison_id: str | None = None) -> None:
        """Queue the new record's writes on `pipe`, inside a MULTI (`create`, and each of a comparison's jobs)."""
        seq = int(self.redis.incr(SEQ))
        at = clock.iso()
        record: dict[str, Any] = {
            "id": job_id, "seq": seq, "tenant": tenant, "state": JobState.QUEUED.value, "queue": queue,
            "name": json.dumps(spec.name), "spec": spec.model_dump_json(), "created_at": at,
            "attempt": 0, "step": 0, "total_steps": spec.training.steps, "rq_job": job_id,
        }
        if comparison_id is not None:
            record["comparison"] = comparison_id
        pipe.hset(job_key(job_id), mapping=record)
        pipe.xadd(events_key(job_id), {"state": JobState.QUEUED.value, "at": at, "message": f"queued on '{queue}'"})
        pipe.zadd(index_key(tenant), {job_id: seq})
        pipe.zadd(index_key(tenant, JobState.QUEUED), {job_id: seq})
        pipe.sadd(TENANTS, tenant)

    def get_many(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        """Several jobs in one round trip; None for any that does not exist."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(job_key(job_id))
                pipe.xrange(events_key(job_id))
            results = pipe.execute()
        return [self.job_from(raw, ev) if raw else None for raw, ev in zip(results[::2], results[1::2], strict=True)]

    def exists(self, job_id: str) -> bool:
        return bool(self.redis.exists(job_key(job_id)))

    def get(self, job_id: str, tenant: str | None = None) -> JobRecord | None:
        """The job, or None if it does not exist or belongs to another tenant."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(job_key(job_id))
            pipe.xrange(events_key(job_id))
            raw, events = pipe.execute()
        if not raw or (tenant is not None and raw.get("tenant") != tenant):
            return None
        return self.job_from(raw, events)

    def job_from(self, raw: dict[str, str], events: list[tuple[str, dict[str, str]]]) -> JobRecord:
        """The job from its record (HGETALL) and its transitions (XRANGE of its events)."""
        spec = JobSpec.model_validate_json(raw["spec"])
        return JobRecord(
            id=raw["id"], name=json.loads(raw["name"]), state=JobState(raw["state"]), queue=raw["queue"],
            spec=spec, notes=spec_notes(spec), created_at=raw["created_at"],
            started_at=raw.get("started_at"), finished_at=raw.get("finished_at"),
            transitions=[Transition(state=JobState(e["state"]), at=e["at"], message=e["message"]) for _, e in events],
            progress=Progress(step=int(raw["step"]), total_steps=int(raw["total_steps"])),
            summary=Summary.model_validate_json(raw["summary"]) if raw.get("summary") else None,
            error=JobError.model_validate_json(raw["error"]) if raw.get("error") else None,
            attempt=int(raw["attempt"]),
            worker=WorkerInfo.model_validate_json(raw["worker"]) if raw.get("worker") else None,
            comparison_id=raw.get("comparison"),
            phase=raw.get("phase") if raw["state"] == JobState.RUNNING.value else None,
        )

    def list(self, tenant: str, state: JobState | None, limit: int, cursor: int | None
             ) -> tuple[list[JobRecord], int | None]:
        """The tenant's jobs, newest first. `cursor` is the sequence number to continue below."""
        index = index_key(tenant, state)
        top = f"({cursor}" if cursor is not None else "+inf"
        found = self.redis.zrevrangebyscore(index, top, "-inf", start=0, num=limit + 1, withscores=True)
        page, more = found[:limit], len(found) > limit
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id, _ in page:
                pipe.hgetall(job_key(job_id))
                pipe.xrange(events_key(job_id))
            results = pipe.execute()
        jobs = [self.job_from(raw, ev) for raw, ev in zip(results[::2], results[1::2], strict=True) if raw]
        return jobs, (int(page[-1][1]) if more and page else None)

    def transition(self, job_id: str, to: JobState, allowed_from: Iterable[JobState], message: str,
                   **fields: Any) -> tuple[bool, JobState | None]:
        """Move `job_id` to `to` if its state is in `allowed_from`. Returns (moved, previous state)."""
        now = clock.now()
        at = clock.iso(now)
        if to.terminal:
            fields.setdefault("finished_at", at)
        ended = repr(now.timestamp()) if to.terminal else ""
        args: list[Any] = [to.value, at, message, " ".join(s.value for s in allowed_from), JOB_INDEX_PREFIX, job_id,
                           ended]
        for name, value in fields.items():
            args += [name, value if isinstance(value, str | int) else json.dumps(value)]
        status, previous = self._run("transition", [job_key(job_id), events_key(job_id), RUNNING, ENDED], args)
        return status == "ok", (JobState(previous) if previous else None)

    def set_fields(self, job_id: str, **fields: Any) -> None:
        self.redis.hset(job_key(job_id), mapping={
            k: v if isinstance(v, str | int) else json.dumps(v) for k, v in fields.items()
        })

    def resumed_from(self, job_id: str) -> int:
        """The step the job's last attempt resumed from (0: from the start, or no attempt yet)."""
        return int(self.redis.hget(job_key(job_id), "resumed_from") or 0)

    def rq_job_id(self, job_id: str) -> str:
        return str(self.redis.hget(job_key(job_id), "rq_job") or job_id)

    def requeue(self, job_id: str, attempt: int, enqueue: Callable[[str, Pipeline], None], pipe: Pipeline) -> str:
        """Enqueue attempt `attempt` of the job as an RQ job of its own (`retry_id`) and name it on the record, in
        one MULTI/EXEC on `pipe`: both or neither. `enqueue(rq_job_id, pipe)` queues the task. Returns that id."""
        rq_job_id = retry_id(job_id, attempt)
        with pipe:
            enqueue(rq_job_id, pipe)
            pipe.hset(job_key(job_id), "rq_job", rq_job_id)
            pipe.execute()
        return rq_job_id

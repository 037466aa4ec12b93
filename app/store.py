"""The Redis data layer: job records, state transitions, metric series.

Keys (prefix `mpjobs:`):
    job:{id}            hash   the job record (state, spec, times, summary, error...)
    job:{id}:events     stream one entry per state transition (also feeds SSE)
    job:{id}:metrics    stream one entry per step, entry id `{step}-0`
    job:{id}:rollup     stream one entry per ROLLUP_STEPS steps, entry id `{index}-0`
    jobs:{tenant}       zset   the tenant's job ids, scored by creation sequence
    jobs:{tenant}:{state} zset the tenant's job ids in that state, same scores
    idem:{tenant}:{sha} string Idempotency-Key -> {fingerprint, job_id}, kept IDEMPOTENCY_TTL_S
    job:{id}:lease      string the running attempt's lease, renewed while it lives
    job:{id}:view:{n}   string the `max_points=n` view as JSON (n = 500 or 1000), kept VIEW_TTL_S;
                               `...:fresh` marks it current (an ended job's: a day; a running one's: 1 s)
    running             set    ids of running jobs, for the reaper
    seq                 string creation sequence counter
    tenants             set    every tenant that has created a job (for /metrics)
    stats               hash   counters since the database began: steps, skipped_steps, diagnoses:{code}
    cmp:{id}            hash   a precision comparison: its spec and its variants' job ids
    cmps:{tenant}       zset   the tenant's comparison ids, scored by creation sequence

Shared by the API and the worker; it imports neither FastAPI nor TensorFlow.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis import Redis
from redis.client import Pipeline

from app import clock
from app.resources import (
    Bucket,
    Job,
    JobError,
    JobState,
    MetricsBuckets,
    MetricsPage,
    Progress,
    Transition,
    WorkerInfo,
)
from app.rollup import ROLLUP_STEPS, Rollup, bucketize_json
from app.schemas import ComparisonSpec, JobSpec, StepRecord, Summary

PREFIX = "mpjobs:"
IDEMPOTENCY_TTL_S = 24 * 3600
"""How long an Idempotency-Key is remembered."""
VIEW_TTL_S = 24 * 3600
"""How long an ended job's bucketed view stays cached (it can no longer change)."""
RAW_BUCKET_LIMIT = 4096
"""Up to this many steps, buckets are cut from the raw series; beyond, from rollups."""

# Atomic transition: check the current state, set fields, record the event, move indexes.
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {'missing', ''} end
local allowed = false
for s in string.gmatch(ARGV[4], '%S+') do if s == cur then allowed = true end end
if not allowed then return {'refused', cur} end
local seq = redis.call('HGET', KEYS[1], 'seq')
local index = ARGV[5] .. redis.call('HGET', KEYS[1], 'tenant') .. ':'
redis.call('HSET', KEYS[1], 'state', ARGV[1])
for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('XADD', KEYS[2], '*', 'state', ARGV[1], 'at', ARGV[2], 'message', ARGV[3])
redis.call('ZREM', index .. cur, ARGV[6])
redis.call('ZADD', index .. ARGV[1], seq, ARGV[6])
if ARGV[1] == 'running' then
  redis.call('SADD', KEYS[3], ARGV[6])
else
  redis.call('SREM', KEYS[3], ARGV[6])
end
return {'ok', cur}
"""

# Requeue a running job whose lease expired, or fail it after its last attempt. One winner
# among all reapers: the state and the lease are checked inside the script.
_REAP = """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' or redis.call('EXISTS', KEYS[4]) == 1 then
  return 'alive'
end
local attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt'))
local seq = redis.call('HGET', KEYS[1], 'seq')
local index = ARGV[1] .. redis.call('HGET', KEYS[1], 'tenant') .. ':'
local to, message = 'queued', 'worker lost during attempt ' .. attempt .. '; requeued to resume from its checkpoint'
if attempt >= tonumber(ARGV[2]) then
  to, message = 'failed', 'worker lost during attempt ' .. attempt .. ', the last allowed'
  redis.call('HSET', KEYS[1], 'finished_at', ARGV[3], 'error', ARGV[4])
end
redis.call('HSET', KEYS[1], 'state', to)
redis.call('XADD', KEYS[2], '*', 'state', to, 'at', ARGV[3], 'message', message)
redis.call('ZREM', index .. 'running', ARGV[5])
redis.call('ZADD', index .. to, seq, ARGV[5])
redis.call('SREM', KEYS[3], ARGV[5])
return to
"""

# Forget steps after `keep` (a lost attempt's, recomputed from the checkpoint) and let the
# stream accept them again: each step stays exactly once.
_REWIND = """
local removed = 0
for i = 1, 2 do
  local gone = redis.call('XRANGE', KEYS[i], '(' .. ARGV[i] .. '-0', '+')
  for _, entry in ipairs(gone) do redis.call('XDEL', KEYS[i], entry[1]) end
  removed = removed + #gone
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('XSETID', KEYS[i], ARGV[i] .. '-0') end
end
return removed
"""

# Count each diagnosis code once per job: a flag on the job, then the counter.
_COUNT_DIAGNOSES = """
for _, code in ipairs(ARGV) do
  if redis.call('HSETNX', KEYS[1], 'counted:' .. code, 1) == 1 then
    redis.call('HINCRBY', KEYS[2], 'diagnoses:' .. code, 1)
  end
end
return 0
"""


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:events"


def metrics_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:metrics"


def rollup_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:rollup"


def view_key(job_id: str, max_points: int) -> str:
    return f"{PREFIX}job:{job_id}:view:{max_points}"


def lease_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:lease"


def comparison_key(comparison_id: str) -> str:
    return f"{PREFIX}cmp:{comparison_id}"


def comparison_index_key(tenant: str) -> str:
    return f"{PREFIX}cmps:{tenant}"


RUNNING = f"{PREFIX}running"
SEQ = f"{PREFIX}seq"
TENANTS = f"{PREFIX}tenants"
STATS = f"{PREFIX}stats"


@dataclass(frozen=True)
class ComparisonRecord:
    id: str
    name: str | None
    created_at: str
    spec: ComparisonSpec
    job_ids: list[str]


def _comparison_record(raw: dict[str, str]) -> ComparisonRecord:
    return ComparisonRecord(id=raw["id"], name=json.loads(raw["name"]), created_at=raw["created_at"],
                            spec=ComparisonSpec.model_validate_json(raw["spec"]), job_ids=json.loads(raw["jobs"]))


def index_key(tenant: str, state: JobState | None = None) -> str:
    return f"{PREFIX}jobs:{tenant}" + (f":{state.value}" if state else "")


def idempotency_key(tenant: str, key: str) -> str:
    return f"{PREFIX}idem:{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"


class JobStore:
    """Jobs in Redis. Connections are passed in; this class owns none."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._transition = redis.register_script(_TRANSITION)
        self._reap = redis.register_script(_REAP)
        self._rewind = redis.register_script(_REWIND)
        self._count_diagnoses = redis.register_script(_COUNT_DIAGNOSES)

    # -- records -------------------------------------------------------------

    def create(self, spec: JobSpec, tenant: str, queue: str, enqueue: Callable[[str, Pipeline], None],
               pipe: Pipeline, job_id: str | None = None) -> str:
        """Enqueue and write the record in one MULTI/EXEC on `pipe`: both or neither.

        RQ opens the MULTI itself, so `enqueue` goes first.
        """
        job_id = job_id or uuid.uuid4().hex
        with pipe:
            enqueue(job_id, pipe)
            self._write_job(pipe, job_id, spec, tenant, queue)
            pipe.execute()
        return job_id

    def _write_job(self, pipe: Pipeline, job_id: str, spec: JobSpec, tenant: str, queue: str,
                   comparison_id: str | None = None) -> None:
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

    def create_comparison(self, spec: ComparisonSpec, tenant: str, jobs: Sequence[tuple[JobSpec, str]],
                          enqueue: Callable[[str, JobSpec, Pipeline], None], pipe: Pipeline) -> str:
        """Every variant's job and the comparison record in one MULTI/EXEC: all or none."""
        comparison_id = uuid.uuid4().hex
        job_ids = [uuid.uuid4().hex for _ in jobs]
        with pipe:
            for job_id, (job_spec, queue) in zip(job_ids, jobs, strict=True):
                enqueue(job_id, job_spec, pipe)
                self._write_job(pipe, job_id, job_spec, tenant, queue, comparison_id)
            seq = int(self.redis.incr(SEQ))
            pipe.hset(comparison_key(comparison_id), mapping={
                "id": comparison_id, "seq": seq, "tenant": tenant, "name": json.dumps(spec.name),
                "created_at": clock.iso(), "spec": spec.model_dump_json(), "jobs": json.dumps(job_ids),
            })
            pipe.zadd(comparison_index_key(tenant), {comparison_id: seq})
            pipe.execute()
        return comparison_id

    def get_comparison(self, comparison_id: str, tenant: str) -> ComparisonRecord | None:
        raw = self.redis.hgetall(comparison_key(comparison_id))
        if not raw or raw.get("tenant") != tenant:
            return None
        return _comparison_record(raw)

    def list_comparisons(self, tenant: str, limit: int, cursor: int | None
                         ) -> tuple[list[ComparisonRecord], int | None]:
        """The tenant's comparisons, newest first; `cursor` continues below a sequence number."""
        top = f"({cursor}" if cursor is not None else "+inf"
        found = self.redis.zrevrangebyscore(comparison_index_key(tenant), top, "-inf", start=0, num=limit + 1,
                                            withscores=True)
        page, more = found[:limit], len(found) > limit
        with self.redis.pipeline(transaction=False) as pipe:
            for comparison_id, _ in page:
                pipe.hgetall(comparison_key(comparison_id))
            raws = pipe.execute()
        return [_comparison_record(raw) for raw in raws if raw], (int(page[-1][1]) if more and page else None)

    def get_many(self, job_ids: Sequence[str]) -> list[Job | None]:
        """Several jobs in one round trip; None for any that does not exist."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(job_key(job_id))
                pipe.xrange(events_key(job_id))
            results = pipe.execute()
        return [self._job(raw, ev) if raw else None for raw, ev in zip(results[::2], results[1::2], strict=True)]

    def claim_idempotency_key(self, tenant: str, key: str, fingerprint: str) -> tuple[bool, str, str]:
        """SET NX a new job id under the key. Returns (claimed, fingerprint, job_id) of the holder."""
        job_id = uuid.uuid4().hex
        record = json.dumps({"fingerprint": fingerprint, "job_id": job_id})
        if self.redis.set(idempotency_key(tenant, key), record, nx=True, ex=IDEMPOTENCY_TTL_S):
            return True, fingerprint, job_id
        held = json.loads(self.redis.get(idempotency_key(tenant, key)) or record)
        return False, held["fingerprint"], held["job_id"]

    def release_idempotency_key(self, tenant: str, key: str) -> None:
        self.redis.delete(idempotency_key(tenant, key))

    def wait_for(self, job_id: str, tenant: str, timeout_s: float) -> Job | None:
        """The job, once its creator has written it (a concurrent duplicate may be mid-create)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.get(job_id, tenant)
            if job is not None or time.monotonic() > deadline:
                return job
            time.sleep(0.02)

    def exists(self, job_id: str) -> bool:
        return bool(self.redis.exists(job_key(job_id)))

    def get(self, job_id: str, tenant: str | None = None) -> Job | None:
        """The job, or None if it does not exist or belongs to another tenant."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(job_key(job_id))
            pipe.xrange(events_key(job_id))
            raw, events = pipe.execute()
        if not raw or (tenant is not None and raw.get("tenant") != tenant):
            return None
        return self._job(raw, events)

    def _job(self, raw: dict[str, str], events: list[tuple[str, dict[str, str]]]) -> Job:
        return Job(
            id=raw["id"], name=json.loads(raw["name"]), state=JobState(raw["state"]), queue=raw["queue"],
            spec=JobSpec.model_validate_json(raw["spec"]), created_at=raw["created_at"],
            started_at=raw.get("started_at"), finished_at=raw.get("finished_at"),
            transitions=[Transition(state=JobState(e["state"]), at=e["at"], message=e["message"]) for _, e in events],
            progress=Progress(step=int(raw["step"]), total_steps=int(raw["total_steps"])),
            summary=Summary.model_validate_json(raw["summary"]) if raw.get("summary") else None,
            error=JobError.model_validate_json(raw["error"]) if raw.get("error") else None,
            attempt=int(raw["attempt"]),
            worker=WorkerInfo.model_validate_json(raw["worker"]) if raw.get("worker") else None,
            comparison_id=raw.get("comparison"),
        )

    def list(self, tenant: str, state: JobState | None, limit: int, cursor: int | None
             ) -> tuple[list[Job], int | None]:
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
        jobs = [self._job(raw, ev) for raw, ev in zip(results[::2], results[1::2], strict=True) if raw]
        return jobs, (int(page[-1][1]) if more and page else None)

    def transition(self, job_id: str, to: JobState, allowed_from: Iterable[JobState], message: str,
                   **fields: Any) -> tuple[bool, JobState | None]:
        """Move `job_id` to `to` if its state is in `allowed_from`. Returns (moved, previous state)."""
        at = clock.iso()
        if to.terminal:
            fields.setdefault("finished_at", at)
        args: list[Any] = [to.value, at, message, " ".join(s.value for s in allowed_from), f"{PREFIX}jobs:", job_id]
        for name, value in fields.items():
            args += [name, value if isinstance(value, str | int) else json.dumps(value)]
        status, previous = self._transition(keys=[job_key(job_id), events_key(job_id), RUNNING], args=args)
        return status == "ok", (JobState(previous) if previous else None)

    def set_fields(self, job_id: str, **fields: Any) -> None:
        self.redis.hset(job_key(job_id), mapping={
            k: v if isinstance(v, str | int) else json.dumps(v) for k, v in fields.items()
        })

    def renew_lease(self, job_id: str, owner: str, ttl_s: float) -> None:
        self.redis.set(lease_key(job_id), owner, px=int(ttl_s * 1000))

    def drop_lease(self, job_id: str) -> None:
        self.redis.delete(lease_key(job_id))

    def running_ids(self) -> set[str]:
        return set(self.redis.smembers(RUNNING))

    def reap(self, job_id: str, max_attempts: int) -> str:
        """'queued' (requeue it), 'failed' (out of attempts) or 'alive' (nothing to do)."""
        error = json.dumps({"reason": "worker_lost", "message": (
            f"The worker running this job disappeared on each of its {max_attempts} attempts.")})
        keys = [job_key(job_id), events_key(job_id), RUNNING, lease_key(job_id)]
        return str(self._reap(keys=keys, args=[f"{PREFIX}jobs:", max_attempts, clock.iso(), error, job_id]))

    def rewind_metrics(self, job_id: str, keep_step: int) -> int:
        """Drop steps after `keep_step` (and their rollups) so a resumed attempt rewrites them once."""
        keys = [metrics_key(job_id), rollup_key(job_id)]
        removed = int(self._rewind(keys=keys, args=[keep_step, keep_step // ROLLUP_STEPS]))
        self.redis.hset(job_key(job_id), "step", keep_step)
        return removed

    def rq_job_id(self, job_id: str) -> str:
        return str(self.redis.hget(job_key(job_id), "rq_job") or job_id)

    def request_cancel(self, job_id: str) -> None:
        self.redis.hset(job_key(job_id), "cancel_requested", 1)

    def cancel_requested(self, job_id: str) -> bool:
        return self.redis.hget(job_key(job_id), "cancel_requested") == "1"

    # -- metrics ---------------------------------------------------------------

    def append_steps(self, job_id: str, records: Sequence[StepRecord], rollups: Sequence[tuple[int, Rollup]],
                     summary: Summary | None) -> None:
        """One round trip: the steps, finished rollups, progress, running summary and the step
        counters. A resent batch whose steps Redis already holds takes them back off the counters."""
        with self.redis.pipeline(transaction=False) as pipe:
            for r in records:
                pipe.xadd(metrics_key(job_id), {"r": r.model_dump_json()}, id=f"{r.step}-0")
            for index, rollup in rollups:
                pipe.xadd(rollup_key(job_id), {"a": json.dumps(rollup.to_json())}, id=f"{index}-0")
            fields: dict[str, Any] = {"step": records[-1].step} if records else {}
            if summary is not None:
                fields["summary"] = summary.model_dump_json()
            if fields:
                pipe.hset(job_key(job_id), mapping=fields)
            if records:
                pipe.hincrby(STATS, "steps", len(records))
                pipe.hincrby(STATS, "skipped_steps", sum(r.skipped for r in records))
            results = pipe.execute(raise_on_error=False)
        for result in results:
            # A resent batch: a step id Redis already holds was written the first time.
            if isinstance(result, redis.ResponseError) and "equal or smaller" not in str(result):
                raise result
        held = [r for r, result in zip(records, results, strict=False) if isinstance(result, Exception)]
        if held:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(STATS, "steps", -len(held))
                pipe.hincrby(STATS, "skipped_steps", -sum(r.skipped for r in held))
                pipe.execute()

    def count_diagnoses(self, job_id: str, codes: Iterable[str]) -> None:
        """Count each diagnosis once per job in `stats`, however often its summary is written."""
        if codes:
            self._count_diagnoses(keys=[job_key(job_id), STATS], args=sorted(set(codes)))

    def stats(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.redis.hgetall(STATS).items()}

    def jobs_by_state(self) -> dict[JobState, int]:
        """Jobs in each state, over every tenant."""
        tenants = sorted(self.redis.smembers(TENANTS))
        with self.redis.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                for state in JobState:
                    pipe.zcard(index_key(tenant, state))
            counts = pipe.execute()
        totals = dict.fromkeys(JobState, 0)
        for i, count in enumerate(counts):
            totals[list(JobState)[i % len(JobState)]] += int(count)
        return totals

    def latest_records(self, job_ids: Sequence[str]) -> dict[str, StepRecord]:
        """Each job's newest step record, for those that have one."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.xrevrange(metrics_key(job_id), count=1)
            found = pipe.execute()
        return {job_id: StepRecord.model_validate_json(last[0][1]["r"])
                for job_id, last in zip(job_ids, found, strict=True) if last}

    def read_metrics(self, job_id: str, after: int, limit: int) -> MetricsPage:
        entries = self.redis.xrange(metrics_key(job_id), min=f"({after}-0", max="+", count=limit)
        points = [StepRecord.model_validate_json(fields["r"]) for _, fields in entries]
        more = len(points) == limit and bool(
            self.redis.xrange(metrics_key(job_id), min=f"({points[-1].step}-0", max="+", count=1)
        )
        missing, expected = [], after + 1
        for point in points:
            if point.step > expected:
                missing.append((expected, point.step - 1))
            expected = point.step + 1
        return MetricsPage(job_id=job_id, points=points, next_after=points[-1].step if more else None,
                           missing_steps=missing)

    def cached_view(self, job_id: str, max_points: int) -> tuple[str | None, bool]:
        """(the cached view or None, whether it is still fresh)."""
        key = view_key(job_id, max_points)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(key)
            pipe.exists(f"{key}:fresh")
            body, fresh = pipe.execute()
        return (None if body is None else str(body)), bool(fresh)

    def claim_view_refresh(self, job_id: str, max_points: int, fresh_s: float) -> bool:
        """Whether this caller recomputes a stale view: one caller per `fresh_s` wins."""
        return bool(self.redis.set(f"{view_key(job_id, max_points)}:fresh", 1, nx=True, px=int(fresh_s * 1000)))

    def cache_view(self, job_id: str, max_points: int, body: str, fresh_s: float) -> None:
        """Keep the view VIEW_TTL_S, fresh for `fresh_s`."""
        key = view_key(job_id, max_points)
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, body, ex=VIEW_TTL_S)
            pipe.set(f"{key}:fresh", 1, px=int(fresh_s * 1000))
            pipe.execute()

    def read_buckets(self, job_id: str, max_points: int) -> MetricsBuckets:
        last = self.redis.xrevrange(metrics_key(job_id), count=1)
        total = int(last[0][0].split("-")[0]) if last else 0
        if total <= RAW_BUCKET_LIMIT:
            # Each record is folded straight into its bucket's rollup: one pass, no per-record rollups.
            entries = self.redis.xrange(metrics_key(job_id))
            per_point = max(1, math.ceil(len(entries) / max_points))
            buckets: list[Bucket] = []
            for start in range(0, len(entries), per_point):
                merged = Rollup()
                for _, fields in entries[start:start + per_point]:
                    merged.add(json.loads(fields["r"]))
                buckets.append(merged.bucket())
            return MetricsBuckets(job_id=job_id, total_steps=total, buckets=buckets)
        # One json.loads for all stored rollups; they are merged in their JSON form.
        raw = [f["a"] for _, f in self.redis.xrange(rollup_key(job_id))]
        stored: list[dict[str, Any]] = json.loads(f"[{','.join(raw)}]")
        covered = stored[-1]["last_step"] if stored else 0
        tail = Rollup()
        for _, f in self.redis.xrange(metrics_key(job_id), min=f"({covered}-0", max="+"):
            tail.add(json.loads(f["r"]))
        parts = stored + ([tail.to_json()] if tail.steps else [])
        # Group whole rollups so that no more than max_points buckets come back.
        groups = math.ceil(len(parts) / max_points)
        per_bucket = math.ceil(len(parts) / math.ceil(len(parts) / groups))
        return MetricsBuckets(job_id=job_id, total_steps=total, buckets=bucketize_json(parts, per_bucket))


__all__ = ["ROLLUP_STEPS", "JobStore"]

"""Comparison records: every variant's job and the record in one MULTI/EXEC, then read back by id or page."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis import Redis
from redis.client import Pipeline

from app.core import clock
from app.store.base import RedisBacked
from app.store.idempotency import IdempotencyKey, write_once
from app.store.ids import new_record_id
from app.store.jobs import JobRecords
from app.store.keys import SEQ, comparison_index_key, comparison_key
from mpjobs.contract.spec import ComparisonSpec, JobSpec


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


class Comparisons(RedisBacked):
    """The `cmp:{id}` hash and each tenant's `cmps:{tenant}` index; a comparison's jobs are job records,
    written through `jobs`."""

    def __init__(self, redis: Redis, jobs: JobRecords) -> None:
        super().__init__(redis)
        self.jobs = jobs

    def create_comparison(self, spec: ComparisonSpec, tenant: str, jobs: Sequence[tuple[JobSpec, str]],
                          enqueue: Callable[[str, JobSpec, Pipeline], None], pipe: Pipeline,
                          once: IdempotencyKey | None = None) -> tuple[str, bool]:
        """Every variant's job and the comparison record in one MULTI/EXEC: all or none. With `once`, its
        Idempotency-Key goes in the same MULTI/EXEC, or the comparison it already names is returned.
        Returns (comparison id, created)."""
        def write(pipe: Pipeline) -> str:
            comparison_id = new_record_id()
            job_ids = [new_record_id() for _ in jobs]
            for job_id, (job_spec, queue) in zip(job_ids, jobs, strict=True):
                enqueue(job_id, job_spec, pipe)
                self.jobs.write_new(pipe, job_id, job_spec, tenant, queue, comparison_id)
            seq = int(self.redis.incr(SEQ))
            pipe.hset(comparison_key(comparison_id), mapping={
                "id": comparison_id, "seq": seq, "tenant": tenant, "name": json.dumps(spec.name),
                "created_at": clock.iso(), "spec": spec.model_dump_json(), "jobs": json.dumps(job_ids),
            })
            pipe.zadd(comparison_index_key(tenant), {comparison_id: seq})
            return comparison_id

        return write_once(pipe, once, lambda made: bool(self.redis.exists(comparison_key(made))), write)

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

"""Evaluation streams: each evaluation on the held-out rows once per step, read back page by page."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from app.store.base import RedisBacked
from app.store.keys import after, entry_id, evaluation_fields, evaluation_record, evaluations_key
from mpjobs.contract.jobs import EvaluationsPage
from mpjobs.contract.records import EvalRecord


class Evaluations(RedisBacked):
    """`job:{id}:evaluations`: one entry per evaluation, id `{step}-0`, so a step's evaluation is stored once.

    A resumed attempt's rewind (`MetricStreams.rewind_metrics`) drops those past its checkpoint with the
    steps. Archiving leaves them in Redis (they are few: one per `eval_every` steps); a purge deletes them."""

    def append(self, job_id: str, records: Sequence[EvalRecord]) -> None:
        """One round trip. An evaluation of a step Redis already holds (a resent one) is left as it was."""
        with self.redis.pipeline(transaction=False) as pipe:
            for record in records:
                pipe.xadd(evaluations_key(job_id), evaluation_fields(record), id=entry_id(record.step))
            results = pipe.execute(raise_on_error=False)
        for result in results:
            if isinstance(result, redis.ResponseError) and "equal or smaller" not in str(result):
                raise result

    def read(self, job_id: str, after_step: int, limit: int) -> EvaluationsPage:
        """Evaluations after step `after_step`, in step order, at most `limit`."""
        entries = self.redis.xrange(evaluations_key(job_id), min=after(after_step), max="+", count=limit + 1)
        found = [evaluation_record(fields) for _, fields in entries[:limit]]
        return EvaluationsPage(job_id=job_id, evaluations=found,
                               next_after=found[-1].step if len(entries) > limit else None)

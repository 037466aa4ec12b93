"""RedisReporter: step records, rollups, progress and the summary into Redis."""

from __future__ import annotations

import json
from collections.abc import Sequence

from app.rollup import ROLLUP_STEPS, Rollup
from app.schemas import StepRecord, Summary
from app.store import JobStore, metrics_key


class RedisReporter:
    """Writes each batch of records in one pipelined round trip (XADD per step)."""

    def __init__(self, store: JobStore, job_id: str) -> None:
        self.store, self.job_id = store, job_id
        self.partial = self._resume_partial()

    def _resume_partial(self) -> Rollup:
        """Rebuild the unfinished rollup from steps already stored (a resumed attempt)."""
        partial = Rollup()
        last = self.store.redis.xrevrange(metrics_key(self.job_id), count=1)
        if not last:
            return partial
        last_step = int(last[0][0].split("-")[0])
        first = last_step - last_step % ROLLUP_STEPS
        for _, fields in self.store.redis.xrange(metrics_key(self.job_id), min=f"({first}-0", max="+"):
            partial.add(json.loads(fields["r"]))
        return partial

    def steps(self, records: Sequence[StepRecord]) -> None:
        finished: list[tuple[int, Rollup]] = []
        for record in records:
            self.partial.add(record.model_dump())
            if record.step % ROLLUP_STEPS == 0:
                finished.append((record.step // ROLLUP_STEPS, self.partial))
                self.partial = Rollup()
        self.store.append_steps(self.job_id, records, finished, None)

    def summary(self, summary: Summary) -> None:
        self.store.set_fields(self.job_id, summary=summary.model_dump_json())

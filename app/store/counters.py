"""Counters since the database began (steps, skips, diagnoses once per job) and jobs per state."""

from __future__ import annotations

from collections.abc import Iterable

from app.store.base import RedisBacked
from app.store.keys import STATS, TENANTS, index_key, job_key
from mpjobs.contract.jobs import JobState

# Count each diagnosis code once per job: a flag on the job, then the counter (none for a deleted job).
COUNT_DIAGNOSES = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for _, code in ipairs(ARGV) do
  if redis.call('HSETNX', KEYS[1], 'counted:' .. code, 1) == 1 then
    redis.call('HINCRBY', KEYS[2], 'diagnoses:' .. code, 1)
  end
end
return 0
"""


class Counters(RedisBacked):
    """The `stats` hash and the per-state indexes, read for Prometheus."""

    SCRIPTS = {"count_diagnoses": COUNT_DIAGNOSES}

    def count_diagnoses(self, job_id: str, codes: Iterable[str]) -> None:
        """Count each diagnosis once per job in `stats`, however often its summary is written."""
        if codes:
            self._run("count_diagnoses", [job_key(job_id), STATS], sorted(set(codes)))

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
